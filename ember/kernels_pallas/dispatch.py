"""Choosing how an op runs: ``impl`` in {"auto", "pallas", "interpret", "interpret_tpu", "xla"}.

- ``"pallas"``: the Pallas kernel compiled for the accelerator: the TPU kernel (Mosaic TPU)
  on a TPU, the GPU kernel (Mosaic GPU where a Hopper kernel exists, else Triton) on an
  NVIDIA GPU.
- ``"interpret"``: the GPU kernel run by the Pallas interpreter on any backend; this is how
  CPU tests exercise the GPU kernels' logic.
- ``"interpret_tpu"``: the TPU kernel run in JAX's TPU interpret mode
  (``pltpu.InterpretParams``) on any backend, which keeps TPU semantics (VMEM blocks, DMAs,
  semaphores, grid order); this is how CPU tests exercise the TPU kernels.
- ``"xla"``: the op's plain-JAX path, compiled by XLA (a real fallback, usable for training).
- ``"auto"``: ``"pallas"`` on GPU/TPU where the op has a kernel for that backend, else ``"xla"``.

An op resolves ``impl`` once with :func:`resolve_impl`, then asks :func:`kernel_platform`
which of its kernels to run and passes :func:`pallas_interpret` to ``pallas_call``. On a GPU,
an op with both a Hopper (Mosaic GPU) and a Triton kernel takes a kernel choice in
:data:`GPU_KERNELS`, resolved by :func:`choose_gpu_kernel`.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import jax

IMPLS: tuple[str, ...] = ("auto", "pallas", "interpret", "interpret_tpu", "xla")
# The backends (``jax.default_backend()`` values) an op may have a Pallas kernel for.
KERNEL_PLATFORMS: tuple[str, ...] = ("gpu", "tpu")


def resolve_impl(impl: str, *, op: str, kernel_backends: Collection[str] = KERNEL_PLATFORMS) -> str:
    """The concrete implementation (``"pallas"``, ``"interpret"``, ``"interpret_tpu"`` or
    ``"xla"``) for ``impl``.

    Args:
      impl: the requested implementation, one of :data:`IMPLS`.
      op: the op's name, used in error messages.
      kernel_backends: backends (``jax.default_backend()`` values) the op has a Pallas
        kernel for.

    Raises:
      ValueError: for an unknown ``impl``, ``"pallas"`` on a backend without a kernel, or
        ``"interpret_tpu"`` for an op without a TPU kernel.
    """
    if impl not in IMPLS:
        raise ValueError(f"{op}: impl must be one of {', '.join(repr(i) for i in IMPLS)}, got {impl!r}")
    backend = jax.default_backend()
    if impl == "auto":
        return "pallas" if backend in kernel_backends else "xla"
    if impl == "pallas" and backend not in kernel_backends:
        raise ValueError(
            f"{op}: impl='pallas' needs a backend with a compiled kernel ({', '.join(kernel_backends) or 'none'}), "
            f"but the default backend is {backend!r}; use impl='interpret' to run the kernel in the "
            "Pallas interpreter, or impl='xla'"
        )
    if impl == "interpret_tpu" and "tpu" not in kernel_backends:
        raise ValueError(
            f"{op}: impl='interpret_tpu' runs the op's TPU kernel, but {op} has kernels for "
            f"{', '.join(kernel_backends) or 'no backend'} only; use impl='interpret' or impl='xla'"
        )
    return impl


def kernel_platform(resolved: str) -> str | None:
    """Which of an op's kernels a resolved ``impl`` runs: ``"gpu"``, ``"tpu"``, or ``None``
    for the XLA path."""
    if resolved == "xla":
        return None
    if resolved == "interpret":
        return "gpu"
    if resolved == "interpret_tpu":
        return "tpu"
    return jax.default_backend()


def pallas_interpret(resolved: str) -> Any:
    """``pallas_call``'s ``interpret`` argument for a resolved ``impl``: ``False`` when
    compiled, ``True`` (the generic interpreter) for ``"interpret"``, and TPU interpret
    mode's ``pltpu.InterpretParams()`` for ``"interpret_tpu"``."""
    if resolved == "interpret_tpu":
        from jax.experimental.pallas import tpu as pltpu

        return pltpu.InterpretParams()
    return resolved == "interpret"


def triton_compiler_params(*, interpret: bool, num_warps: int, num_stages: int):
    """Triton compiler parameters for a ``pallas_call`` compiled for an NVIDIA GPU, else
    ``None`` (interpreted, or another backend). Passing them also picks the Triton lowering
    where a JAX version would otherwise lower through Mosaic GPU."""
    if interpret or jax.default_backend() != "gpu":
        return None
    from jax.experimental.pallas import triton as plgpu

    return plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages)


GPU_KERNELS: tuple[str, ...] = ("auto", "triton", "hopper")


def refuse_gpu_kernel_choice_off_gpu(
    option: str, choice: str, *, impl: str, platform: str | None, op: str = ""
) -> None:
    """Raises ``ValueError`` when ``option`` (a choice among :data:`GPU_KERNELS`) is not
    ``"auto"`` on a call that runs no GPU kernel (``platform``, from :func:`kernel_platform`):
    a misspelt choice is named as one, a real one says which ``impl`` runs the GPU kernels.
    ``op``: a prefix for the messages (``"grouped_matmul: "``)."""
    if choice == "auto" or platform == "gpu":
        return
    if choice not in GPU_KERNELS:
        raise ValueError(f"{op}{option} must be one of {GPU_KERNELS}, got {choice!r}")
    raise ValueError(
        f"{op}{option}={choice!r} chooses among the GPU kernels (impl='pallas' on a GPU, "
        f"or 'interpret'); impl={impl!r} runs the {platform or 'XLA'} path here"
    )


def choose_gpu_kernel(what: str, choice: str, hopper_reason: str | None, *, hopper_by_default: bool) -> str:
    """``"hopper"`` or ``"triton"`` for ``choice`` in :data:`GPU_KERNELS`: ``"auto"`` takes the
    Hopper kernel where ``hopper_by_default`` and ``hopper_reason`` (why it cannot run this
    call; None: it can) allow; ``what`` names the kernel in errors.

    Raises:
      ValueError: for an unknown ``choice``, or ``"hopper"`` where it cannot run.
    """
    if choice not in GPU_KERNELS:
        raise ValueError(f"the {what} kernel must be one of {GPU_KERNELS}, got {choice!r}")
    if choice == "triton":
        return "triton"
    if hopper_reason is not None and choice == "hopper":
        raise ValueError(f"the hopper {what} kernel cannot run this call: {hopper_reason}")
    if choice == "auto" and not hopper_by_default:
        return "triton"
    return "triton" if hopper_reason else "hopper"
