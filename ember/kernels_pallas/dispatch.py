"""Choosing how an op runs: ``impl`` in {"auto", "pallas", "interpret", "xla"}.

- ``"pallas"``: the Pallas kernel compiled for the accelerator (Mosaic TPU, Mosaic GPU or
  Triton on NVIDIA GPUs).
- ``"interpret"``: the same Pallas kernel run by the Pallas interpreter on any backend; this
  is how CPU tests exercise kernel logic.
- ``"xla"``: the op's plain-JAX path, compiled by XLA (a real fallback, usable for training).
- ``"auto"``: ``"pallas"`` on GPU/TPU where the op has a kernel for that backend, else ``"xla"``.
"""

from __future__ import annotations

from collections.abc import Collection

import jax

IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "xla")


def resolve_impl(impl: str, *, op: str, kernel_backends: Collection[str] = ("gpu", "tpu")) -> str:
    """The concrete implementation (``"pallas"``, ``"interpret"`` or ``"xla"``) for ``impl``.

    Args:
      impl: the requested implementation, one of :data:`IMPLS`.
      op: the op's name, used in error messages.
      kernel_backends: backends (``jax.default_backend()`` values) the op has a Pallas
        kernel for.

    Raises:
      ValueError: for an unknown ``impl``, or ``"pallas"`` on a backend without a kernel.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(repr(i) for i in IMPLS)}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas" if backend in kernel_backends else "xla"
    if impl == "pallas" and backend not in kernel_backends:
        raise ValueError(
            f"{op}: impl='pallas' needs a backend with a compiled kernel ({', '.join(kernel_backends)}), "
            f"but the default backend is {backend!r}; use impl='interpret' to run the kernel in the "
            "Pallas interpreter, or impl='xla'"
        )
    return impl


def triton_compiler_params(*, interpret: bool, num_warps: int, num_stages: int):
    """Triton compiler parameters for a ``pallas_call`` compiled for an NVIDIA GPU, else
    ``None`` (interpreted, or another backend). Passing them also picks the Triton lowering
    where a JAX version would otherwise lower through Mosaic GPU."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)
