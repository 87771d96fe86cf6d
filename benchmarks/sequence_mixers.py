"""Sequence mixers: chunked linear attention and Mamba-2 SSD against the sequential scan,
the quadratic (masked-matrix) form and Ember's flash attention at the same length; and the
time of one decode step by position.

    python -m benchmarks.sequence_mixers          # GPU or TPU: 1k-64k tokens; CPU: small sizes

Targets on an H100 (the issue): linear attention forward+backward at 16k >= 4x faster than
flash attention; SSD >= 5x faster than the naive XLA scan; decode time per token flat
(position 32k within 1.1x of position 128). Results: ``benchmarks/results/sequence_mixers-<device>.json``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.harness import device_label, on_accelerator, print_table, time_fn, write_results
from ember.kernels_pallas.linear_attention import (
    linear_attention,
    linear_attention_quadratic,
    linear_attention_reference,
    linear_attention_step,
)
from ember.kernels_pallas.ssd import ssd, ssd_quadratic, ssd_reference, ssd_step


@dataclasses.dataclass(frozen=True)
class Sizes:
    batch: int
    heads: int  # linear attention and flash attention heads
    head_dim: int  # linear attention dk = dv, flash attention head_dim
    ssd_heads: int
    ssd_head_dim: int
    ssd_state: int
    seq_lens: tuple[int, ...]
    scan_max_seq: int  # the sequential scan is slow: skipped above this
    quadratic_max_seq: int  # O(seq^2) memory: skipped above this
    decode_positions: tuple[int, ...]
    dtype: str
    chunk_impls: tuple[str, ...]  # impls of the chunked forms to time
    repeats: int


GPU_SIZES = Sizes(
    batch=1,
    heads=16,
    head_dim=128,
    ssd_heads=32,
    ssd_head_dim=64,
    ssd_state=128,
    seq_lens=(1024, 2048, 4096, 8192, 16384, 32768, 65536),
    scan_max_seq=16384,
    quadratic_max_seq=8192,
    decode_positions=(128, 512, 2048, 8192, 32768),
    dtype="bfloat16",
    chunk_impls=("pallas", "xla"),
    repeats=10,
)
# The Pallas interpreter is far too slow to time; on CPU the chunked form is the XLA path.
CPU_SIZES = Sizes(
    batch=1,
    heads=2,
    head_dim=32,
    ssd_heads=4,
    ssd_head_dim=16,
    ssd_state=16,
    seq_lens=(256, 1024),
    scan_max_seq=1024,
    quadratic_max_seq=1024,
    decode_positions=(128, 512, 2048),
    dtype="float32",
    chunk_impls=("xla",),
    repeats=5,
)


DECODE_REPEATS = 200  # a step takes ~0.1 ms: many repeats make its median stable


def flash_attention_baseline() -> tuple[str, Callable]:
    """The "flash attention" rows (causal, same shapes): Ember's flash attention, or
    ``jax.nn.dot_product_attention`` if it is not importable."""
    try:
        from ember.kernels_pallas.flash_attention import flash_attention
    except ImportError:
        return "jax.nn.dot_product_attention", lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return "ember flash_attention", lambda q, k, v: flash_attention(q, k, v, causal=True)


def forward_and_backward(fn: Callable, argnums: tuple[int, ...]) -> tuple[Callable, Callable]:
    """Jitted forward, and jitted forward+backward of ``sum(outputs)`` w.r.t. ``argnums``."""
    loss = lambda *args: jnp.sum(fn(*args).astype(jnp.float32))  # noqa: E731
    return jax.jit(fn), jax.jit(jax.grad(loss, argnums=argnums))


def measure(fn: Callable, args, repeats: int) -> float | str:
    """Milliseconds per call, or the error's first line (e.g. out of memory)."""
    try:
        return 1e3 * time_fn(fn, *args, warmup=1, repeats=repeats)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def linear_attention_rows(sizes: Sizes, dtype, keys) -> list[dict]:
    _, baseline = flash_attention_baseline()
    rows = []
    for seq in sizes.seq_lens:
        shape = (sizes.batch, seq, sizes.heads, sizes.head_dim)
        q, k, v = (jax.random.normal(key, shape, dtype) for key in keys[:3])
        q, k = jax.nn.softplus(q) / sizes.head_dim, jax.nn.softplus(k)
        log_decay = -jax.nn.softplus(jax.random.normal(keys[3], shape[:3]))
        forms: dict[str, Callable] = {
            f"chunked[{impl}]": (lambda q, k, v, g, impl=impl: linear_attention(q, k, v, log_decay=g, impl=impl))
            for impl in sizes.chunk_impls
        }
        if seq <= sizes.scan_max_seq:
            forms["scan"] = lambda q, k, v, g: linear_attention_reference(q, k, v, log_decay=g)
        if seq <= sizes.quadratic_max_seq:
            forms["quadratic"] = lambda q, k, v, g: linear_attention_quadratic(q, k, v, log_decay=g)
        for form, fn in forms.items():
            forward, both = forward_and_backward(fn, (0, 1, 2, 3))
            rows.append(
                dict(
                    op="linear_attention",
                    seq=seq,
                    form=form,
                    fwd_ms=measure(forward, (q, k, v, log_decay), sizes.repeats),
                    fwd_bwd_ms=measure(both, (q, k, v, log_decay), sizes.repeats),
                )
            )
        forward, both = forward_and_backward(baseline, (0, 1, 2))
        rows.append(
            dict(
                op="linear_attention",
                seq=seq,
                form="flash attention",
                fwd_ms=measure(forward, (q, k, v), sizes.repeats),
                fwd_bwd_ms=measure(both, (q, k, v), sizes.repeats),
            )
        )
    return rows


