"""XLA's backend optimizations back on for a stretch of a test session (tests/conftest.py turns
them off: at test sizes compiling dominates). Long training runs pay for them: a test marked
``xla_optimized`` gets them through conftest, a module fixture that trains through this."""

import contextlib
import os
from collections.abc import Iterator

import jax


@contextlib.contextmanager
def xla_optimizations() -> Iterator[None]:
    """Optimizations on in this process and in the subprocesses it starts, for the ``with`` body."""
    previous_env = os.environ.get("JAX_DISABLE_MOST_OPTIMIZATIONS")
    previous = jax.config.read("jax_disable_most_optimizations")
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "0"
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", previous)
        if previous_env is None:
            os.environ.pop("JAX_DISABLE_MOST_OPTIMIZATIONS", None)
        else:
            os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = previous_env
