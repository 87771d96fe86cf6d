"""Mixture of experts against its baselines: grouped matmul, MoE layer, MoE++, a tiny MoE LM.

The grouped matmul against ragged_dot and dense loops, the MoE layer and MoE++ against the
dense MLP and plain MoE, and a tiny MoE language model against the dense one of equal active
parameters.

    python -m benchmarks.moe                          # GPU: MoE-sized problems; CPU: small sizes
    python -m benchmarks.moe --section moe_layer      # one section (repeat --section for more)
    python -m benchmarks.moe --section stdlib_lm --steps 300   # opt-in: trains two models (minutes)

The default run is ``grouped_matmul``, ``moe_layer`` and ``moe_plus_plus``; ``stdlib_lm`` runs
only when named.

``grouped_matmul`` section: for each problem (experts, rows, k, n) and load (balanced:
every expert the same rows; skewed: a Zipf-like draw, one expert with about half the rows
and some with none), forward and forward+backward (gradients of ``lhs`` and ``rhs``) of

- ``grouped_matmul[<impl>]``: Ember's op (``impl="pallas"`` on a GPU or TPU; on CPU its XLA path,
  ``jax.lax.ragged_dot``, since the Pallas interpreter is far too slow to time);
- ``ragged_dot``: ``jax.lax.ragged_dot`` called directly;
- ``per_expert_loop``: one dense matmul per expert on its static slice of rows (sizes
  known when tracing, as a plain PyTorch-style MoE loop does), concatenated;
- ``dense_equal_flops``: one ``[rows, k] @ [k, n]`` matmul, the same FLOPs as the grouped
  matmul; the ceiling a grouped matmul aims at;
- ``grouped_matmul[hopper]`` (on a GPU): Ember's op with ``gpu_kernel="hopper"``, the Mosaic
  GPU ``gmm`` for the forward and ``d_lhs`` (``d_rhs`` stays Triton's ``tgmm``);
- ``jax_ragged_dot_mgpu`` (on a GPU): JAX's Hopper ragged dot written in Mosaic GPU
  (``jax.experimental.pallas.ops.gpu.ragged_dot_mgpu``; forward only, so its forward+backward
  records the error), the wgmma kernel a Triton grouped matmul is measured against.

TFLOP/s count the useful FLOPs (``2 * rows * k * n`` forward, three times that forward +
backward). Target on an H100 (the issue): grouped_matmul >= 0.8x the TFLOP/s of the
equal-FLOP dense matmul.

``moe_layer`` section: tokens/s of one training step (jitted ``value_and_grad`` of a
squared-output loss over the parameters and the input) of ``MoeMlp`` against the dense
``Mlp`` of equal *active* parameters (``mlp_dim = top_k * expert_dim``), same ``d_model`` and
tokens: ``moe_dropless[<impl>]`` (``pallas`` grouped matmul on a GPU or TPU, ``xla`` on CPU) and
``moe_capacity`` (capacity-factor dispatch, same impl). Ratios: MoE tokens/s over dense.

``moe_plus_plus`` section: the same step for plain MoE (``E`` FFN experts, top-k) against MoE++
(the same ``E`` FFN experts plus zero, copy and constant experts, gating residual fed the
previous layer's logits, here a fixed random draw), with the measured fraction of token-slots
that went to FFN experts: the slots a zero-computation expert takes cost no matmul rows,
which is where MoE++'s speed comes from (the paper: 1.1-2.1x expert throughput). The routers
are randomly initialised, so the zero-computation experts win only the slots they draw by
chance (about their share of the routed experts); a trained MoE++ router learns to send
more (easy tokens) there. The ratio measured here is that of an untrained router.

``stdlib_lm`` section (opt-in): ``configs/lm/tiny.yaml`` (dense MLP of 256) and
``configs/lm/moe_tiny.yaml`` (8 experts of 128, top-2: equal active MLP width) trained the
same steps (``--steps``, default their configured 1500) through the LM trainer on the Python
standard library's source; final validation loss of each, the gap and tokens/s.

Results: ``benchmarks/results/moe-<device>.json`` (a run of some sections keeps the other
sections' figures already in that file).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import RESULTS_DIR, device_label, on_accelerator, print_table, time_fn, write_results
from ember.core.config import load_config
from ember.core.tree import param_count
from ember.kernels_pallas.grouped_matmul import GroupedMatmulBlockSizes, grouped_matmul
from ember.models.config import ModelConfig, MoEConfig
from ember.models.layers.mlp import Mlp
from ember.models.layers.moe import MoeMlp

CONFIGS = Path(__file__).resolve().parents[1] / "configs" / "lm"


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
    # Kernel tiles timed on the first problem and load (grouped_matmul_tile_rows); the GPU
    # candidates are Triton GEMM shapes for sm90: wider n and k tiles, 8 warps, more stages.
    tiles: tuple[GroupedMatmulBlockSizes, ...] = ()


GPU_SIZES = Sizes(
    # Mixtral-8x7B's up projection (8 experts, top-2 of 8k tokens); a fine-grained MoE
    # (64 experts, top-8 of 4k tokens, Qwen/DeepSeek-MoE-like widths).
    problems=(Problem(8, 16384, 4096, 14336), Problem(64, 32768, 2048, 1408)),
    loads=("balanced", "skewed"),
    dtype="bfloat16",
    impl="pallas",
    repeats=10,
    tiles=(
        GroupedMatmulBlockSizes(128, 64, 128, num_warps=8, num_stages=4),  # the default
        GroupedMatmulBlockSizes(128, 64, 128, num_warps=4, num_stages=3),  # the default until it was seen to spill
        GroupedMatmulBlockSizes(128, 64, 256, num_warps=8, num_stages=3),
        GroupedMatmulBlockSizes(256, 64, 128, num_warps=8, num_stages=3),
        GroupedMatmulBlockSizes(128, 128, 128, num_warps=8, num_stages=3),
        GroupedMatmulBlockSizes(64, 64, 256, num_warps=4, num_stages=4),
    ),
)
CPU_SIZES = Sizes(
    problems=(Problem(8, 1024, 128, 256), Problem(32, 2048, 64, 128)),
    loads=("balanced", "skewed"),
    dtype="float32",
    impl="auto",
    repeats=5,
)
# On a GPU also grouped_matmul[hopper] and jax_ragged_dot_mgpu.
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
    rhs = (jax.random.normal(k_rhs, (problem.experts, problem.k, problem.n), dtype) / np.sqrt(problem.k)).astype(dtype)
    sizes_array = jnp.asarray(group_sizes, jnp.int32)
    impl = sizes.impl
    forms = {
        "grouped_matmul": (lambda a, b, s: grouped_matmul(a, b, s, impl=impl), (lhs, rhs, sizes_array)),
        "ragged_dot": (lambda a, b, s: jax.lax.ragged_dot(a, b, s), (lhs, rhs, sizes_array)),
        "per_expert_loop": (per_expert_loop(group_sizes), (lhs, rhs)),
        "dense_equal_flops": (lambda a, b: a @ b, (lhs, rhs[0])),
    }
    if impl == "pallas" and jax.default_backend() == "gpu":
        hopper = lambda a, b, s: grouped_matmul(a, b, s, impl=impl, gpu_kernel="hopper")  # noqa: E731
        forms["grouped_matmul[hopper]"] = (hopper, (lhs, rhs, sizes_array))
        forms["jax_ragged_dot_mgpu"] = (_jax_ragged_dot_mgpu, (lhs, rhs, sizes_array))
    return forms


def _jax_ragged_dot_mgpu(lhs, rhs, group_sizes):
    """JAX's Hopper (Mosaic GPU) ragged dot with the tiles its own sweep starts from."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    return ragged_dot_mgpu.ragged_dot(
        lhs, rhs, group_sizes=group_sizes, block_m=128, block_n=128, block_k=64, max_concurrent_steps=4, grid_block_n=1
    )


