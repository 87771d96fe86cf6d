"""Attention kernels against ``jax.nn.dot_product_attention`` (cuDNN and XLA), side by side.

    python -m benchmarks.attention            # full sweep on a GPU, a quick XLA-path run on CPU

Sections (each row prints ours and the baseline, and the ratio):

- dense: bf16, head_dim 128, q_len 1k..16k, causal and not; forward and forward+backward
  TFLOP/s of ``flash_attention`` vs cuDNN and XLA attention;
- block_sparse: local + global (Longformer) at 16k; ours visiting live blocks only, vs cuDNN
  given the same mask as an explicit boolean array, vs our dense causal kernel;
- sigmoid: ``score="sigmoid"`` vs our softmax kernel, same shapes;
- paged_decode: ``ragged_paged_attention`` on a step of decodes only (one query per
  sequence), GB/s of KV cache read vs the measured HBM bandwidth.

Before timing, every kernel's output is checked against its reference on the device (the
same check as the test suite, compiled for real instead of interpreted); a failure stops
the run. On a machine without a GPU the script says so and times the XLA paths at small
sizes only. Results: ``benchmarks/results/attention-<device>.json``.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import jax
import jax.numpy as jnp

from benchmarks.harness import device_label, on_gpu, print_table, time_fn, write_results
from ember.kernels_pallas.block_mask import LocalGlobalMask, live_block_grid
from ember.kernels_pallas.flash_attention import FlashBlockSizes, flash_attention, flash_attention_reference
from ember.kernels_pallas.ragged_paged_attention import ragged_paged_attention, ragged_paged_attention_reference

# Forward+backward FLOPs over forward FLOPs: backward recomputes QK^T and adds four more
# matmuls (dV, dP, dQ, dK): 2 + 5 = 7 matmuls against the forward's 2.
FWD_BWD_FLOP_RATIO = 3.5


def _attention_flops(batch, heads, q_len, kv_len, head_dim, pair_fraction):
    """Forward FLOPs of the two matmuls over the visible fraction of score pairs."""
    return 4.0 * batch * heads * q_len * kv_len * head_dim * pair_fraction


def _qkv(shape_q, shape_kv, dtype, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    return (
        jax.random.normal(keys[0], shape_q, dtype),
        jax.random.normal(keys[1], shape_kv, dtype),
        jax.random.normal(keys[2], shape_kv, dtype),
    )


def _fwd_and_fwd_bwd(attend: Callable):
    fwd = jax.jit(attend)
    grad = jax.jit(jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v).astype(jnp.float32)), argnums=(0, 1, 2)))
    return fwd, grad


def _time_or_error(fn, *args):
    """Seconds per call, or the error text (e.g. a baseline that does not support a case)."""
    try:
        return time_fn(fn, *args, warmup=2, repeats=10)
    except Exception as error:  # noqa: BLE001 - a baseline failing is a result, not a crash
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _tflops(flops, seconds):
    return flops / seconds / 1e12 if isinstance(seconds, float) else None


def _ratio(ours, theirs):
    return theirs / ours if isinstance(ours, float) and isinstance(theirs, float) else None


def check_kernels_on_device(impl: str) -> dict[str, float]:
    """Max |kernel - reference| of each kernel on this device (f32, awkward lengths); raises
    if one is off by more than the test-suite f32 tolerance scaled for long sums."""
    errors = {}
    q, k, v = _qkv((1, 333, 4, 64), (1, 333, 2, 64), jnp.float32)
    for name, options in {
        "flash_causal": dict(causal=True),
        "flash_local_global": dict(block_mask=LocalGlobalMask(40, 40, 16)),
        "flash_sigmoid_window": dict(score="sigmoid", window=(50, 10), logits_soft_cap=5.0),
    }.items():
        def ours(q, k, v, options=options):
            return jnp.sum(flash_attention(q, k, v, impl=impl, block_sizes=FlashBlockSizes(64, 64), **options) ** 2)

        def ref(q, k, v, options=options):
            return jnp.sum(flash_attention_reference(q, k, v, **options) ** 2)

        got = jax.jit(jax.value_and_grad(ours, argnums=(0, 1, 2)))(q, k, v)
        want = jax.jit(jax.value_and_grad(ref, argnums=(0, 1, 2)))(q, k, v)
        errors[name] = max(
            float(jnp.max(jnp.abs(a - b)) / (1.0 + jnp.max(jnp.abs(b))))
            for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want))
        )
    pages = jax.random.normal(jax.random.key(1), (2, 64, 16, 2, 64))
    table = jax.random.permutation(jax.random.key(2), 64)[:48].reshape(6, 8).astype(jnp.int32)
    lengths = jnp.array([0, 1, 16, 17, 100, 128], jnp.int32)
    qd = jax.random.normal(jax.random.key(3), (6, 8, 64))
    decodes = _decode_metadata(lengths)
    got = jax.jit(lambda *a: ragged_paged_attention(*a, impl=impl))(qd, pages[0], pages[1], table, *decodes)
    want = ragged_paged_attention_reference(qd, pages[0], pages[1], table, *decodes)
    errors["paged_decode"] = float(jnp.max(jnp.abs(got - want)))
    bad = {name: err for name, err in errors.items() if not err < 1e-3}
    if bad:
        raise AssertionError(f"kernels disagree with their references on {device_label()}: {bad}")
    return errors


def measured_bandwidth_gbs(num_bytes: int) -> float:
    """Device memory bandwidth in GB/s from a large elementwise copy (read + write)."""
    x = jnp.ones((num_bytes // 4,), jnp.float32)
    copy = jax.jit(lambda x: x * 2.0)
    return 2 * num_bytes / time_fn(copy, x, warmup=2, repeats=10) / 1e9


def dense_rows(impl, baselines, q_lens, batch_tokens, heads, head_dim, dtype):
    rows = []
    for q_len in q_lens:
        batch = max(1, batch_tokens // q_len)
        q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
        for causal in (False, True):
            flops = _attention_flops(batch, heads, q_len, q_len, head_dim, 0.5 if causal else 1.0)
            row = dict(section="dense", q_len=q_len, batch=batch, causal=causal)
            fwd, fwd_bwd = _fwd_and_fwd_bwd(lambda q, k, v, c=causal: flash_attention(q, k, v, causal=c, impl=impl))
            ours = (_time_or_error(fwd, q, k, v), _time_or_error(fwd_bwd, q, k, v))
            row.update(ours_fwd_tflops=_tflops(flops, ours[0]), ours_fwd_bwd_tflops=_tflops(FWD_BWD_FLOP_RATIO * flops, ours[1]))
            for baseline in baselines:
                fwd, fwd_bwd = _fwd_and_fwd_bwd(
                    lambda q, k, v, c=causal, b=baseline: jax.nn.dot_product_attention(q, k, v, is_causal=c, implementation=b)
                )
                theirs = (_time_or_error(fwd, q, k, v), _time_or_error(fwd_bwd, q, k, v))
                row[f"{baseline}_fwd_tflops"] = _tflops(flops, theirs[0])
                row[f"{baseline}_fwd_bwd_tflops"] = _tflops(FWD_BWD_FLOP_RATIO * flops, theirs[1])
                row[f"fwd_speedup_vs_{baseline}"] = _ratio(ours[0], theirs[0])
                row[f"fwd_bwd_speedup_vs_{baseline}"] = _ratio(ours[1], theirs[1])
                for name, value in (("fwd", theirs[0]), ("fwd_bwd", theirs[1])):
                    if isinstance(value, str):
                        row[f"{baseline}_{name}_error"] = value
            rows.append(row)
    return rows


def block_sparse_rows(impl, baseline, q_len, heads, head_dim, dtype, mask):
    q, k, v = _qkv((1, q_len, heads, head_dim), (1, q_len, heads, head_dim), dtype)
    block = FlashBlockSizes()
    live = live_block_grid(mask, q_len, q_len, block.block_q, block.block_kv)
    dense_mask = jnp.asarray(mask.dense(q_len, q_len))[None, None]
    pair_fraction = float(mask.dense(q_len, q_len).mean())
    flops = _attention_flops(1, heads, q_len, q_len, head_dim, pair_fraction)
    ours = _time_or_error(jax.jit(lambda q, k, v: flash_attention(q, k, v, block_mask=mask, impl=impl)), q, k, v)
    ours_causal = _time_or_error(jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True, impl=impl)), q, k, v)
    theirs = _time_or_error(
        jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, mask=dense_mask, implementation=baseline)), q, k, v
    )
    row = dict(
        section="block_sparse", q_len=q_len, mask=repr(mask), live_blocks=int(live.sum()), total_blocks=int(live.size),
        ours_fwd_ms=ours * 1e3 if isinstance(ours, float) else ours,
        ours_fwd_tflops=_tflops(flops, ours),
        ours_dense_causal_fwd_ms=ours_causal * 1e3 if isinstance(ours_causal, float) else ours_causal,
        **{f"{baseline or 'default'}_masked_fwd_ms": theirs * 1e3 if isinstance(theirs, float) else theirs},
        speedup_vs_baseline_with_mask=_ratio(ours, theirs),
        speedup_vs_our_dense_causal=_ratio(ours, ours_causal),
    )
    return [row]


def sigmoid_rows(impl, q_len, batch, heads, head_dim, dtype):
    q, k, v = _qkv((batch, q_len, heads, head_dim), (batch, q_len, heads, head_dim), dtype)
    rows = []
    for causal in (False, True):
        times = {}
        for score in ("softmax", "sigmoid"):
            fwd, fwd_bwd = _fwd_and_fwd_bwd(
                lambda q, k, v, s=score, c=causal: flash_attention(q, k, v, score=s, causal=c, impl=impl)
            )
            times[score] = (_time_or_error(fwd, q, k, v), _time_or_error(fwd_bwd, q, k, v))
        rows.append(dict(
            section="sigmoid", q_len=q_len, causal=causal,
            softmax_fwd_ms=times["softmax"][0] * 1e3, sigmoid_fwd_ms=times["sigmoid"][0] * 1e3,
            fwd_speedup_sigmoid_vs_softmax=_ratio(times["sigmoid"][0], times["softmax"][0]),
            fwd_bwd_speedup_sigmoid_vs_softmax=_ratio(times["sigmoid"][1], times["softmax"][1]),
        ))
    return rows


def _decode_metadata(lengths):
    """``(query_starts, query_lens, kv_lens)`` of a step of one decode per sequence
    (a sequence of length 0 sits out)."""
    batch = lengths.shape[0]
    return jnp.arange(batch, dtype=jnp.int32), (lengths > 0).astype(jnp.int32), lengths


def paged_rows(impl, batch, heads, kv_heads, head_dim, page_size, length, dtype, bandwidth_gbs):
    pages_per_seq = length // page_size
    num_pages = batch * pages_per_seq
    keys = jax.random.split(jax.random.key(4), 4)
    k_pages = jax.random.normal(keys[0], (num_pages, page_size, kv_heads, head_dim), dtype)
    v_pages = jax.random.normal(keys[1], (num_pages, page_size, kv_heads, head_dim), dtype)
    table = jax.random.permutation(keys[2], num_pages).reshape(batch, pages_per_seq).astype(jnp.int32)
    q = jax.random.normal(keys[3], (batch, heads, head_dim), dtype)
    lengths = jnp.full((batch,), length, jnp.int32)
    decode = jax.jit(lambda *a: ragged_paged_attention(*a, impl=impl))
    seconds = _time_or_error(decode, q, k_pages, v_pages, table, *_decode_metadata(lengths))
    cache_bytes = 2 * batch * length * kv_heads * head_dim * jnp.dtype(dtype).itemsize
    gbs = cache_bytes / seconds / 1e9 if isinstance(seconds, float) else None
    return [dict(
        section="paged_decode", batch=batch, length=length, page_size=page_size,
        ours_ms=seconds * 1e3 if isinstance(seconds, float) else seconds,
        ours_gbs=gbs, measured_bandwidth_gbs=bandwidth_gbs,
        fraction_of_bandwidth=gbs / bandwidth_gbs if gbs else None,
    )]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes even on a GPU")
    args = parser.parse_args(argv)
    gpu = on_gpu()
    if gpu and not args.quick:
        impl, baselines, dtype = "pallas", ("cudnn", "xla"), jnp.bfloat16
        sizes = dict(q_lens=(1024, 2048, 4096, 8192, 16384), batch_tokens=16384, heads=16, head_dim=128)
        sparse_len, paged = 16384, dict(batch=64, heads=32, kv_heads=8, head_dim=128, page_size=16, length=4096)
        bandwidth_bytes = 4 << 30
    else:
        if not gpu:
            print(f"No GPU found (device: {device_label()}): timing the XLA paths at small sizes only.")
        impl, baselines, dtype = ("pallas" if gpu else "xla"), ("xla",), (jnp.bfloat16 if gpu else jnp.float32)
        sizes = dict(q_lens=(256, 512), batch_tokens=512, heads=4, head_dim=64)
        sparse_len, paged = 1024, dict(batch=4, heads=8, kv_heads=2, head_dim=64, page_size=16, length=512)
        bandwidth_bytes = 256 << 20
    checks = check_kernels_on_device(impl) if gpu else {}
    bandwidth = measured_bandwidth_gbs(bandwidth_bytes)
    sparse_mask = LocalGlobalMask(256, 256, 64) if gpu and not args.quick else LocalGlobalMask(64, 64, 16)
    rows = []
    rows += dense_rows(impl, baselines, dtype=dtype, **sizes)
    rows += block_sparse_rows(impl, baselines[0], sparse_len, sizes["heads"], sizes["head_dim"], dtype, sparse_mask)
    rows += sigmoid_rows(impl, sizes["q_lens"][-1], max(1, sizes["batch_tokens"] // sizes["q_lens"][-1]),
                         sizes["heads"], sizes["head_dim"], dtype)
    rows += paged_rows(impl, dtype=dtype, bandwidth_gbs=bandwidth, **paged)
    for section in ("dense", "block_sparse", "sigmoid", "paged_decode"):
        section_rows = [r for r in rows if r["section"] == section]
        columns = [c for c in section_rows[0] if c != "section" and not c.endswith("_error")]
        print(f"\n== {section} ({impl}, {jnp.dtype(dtype).name}) ==")
        print_table(section_rows, columns)
    path = write_results("attention", dict(
        impl=impl, dtype=jnp.dtype(dtype).name, gpu=gpu, device_value_checks=checks,
        measured_bandwidth_gbs=bandwidth, rows=rows,
        note=None if gpu else "no GPU found: XLA paths at small sizes; kernels are checked by the test suite in interpret mode",
    ))
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
