"""GRPO's rollouts: the serving engine against a plain generate loop, and where a run's time goes.

    python -m benchmarks.rl_lm                    # every section
    python -m benchmarks.rl_lm --section rollout

``rollout`` section: one GRPO rollout's worth of sampling (128 completions: 16 prompts x 8) of
the same model at temperature 1, through the engine (continuous batching, chunked prefill,
paged KV cache, ``ember.serving.engine``; with its prefix caching, each group's prompt prefilled
once, and without) and through a plain loop that runs the model's full
forward over the padded ``[rows, prompt + max_tokens]`` batch once per new token (jitted at
one shape, the loop RL scripts write by hand). Both generate every token (no early stop).
Generated tokens per second and the engine's over the loop's, for the arithmetic task's shape
(6-token prompts, 5 new tokens) and a longer one (32-token prompts, 96 new tokens).

``share`` section: the shipped arithmetic task end to end (``configs/rl_lm``: pretraining,
shortened, then 30 GRPO steps); the share of GRPO wall time in rollouts vs updates, rollout and
training tokens per second, and the held-out accuracy before and after.

Results: ``benchmarks/results/rl_lm-<device>.json``.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.harness import print_table, run_sections
from ember.core.config import load_config
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.serving.engine import Engine
from ember.serving.requests import SamplingParams
from ember.training.launcher import shipped_configs_dir
from ember.training.lm.config import LMConfig
from ember.training.lm.trainer import train
from ember.training.rl_lm import entry
from ember.training.rl_lm.config import GRPOConfig

ROWS = 128
GROUP = 8  # samples of each prompt, as GRPO draws them
SHAPES = ((6, 5), (32, 96))  # (prompt tokens, new tokens)


def plain_loop(model: DecoderLM, params, prompt_len: int, new_tokens: int):
    """``sample(prompts [rows, prompt_len], seed) -> [rows, new_tokens]``: runs the full forward
    over the padded batch once per new token (one jitted step, compiled on the first call)."""
    total = prompt_len + new_tokens

    @jax.jit
    def step(tokens, position, key):
        logits, _ = model.apply({"params": params}, tokens)
        last = jax.lax.dynamic_index_in_dim(logits, position - 1, axis=1, keepdims=False)
        drawn = jax.random.categorical(key, last.astype(jnp.float32))
        return jax.lax.dynamic_update_index_in_dim(tokens, drawn.astype(tokens.dtype), position, axis=1)

    def sample(prompts: np.ndarray, seed: int) -> np.ndarray:
        tokens = jnp.zeros((prompts.shape[0], total), jnp.int32).at[:, :prompt_len].set(prompts)
        key = jax.random.key(seed)
        for position in range(prompt_len, total):
            tokens = step(tokens, position, jax.random.fold_in(key, position))
        return np.asarray(tokens[:, prompt_len:])

    return sample


def rollout_rows() -> list[dict]:
    config = ModelConfig(vocab_size=384, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=256,
                         max_seq_len=256, scan_layers=False)  # fmt: skip
    model = DecoderLM(config)
    params = model.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"]
    params = jax.tree.map(
        lambda x: x.unbox() if hasattr(x, "unbox") else x, params, is_leaf=lambda x: hasattr(x, "unbox")
    )
    rows = []
    for prompt_len, new_tokens in SHAPES:
        generator = np.random.default_rng(0)
        prompts = np.repeat(generator.integers(0, 256, (ROWS // GROUP, prompt_len)), GROUP, axis=0).astype(np.int32)
        engine = Engine.from_model(config, params, num_slots=64, token_budget=256, max_context=prompt_len + new_tokens)
        settings = [
            SamplingParams(max_tokens=new_tokens, temperature=1.0, seed=i, ignore_eos=True) for i in range(ROWS)
        ]
        # Warm: every bucket is compiled already; this warms the host path (on other prompts, so that
        # the timed engines find nothing of theirs cached).
        engine.generate(generator.integers(0, 256, (ROWS, prompt_len)).tolist(), settings)
        seconds = {}
        for caching in (True, False):
            fresh = Engine(engine.program.fresh_copy(), prefix_caching=caching)
            start = time.perf_counter()
            results = fresh.generate(prompts.tolist(), settings)
            seconds[caching] = time.perf_counter() - start
            assert all(len(r.tokens) == new_tokens for r in results)
        engine_seconds = seconds[True]
        sample = plain_loop(model, params, prompt_len, new_tokens)
        sample(prompts, seed=0)  # compiles
        start = time.perf_counter()
        sample(prompts, seed=1)
        loop_seconds = time.perf_counter() - start
        tokens = ROWS * new_tokens
        rows.append({
            "prompt_tokens": prompt_len,
            "new_tokens": new_tokens,
            "engine_tokens_per_s": tokens / engine_seconds,
            "engine_no_prefix_cache_tokens_per_s": tokens / seconds[False],
            "loop_tokens_per_s": tokens / loop_seconds,
            "engine_over_loop": loop_seconds / engine_seconds,
            "prefix_cache_speedup": seconds[False] / engine_seconds,
        })  # fmt: skip
    columns = ["prompt_tokens", "new_tokens", "engine_tokens_per_s", "engine_no_prefix_cache_tokens_per_s"]
    print_table(rows, [*columns, "loop_tokens_per_s", "engine_over_loop", "prefix_cache_speedup"])
    return rows


def share_row() -> dict:
    configs = shipped_configs_dir() / "rl_lm"
    with tempfile.TemporaryDirectory() as root:
        os.environ.setdefault("EMBER_CACHE", str(Path(root) / "cache"))
        quiet = ["logging.progress=false", "logging.tensorboard=false"]
        pretrain = [f"run_dir={root}/arithmetic", "train.steps=400", "sample.prompts=[]", *quiet]
        start = time.perf_counter()
        train(load_config(LMConfig, configs / "arithmetic_pretrain.yaml", pretrain))
        pretrain_seconds = time.perf_counter() - start
        grpo = [f"run_dir={root}/grpo", f"base_model.path={root}/arithmetic", *quiet]
        start = time.perf_counter()
        summary = entry.run(load_config(GRPOConfig, configs / "grpo_arithmetic.yaml", grpo))
        grpo_seconds = time.perf_counter() - start
        records = [json.loads(line) for line in Path(f"{root}/grpo/metrics.jsonl").read_text().splitlines()]
    mean = lambda key: float(np.mean([r[key] for r in records if key in r]))  # noqa: E731
    row = {
        "pretrain_seconds": pretrain_seconds,
        "grpo_seconds": grpo_seconds,
        "grpo_steps": summary["steps"],
        "rollout_time_fraction": mean("rollout_time_fraction"),
        "rollout_tokens_per_second": mean("rollout_tokens_per_second"),
        "train_tokens_per_second": mean("train_tokens_per_second"),
        "logprob_mismatch_max": max(r["logprob_mismatch_max"] for r in records if "logprob_mismatch_max" in r),
        **{
            k: summary[k]
            for k in ("eval_reward_start", "eval_reward", "eval_reward_sampled_start", "eval_reward_sampled")
        },
    }
    print_table([row], list(row))
    return row


def main(argv=None) -> Path:
    return run_sections(
        "rl_lm", {"rollout": rollout_rows, "share": share_row}, "GRPO rollouts: engine vs plain loop", argv
    )


if __name__ == "__main__":
    main()