def _timed_ms(fn: Callable, args, repeats: int) -> float | str:
    """Milliseconds per call, or the error's first line (e.g. out of memory)."""
    try:
        return 1e3 * time_fn(fn, *args, warmup=1, repeats=repeats)
    except Exception as error:
        return f"{type(error).__name__}: {str(error).splitlines()[0][:120]}"


def _timed_fwd_and_fwd_bwd(fn: Callable, args, repeats: int) -> tuple[float | str, float | str]:
    """Milliseconds (or the error's first line) of ``fn`` and of the gradient of its summed
    output with respect to its first two arguments."""
    loss = lambda *a: jnp.sum(fn(*a).astype(jnp.float32))  # noqa: E731
    fwd = _timed_ms(jax.jit(fn), args, repeats)
    return fwd, _timed_ms(jax.jit(jax.grad(loss, argnums=(0, 1))), args, repeats)


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
                grouped = form not in ("ragged_dot", "dense_equal_flops")  # the peer itself; other FLOPs
                fwd_ms, fwd_bwd_ms = _timed_fwd_and_fwd_bwd(fn, args, sizes.repeats)
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


def grouped_matmul_tile_rows(sizes: Sizes, key=None) -> list[dict]:
    """One row per tile of ``sizes.tiles``: our grouped matmul's forward and forward+backward
    on the first problem and load, and each one's TFLOP/s over the equal-FLOP dense matmul's
    (timed once, in the same run)."""
    problem, load = sizes.problems[0], sizes.loads[0]
    group_sizes = group_sizes_for(load, problem.experts, problem.rows)
    forms = forms_for(sizes, problem, group_sizes, jnp.dtype(sizes.dtype), jax.random.key(0) if key is None else key)
    flops = 2.0 * problem.rows * problem.k * problem.n

    dense = _timed_fwd_and_fwd_bwd(*forms["dense_equal_flops"], sizes.repeats)
    args = forms["grouped_matmul"][1]
    rows = []
    for tile in sizes.tiles:
        tiled = lambda a, b, s, tile=tile: grouped_matmul(a, b, s, impl=sizes.impl, block_sizes=tile)  # noqa: E731
        ours = _timed_fwd_and_fwd_bwd(tiled, args, sizes.repeats)
        row = dict(section="grouped_matmul_tiles", **dataclasses.asdict(problem), load=load, **dataclasses.asdict(tile))
        for phase, mine, theirs, phase_flops in zip(("fwd", "fwd_bwd"), ours, dense, (flops, 3 * flops), strict=True):
            row[f"{phase}_ms"] = mine
            row[f"{phase}_tflops"] = _tflops(phase_flops, mine)
            dense_tflops = _tflops(phase_flops, theirs)
            if row[f"{phase}_tflops"] is not None and dense_tflops is not None:
                row[f"{phase}_vs_dense_equal_flops"] = row[f"{phase}_tflops"] / dense_tflops
        rows.append(row)
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