def ssd_inputs(sizes: Sizes, seq: int, dtype, keys):
    b, h, p, n = sizes.batch, sizes.ssd_heads, sizes.ssd_head_dim, sizes.ssd_state
    x = jax.random.normal(keys[0], (b, seq, h, p), dtype)
    dt = jax.random.normal(keys[1], (b, seq, h)) - 2.0
    A = -jnp.exp(jax.random.normal(keys[2], (h,)))
    B = jax.random.normal(keys[3], (b, seq, 1, n), dtype)
    C = jax.random.normal(keys[4], (b, seq, 1, n), dtype)
    return x, dt, A, B, C


def ssd_rows(sizes: Sizes, dtype, keys) -> list[dict]:
    rows = []
    for seq in sizes.seq_lens:
        args = ssd_inputs(sizes, seq, dtype, keys)
        forms: dict[str, Callable] = {
            f"chunked[{impl}]": (lambda x, dt, A, B, C, impl=impl: ssd(x, dt, A, B, C, impl=impl))
            for impl in sizes.chunk_impls
        }
        if seq <= sizes.scan_max_seq:
            forms["scan"] = ssd_reference
        if seq <= sizes.quadratic_max_seq:
            forms["quadratic"] = ssd_quadratic
        for form, fn in forms.items():
            forward, both = forward_and_backward(fn, (0, 1, 2, 3, 4))
            rows.append(
                dict(
                    op="ssd",
                    seq=seq,
                    form=form,
                    fwd_ms=measure(forward, args, sizes.repeats),
                    fwd_bwd_ms=measure(both, args, sizes.repeats),
                )
            )
    return rows


def decode_rows(sizes: Sizes, dtype, keys) -> list[dict]:
    """One decode step from the state left by a prefix of ``position`` tokens."""
    rows = []
    la_step = jax.jit(linear_attention_step)
    s_step = jax.jit(ssd_step)
    shape = (sizes.batch, 1, sizes.heads, sizes.head_dim)
    for position in sizes.decode_positions:
        q, k, v = (
            jax.random.normal(key, (sizes.batch, position, sizes.heads, sizes.head_dim), dtype) for key in keys[:3]
        )
        _, state = linear_attention(jax.nn.softplus(q), jax.nn.softplus(k), v, return_final_state=True)
        token = [jax.random.normal(key, shape, dtype)[:, 0] for key in keys[3:6]]
        rows.append(
            dict(
                op="linear_attention_step", position=position, step_ms=measure(la_step, (*token, state), DECODE_REPEATS)
            )
        )
        x, dt, A, B, C = ssd_inputs(sizes, position, dtype, keys)
        _, ssm_state = ssd(x, dt, A, B, C, return_final_state=True)
        rows.append(
            dict(
                op="ssd_step",
                position=position,
                step_ms=measure(s_step, (x[:, -1], dt[:, -1], A, B[:, -1], C[:, -1], ssm_state), DECODE_REPEATS),
            )
        )
    return rows


def ratios(rows: list[dict], sizes: Sizes) -> dict:
    """The issue's targets as measured ratios."""
    best = "chunked[pallas]" if "pallas" in sizes.chunk_impls else "chunked[xla]"
    by = {(r["op"], r.get("seq"), r.get("form")): r for r in rows}
    summary: dict[str, dict] = {"flash_over_chunked_linear_attention_fwd_bwd": {}, "scan_over_chunked_ssd_fwd_bwd": {}}
    for seq in sizes.seq_lens:
        chunked = by.get(("linear_attention", seq, best), {}).get("fwd_bwd_ms")
        flash = by.get(("linear_attention", seq, "flash attention"), {}).get("fwd_bwd_ms")
        if isinstance(chunked, float) and isinstance(flash, float):
            summary["flash_over_chunked_linear_attention_fwd_bwd"][seq] = flash / chunked
        chunked_ssd = by.get(("ssd", seq, best), {}).get("fwd_bwd_ms")
        scan = by.get(("ssd", seq, "scan"), {}).get("fwd_bwd_ms")
        if isinstance(chunked_ssd, float) and isinstance(scan, float):
            summary["scan_over_chunked_ssd_fwd_bwd"][seq] = scan / chunked_ssd
    for op in ("linear_attention_step", "ssd_step"):
        steps = [r["step_ms"] for r in rows if r["op"] == op]
        if all(isinstance(s, float) for s in steps) and steps:
            summary[f"{op}_last_over_first_position"] = steps[-1] / steps[0]
    return summary


def main() -> None:
    sizes = GPU_SIZES if on_accelerator() else CPU_SIZES  # a TPU runs the GPU sizes, its own kernels
    if not on_accelerator():
        print(f"No GPU or TPU found ({device_label()}): small sizes, chunked forms on the XLA path.")
    dtype = jnp.dtype(sizes.dtype)
    keys = jax.random.split(jax.random.key(0), 6)
    mixer_rows = linear_attention_rows(sizes, dtype, keys) + ssd_rows(sizes, dtype, keys)
    print_table(mixer_rows, ["op", "seq", "form", "fwd_ms", "fwd_bwd_ms"])
    step_rows = decode_rows(sizes, dtype, keys)
    print_table(step_rows, ["op", "position", "step_ms"])
    summary = ratios(mixer_rows + step_rows, sizes)
    for name, value in summary.items():
        print(f"{name}: {value}")
    path = write_results(
        "sequence_mixers",
        {
            "sizes": dataclasses.asdict(sizes),
            "baseline": flash_attention_baseline()[0],
            "rows": mixer_rows + step_rows,
            "ratios": summary,
        },
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
