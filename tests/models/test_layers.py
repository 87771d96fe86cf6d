"""Layers against hand-computed numbers: norms, rotary embedding and its scalings, MLPs,
feature maps, and ModelConfig validation."""

import dataclasses
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.config import load_config
from ember.core.errors import ConfigError
from ember.models.config import ModelConfig, RopeConfig
from ember.models.layers.feature_maps import elu_plus_one, hedgehog_features
from ember.models.layers.mlp import mlp
from ember.models.layers.norm import layer_norm, rms_norm
from ember.models.layers.rope import apply_rope, rope_inverse_frequencies
from tests.tolerances import assert_allclose


def test_rms_norm_and_layer_norm_match_their_formulas(rng):
    x = jax.random.normal(rng, (3, 5, 8))
    scale = jax.random.normal(jax.random.fold_in(rng, 1), (8,))
    bias = jax.random.normal(jax.random.fold_in(rng, 2), (8,))
    xn = np.asarray(x, np.float64)
    expected_rms = xn / np.sqrt((xn**2).mean(-1, keepdims=True) + 1e-6) * np.asarray(scale)
    assert_allclose(rms_norm(x, scale, 1e-6), expected_rms)
    centred = xn - xn.mean(-1, keepdims=True)
    expected_ln = centred / np.sqrt((centred**2).mean(-1, keepdims=True) + 1e-5) * np.asarray(scale) + np.asarray(bias)
    assert_allclose(layer_norm(x, scale, bias, 1e-5), expected_ln)


def test_rope_rotates_channel_pairs_i_and_i_plus_half(rng):
    x = jax.random.normal(rng, (1, 3, 2, 4))
    positions = jnp.array([[0, 5, 11]])
    inv_freq = rope_inverse_frequencies(4, RopeConfig(theta=100.0))
    np.testing.assert_allclose(inv_freq, [1.0, 0.1], rtol=1e-6)
    out = np.asarray(apply_rope(x, positions, inv_freq))
    xn = np.asarray(x)
    for s, p in enumerate([0, 5, 11]):
        for pair, freq in ((0, 1.0), (1, 0.1)):
            a, b = xn[0, s, :, pair], xn[0, s, :, pair + 2]
            c, d = math.cos(p * freq), math.sin(p * freq)
            assert_allclose(out[0, s, :, pair], a * c - b * d)
            assert_allclose(out[0, s, :, pair + 2], b * c + a * d)


def test_rope_scalings_by_hand():
    base = 1.0 / 10000.0 ** (np.arange(0, 8, 2) / 8)  # [1, 0.1, 0.01, 0.001]
    linear = rope_inverse_frequencies(8, RopeConfig(scaling="linear", factor=4.0))
    assert_allclose(linear, base / 4)
    llama3 = rope_inverse_frequencies(
        8, RopeConfig(scaling="llama3", factor=4.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_len=16)
    )
    # Wavelengths 2*pi/f: 6.28 lies between 16/4 and 16/1 (blended); the rest exceed 16 (divided by 4).
    smooth = (16 / (2 * math.pi) - 1.0) / (4.0 - 1.0)
    assert_allclose(llama3, [(1 - smooth) * 1.0 / 4 + smooth * 1.0, 0.1 / 4, 0.01 / 4, 0.001 / 4])
    # With a long original context every wavelength (< 2048 / 4) is "high frequency": kept.
    kept = rope_inverse_frequencies(8, RopeConfig(scaling="llama3", factor=4.0, original_max_len=2048 * 16))
    assert_allclose(kept, np.where(2 * np.pi / base < 2048 * 16 / 4, base, base / 4))


@pytest.mark.parametrize("kind", ["swiglu", "geglu", "gelu", "relu"])
def test_mlp_kinds(kind, rng):
    keys = jax.random.split(rng, 4)
    x = jax.random.normal(keys[0], (2, 3, 8))
    up, gate = jax.random.normal(keys[1], (8, 16)), jax.random.normal(keys[2], (8, 16))
    down = jax.random.normal(keys[3], (16, 8))
    gated = kind in ("swiglu", "geglu")
    xn, upn, gaten, downn = (np.asarray(a, np.float64) for a in (x, up, gate, down))
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731
    gelu = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z**3)))  # noqa: E731
    act = {"swiglu": silu, "geglu": gelu, "gelu": gelu, "relu": lambda z: np.maximum(z, 0)}[kind]
    hidden = act(xn @ gaten) * (xn @ upn) if gated else act(xn @ upn)
    assert_allclose(mlp(x, up, down, kind, gate if gated else None), hidden @ downn, scale=10)  # 16-term sums
    with pytest.raises(ValueError, match="gate"):
        mlp(x, up, down, kind, None if gated else gate)