@dataclasses.dataclass(frozen=True)
class LayerSizes:
    """One MoE layer: ``tokens`` rows of ``d_model`` through ``experts`` FFN experts of
    ``expert_dim`` channels, ``top_k`` per token; the dense baseline has ``top_k * expert_dim``.
    MoE++ adds ``zero_experts``, ``copy_experts`` and ``constant_experts`` to the routed ones."""

    tokens: int
    d_model: int
    experts: int
    expert_dim: int
    top_k: int
    capacity_factor: float
    zero_experts: int
    copy_experts: int
    constant_experts: int
    precision: str  # the models' ``precision`` policy
    impl: str  # the models' ``moe_impl``
    repeats: int


GPU_LAYER_SIZES = LayerSizes(
    # One Mixtral-8x7B MLP layer (8 experts of 14336, top-2) on 8k tokens in bf16 compute;
    # MoE++ adds the paper's 1 zero, 1 copy and 2 constant experts.
    tokens=8192,
    d_model=4096,
    experts=8,
    expert_dim=14336,
    top_k=2,
    capacity_factor=1.25,
    zero_experts=1,
    copy_experts=1,
    constant_experts=2,
    precision="bf16",
    impl="pallas",
    repeats=10,
)
CPU_LAYER_SIZES = LayerSizes(
    tokens=2048,
    d_model=128,
    experts=8,
    expert_dim=256,
    top_k=2,
    capacity_factor=1.25,
    zero_experts=1,
    copy_experts=1,
    constant_experts=2,
    precision="f32",
    impl="xla",
    repeats=10,
)


