"""Which ops have a Pallas kernel for which backend, and what ``impl="auto"`` runs here.

Each op file declares ``KERNEL_BACKENDS`` (the ``jax.default_backend()`` values it has a
kernel for); this table gathers them for ``ember info`` and the dispatcher tests.
"""

from __future__ import annotations

import importlib

import jax

from ember.kernels_pallas.dispatch import KERNEL_PLATFORMS, resolve_impl

OPS: tuple[str, ...] = (
    "flash_attention",
    "ragged_paged_attention",
    "linear_attention",
    "ssd",
    "short_conv",
    "grouped_matmul",
    "quantized_matmul",
)


def kernel_backends(op: str) -> tuple[str, ...]:
    """The backends ``op`` has a Pallas kernel for."""
    return tuple(importlib.import_module(f"ember.kernels_pallas.{op}").KERNEL_BACKENDS)


def kernel_table() -> dict[str, dict[str, object]]:
    """``{op: {"gpu": bool, "tpu": bool, "auto_here": "pallas" | "xla"}}`` for every op, the
    last on this process's default backend."""
    table = {}
    for op in OPS:
        backends = kernel_backends(op)
        row: dict[str, object] = {platform: platform in backends for platform in KERNEL_PLATFORMS}
        row["auto_here"] = resolve_impl("auto", op=op, kernel_backends=backends)
        table[op] = row
    return table


def format_kernel_table(table: dict[str, dict[str, object]]) -> str:
    lines = [f"pallas kernels (auto on {jax.default_backend()}):"]
    for op, row in table.items():
        backends = ", ".join(p for p in KERNEL_PLATFORMS if row[p]) or "none (XLA only)"
        lines.append(f"  {op:<24} {backends:<16} auto: {row['auto_here']}")
    return "\n".join(lines)
