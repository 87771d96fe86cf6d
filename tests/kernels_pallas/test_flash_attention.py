"""flash_attention: the Pallas kernels (interpret mode) and the XLA path against the
reference, dtypes, GQA ratios (dk/dv accumulated per key head), head dims (80 and 96 padded
to 128), non-block-multiple lengths, argument checking."""

import jax
import jax.numpy as jnp
import pytest

from ember.kernels_pallas.block_mask import LocalGlobalMask
from ember.kernels_pallas.flash_attention import FlashBlockSizes, flash_attention, flash_attention_reference
from tests.kernels_pallas.flash_checks import assert_kernel_matches_reference, random_qkv
from tests.kernels_pallas.traced_kernels import kernel_grids_in_gradient
from tests.tolerances import assert_allclose


@pytest.mark.parametrize(
    "dtype, causal, group, head_dim, q_len, kv_len",
    [
        (jnp.float32, True, 1, 64, 77, 77),
        (jnp.float32, False, 2, 128, 77, 77),
        (jnp.float32, True, 4, 64, 40, 77),  # q_len != kv_len: top-left aligned causal
        (jnp.bfloat16, True, 4, 64, 77, 77),
        (jnp.bfloat16, False, 8, 128, 77, 77),
        # head_dim 80 / 96 run padded to 128; a group of 3 query heads per key head
        (jnp.float32, True, 3, 80, 40, 40),
        (jnp.bfloat16, False, 2, 96, 33, 33),
    ],
)
def test_kernel_values_and_grads_match_reference(rng, dtype, causal, group, head_dim, q_len, kv_len):
    kv_heads = 2 if group <= 2 else 1
    q, k, v, d_out = random_qkv(
        rng,
        batch=2 if group == 1 else 1,
        q_len=q_len,
        kv_len=kv_len,
        heads=group * kv_heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=dtype,
    )
    assert_kernel_matches_reference(q, k, v, d_out, causal=causal)


def test_kernel_long_sequence_default_blocks(rng):
    """1000 tokens: 8 x 8 blocks of the default 128, the last one partial."""
    q, k, v, d_out = random_qkv(rng, batch=1, q_len=1000, kv_len=1000, heads=1, kv_heads=1, head_dim=64)
    # Sums over 1000 keys in a different order than the reference: slightly more rounding.
    assert_kernel_matches_reference(q, k, v, d_out, block_sizes=FlashBlockSizes(), causal=True, scale=4.0)


@pytest.mark.parametrize("options", [dict(causal=True), dict(causal=False), dict(window=(9, 4))])
def test_xla_path_matches_jax_dot_product_attention(rng, options):
    """The XLA path (= the reference) against JAX's own attention, values and gradients."""
    q, k, v, d_out = random_qkv(rng, batch=2, q_len=77, kv_len=77, heads=4, kv_heads=2, head_dim=64)
    ours = lambda q, k, v: flash_attention(q, k, v, impl="xla", **options)  # noqa: E731
    window = options.get("window")
    theirs = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
        q, k, v, is_causal=options.get("causal", False), local_window_size=window, implementation="xla"
    )

    @jax.jit
    def values_and_grads(q, k, v, d_out):
        out, ours_vjp = jax.vjp(ours, q, k, v)
        expected, theirs_vjp = jax.vjp(theirs, q, k, v)
        return out, expected, ours_vjp(d_out), theirs_vjp(d_out)

    out, expected, our_grads, their_grads = values_and_grads(q, k, v, d_out)
    assert_allclose(out, expected)
    for got, want in zip(our_grads, their_grads):
        assert_allclose(got, want)


def test_xla_path_chunks_long_queries_like_the_reference(rng):
    """1000 queries: two rematerialized chunks of 512, the second padded."""
    q, k, v, d_out = random_qkv(rng, batch=1, q_len=1000, kv_len=1000, heads=2, kv_heads=1, head_dim=16)
    segments = jnp.repeat(jnp.arange(4), 250)[None]
    options = dict(causal=True, segment_ids=segments, block_mask=LocalGlobalMask(100, 30, 8))

    @jax.jit
    def values_and_grads(q, k, v, d_out):
        results = []
        for fn in (
            lambda *a: flash_attention(*a, impl="xla", **options),
            lambda *a: flash_attention_reference(*a, **options),
        ):
            out, vjp = jax.vjp(fn, q, k, v)
            results.append((out, vjp(d_out)))
        return results

    (out, grads), (expected, expected_grads) = values_and_grads(q, k, v, d_out)
    assert_allclose(out, expected)
    for got, want in zip(grads, expected_grads):
        assert_allclose(got, want)


def test_auto_on_cpu_is_the_xla_path(rng):
    q, k, v, _ = random_qkv(rng, batch=1, q_len=20, kv_len=20, heads=2, kv_heads=1, head_dim=16)
    auto = jax.jit(lambda q, k, v: flash_attention(q, k, v, causal=True))
    assert_allclose(auto(q, k, v), jax.jit(flash_attention_reference, static_argnames="causal")(q, k, v, causal=True))


