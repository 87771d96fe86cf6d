"""Ember: a JAX/XLA research framework for efficient sequence models and RL environments.

Subpackages (imports run one way: core <- kernels_pallas <- models <- serving <- training,
and core <- envs <- training; serving never imports training):

- ``ember.core``: config loading, mesh and logical-axis sharding, precision policy,
  registries, checkpoint I/O, tree helpers, errors.
- ``ember.kernels_pallas``: Pallas kernels with plain-jnp references and dispatchers.
- ``ember.models``: Flax Linen modules.
- ``ember.envs``: vectorized JAX RL environments.
- ``ember.training``: trainers and the ``ember train`` launcher.
- ``ember.serving``: the jitted serving loop.

Importing ``ember`` is cheap: subpackages are imported on first use.
"""

__version__ = "0.1.0"

__all__ = ["__version__"]
