"""CCA / CCGQA: the layer equals an independent implementation of the paper's equations
(alone and on packed documents), parameters and KV-cache bytes shrink by the compression
factor, the layer is causal, and a CCA model trains on a small synthetic task."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from ember.core.tree import param_bytes, param_count
from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.layers.cca import CompressedConvAttention
from tests.host_random import numpy_rng, perturbed
from tests.tolerances import assert_allclose

MHA = ModelConfig(
    vocab_size=64, d_model=64, num_layers=2, num_heads=4, mlp_dim=128, attention_impl="xla", max_seq_len=64
)
COMPRESSION = 4


def cca(kv_heads=0):
    return dataclasses.replace(
        MHA, block_pattern=("cca",), cca_compression=COMPRESSION, cca_heads=2, cca_kv_heads=kv_heads
    )


def attention_params(config):
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.key(0), jnp.ones((1, 8), jnp.int32))
    return jax.tree.map(
        lambda box: box.value if hasattr(box, "value") else box,
        shapes["params"]["layers"]["block_0"]["attn"],
        is_leaf=lambda x: hasattr(x, "value"),
    )


def causal_conv_over_sequence(x, weight):
    """``y[t] = sum_j x[t - j] @ weight[width - 1 - j]`` (zeros before the sequence): tap
    ``width - 1`` multiplies the current token. ``x [seq, ...]``; ``weight[j]`` multiplies
    elementwise (depthwise, ``[channels]``) or per head (``[heads, dim, dim]``)."""
    width = weight.shape[0]
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(min(width, t + 1)):
            tap = weight[width - 1 - j]
            out[t] += x[t - j] * tap if tap.ndim == 1 else np.einsum("hd,hde->he", x[t - j], tap)
    return out


def cca_paper_reference(params, x, config):
    """CCA of one document ``x [seq, embed]`` in float64, written from the paper's equations:
    down-projections, a causal depthwise convolution over the sequence then a causal
    convolution over the sequence mixing channels within each head, plus the mean of the
    pre-convolution query (per key head) and key; the second half of the value channels
    shifted by one token; QK RMS-norm, rotary embedding, causal attention per head (GQA)
    and the up-projection."""
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    heads, kv_heads, dim = config.cca_query_heads, config.cca_key_value_heads, config.cca_head_size
    group, seq = heads // kv_heads, x.shape[0]
    q_lat, k_lat, v_lat = (x @ p[name]["kernel"] for name in ("q", "k", "v"))
    q = causal_conv_over_sequence(q_lat, p["q_conv1"]).reshape(seq, heads, dim)
    q = causal_conv_over_sequence(q, p["q_conv2"])
    k = causal_conv_over_sequence(k_lat, p["k_conv1"]).reshape(seq, kv_heads, dim)
    k = causal_conv_over_sequence(k, p["k_conv2"])
    mean = (q_lat.reshape(seq, kv_heads, group, dim).mean(axis=2) + k_lat.reshape(seq, kv_heads, dim)) / 2
    q, k = q + np.repeat(mean, group, axis=1), k + mean
    half = v_lat.shape[1] // 2
    previous = np.concatenate([np.zeros_like(v_lat[:1]), v_lat[:-1]])
    v = np.concatenate([v_lat[:, :half], previous[:, half:]], axis=1).reshape(seq, kv_heads, dim)

    def rms_norm_and_rope(a, scale):
        a = a / np.sqrt((a**2).mean(-1, keepdims=True) + config.norm_eps) * scale
        angle = np.arange(seq)[:, None, None] * config.rope.theta ** (-np.arange(0, dim, 2) / dim)
        first, second = a[..., : dim // 2], a[..., dim // 2 :]
        cos, sin = np.cos(angle), np.sin(angle)
        return np.concatenate([first * cos - second * sin, second * cos + first * sin], -1)

    q, k = rms_norm_and_rope(q, p["q_norm"]["scale"]), rms_norm_and_rope(k, p["k_norm"]["scale"])
    out = np.zeros((seq, heads, dim))
    for h in range(heads):
        logits = q[:, h] @ k[:, h // group].T / np.sqrt(dim)
        logits = np.where(np.tril(np.ones((seq, seq), bool)), logits, -np.inf)
        weights = np.exp(logits - logits.max(-1, keepdims=True))
        out[:, h] = weights / weights.sum(-1, keepdims=True) @ v[:, h // group]
    return np.einsum("shd,hde->se", out, p["o"]["kernel"])


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_cca_layer_matches_the_papers_equations(rng, kv_heads):
    """Perturbed parameters (the identity-initialised convolutions would hide reversed or
    misplaced taps), a width-3 convolution, CCGQA and CCA; and two packed documents, each
    of which must equal the reference run on it alone."""
    config = dataclasses.replace(
        MHA, block_pattern=("cca",), cca_compression=COMPRESSION, cca_heads=4, cca_kv_heads=kv_heads, cca_conv_width=3
    )
    layer = CompressedConvAttention(config)
    gen = numpy_rng(rng)
    # Inputs and outputs stay NumPy arrays: each eager slice of a jax.Array compiles a program.
    x = gen.standard_normal((2, 9, config.d_model)).astype(np.float32)
    positions = np.broadcast_to(np.arange(9), (2, 9))
    # Jitted: op by op, the init compiled ~100 programs.
    params = jax.jit(layer.init)(jax.random.key(0), x, positions)["params"]
    params = perturbed(params, jax.random.fold_in(rng, 1), scale=0.3)
    params = nn.meta.unbox(params)
    apply = jax.jit(layer.apply)
    out = np.asarray(apply({"params": params}, x, positions)[0])
    for row in range(2):
        assert_allclose(out[row], cca_paper_reference(params, np.asarray(x[row], np.float64), config), scale=10)
    segment_ids = jnp.array([[1] * 4 + [2] * 5] * 2)
    packed_positions = jnp.array([list(range(4)) + list(range(5))] * 2)
    packed = np.asarray(apply({"params": params}, x, packed_positions, segment_ids)[0])
    for row in range(2):
        for doc in (slice(0, 4), slice(4, 9)):
            expected = cca_paper_reference(params, np.asarray(x[row, doc], np.float64), config)
            assert_allclose(packed[row, doc], expected, scale=10)


def test_projection_parameters_shrink_by_the_compression_factor():
    mha, compressed = attention_params(MHA), attention_params(cca())
    projections = lambda tree: param_count({name: tree[name] for name in ("q", "k", "v", "o")})  # noqa: E731
    assert projections(mha) * 1 == projections(compressed) * COMPRESSION
    # On top: per layer, two convolutions each for q (2 heads) and k (2 heads here) of width 2
    # (depthwise [2, 16] and per-head [2, 2, 8, 8]) and the two QK-norm scales [8].
    extra_per_layer = 2 * (2 * 16 + 2 * 2 * 8 * 8) + 2 * 8
    assert param_count(compressed) == projections(compressed) + MHA.num_layers * extra_per_layer


def test_kv_cache_bytes_shrink_by_the_compression_factor():
    def page_bytes(config):
        layers = init_cache_layers(config, num_slots=2, num_pages=4)
        return param_bytes(
            {name: {k: v for k, v in state.items() if k.endswith("_pages")} for name, state in layers.items()}
        )

    assert page_bytes(MHA) == COMPRESSION * page_bytes(cca())
    assert page_bytes(MHA) == 2 * COMPRESSION * page_bytes(cca(kv_heads=1))  # CCGQA: heads shared too


def test_cca_is_causal(rng):
    model = DecoderLM(cca(kv_heads=1))
    tokens = jax.random.randint(rng, (1, 16), 0, 64)
    params = jax.jit(model.init)(jax.random.key(1), tokens)["params"]
    changed = tokens.at[0, 10].set((tokens[0, 10] + 1) % 64)
    apply = jax.jit(model.apply)
    before, _ = apply({"params": params}, tokens)
    after, _ = apply({"params": params}, changed)
    assert_allclose(after[:, :10], before[:, :10])
    assert np.abs(np.asarray(after[:, 10:] - before[:, 10:])).max() > 1e-3


def test_cca_model_learns_a_synthetic_task(rng):
    """Next token = token two steps back + 1 (mod vocab): needs attention through the latent
    space (two positions back) to solve."""
    config = dataclasses.replace(cca(kv_heads=1), vocab_size=16)
    model = DecoderLM(config)
    start = jax.random.randint(rng, (32, 2), 0, 16)
    steps = jnp.arange(24) // 2
    tokens = (start[:, jnp.arange(24) % 2] + steps[None, :]) % 16
    params = jax.jit(model.init)(jax.random.key(2), tokens)["params"]
    optimizer = optax.adam(1e-2)

    def loss_fn(params):
        logits, _ = model.apply({"params": params}, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits[:, 2:], tokens[:, 3:]).mean()

    @jax.jit
    def step(params, state):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, state = optimizer.update(grads, state, params)
        return optax.apply_updates(params, updates), state, loss

    state = optimizer.init(params)
    losses = []
    for _ in range(60):
        params, state, loss = step(params, state)
        losses.append(float(loss))
    assert losses[0] > 2.0  # ~log(16) at initialisation
    assert losses[-1] < 0.25 * losses[0], losses[::10]
