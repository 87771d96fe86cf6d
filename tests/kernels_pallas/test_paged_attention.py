"""paged_attention: the Pallas decode kernel (interpret mode) and the XLA path against the
reference, and the reference against jax.nn.dot_product_attention on contiguous caches."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.paged_attention import paged_attention, paged_attention_reference
from tests.kernels_pallas.flash_checks import FAST_COMPILE
from tests.kernels_pallas.paged_checks import contiguous_cache, random_normal, random_paged_cache
from tests.tolerances import assert_allclose

PAGE_SIZE = 8
MAX_PAGES = 4
# 0 (empty slot), 1, exactly one page, one past a page boundary, two pages, a full table.
LENGTHS = jnp.array([0, 1, 8, 9, 16, 32], jnp.int32)


def _setup(rng, dtype, heads=8, kv_heads=2, head_dim=64):
    k_cache, k_query = jax.random.split(rng)
    k_pages, v_pages, page_table = random_paged_cache(
        k_cache, num_pages=30, page_size=PAGE_SIZE, kv_heads=kv_heads, head_dim=head_dim,
        num_seqs=LENGTHS.shape[0], max_pages_per_seq=MAX_PAGES, dtype=dtype,
    )
    q = random_normal(k_query, (LENGTHS.shape[0], heads, head_dim), dtype)
    return q, k_pages, v_pages, page_table


@pytest.mark.parametrize(
    "dtype, pages_per_block, options",
    [
        (jnp.float32, 1, {}),
        (jnp.bfloat16, 2, {}),
        (jnp.float32, 2, dict(window=(5, 0), logits_soft_cap=2.0)),
    ],
)
def test_kernel_matches_reference(rng, dtype, pages_per_block, options):
    q, k_pages, v_pages, page_table = _setup(rng, dtype)
    kernel = jax.jit(
        lambda *args: paged_attention(*args, impl="interpret", pages_per_block=pages_per_block, **options),
        compiler_options=FAST_COMPILE,
    )
    out = kernel(q, k_pages, v_pages, page_table, LENGTHS)
    as_f32 = [x.astype(jnp.float32) for x in (q, k_pages, v_pages)]
    expected = jax.jit(lambda *a: paged_attention_reference(*a, **options))(*as_f32, page_table, LENGTHS)
    assert out.dtype == dtype
    assert_allclose(out, expected, dtype=dtype)
    assert np.all(np.asarray(out[0]) == 0.0)  # length 0


def _numpy_decode_attention(q, keys, values, window):
    """Hand-computed attention of one query ``[heads, d]`` (the last token) over a
    contiguous cache ``[length, kv_heads, d]``, in float64."""
    heads, head_dim = q.shape
    length, kv_heads = keys.shape[:2]
    out = np.zeros((heads, head_dim))
    for h in range(heads):
        logits = keys[:, h // (heads // kv_heads)] @ q[h] / np.sqrt(head_dim)
        if window is not None:
            logits[: max(0, length - 1 - window[0])] = -np.inf
        weights = np.exp(logits - logits.max())
        out[h] = (weights / weights.sum()) @ values[:, h // (heads // kv_heads)]
    return out


@pytest.mark.parametrize("window", [None, (3, 0)])
def test_xla_path_matches_hand_computed_attention_on_contiguous_cache(rng, window):
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=4, kv_heads=1, head_dim=16)
    out = jax.jit(lambda *a: paged_attention(*a, window=window, impl="xla"))(q, k_pages, v_pages, page_table, LENGTHS)
    for seq, length in enumerate(np.asarray(LENGTHS)):
        keys = contiguous_cache(k_pages, page_table, seq, length).astype(np.float64)
        values = contiguous_cache(v_pages, page_table, seq, length).astype(np.float64)
        expected = _numpy_decode_attention(np.asarray(q[seq], np.float64), keys, values, window) if length else 0.0
        assert_allclose(out[seq], np.broadcast_to(expected, out[seq].shape), err_msg=f"sequence {seq}")


@pytest.mark.parametrize(
    "change, argument",
    [
        (lambda a: {**a, "q": a["q"][None]}, "q"),
        (lambda a: {**a, "q": a["q"][:, :3]}, "heads"),
        (lambda a: {**a, "q": a["q"][..., :8]}, "head_dim"),
        (lambda a: {**a, "v_pages": a["v_pages"][:-1]}, "v_pages"),
        (lambda a: {**a, "k_pages": a["k_pages"][0], "v_pages": a["v_pages"][0]}, "k_pages"),
        (lambda a: {**a, "page_table": a["page_table"][:-1]}, "page_table"),
        (lambda a: {**a, "page_table": a["page_table"].astype(jnp.float32)}, "page_table"),
        (lambda a: {**a, "lengths": a["lengths"][:-1]}, "lengths"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(rng, change, argument):
    q, k_pages, v_pages, page_table = _setup(rng, jnp.float32, heads=4, kv_heads=2, head_dim=16)
    args = dict(q=q, k_pages=k_pages, v_pages=v_pages, page_table=page_table, lengths=LENGTHS)
    with pytest.raises(ValueError, match=argument):
        paged_attention(**change(args), impl="xla")