def layer_config(sizes: LayerSizes, *, capacity: bool = False, plus_plus: bool = False) -> ModelConfig:
    """The model config of one layer: dropless (or ``capacity``-factor) MoE, MoE++ with
    ``plus_plus``; its ``mlp_dim`` is the dense baseline's width ``top_k * expert_dim``."""
    extra = (sizes.zero_experts, sizes.copy_experts, sizes.constant_experts) if plus_plus else (0, 0, 0)
    moe = MoEConfig(
        num_experts=sizes.experts,
        top_k=sizes.top_k,
        expert_dim=sizes.expert_dim,
        capacity_factor=sizes.capacity_factor if capacity else 0.0,
        num_zero_experts=extra[0],
        num_copy_experts=extra[1],
        num_constant_experts=extra[2],
        gating_residual=plus_plus,
    )
    return ModelConfig(
        d_model=sizes.d_model,
        mlp_dim=sizes.top_k * sizes.expert_dim,
        mlp_pattern=("moe",),
        moe=moe,
        precision=sizes.precision,
        moe_impl=sizes.impl,
    )


def _perturbed(params, key):
    """``params`` plus 10% relative noise: away from the initialisation's symmetries."""
    leaves, treedef = jax.tree.flatten(params)
    keys = jax.random.split(key, len(leaves))
    noisy = [leaf * (1 + 0.1 * jax.random.normal(k, leaf.shape, leaf.dtype)) for leaf, k in zip(leaves, keys)]
    return jax.tree.unflatten(treedef, noisy)


def _inactive_expert_params(params, moe: MoEConfig) -> int:
    """The parameters of the ``num_experts - top_k`` FFN experts a token does not use."""
    return param_count(params["experts"]) * (moe.num_experts - moe.top_k) // moe.num_experts


def layer_row(section: str, form: str, config: ModelConfig, sizes: LayerSizes, key) -> dict:
    """Times one training step (``value_and_grad`` over parameters and input of
    ``mean(y^2)``) of ``form``: ``dense`` (the ``Mlp`` of ``config.mlp_dim``) or an MoE form
    (``MoeMlp(config)``, fed a fixed random ``previous_logits`` when the router has a gating
    residual). Returns ms, tokens/s, parameter counts and, for MoE forms, the fraction of
    token-slots that reached an FFN expert's matmul (not a zero-computation expert, not dropped)."""
    k_x, k_prev, k_init, k_noise = jax.random.split(key, 4)
    policy = config.policy
    x = jax.random.normal(k_x, (1, sizes.tokens, sizes.d_model), policy.compute_dtype)
    dense = form == "dense"
    if dense:
        module = Mlp(config.mlp_dim, config.mlp, config.init_std, policy.compute_dtype, policy.param_dtype)
        inputs = (x,)
    else:
        module = MoeMlp(config)
        previous = jax.random.normal(k_prev, (1, sizes.tokens, config.moe.total_experts), jnp.float32)
        inputs = (x, previous if config.moe.gating_residual else None)
    params = _perturbed(module.init(k_init, *inputs)["params"], k_noise)

    def loss(params, x):
        out = module.apply({"params": params}, x, *inputs[1:])
        y = out if dense else out[0]
        return jnp.mean(jnp.square(y.astype(jnp.float32)))

    step_ms = _timed_ms(jax.jit(jax.value_and_grad(loss, argnums=(0, 1))), (params, x), sizes.repeats)
    row = dict(
        section=section,
        form=form,
        tokens=sizes.tokens,
        d_model=sizes.d_model,
        params=param_count(params),
        # Per token: the dense MLP's all; an MoE's router and extras plus top_k of its E experts.
        active_params=param_count(params) - (0 if dense else _inactive_expert_params(params, config.moe)),
        step_ms=step_ms,
        tokens_per_s=sizes.tokens / step_ms * 1e3 if isinstance(step_ms, float) else None,
    )
    if not dense:
        stats = jax.jit(lambda p, *a: module.apply({"params": p}, *a)[2])(params, *inputs)
        slots = float(stats["rows"]) * config.moe.top_k
        ffn_slots = float(jnp.sum(stats["counts"][: config.moe.num_experts]) - stats["dropped"])
        row.update(ffn_slot_fraction=ffn_slots / slots, dropped_fraction=float(stats["dropped"]) / slots)
    return row