def test_feature_maps(rng):
    x = jax.random.normal(rng, (1, 2, 3, 4))
    assert_allclose(elu_plus_one(x), np.where(np.asarray(x) > 0, np.asarray(x) + 1, np.exp(np.asarray(x))))
    weight = jax.random.normal(jax.random.fold_in(rng, 1), (3, 4, 5))
    projected = np.einsum("bshd,hdf->bshf", np.asarray(x, np.float64), np.asarray(weight, np.float64))
    softmax = lambda z: np.exp(z) / np.exp(z).sum(-1, keepdims=True)  # noqa: E731
    assert_allclose(hedgehog_features(x, weight), np.concatenate([softmax(projected), softmax(-projected)], -1))


def test_config_validation_names_the_field():
    cases = {
        "num_kv_heads": dict(num_heads=4, num_kv_heads=3),
        "block_pattern": dict(block_pattern=("global", "mamba")),
        "mlp": dict(mlp="swish"),
        "num_layers": dict(num_layers=3, block_pattern=("global", "local")),
        "cca_compression": dict(block_pattern=("cca",), cca_compression=3),
        "precision": dict(precision="int8"),
        "norm_eps": dict(norm_eps=-1e-6),  # NaN logits
        # An infinite (or NaN) cap passed the >= 0 check and made every logit NaN; a bad
        # final_soft_cap was reported under the key attn_soft_cap.
        "attn_soft_cap": dict(attn_soft_cap=float("inf")),
        "final_soft_cap": dict(final_soft_cap=float("nan")),
        "attn_scale": dict(attn_scale=0.2, block_pattern=("global", "cca"), cca_heads=2),  # CCA would ignore it
        "local_rope_theta": dict(local_rope_theta=-1.0),
        "embed_scale": dict(embed_scale=0.0),
    }
    for key, fields in cases.items():
        with pytest.raises(ConfigError, match=key.split(".")[-1]) as error:
            ModelConfig(**fields)
        assert error.value.key == key
    with pytest.raises(ConfigError, match=re.escape("rope.scaling")):
        RopeConfig(scaling="yarn")
    with pytest.raises(ConfigError, match=re.escape("rope.original_max_len")):  # was linear scaling in disguise
        RopeConfig(scaling="llama3", factor=8.0, original_max_len=0)
    # Lists from YAML become the tuple block pattern; unscanned depth need not be a multiple.
    config = load_config(ModelConfig, {"block_pattern": ["local", "global"], "num_layers": 3, "scan_layers": False})
    assert config.layer_kinds == ("local", "global", "local")
    assert dataclasses.replace(config, num_heads=2).head_size == 32


def test_a_bfloat16_embedding_sums_a_frequent_tokens_gradient_in_float32():
    """The lookup's gradient scatter-added each token's contribution in the table's dtype: with a
    ``pure_bf16`` model, 4096 occurrences of one token (each contributing ~0.02) summed to 16
    where the float32 sum is ~82 (bfloat16's sum stops growing at 256 times an addend): the
    embedding of every frequent token trained on a fraction of its gradient."""
    from flax.linen import meta

    from ember.models.layers.embedding import Embed

    tokens = jnp.full((4, 1024), 5, jnp.int32).at[0, :3].set(jnp.asarray([1, 2, 3]))
    upstream = 0.02 + 0.01 * jax.random.normal(jax.random.key(1), (*tokens.shape, 16))

    def gradient(dtype):
        embed = Embed(64, 16, dtype=dtype, param_dtype=dtype)
        params = meta.unbox(embed.init(jax.random.key(0), tokens))
        loss = lambda p: jnp.sum(embed.apply(p, tokens).astype(jnp.float32) * upstream)  # noqa: E731
        return jax.grad(loss)(params)["params"]["embedding"]

    exact, half = gradient(jnp.float32), gradient(jnp.bfloat16)
    assert half.dtype == jnp.bfloat16
    assert_allclose(half, exact)  # bfloat16's tolerance: the sum's own rounding
    assert float(jnp.min(exact[5])) > 70  # the frequent token's row
