"""Low-rank adapters against their baselines: LoRA fine-tuning against full fine-tuning, and
serving many adapters at once against one merged model.

    python -m benchmarks.adapters                      # every section
    python -m benchmarks.adapters --section finetune   # one section (repeat for more)

``finetune`` section: one optimizer step (the trainer's jitted ``train_step``, AdamW, the
LM loss) of the same decoder LM trained fully and with LoRA (rank 16 on q, k, v, o, gate,
up, down; base frozen through the trainable mask, so it gets no gradient buffers and no
optimizer state), and with DoRA. Step seconds, tokens/s, trainable parameters and the
optimizer state's bytes; ratios against full fine-tuning. LoRA's step saves the frozen
weights' weight-gradient matmuls (about a third of a step's FLOPs) and their AdamW update,
and pays for the adapters' small matmuls; DoRA adds each adapted weight's column norm.

``serving`` section: output tokens/s of one engine serving 1, 8 and 32 distinct adapters (rank
16 on q, k, v, o, up, down; requests spread evenly over them, every step mixing adapters; each
token's delta by two grouped matmuls over tokens sorted by adapter) against the same engine
serving one model with an adapter merged in (no delta at all), on the same requests (64
prompts of 32 tokens, 32 greedy output tokens each, 32 slots). S-LoRA reports a small loss
against a merged model; the goal is >= 0.8x the merged model's throughput at 32 adapters.

Results: ``benchmarks/results/adapters-<device>.json`` (a run of some sections keeps the
other sections' figures already in that file).
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import optax

from benchmarks.harness import on_gpu, print_table, run_sections, time_fn
from ember.core.sharding import unbox
from ember.core.tree import param_bytes, param_count, param_paths, tree_from_paths
from ember.models.adapters import LoraConfig, adapter_leaves, adapter_mask, add_lora, merged_weights
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.hf.peft import with_adapter
from ember.serving import Engine, SamplingParams
from ember.training.lm.task import lm_loss
from ember.training.train_step import init_state, train_step
from ember.training.trainable import select, trainable_mask

ALL_LINEAR = ("q", "k", "v", "o", "gate", "up", "down")


def finetune_section() -> list[dict]:
    if on_gpu():
        config = ModelConfig(vocab_size=32000, d_model=1024, num_layers=8, num_heads=16, mlp_dim=4096,
                             max_seq_len=2048, precision="bf16")  # fmt: skip
        batch, seq = 8, 2048
    else:
        config = ModelConfig(vocab_size=512, d_model=256, num_layers=4, num_heads=8, mlp_dim=1024, max_seq_len=256)
        batch, seq = 8, 256
    model = DecoderLM(config)
    tokens = jax.random.randint(jax.random.key(1), (batch, seq + 1), 0, config.vocab_size)
    positions = jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (batch, seq))
    data = {
        "tokens": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "positions": positions,
        "segment_ids": jnp.ones((batch, seq), jnp.int32),
        "loss_mask": jnp.ones((batch, seq), jnp.float32),
    }
    base = model.init(jax.random.key(0), data["tokens"][:1], positions=positions[:1])["params"]
    tx = optax.adamw(1e-4)
    variants = {
        "full": (base, None),
        "lora_r16": (add_lora(base, LoraConfig(rank=16, targets=ALL_LINEAR), jax.random.key(2)), "lora"),
        "dora_r16": (add_lora(base, LoraConfig(rank=16, targets=ALL_LINEAR, dora=True), jax.random.key(2)), "lora"),
    }
    rows = []
    for name, (params, kind) in variants.items():
        mask = adapter_mask(params) if kind else trainable_mask(params)
        variables = functools.partial(dict, params=params)
        state = jax.jit(functools.partial(init_state, init_variables=lambda _, v=variables: v(), tx=tx, mask=mask))(
            jax.random.key(0)
        )
        state = dataclasses.replace(state, params=unbox(state.params), opt_state=unbox(state.opt_state))
        step = jax.jit(
            functools.partial(
                train_step,
                loss_fn=lambda p, b, **kw: lm_loss(p, b, model=model),
                tx=tx,
                schedule=optax.constant_schedule(1e-4),
                mask=mask,
                count_name="tokens",
            )
        )
        seconds = time_fn(lambda s, step=step: step(s, data, None)[1]["loss"], state, warmup=2, repeats=5)
        rows.append(
            {
                "variant": name,
                "step_s": seconds,
                "tokens_per_s": batch * seq / seconds,
                "trainable_params": param_count(select(unbox(params), mask)),
                "optimizer_bytes": param_bytes(state.opt_state),
            }
        )
    full = rows[0]
    for row in rows:
        row["step_time_vs_full"] = row["step_s"] / full["step_s"]
        row["optimizer_bytes_vs_full"] = row["optimizer_bytes"] / full["optimizer_bytes"]
    print_table(rows, ["variant", "step_s", "tokens_per_s", "trainable_params", "optimizer_bytes",
                       "step_time_vs_full", "optimizer_bytes_vs_full"])  # fmt: skip
    return rows


def serving_section() -> list[dict]:
    if on_gpu():
        config = ModelConfig(vocab_size=32000, d_model=1024, num_layers=8, num_heads=16, mlp_dim=4096,
                             max_seq_len=256, precision="bf16")  # fmt: skip
    else:
        config = ModelConfig(vocab_size=512, d_model=256, num_layers=4, num_heads=8, mlp_dim=1024, max_seq_len=128)
    base = unbox(DecoderLM(config).init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))["params"])
    lora = LoraConfig(rank=16, targets=("q", "k", "v", "o", "up", "down"))

    def adapter(seed):
        flat = param_paths(add_lora(base, lora, jax.random.key(seed)))
        flat = {p: v + 0.01 * jax.random.normal(jax.random.key(seed), v.shape) if p.endswith("_lora_b") else v
                for p, v in flat.items()}  # fmt: skip
        return adapter_leaves(tree_from_paths(flat))

    adapters = {f"a{i}": adapter(i) for i in range(32)}
    prompts = [jax.random.randint(jax.random.key(100 + i), (32,), 0, config.vocab_size).tolist() for i in range(64)]
    options = dict(num_slots=32, token_budget=256, max_context=128)

    def tokens_per_s(engine, names):
        params = [SamplingParams(max_tokens=32, ignore_eos=True, adapter=names[i % len(names)] if names else None)
                  for i in range(len(prompts))]  # fmt: skip
        engine.generate(prompts[:8], params[:8])  # warm: every bucket was compiled at build
        start = time.perf_counter()
        results = engine.generate(prompts, params)
        return sum(len(r.tokens) for r in results) / (time.perf_counter() - start)

    merged = merged_weights(with_adapter(base, adapters["a0"]))
    merged_rate = tokens_per_s(Engine.from_model(config, merged, **options), None)
    rows = [{"variant": "merged (1 model)", "adapters": 0, "tokens_per_s": merged_rate, "vs_merged": 1.0}]
    for count in (1, 8, 32):
        chosen = {name: adapters[name] for name in list(adapters)[:count]}
        rate = tokens_per_s(Engine.from_model(config, base, adapters=chosen, **options), list(chosen))
        rows.append({"variant": f"{count} adapters", "adapters": count, "tokens_per_s": rate,
                     "vs_merged": rate / merged_rate})  # fmt: skip
    print_table(rows, ["variant", "adapters", "tokens_per_s", "vs_merged"])
    return rows


SECTIONS = {"finetune": finetune_section, "serving": serving_section}


def main() -> None:
    run_sections("adapters", SECTIONS, __doc__.split("\n\n")[0])


if __name__ == "__main__":
    main()