def moe_layer_rows(sizes: LayerSizes, key=None) -> list[dict]:
    """``dense`` (``mlp_dim = top_k * expert_dim``), ``moe_dropless[<impl>]`` and
    ``moe_capacity[<factor>]`` training steps on the same tokens."""
    key = jax.random.key(1) if key is None else key
    forms = {
        "dense": layer_config(sizes),
        f"moe_dropless[{sizes.impl}]": layer_config(sizes),
        f"moe_capacity[{sizes.capacity_factor:g}]": layer_config(sizes, capacity=True),
    }
    return [layer_row("moe_layer", form, config, sizes, key) for form, config in forms.items()]


def moe_plus_plus_rows(sizes: LayerSizes, key=None) -> list[dict]:
    """Dropless plain MoE (``experts`` FFN experts, top-k) and MoE++ (the same plus the zero,
    copy and constant experts, gating residual), randomly initialised routers."""
    key = jax.random.key(2) if key is None else key
    forms = {
        f"moe[{sizes.experts}e top{sizes.top_k}]": layer_config(sizes),
        f"moe++[{sizes.experts}e+{sizes.zero_experts}z+{sizes.copy_experts}c+{sizes.constant_experts}k]": (
            layer_config(sizes, plus_plus=True)
        ),
    }
    return [layer_row("moe_plus_plus", form, config, sizes, key) for form, config in forms.items()]


def layer_ratios(rows: list[dict]) -> dict[str, float]:
    """Tokens/s ratios: each MoE form over ``dense`` (``moe_layer``) and MoE++ over plain MoE
    (``moe_plus_plus``; the paper reports 1.1-2.1x expert throughput)."""
    ratios = {}
    for section in ("moe_layer", "moe_plus_plus"):
        timed = [r for r in rows if r.get("section") == section and r["tokens_per_s"] is not None]
        if not timed:
            continue
        base = timed[0]
        for row in timed[1:]:
            ratios[f"{section} {row['form']} / {base['form']} tokens/s"] = row["tokens_per_s"] / base["tokens_per_s"]
    return ratios


STDLIB_CONFIGS = {"dense": CONFIGS / "tiny.yaml", "moe": CONFIGS / "moe_tiny.yaml"}
"""The two demo runs the ``stdlib_lm`` section trains: equal active MLP width (dense 256
channels; 8 experts of 128, top-2)."""


def train_stdlib_lm(name: str, steps: int | None, run_root: Path) -> dict:
    """Trains ``STDLIB_CONFIGS[name]`` through the LM trainer (``steps``: None keeps the
    configured count) in ``run_root/name``, without samples or TensorBoard; returns its
    final validation loss, last training loss, median tokens/s over the logging windows and
    the wall time (compilation, evaluation and checkpoints included)."""
    # Imported here: the trainer pulls in orbax and tqdm, which benchmarks.gpu (importing this
    # module for its grouped_matmul rows) must not need on the device image.
    from ember.training.lm.config import LMConfig
    from ember.training.lm.trainer import train as train_lm

    overrides = [f"run_dir={run_root / name}", "sample.prompts=[]", "logging.tensorboard=false"]
    if steps is not None:
        overrides += [f"train.steps={steps}", f"checkpoint.every={steps}"]
    config = load_config(LMConfig, STDLIB_CONFIGS[name], overrides)
    start = time.perf_counter()
    summary = train_lm(config)
    return dict(
        section="stdlib_lm",
        model=name,
        config=str(STDLIB_CONFIGS[name].relative_to(CONFIGS.parents[1])),
        steps=summary["steps"],
        val_loss=summary.get("val_loss"),
        train_loss=summary.get("loss"),
        tokens_per_s=_median_logged(run_root / name, "tokens_per_second"),
        wall_s=time.perf_counter() - start,
    )


