"""Counting the XLA programs a piece of code builds: each eager op of a new shape and each jitted
function of new arguments is lowered and compiled on its own (~20 ms each on a CPU), so code that
runs op by op on jax arrays spends its time compiling, not computing."""

import contextlib
from collections.abc import Iterator

import jax

LOWERED = "/jax/core/compile/jaxpr_to_mlir_module_duration"
"""JAX's event for one program lowered (it fires whether or not the persistent compilation cache
then holds the program compiled)."""


@contextlib.contextmanager
def programs_lowered() -> Iterator[list[str]]:
    """Yields a list that collects the name of each XLA program lowered in the ``with`` body (each
    program JAX had not built in this process yet: a jitted function's, ``jit_<name>``, or one
    eager op's, such as ``jit_concatenate``)."""
    lowered = []

    def listen(event, duration, **kwargs):
        if event == LOWERED:
            lowered.append(kwargs.get("fun_name", event))

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield lowered
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
