"""DecoderLM training step (forward + backward) against a plain Flax model of the same
architecture using ``jax.nn.dot_product_attention``, side by side.

    python -m benchmarks.models                 # GPU: 125m / 350m / 1b presets in bf16
                                                # CPU: the tiny preset at a small size

For each preset: tokens/s and model FLOPs/s of both, the ratio ours / plain, and MFU
(``ember.models.flops.flops_per_token`` over the device's dense bf16 peak) on a GPU.
Before timing, both models are given the same weights and their losses compared, so the
two sides compute the same function. Results: ``benchmarks/results/models-<device>.json``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

from benchmarks.harness import device_label, on_gpu, print_table, time_fn, write_results
from ember.core.config import load_config
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.flops import flops_per_token
from ember.models.layer_layout import layers_to_list
from ember.models.layers.rope import apply_rope, rope_inverse_frequencies

PRESETS = Path(__file__).resolve().parents[1] / "configs" / "models"
PEAK_BF16_FLOPS = {"h100": 989e12, "h200": 989e12, "a100": 312e12}
"""Dense bf16 tensor-core peak per device (SXM parts), for MFU."""


class PlainBlock(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions):
        c = self.config
        dtype = c.policy.compute_dtype
        heads, kv_heads, head_dim = c.num_heads, c.kv_heads, c.head_size
        h = nn.RMSNorm(epsilon=c.norm_eps, dtype=dtype, name="attn_norm")(x)
        q = nn.DenseGeneral((heads, head_dim), use_bias=False, dtype=dtype, name="q")(h)
        k = nn.DenseGeneral((kv_heads, head_dim), use_bias=False, dtype=dtype, name="k")(h)
        v = nn.DenseGeneral((kv_heads, head_dim), use_bias=False, dtype=dtype, name="v")(h)
        inv_freq = rope_inverse_frequencies(head_dim, c.rope)
        q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        x = x + nn.DenseGeneral(x.shape[-1], axis=(-2, -1), use_bias=False, dtype=dtype, name="o")(out)
        h = nn.RMSNorm(epsilon=c.norm_eps, dtype=dtype, name="mlp_norm")(x)
        gate = nn.Dense(c.mlp_dim, use_bias=False, dtype=dtype, name="gate")(h)
        up = nn.Dense(c.mlp_dim, use_bias=False, dtype=dtype, name="up")(h)
        return x + nn.Dense(x.shape[-1], use_bias=False, dtype=dtype, name="down")(nn.silu(gate) * up)


class PlainLM(nn.Module):
    """The textbook Flax Llama: a Python loop of blocks, tied embeddings."""

    config: ModelConfig

    @nn.compact
    def __call__(self, tokens):
        c = self.config
        embed = nn.Embed(c.vocab_size, c.d_model, dtype=c.policy.compute_dtype, name="embed")
        x = embed(tokens)
        positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
        for i in range(c.num_layers):
            x = PlainBlock(c, name=f"block_{i}")(x, positions)
        x = nn.RMSNorm(epsilon=c.norm_eps, dtype=c.policy.compute_dtype, name="final_norm")(x)
        return embed.attend(x).astype(jnp.float32)


def plain_params_from_ember(config: ModelConfig, params) -> dict:
    """The same weights in the plain model's layout."""
    plain = {
        "embed": {"embedding": params["embed"]["embedding"]},
        "final_norm": {"scale": params["final_norm"]["scale"]},
    }
    for i, layer in enumerate(layers_to_list(config, params)):
        plain[f"block_{i}"] = {
            "attn_norm": {"scale": layer["attn_norm"]["scale"]},
            "mlp_norm": {"scale": layer["mlp_norm"]["scale"]},
            **{name: {"kernel": layer["attn"][name]["kernel"]} for name in ("q", "k", "v", "o")},
            **{name: {"kernel": layer["mlp"][name]} for name in ("gate", "up", "down")},
        }
    return plain


def loss_and_grad(logits_fn):
    def loss(params, tokens):
        logits = logits_fn(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return jax.jit(jax.value_and_grad(loss))


def run_preset(name: str, batch: int, seq: int, precision: str) -> dict:
    config = load_config(ModelConfig, PRESETS / f"{name}.yaml")
    config = dataclasses.replace(config, precision=precision, max_seq_len=max(config.max_seq_len, seq), remat="none")
    tokens = jax.random.randint(jax.random.key(0), (batch, seq + 1), 0, config.vocab_size)
    ours_model, plain_model = DecoderLM(config), PlainLM(config)
    params = jax.jit(ours_model.init)(jax.random.key(1), tokens[:, :-1])["params"]
    params = nn.meta.unbox(params)
    plain = plain_params_from_ember(config, params)
    ours_step = loss_and_grad(lambda p, t: ours_model.apply({"params": p}, t)[0])
    plain_step = loss_and_grad(lambda p, t: plain_model.apply({"params": p}, t))
    ours_loss, plain_loss = float(ours_step(params, tokens)[0]), float(plain_step(plain, tokens)[0])
    if not np.isclose(ours_loss, plain_loss, rtol=2e-2 if precision != "f32" else 1e-4):
        raise SystemExit(f"{name}: ours and plain disagree (loss {ours_loss} vs {plain_loss}); not timing")
    ours_s = time_fn(ours_step, params, tokens, repeats=5)
    plain_s = time_fn(plain_step, plain, tokens, repeats=5)
    tokens_per_step = batch * seq
    flops = flops_per_token(config, seq) * tokens_per_step
    peak = PEAK_BF16_FLOPS.get(device_label())
    return {
        "preset": name,
        "batch": batch,
        "seq": seq,
        "precision": precision,
        "ours_tokens_per_s": tokens_per_step / ours_s,
        "plain_tokens_per_s": tokens_per_step / plain_s,
        "ratio": plain_s / ours_s,
        "ours_tflops": flops / ours_s / 1e12,
        "ours_mfu": flops / ours_s / peak if peak else None,
        "plain_mfu": flops / plain_s / peak if peak else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", nargs="*", default=None)
    args = parser.parse_args()
    if on_gpu():
        presets = args.presets or ["125m", "350m", "1b"]
        rows = [run_preset(name, batch=8, seq=2048, precision="bf16") for name in presets]
    else:
        print("No GPU found: timing the tiny preset on CPU at batch 8, seq 128 (f32).")
        rows = [run_preset(name, batch=8, seq=128, precision="f32") for name in (args.presets or ["tiny"])]
    print_table(
        rows,
        [
            "preset",
            "batch",
            "seq",
            "precision",
            "ours_tokens_per_s",
            "plain_tokens_per_s",
            "ratio",
            "ours_tflops",
            "ours_mfu",
        ],
    )
    path = write_results("models", {"rows": rows})
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