def _median_logged(run_dir: Path, key: str) -> float | None:
    """The median of ``key`` over a run's ``metrics.jsonl`` lines (one logging window each:
    steadier than the last window alone on a shared machine)."""
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    values = [record[key] for record in map(json.loads, lines) if key in record]
    return float(np.median(values)) if values else None


def stdlib_lm_rows(steps: int | None) -> list[dict]:
    """The dense and the MoE demo model trained the same steps, each in a fresh temporary run
    directory."""
    with tempfile.TemporaryDirectory(prefix="ember-moe-bench-") as root:
        return [train_stdlib_lm(name, steps, Path(root)) for name in STDLIB_CONFIGS]


def stdlib_lm_ratios(rows: list[dict]) -> dict[str, float]:
    """The validation-loss gap MoE minus dense (< 0: the MoE model is ahead) and the tokens/s
    ratio MoE over dense."""
    dense, moe = (next(r for r in rows if r["model"] == name) for name in ("dense", "moe"))
    figures = {"stdlib_lm val_loss moe - dense": moe["val_loss"] - dense["val_loss"]}
    if moe["tokens_per_s"] and dense["tokens_per_s"]:
        figures["stdlib_lm moe / dense tokens/s"] = moe["tokens_per_s"] / dense["tokens_per_s"]
    return figures


SECTIONS = ("grouped_matmul", "moe_layer", "moe_plus_plus", "stdlib_lm")
DEFAULT_SECTIONS = ("grouped_matmul", "moe_layer", "moe_plus_plus")
"""``stdlib_lm`` trains two models for minutes: it runs only when named with ``--section``."""


def run_section(name: str, steps: int | None) -> dict:
    """``{"sizes", "rows", "ratios"}`` of one section, its table and ratios printed."""
    if name == "grouped_matmul":
        sizes = GPU_SIZES if on_accelerator() else CPU_SIZES  # a TPU runs the GPU sizes
        rows = grouped_matmul_rows(sizes)
        columns = ["experts", "rows", "k", "n", "load", "form", "fwd_ms", "fwd_bwd_ms", "fwd_tflops"]
        print_table(rows, [*columns, "rel_diff_vs_ragged_dot"])
        ratios = grouped_matmul_ratios(rows)
    elif name in ("moe_layer", "moe_plus_plus"):
        sizes = GPU_LAYER_SIZES if on_accelerator() else CPU_LAYER_SIZES
        rows = moe_layer_rows(sizes) if name == "moe_layer" else moe_plus_plus_rows(sizes)
        columns = ["form", "tokens", "d_model", "params", "active_params", "step_ms", "tokens_per_s"]
        print_table(rows, [*columns, "ffn_slot_fraction"])
        ratios = layer_ratios(rows)
    else:
        sizes = {"steps": steps}  # None: the configs' own
        rows = stdlib_lm_rows(steps)
        print_table(rows, ["model", "steps", "val_loss", "train_loss", "tokens_per_s", "wall_s"])
        ratios = stdlib_lm_ratios(rows)
    for key, value in ratios.items():
        print(f"{key}: {value:.3g}")
    sizes = sizes if isinstance(sizes, dict) else dataclasses.asdict(sizes)
    return {"sizes": sizes, "rows": rows, "ratios": ratios}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--section", action="append", choices=SECTIONS, help="run only these (repeatable)")
    parser.add_argument("--steps", type=int, default=None, help="stdlib_lm training steps (default: the configs')")
    args = parser.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if not on_accelerator():
        print(f"No GPU or TPU found ({device_label()}): small sizes; MoE on the XLA path (ragged_dot).")
    measured = {}
    for name in args.section or DEFAULT_SECTIONS:
        print(f"== {name}")
        measured[name] = run_section(name, args.steps)
    # A run of some sections keeps the others' figures recorded for this device (read now, not
    # at the start: another run of other sections may have written meanwhile).
    path = RESULTS_DIR / f"moe-{device_label()}.json"
    previous = json.loads(path.read_text()).get("sections", {}) if path.is_file() else {}
    print(f"wrote {write_results('moe', {'sections': {**previous, **measured}})}")


if __name__ == "__main__":
    main()
