"""Mixture of experts: the grouped matmul against its baselines.

    python -m benchmarks.moe          # GPU: MoE-sized problems; CPU: small sizes

``grouped_matmul`` section: for each problem (experts, rows, k, n) and load (balanced:
every expert the same rows; skewed: a Zipf-like draw, one expert with about half the rows
and some with none), forward and forward+backward (gradients of ``lhs`` and ``rhs``) of

- ``grouped_matmul[<impl>]``: Ember's op (``impl="pallas"`` on a GPU; on CPU its XLA path,
  ``jax.lax.ragged_dot``, since the Pallas interpreter is far too slow to time);
- ``ragged_dot``: ``jax.lax.ragged_dot`` called directly;
- ``per_expert_loop``: one dense matmul per expert on its static slice of rows (sizes
  known when tracing, as a plain PyTorch-style MoE loop does), concatenated;
- ``dense_equal_flops``: one ``[rows, k] @ [k, n]`` matmul, the same FLOPs as the grouped
  matmul; the ceiling a grouped matmul aims at.

TFLOP/s count the useful FLOPs (``2 * rows * k * n`` forward, three times that forward +
backward). Target on an H100 (the issue): grouped_matmul >= 0.8x the TFLOP/s of the
equal-FLOP dense matmul. Results: ``benchmarks/results/moe-<device>.json``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import device_label, on_gpu, print_table, time_fn, write_results
from ember.kernels_pallas.grouped_matmul import grouped_matmul


@dataclasses.dataclass(frozen=True)
class Problem:
    """One grouped matmul: ``[rows, k]`` rows spread over ``experts`` matrices ``[k, n]``."""

    experts: int
    rows: int
    k: int
    n: int


@dataclasses.dataclass(frozen=True)
class Sizes:
    problems: tuple[Problem, ...]
    loads: tuple[str, ...]
    dtype: str
    impl: str  # grouped_matmul's impl
    repeats: int


GPU_SIZES = Sizes(
    # Mixtral-8x7B's up projection (8 experts, top-2 of 8k tokens); a fine-grained MoE
    # (64 experts, top-8 of 4k tokens, Qwen/DeepSeek-MoE-like widths).
    problems=(Problem(8, 16384, 4096, 14336), Problem(64, 32768, 2048, 1408)),
    loads=("balanced", "skewed"),
    dtype="bfloat16",
    impl="pallas",
    repeats=10,
)
CPU_SIZES = Sizes(
    problems=(Problem(8, 1024, 128, 256), Problem(32, 2048, 64, 128)),
    loads=("balanced", "skewed"),
    dtype="float32",
    impl="auto",
    repeats=5,
)
FORMS = ("grouped_matmul", "ragged_dot", "per_expert_loop", "dense_equal_flops")


def group_sizes_for(load: str, experts: int, rows: int, seed: int = 0) -> np.ndarray:
    """int32 ``[experts]`` summing to ``rows``: equal shares, or a Zipf-like skew (weights
    ``1 / rank^1.5``; the least-loaded quarter of the experts get nothing)."""
    if load == "balanced":
        return (np.full(experts, rows // experts) + (np.arange(experts) < rows % experts)).astype(np.int32)
    if load != "skewed":
        raise ValueError(f"load must be 'balanced' or 'skewed', got {load!r}")
    weights = 1.0 / np.arange(1, experts + 1) ** 1.5
    weights[experts - experts // 4 :] = 0.0
    gen = np.random.default_rng(seed)
    return gen.permutation(gen.multinomial(rows, weights / weights.sum())).astype(np.int32)


def per_expert_loop(group_sizes: np.ndarray) -> Callable:
    """``fn(lhs, rhs)``: a dense matmul per expert on its rows, with the sizes fixed at trace
    time (an empty expert contributes nothing)."""
    bounds = np.concatenate([[0], np.cumsum(group_sizes)]).tolist()

    def fn(lhs, rhs):
        pieces = [lhs[lo:hi] @ rhs[g] for g, (lo, hi) in enumerate(itertools.pairwise(bounds)) if hi > lo]
        return jnp.concatenate(pieces, axis=0)

    return fn


def forms_for(sizes: Sizes, problem: Problem, group_sizes: np.ndarray, dtype, key) -> dict[str, tuple[Callable, tuple]]:
    """``{form: (fn, args)}``, each ``fn(*args)`` one product of the row's FLOPs."""
    k_lhs, k_rhs = jax.random.split(key)
    lhs = jax.random.normal(k_lhs, (problem.rows, problem.k), dtype)
    rhs = jax.random.normal(k_rhs, (problem.experts, problem.k, problem.n), dtype) / np.sqrt(problem.k)
    sizes_array = jnp.asarray(group_sizes, jnp.int32)
    impl = sizes.impl
    return {
        "grouped_matmul": (lambda a, b, s: grouped_matmul(a, b, s, impl=impl), (lhs, rhs, sizes_array)),
        "ragged_dot": (lambda a, b, s: jax.lax.ragged_dot(a, b, s), (lhs, rhs, sizes_array)),
        "per_expert_loop": (per_expert_loop(group_sizes), (lhs, rhs)),
        "dense_equal_flops": (lambda a, b: a @ b, (lhs, rhs[0])),
    }


