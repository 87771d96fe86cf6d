"""ember.kernels_pallas.linear_attention_tpu: the Mosaic TPU kernel, run in JAX's TPU interpret
mode (``impl="interpret_tpu"``), against the scan references of linear attention and SSD
(which runs it), values and gradients; and its lowering for a real TPU."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.linear_attention import linear_attention, linear_attention_reference
from ember.kernels_pallas.linear_attention_tpu import chunked_linear_attention_tpu
from ember.kernels_pallas.ssd import ssd, ssd_reference
from tests.kernels_pallas import scan_checks
from tests.kernels_pallas import test_linear_attention as linear_attention_cases
from tests.kernels_pallas import test_ssd as ssd_cases

SEQ = 37  # not a multiple of the chunk size 8
# Row 0: documents start on a chunk boundary (8), inside chunks (13, 30) and one lasts a
# single token (13); row 1 is one document, so the state crosses every chunk.
DOCUMENT_STARTS = (8, 13, 14, 30)


def _segment_ids():
    row = np.searchsorted(DOCUMENT_STARTS, np.arange(SEQ), side="right")
    return jnp.asarray(np.stack([row, np.zeros(SEQ, int)]), jnp.int32)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_linear_attention_kernel_matches_reference_in_values_and_gradients(rng, dtype):
    """GQA (2 value heads per query/key head), data-dependent decay, an initial state."""
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = {**linear_attention_cases.make_inputs(key_inputs, dtype=dtype, seq=SEQ), "segment_ids": _segment_ids()}
    expected, expected_grads = linear_attention_cases.values_and_grads(
        linear_attention_reference, inputs, key_cotangent
    )
    actual = linear_attention_cases.values_and_grads(
        linear_attention, inputs, key_cotangent, chunk_size=8, impl="interpret_tpu"
    )
    scan_checks.assert_forms_agree(
        {"tpu kernel": actual},
        expected,
        expected_grads,
        dtype=dtype,
        grad_args=linear_attention_cases.GRAD_ARGS,
        output_name="outputs",
    )


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_ssd_kernel_matches_reference_in_values_and_gradients(rng, dtype):
    """Mamba-2 shapes: 2 heads per B/C group, head_dim 4, state 8, an initial state."""
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = {**ssd_cases.make_inputs(key_inputs, dtype=dtype, seq=SEQ), "segment_ids": _segment_ids()}
    expected, expected_grads = ssd_cases.values_and_grads(ssd_reference, inputs, key_cotangent)
    actual = ssd_cases.values_and_grads(ssd, inputs, key_cotangent, chunk_size=8, impl="interpret_tpu")
    scan_checks.assert_forms_agree(
        {"tpu kernel": actual}, expected, expected_grads, dtype=dtype, grad_args=ssd_cases.GRAD_ARGS, output_name="y"
    )


def test_normalized_wide_values_match_reference(rng):
    """dv = 128 with the key-sum column is 129 value columns, padded to two lane tiles."""
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = linear_attention_cases.make_inputs(key_inputs, batch=1, seq=20, dv=128, normalize=True)
    expected, expected_grads = linear_attention_cases.values_and_grads(
        linear_attention_reference, inputs, key_cotangent, normalize=True
    )
    actual = linear_attention_cases.values_and_grads(
        linear_attention, inputs, key_cotangent, normalize=True, chunk_size=8, impl="interpret_tpu"
    )
    # The final state and the gradients sum over the sequence and the 128 value columns.
    scan_checks.assert_forms_agree(
        {"tpu kernel": actual},
        expected,
        expected_grads,
        dtype=jnp.float32,
        grad_args=linear_attention_cases.GRAD_ARGS,
        output_name="outputs",
    )


def test_kernels_lower_for_a_tpu():
    """The forward and backward lower to Mosaic TPU custom calls (block shapes legal for a
    TPU, every primitive lowerable), in bf16 with a head_dim of 64 and dv + 1 = 65 columns."""
    batch, seq, qk_heads, heads, dk, dv = 2, 100, 1, 2, 64, 65
    shaped = jax.ShapeDtypeStruct

    def loss(q, k, v, log_decay, doc, state):
        outputs, final_state = chunked_linear_attention_tpu(
            q, k, v, log_decay, doc, state, chunk_size=128, interpret=False
        )
        return jnp.sum(outputs) + jnp.sum(final_state)

    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3, 5))), platforms=["tpu"])(
        shaped((batch, seq, qk_heads, dk), jnp.bfloat16),
        shaped((batch, seq, qk_heads, dk), jnp.bfloat16),
        shaped((batch, seq, heads, dv), jnp.bfloat16),
        shaped((batch, seq, heads), jnp.float32),
        shaped((batch, seq), jnp.int32),
        shaped((batch, heads, dk, dv), jnp.float32),
    )
    module = exported.mlir_module()
    assert module.count("tpu_custom_call") == 2
    assert "linear_attention_forward_tpu" in module and "linear_attention_backward_tpu" in module
