"""Which Pallas kernels a function's gradient would launch, read off its traced jaxpr (so GPU
kernels can be checked for on a CPU without running them)."""

import jax
import jax.extend
import jax.numpy as jnp

# A Triton (or interpreted) kernel is a pallas_call; a Mosaic GPU kernel is an mpmd_map.
_KERNEL_PRIMITIVES = ("pallas_call", "mpmd_map")


def kernels_in_gradient(fn, *args) -> set[str]:
    """The names of the Pallas kernels in the jaxpr of the gradient of ``fn``'s summed
    output with respect to every argument (traced, not run). Read from the kernel calls
    themselves: a jitted op's own name would match any pattern on the jaxpr's text."""
    grad = jax.grad(lambda *a: fn(*a).astype(jnp.float32).sum(), argnums=tuple(range(len(args))))
    names = set()

    def visit(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in _KERNEL_PRIMITIVES:
                name = eqn.params["name"]
                names.add(getattr(name, "name", name))
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                visit(sub)

    visit(jax.make_jaxpr(grad)(*args).jaxpr)
    return names