def _timed_ms(fn: Callable, args, repeats: int) -> float | str:
    """Milliseconds per call, or the error's first line (e.g. out of memory)."""
    try:
        return 1e3 * time_fn(fn, *args, warmup=1, repeats=repeats)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _tflops(flops: float, ms) -> float | None:
    return flops / ms / 1e9 if isinstance(ms, float) else None


def _relative_diff(fn: Callable, args, want: jax.Array) -> float | str:
    """``||fn(*args) - want|| / ||want||`` in float32 (a check that the timed forms agree)."""
    try:
        got = jax.jit(fn)(*args).astype(jnp.float32)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"
    return float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))


def grouped_matmul_rows(sizes: Sizes, key=None) -> list[dict]:
    """One row per (problem, load, form): ``fwd_ms``, ``fwd_bwd_ms``, their TFLOP/s and,
    for the grouped forms, the relative difference of the output from ``ragged_dot``'s."""
    dtype = jnp.dtype(sizes.dtype)
    key = jax.random.key(0) if key is None else key
    rows = []
    for problem in sizes.problems:
        flops = 2.0 * problem.rows * problem.k * problem.n
        for load in sizes.loads:
            group_sizes = group_sizes_for(load, problem.experts, problem.rows)
            forms = forms_for(sizes, problem, group_sizes, dtype, key)
            peer_fn, peer_args = forms["ragged_dot"]
            peer_out = jax.jit(peer_fn)(*peer_args).astype(jnp.float32)
            for form, (fn, args) in forms.items():
                loss = lambda *a, fn=fn: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
                grouped = form in ("grouped_matmul", "per_expert_loop")
                fwd_ms = _timed_ms(jax.jit(fn), args, sizes.repeats)
                fwd_bwd_ms = _timed_ms(jax.jit(jax.grad(loss, argnums=(0, 1))), args, sizes.repeats)
                rows.append(
                    dict(
                        section="grouped_matmul",
                        **dataclasses.asdict(problem),
                        load=load,
                        max_expert_rows=int(group_sizes.max()),
                        empty_experts=int((group_sizes == 0).sum()),
                        form=form if form != "grouped_matmul" else f"grouped_matmul[{sizes.impl}]",
                        fwd_ms=fwd_ms,
                        fwd_bwd_ms=fwd_bwd_ms,
                        fwd_tflops=_tflops(flops, fwd_ms),
                        fwd_bwd_tflops=_tflops(3 * flops, fwd_bwd_ms),
                        rel_diff_vs_ragged_dot=_relative_diff(fn, args, peer_out) if grouped else None,
                    )
                )
            del peer_out
    return rows


def grouped_matmul_ratios(rows: list[dict]) -> dict[str, float]:
    """``{"<experts>x<rows>x<k>x<n> <load> <fwd|fwd_bwd> <baseline>": ours' TFLOP/s over the
    baseline's}`` for every baseline form (> 1: ours is faster)."""
    ratios = {}
    ours = [r for r in rows if r.get("section") == "grouped_matmul" and r["form"].startswith("grouped_matmul[")]
    for mine in ours:
        name = f"{mine['experts']}x{mine['rows']}x{mine['k']}x{mine['n']} {mine['load']}"
        for other in rows:
            same = all(other.get(f) == mine[f] for f in ("section", "experts", "rows", "k", "n", "load"))
            if not same or other is mine:
                continue
            for phase in ("fwd", "fwd_bwd"):
                a, b = mine[f"{phase}_tflops"], other[f"{phase}_tflops"]
                if a is not None and b is not None:
                    ratios[f"{name} {phase} vs {other['form']}"] = a / b
    return ratios


def main() -> None:
    sizes = GPU_SIZES if on_gpu() else CPU_SIZES
    if not on_gpu():
        print(f"No GPU found ({device_label()}): small sizes; grouped_matmul on its XLA path (ragged_dot).")
    rows = grouped_matmul_rows(sizes)
    columns = ["experts", "rows", "k", "n", "load", "form", "fwd_ms", "fwd_bwd_ms", "fwd_tflops"]
    print_table(rows, [*columns, "rel_diff_vs_ragged_dot"])
    ratios = grouped_matmul_ratios(rows)
    for name, value in ratios.items():
        print(f"{name}: {value:.3g}")
    path = write_results("moe", {"sizes": dataclasses.asdict(sizes), "rows": rows, "ratios": ratios})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
