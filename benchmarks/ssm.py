"""A state-space model against a transformer of equal size, side by side in one run.

    python -m benchmarks.ssm                         # GPU: full sizes; CPU: tiny models, small ranges
    python -m benchmarks.ssm --ssm-kind linear       # another O(1)-state layer kind
    python -m benchmarks.ssm --sizes gpu             # force the full sizes (or --sizes cpu)

Every model runs through the serving engine's compiled ragged step (``ember.serving``):

- decode: one step of ``decode_rows`` sequences, one token each, at position ``p`` (the
  program compiled for a context of ``p + 1``, what a server of that context holds), ms per
  step and per token. Goal: the SSM flat, the last position within 1.1x of the first.
- prefill: one step of a single ``L``-token chunk that starts a sequence, in tokens/s.
  Goal: the SSM ahead of the transformer from 4k tokens on.
- serving: the engine on a Poisson workload of long prompts (``benchmarks.serving``'s
  replay), a hybrid (three SSM layers per global attention layer) against the transformer.
- state bytes: one sequence's cache (state slots plus KV pages) at each decode position.
- ssd: ``ember.kernels_pallas.ssd`` forward+backward against the naive scan
  ``ssd_reference`` (``benchmarks.sequence_mixers``' rows). Goal on a GPU: >= 5x.

"Equal size" is equal parameter count: the SSM (and the hybrid) take the transformer's widths
and the number of layers whose parameter count is nearest to the transformer's. The SSM's
layer kind is ``--ssm-kind`` (default :data:`SSM_KIND`); kinds in :data:`NO_MLP_KINDS` have
no MLP, as in their reference models. Results: ``benchmarks/results/ssm-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import sequence_mixers
from benchmarks.harness import device_label, on_gpu, print_table, time_fn, write_results
from benchmarks.serving import make_workload, run_engine, summarize
from ember.core.tree import param_bytes, param_count
from ember.models.cache import init_cache_layers
from ember.models.config import LAYER_KINDS, SOFTMAX_FAMILY, ModelConfig
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.model_program import build_program
from ember.serving.program import DeviceProgram, batch_arrays
from ember.serving.sampling import settings_array

SSM_KIND = "mamba2"
"""The state-space layer kind measured unless ``--ssm-kind`` names another."""
NO_MLP_KINDS: tuple[str, ...] = ("mamba2",)
"""Kinds whose blocks are the mixer alone (``mlp_pattern`` ``none``), as Mamba-2 models are."""
HYBRID_ATTENTION_EVERY = 4
"""The hybrid's period: ``HYBRID_ATTENTION_EVERY - 1`` SSM layers, then one global attention layer."""


@dataclasses.dataclass(frozen=True)
class Sizes:
    transformer: ModelConfig  # the baseline; the SSM and the hybrid copy its widths
    decode_rows: int
    decode_positions: tuple[int, ...]
    prefill_lens: tuple[int, ...]
    serving_slots: int
    serving_budget: int
    serving_requests: int
    serving_prompts: tuple[int, int]
    serving_outputs: tuple[int, int]
    serving_rate: float  # arrivals per second: high enough that requests queue
    mixers: sequence_mixers.Sizes  # the ssd rows (lengths where the naive scan still runs)
    repeats: int
    decode_repeats: int  # a decode step is short: more repeats steady its median


GPU_SIZES = Sizes(
    transformer=ModelConfig(  # the 125m preset's shape in bf16, with room for 32k tokens
        vocab_size=32000,
        d_model=768,
        num_layers=12,
        num_heads=12,
        mlp_dim=2560,
        max_seq_len=32768 + 16,
        precision="bf16",
        page_size=16,
    ),
    decode_rows=8,
    decode_positions=(128, 512, 2048, 8192, 32768),
    prefill_lens=(1024, 2048, 4096, 8192, 16384),
    serving_slots=16,
    serving_budget=2048,
    serving_requests=48,
    serving_prompts=(4096, 8192),
    serving_outputs=(64, 128),
    serving_rate=64.0,
    mixers=dataclasses.replace(sequence_mixers.GPU_SIZES, seq_lens=(1024, 4096, 16384), quadratic_max_seq=0),
    repeats=10,
    decode_repeats=100,
)
CPU_SIZES = Sizes(
    transformer=ModelConfig(
        vocab_size=512, d_model=64, num_layers=4, num_heads=4, mlp_dim=256, max_seq_len=2048 + 16, page_size=16
    ),
    decode_rows=4,
    decode_positions=(128, 512, 2048),
    prefill_lens=(256, 1024, 2048),
    serving_slots=4,
    serving_budget=256,
    serving_requests=12,
    serving_prompts=(512, 1024),
    serving_outputs=(16, 32),
    serving_rate=64.0,
    mixers=dataclasses.replace(sequence_mixers.CPU_SIZES, seq_lens=(256, 1024), quadratic_max_seq=0),
    repeats=5,
    decode_repeats=50,
)