@pytest.mark.parametrize(
    "shapes, options, argument",
    [
        (((1, 8, 3, 16), (1, 8, 2, 16)), {}, "heads"),
        # Zero kv_heads or head_dim: ZeroDivisionError ("integer modulo by zero", "float division").
        (((1, 8, 2, 16), (1, 8, 0, 16)), {}, r"kv_heads \(0\), which must be positive"),
        (((1, 8, 2, 0), (1, 8, 1, 0)), {}, "head_dim must be positive"),
        (((1, 8, 4, 16), (1, 8, 2, 32)), {}, "head_dim"),
        (((8, 4, 16), (1, 8, 2, 16)), {}, "q"),
        (((1, 8, 4, 16), (8, 2, 16)), {}, "k"),
        (((1, 8, 4, 16), (2, 8, 2, 16)), {}, "batch"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"window": (3,)}, "window"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"score": "relu"}, "score"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"logits_soft_cap": -1.0}, "logits_soft_cap"),
        # An infinite cap gave inf * tanh(0) = NaN outputs.
        (
            ((1, 8, 4, 16), (1, 8, 2, 16)),
            {"logits_soft_cap": float("inf")},
            "logits_soft_cap must be a positive finite",
        ),
        # A NaN or infinite scale gave NaN outputs; True was taken as 1.0.
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"sm_scale": float("nan")}, "sm_scale must be a finite number"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"sm_scale": True}, "sm_scale must be a finite number"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"segment_ids": jnp.zeros((1, 7), jnp.int32)}, "segment_ids"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"segment_positions": jnp.zeros((1, 7), jnp.int32)}, "segment_positions"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"block_mask": "causal"}, "block_mask"),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"impl": "cuda"}, "impl"),
        # A misspelt backward_kernel on the XLA path was said to need the GPU kernels.
        (
            ((1, 8, 4, 16), (1, 8, 2, 16)),
            {"backward_kernel": "trition", "impl": "xla"},
            "backward_kernel must be one of",
        ),
        (((1, 8, 4, 16), (1, 8, 2, 16)), {"impl": "pallas"}, "impl='pallas'"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(shapes, options, argument):
    q_shape, kv_shape = shapes
    q = jnp.ones(q_shape)
    k = v = jnp.ones(kv_shape)
    with pytest.raises(ValueError, match=argument):
        flash_attention(q, k, v, **options)


@pytest.mark.parametrize(
    "dtypes, options, message",
    [
        ((jnp.int32, jnp.float32), {}, "q must be a floating-point array, got dtype int32"),
        ((jnp.float32, jnp.int8), {}, "k must be a floating-point array, got dtype int8"),
        # Float ids were cast to int32: 0.25 and 0.75 became one document.
        ((jnp.float32,) * 2, {"segment_ids": jnp.array([[0.25] * 4 + [0.75] * 4])}, "q segment_ids must be an integer"),
        ((jnp.float32,) * 2, {"segment_positions": jnp.zeros((1, 8))}, "q segment_positions must be an integer"),
    ],
)
def test_bad_dtypes_raise_value_error_naming_them(dtypes, options, message):
    """Integer q/k/v gave an integer (truncated) output, float segment ids were silently
    truncated to int32; both are refused, by the op and its reference."""
    q = jnp.ones((1, 8, 2, 16), dtypes[0])
    k = v = jnp.ones((1, 8, 1, 16), dtypes[1])
    for op in (flash_attention, flash_attention_reference):
        with pytest.raises(ValueError, match=message):
            op(q, k, v, **options)


def test_gpu_backward_takes_keys_in_its_own_tiles(rng):
    """The Triton backward keeps the forward's query blocks but takes keys 64 at a time by
    default (``backward_block_kv`` sets it, never above ``block_kv``): 200 tokens are 2
    query blocks of 128 and 4 key blocks of 64 for dk/dv."""
    q, k, v, _ = random_qkv(rng, batch=1, q_len=200, kv_len=200, heads=4, kv_heads=2, head_dim=16)

    def grids(block_sizes):
        attend = lambda q, k, v: flash_attention(q, k, v, causal=True, block_sizes=block_sizes, impl="interpret")  # noqa: E731
        return kernel_grids_in_gradient(attend, q, k, v)

    assert grids(FlashBlockSizes()) == {
        "flash_attention_forward": (1, 4, 2),
        "flash_attention_dq": (1, 4, 2),
        "flash_attention_dkv": (1, 2, 4),
    }
    assert grids(FlashBlockSizes(backward_block_kv=32))["flash_attention_dkv"] == (1, 2, 7)
    assert grids(FlashBlockSizes(64, 32, backward_block_kv=128))["flash_attention_dkv"] == (1, 2, 7)
    assert FlashBlockSizes().backward_tiles() == (64, None)
    assert FlashBlockSizes(num_warps=4, backward_num_warps=8).backward_tiles() == (64, 8)


@pytest.mark.parametrize(
    "kwargs, argument",
    [
        (dict(block_q=12), "block_q"),
        (dict(block_kv=4), "block_kv"),
        (dict(num_warps=3), "num_warps"),
        (dict(num_stages=0), "num_stages"),
        (dict(backward_block_kv=48), "backward_block_kv"),
        (dict(backward_num_warps=6), "backward_num_warps"),
        (dict(num_stages=True), "num_stages must be a positive int, got True"),
        (dict(num_warps=True), r"num_warps must be None \(chosen by tile size\) or one of"),
    ],
)
def test_block_sizes_validate_themselves(kwargs, argument):
    with pytest.raises(ValueError, match=argument):
        FlashBlockSizes(**kwargs)


def test_block_sizes_fit_short_sequences():
    assert FlashBlockSizes(128, 128).fitted(77, 5) == FlashBlockSizes(128, 8)
    assert FlashBlockSizes(64, 128).fitted(1000, 33) == FlashBlockSizes(64, 64)
    assert FlashBlockSizes(128, 128, num_warps=4, num_stages=3).fitted(8, 8) == FlashBlockSizes(8, 8, 4, 3)
