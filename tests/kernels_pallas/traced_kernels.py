"""Which Pallas kernels a function's gradient would launch, read off its traced jaxpr (so GPU
kernels can be checked for on a CPU without running them)."""

import jax
import jax.extend
import jax.numpy as jnp

# A Triton (or interpreted) kernel is a pallas_call; a Mosaic GPU kernel is an mpmd_map.
_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def _kernel_calls(fn, *args):
    """The kernel calls (jaxpr equations) in the gradient of ``fn``'s summed output with
    respect to every argument, traced, not run."""
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(len(args))))
    calls = []

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _KERNEL_PRIMITIVES:
                calls.append(eqn)
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(grad)(*args).jaxpr)
    return calls


def _name(eqn) -> str:
    name = eqn.params["name"]
    return getattr(name, "name", name)


def kernels_in_gradient(fn, *args) -> set[str]:
    """The names of the Pallas kernels in the gradient of ``fn`` (see :func:`_kernel_calls`).
    Read from the kernel calls themselves: a jitted op's own name would match any pattern on
    the jaxpr's text."""
    return {_name(eqn) for eqn in _kernel_calls(fn, *args)}


def kernel_grids_in_gradient(fn, *args) -> dict[str, tuple[int, ...]]:
    """``{name: grid}`` of the ``pallas_call`` kernels in the gradient of ``fn``."""
    return {
        _name(eqn): eqn.params["grid_mapping"].grid for eqn in _kernel_calls(fn, *args) if "grid_mapping" in eqn.params
    }