# Models -------------------------------------------------------------------------------------


@functools.cache
def count_params(config: ModelConfig) -> int:
    """Parameters of ``DecoderLM(config)``, from shapes alone (each config traced once)."""
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jax.ShapeDtypeStruct((1, 8), jnp.int32))
    return param_count(nn.meta.unbox(shapes["params"]))


def with_pattern(transformer: ModelConfig, block_pattern: tuple[str, ...]) -> ModelConfig:
    """``transformer``'s widths with ``block_pattern`` (blocks of :data:`NO_MLP_KINDS` without
    an MLP) and the multiple of the pattern's period of layers whose parameter count is
    nearest to the transformer's (parameters grow linearly with the layers)."""
    mlps = tuple("none" if kind in NO_MLP_KINDS else "dense" for kind in block_pattern)
    config = dataclasses.replace(transformer, block_pattern=block_pattern, mlp_pattern=mlps)
    period = config.layer_period
    one, two = (count_params(dataclasses.replace(config, num_layers=n * period)) for n in (1, 2))
    per_period, rest = two - one, 2 * one - two
    periods = max(1, round((count_params(transformer) - rest) / per_period))
    return dataclasses.replace(config, num_layers=periods * period)


def model_configs(ssm_kind: str, transformer: ModelConfig) -> dict[str, ModelConfig]:
    """The three models: ``transformer``, ``ssm`` (every layer ``ssm_kind``) and ``hybrid``."""
    hybrid = (ssm_kind,) * (HYBRID_ATTENTION_EVERY - 1) + ("global",)
    return {
        "transformer": transformer,
        "ssm": with_pattern(transformer, (ssm_kind,)),
        "hybrid": with_pattern(transformer, hybrid),
    }


def random_params(config: ModelConfig):
    return nn.meta.unbox(jax.jit(DecoderLM(config).init)(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])


# Measurements -------------------------------------------------------------------------------


def step_ms(program: DeviceProgram, batch: dict[str, np.ndarray], repeats: int) -> float:
    """Median milliseconds of one compiled step on ``batch`` (the cache threaded through,
    since each step donates it)."""
    bucket = batch["tokens"].shape[0]
    step = program.steps[bucket]
    arrays, settings = jax.device_put((batch, settings_array(program.num_slots)))

    def run():
        program.kv, tokens, _ = step(program.params, program.kv, arrays, settings)
        return tokens

    return 1e3 * time_fn(run, warmup=2, repeats=repeats)


def rounded_context(config: ModelConfig, tokens: int) -> int:
    return math.ceil(tokens / config.page_size) * config.page_size


def decode_ms(config: ModelConfig, params, rows: int, position: int, repeats: int) -> float:
    """One decode step of ``rows`` sequences, each feeding its token at ``position``."""
    program = build_program(
        config, params, num_slots=rows, token_buckets=(rows,), max_context=rounded_context(config, position + 1)
    )
    batch = batch_arrays(rows, rows, program.pages_per_seq)
    batch["tokens"][:] = np.random.default_rng(position).integers(0, config.vocab_size, size=rows)
    batch["query_starts"][:] = np.arange(rows)
    batch["query_lens"][:] = 1
    batch["kv_lens"][:] = position + 1
    batch["page_table"][:] = np.arange(program.num_pages).reshape(rows, program.pages_per_seq)
    return step_ms(program, batch, repeats)


