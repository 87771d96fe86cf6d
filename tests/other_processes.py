"""A stand-in for an array that a multi-process run shards (or replicates) over several
processes, for unit tests of code that must gather such arrays (``ember.core.sharding.
addressable_here``) without starting processes: a ``jax.Array`` that says it is not fully
addressable and, like JAX's own, refuses to be fetched or moved; ``gather_patched`` makes
``multihost_utils.process_allgather`` return its whole value."""

import jax
from jax.experimental import multihost_utils


class OtherProcessesHold(jax.Array):
    """An array whose shards other processes hold too; ``whole`` is what gathering gives."""

    is_fully_addressable = False

    def __init__(self, whole):
        self.whole = whole

    def __array__(self, *args, **kwargs):
        raise RuntimeError("Fetching value for jax.Array that spans non-addressable devices is not possible")


def gather_patched(monkeypatch) -> list:
    """Patches ``process_allgather`` to gather :class:`OtherProcessesHold` arrays; returns the
    list of the arrays it is asked to gather."""
    gathered = []
    monkeypatch.setattr(multihost_utils, "process_allgather", lambda x, tiled: gathered.append(x) or x.whole)
    return gathered
