"""The ground floor every other Ember package builds on.

Modules: ``config`` (typed YAML configs), ``sharding`` (meshes and logical axes),
``precision`` (dtype policies), ``registry`` (named registries), ``checkpoint`` (orbax),
``tree`` (parameter counting and summaries), ``cache_dir`` (where Ember's caches live),
``errors``.
"""