def prefill_ms(config: ModelConfig, params, length: int, repeats: int) -> float:
    """One step whose budget is a single ``length``-token chunk starting a sequence."""
    program = build_program(
        config, params, num_slots=1, token_buckets=(length,), max_context=rounded_context(config, length)
    )
    batch = batch_arrays(1, length, program.pages_per_seq)
    batch["tokens"][:] = np.random.default_rng(length).integers(0, config.vocab_size, size=length)
    batch["query_lens"][:] = length
    batch["kv_lens"][:] = length
    batch["page_table"][0] = np.arange(program.pages_per_seq)
    return step_ms(program, batch, repeats)


def cache_bytes(config: ModelConfig, num_slots: int, num_pages: int) -> int:
    return param_bytes(jax.eval_shape(lambda: init_cache_layers(config, num_slots, num_pages)))


def sequence_cache_bytes(config: ModelConfig, context: int) -> dict[str, int]:
    """One sequence's cache at ``context`` tokens: its state slots (O(1)) and its KV pages."""
    empty = cache_bytes(config, 1, 1)
    slot, page = cache_bytes(config, 2, 1) - empty, cache_bytes(config, 1, 2) - empty
    pages = math.ceil(context / config.page_size) * page
    return {"state_bytes": slot, "kv_bytes": pages, "total_bytes": slot + pages}


def serving_rows(configs: dict[str, ModelConfig], params: dict, sizes: Sizes) -> list[dict]:
    """The hybrid and the transformer replaying one workload of long prompts."""
    workload = make_workload(
        0,
        sizes.serving_requests,
        sizes.serving_prompts,
        sizes.serving_outputs,
        sizes.serving_rate,
        sizes.transformer.vocab_size,
    )
    max_context = rounded_context(sizes.transformer, sizes.serving_prompts[1] + sizes.serving_outputs[1])
    rows = []
    for name in ("hybrid", "transformer"):
        engine = Engine.from_model(
            configs[name],
            params[name],
            num_slots=sizes.serving_slots,
            token_budget=sizes.serving_budget,
            max_context=max_context,
        )
        warm_up = dataclasses.replace(workload, arrivals=[0.0], prompts=workload.prompts[:1], output_lens=[2])
        run_engine(engine, warm_up, static=False)
        token_times, elapsed = run_engine(engine, workload, static=False)
        row = summarize(name, workload, token_times, elapsed)
        prompt_tokens = sum(len(p) for p in workload.prompts)
        row.update(model=name, total_tok_s=(prompt_tokens + row["tokens"]) / elapsed)
        rows.append(row)
    return rows


def decode_rows(configs: dict[str, ModelConfig], params: dict, sizes: Sizes) -> list[dict]:
    rows = []
    for name in ("ssm", "transformer"):
        for position in sizes.decode_positions:
            ms = decode_ms(configs[name], params[name], sizes.decode_rows, position, sizes.decode_repeats)
            rows.append(dict(model=name, position=position, step_ms=ms, ms_per_token=ms / sizes.decode_rows))
    return rows


def prefill_rows(configs: dict[str, ModelConfig], params: dict, sizes: Sizes) -> list[dict]:
    rows = []
    for name in ("ssm", "transformer"):
        for length in sizes.prefill_lens:
            ms = prefill_ms(configs[name], params[name], length, sizes.repeats)
            rows.append(dict(model=name, tokens=length, ms=ms, tok_s=length / ms * 1e3))
    return rows


def state_rows(configs: dict[str, ModelConfig], params: dict, sizes: Sizes) -> list[dict]:
    del params  # from shapes alone
    return [
        dict(model=name, context=position, **sequence_cache_bytes(config, position))
        for name, config in configs.items()
        for position in sizes.decode_positions
    ]


def ssd_rows(configs: dict[str, ModelConfig], params: dict, sizes: Sizes) -> list[dict]:
    del configs, params  # the op alone, at sequence_mixers' shapes
    mixers = sizes.mixers
    return sequence_mixers.ssd_rows(mixers, jnp.dtype(mixers.dtype), jax.random.split(jax.random.key(0), 6))


SECTIONS = {
    "decode": (decode_rows, ["model", "position", "step_ms", "ms_per_token"]),
    "prefill": (prefill_rows, ["model", "tokens", "ms", "tok_s"]),
    "state_bytes": (state_rows, ["model", "context", "state_bytes", "kv_bytes", "total_bytes"]),
    "serving": (serving_rows, ["model", "output_tok_s", "total_tok_s", "ttft_p50_ms", "tbt_p50_ms", "seconds"]),
    "ssd": (ssd_rows, ["op", "seq", "form", "fwd_ms", "fwd_bwd_ms"]),
}
"""Section name -> (``rows(configs, params, sizes)``, the columns printed)."""


def goals(results: dict[str, list[dict]], sizes: Sizes) -> dict[str, dict]:
    """The targets as measured ratios (of the sections that ran)."""

    def by_model(section, key, field):
        return {(row["model"], row[key]): row[field] for row in results.get(section, [])}

    summary: dict[str, dict] = {}
    if "decode" in results:
        decode = by_model("decode", "position", "ms_per_token")
        first, last = sizes.decode_positions[0], sizes.decode_positions[-1]
        for model in ("ssm", "transformer"):
            summary[f"{model}_decode_{last}_over_{first}"] = {"value": decode[model, last] / decode[model, first]}
        summary[f"ssm_decode_{last}_over_{first}"]["target"] = "<= 1.1"
    if "prefill" in results:
        tok_s = by_model("prefill", "tokens", "tok_s")
        ratio = {length: tok_s["ssm", length] / tok_s["transformer", length] for length in sizes.prefill_lens}
        summary["ssm_over_transformer_prefill_tok_s"] = {"value": ratio, "target": "> 1 from 4096 tokens on"}
    if "state_bytes" in results:
        last = sizes.decode_positions[-1]
        total = by_model("state_bytes", "context", "total_bytes")
        summary[f"transformer_over_ssm_cache_bytes_at_{last}"] = {
            "value": total["transformer", last] / total["ssm", last]
        }
    if "serving" in results:
        served = {row["model"]: row["output_tok_s"] for row in results["serving"]}
        summary["hybrid_over_transformer_serving_output_tok_s"] = {"value": served["hybrid"] / served["transformer"]}
    if "ssd" in results:
        ratio = sequence_mixers.ratios(results["ssd"], sizes.mixers)["scan_over_chunked_ssd_fwd_bwd"]
        summary["scan_over_chunked_ssd_fwd_bwd"] = {"value": ratio, "target": ">= 5 on a GPU"}
    return summary


# Main ---------------------------------------------------------------------------------------


def state_kinds() -> tuple[str, ...]:
    """Layer kinds with O(1) state per sequence (every kind outside the softmax family)."""
    return tuple(kind for kind in LAYER_KINDS if kind not in SOFTMAX_FAMILY)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ssm-kind", default=SSM_KIND, help=f"the SSM's layer kind (default {SSM_KIND})")
    parser.add_argument("--sizes", choices=("auto", "cpu", "gpu"), default="auto", help="auto: gpu on a GPU")
    parser.add_argument("--sections", nargs="+", choices=list(SECTIONS), default=list(SECTIONS), help="what to run")
    parser.add_argument("--results-dir", default=None, help="where the JSON goes (default benchmarks/results)")
    args = parser.parse_args()
    if args.ssm_kind not in state_kinds():
        parser.error(f"--ssm-kind {args.ssm_kind!r} is not a state layer kind here; choose one of {state_kinds()}")
    sizes = GPU_SIZES if args.sizes == "gpu" or (args.sizes == "auto" and on_gpu()) else CPU_SIZES
    print(f"device {device_label()}, {'GPU' if sizes is GPU_SIZES else 'CPU'} sizes, SSM kind {args.ssm_kind}")
    configs = model_configs(args.ssm_kind, sizes.transformer)
    params = {name: random_params(config) for name, config in configs.items()}
    models = [
        dict(
            model=name,
            block_pattern=list(config.block_pattern),
            mlp_pattern=list(config.mlp_pattern),
            num_layers=config.num_layers,
            params=param_count(params[name]),
        )
        for name, config in configs.items()
    ]
    print_table(models, ["model", "block_pattern", "mlp_pattern", "num_layers", "params"])
    results = {}
    for section in args.sections:
        rows_fn, columns = SECTIONS[section]
        results[section] = rows_fn(configs, params, sizes)
        print_table(results[section], columns)
    summary = goals(results, sizes)
    for name, goal in summary.items():
        print(f"{name}: {goal}")
    payload = dict(ssm_kind=args.ssm_kind, sizes=dataclasses.asdict(sizes), models=models, **results, goals=summary)
    print(f"wrote {write_results('ssm', payload, args.results_dir)}")


if __name__ == "__main__":
    main()
