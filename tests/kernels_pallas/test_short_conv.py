"""ember.kernels_pallas.short_conv: against XLA's grouped convolution (values and
gradients), numpy, and its own step function; state passing and segment resets."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.short_conv import short_conv, short_conv_step
from tests.host_random import numpy_rng
from tests.tolerances import assert_allclose


def make_inputs(key, *, dtype=jnp.float32, batch=2, seq=19, channels=6, width=4):
    gen = numpy_rng(key)
    normal = lambda *shape: jnp.asarray(gen.standard_normal(shape, np.float32), dtype)  # noqa: E731
    return dict(
        x=normal(batch, seq, channels),
        weight=normal(width, channels),
        bias=normal(channels),
        initial_state=normal(batch, width - 1, channels),
    )


def grouped_conv(x, weight, bias, initial_state):
    """The trusted peer: ``lax.conv_general_dilated`` with one group per channel over the
    history followed by the sequence."""
    inputs = jnp.concatenate([initial_state, x], axis=1)
    kernel = weight[:, None, :]  # [width, in_channels / groups = 1, channels]
    y = jax.lax.conv_general_dilated(
        inputs,
        kernel,
        window_strides=(1,),
        padding="VALID",
        dimension_numbers=("NWC", "WIO", "NWC"),
        feature_group_count=x.shape[-1],
        precision=jax.lax.Precision.HIGHEST,
    )
    return y + bias


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_values_and_gradients_match_grouped_convolution(rng, dtype):
    inputs = make_inputs(rng, dtype=dtype)
    cotangent = jnp.asarray(numpy_rng(jax.random.fold_in(rng, 1)).standard_normal(inputs["x"].shape, np.float32))

    def loss(fn):
        return lambda args: jnp.sum(fn(**args).astype(jnp.float32) * cotangent)

    expected, expected_grads = jax.jit(jax.value_and_grad(loss(grouped_conv)))(inputs)
    actual, grads = jax.jit(jax.value_and_grad(loss(short_conv)))(inputs)
    assert_allclose(short_conv(**inputs), grouped_conv(**inputs), dtype=dtype)
    assert_allclose(actual, expected, dtype=dtype, scale=10.0)  # a sum over the whole output
    for name in inputs:
        # Weight and bias gradients sum over batch and sequence.
        assert_allclose(grads[name], expected_grads[name], dtype=dtype, scale=4.0, err_msg=f"d{name}")


def test_matches_numpy_definition_with_zero_history(rng):
    inputs = make_inputs(rng, width=3)
    x, weight, bias = (np.asarray(inputs[n], np.float64) for n in ("x", "weight", "bias"))
    padded = np.concatenate([np.zeros((2, 2, 6)), x], axis=1)
    expected = sum(weight[j] * padded[:, j : j + 19] for j in range(3)) + bias
    assert_allclose(short_conv(inputs["x"], inputs["weight"], inputs["bias"]), expected)


def test_pieces_with_state_passed_and_step_by_step_equal_the_whole(rng):
    inputs = make_inputs(rng)
    whole, whole_state = short_conv(**inputs, return_final_state=True)
    state, pieces = inputs["initial_state"], []
    for part in (slice(0, 2), slice(2, 11), slice(11, None)):  # a piece shorter than the history
        piece, state = short_conv(
            inputs["x"][:, part], inputs["weight"], inputs["bias"], initial_state=state, return_final_state=True
        )
        pieces.append(piece)
    assert_allclose(jnp.concatenate(pieces, axis=1), whole)
    assert_allclose(state, whole_state)

    step = jax.jit(short_conv_step)
    state, outputs = inputs["initial_state"], []
    for t in range(inputs["x"].shape[1]):
        y, state = step(inputs["x"][:, t], state, inputs["weight"], inputs["bias"])
        outputs.append(y)
    assert_allclose(jnp.stack(outputs, axis=1), whole)
    assert_allclose(state, whole_state)


def test_segment_resets_equal_documents_run_separately(rng):
    lengths = [5, 2, 9]  # a document shorter than the kernel width
    inputs = make_inputs(rng, batch=1, seq=sum(lengths))
    segment_ids = jnp.repeat(jnp.arange(3), jnp.array(lengths))[None]
    packed, packed_state = short_conv(**inputs, segment_ids=segment_ids, return_final_state=True)
    start = 0
    for index, length in enumerate(lengths):
        history = inputs["initial_state"] if index == 0 else None  # the first document's only
        alone, state = short_conv(
            inputs["x"][:, start : start + length],
            inputs["weight"],
            inputs["bias"],
            initial_state=history,
            return_final_state=True,
        )
        assert_allclose(packed[:, start : start + length], alone, err_msg=f"document {index}")
        start += length
    assert_allclose(packed_state, state)  # the last document's history only


def test_step_names_a_token_with_a_seq_axis_left_in():
    """short_conv_step takes one token; a [batch, 1, channels] slice used to be refused as
    'x must be a float array [batch, seq, channels], got float32[2, 1, 1, 6]'."""
    with pytest.raises(
        ValueError, match=r"short_conv_step: x must be \[batch, channels\] \(one token\), got shape \(2, 1, 6\)"
    ):
        short_conv_step(jnp.ones((2, 1, 6)), jnp.zeros((2, 3, 6)), jnp.ones((4, 6)))


def test_errors_name_the_op_and_state_argument_called():
    """short_conv's errors named short_conv_reference and its ``initial_state`` 'state';
    short_conv_step's ``state`` is named as such."""
    x, weight = jnp.ones((2, 5, 6)), jnp.ones((4, 6))
    with pytest.raises(ValueError, match=r"^short_conv: initial_state must be a float array"):
        short_conv(x, weight, initial_state=jnp.ones((2, 4, 6)))
    with pytest.raises(ValueError, match=r"^short_conv: x must be a float array"):
        short_conv(x[0], weight)
    with pytest.raises(ValueError, match=r"^short_conv_step: state must be a float array"):
        short_conv_step(x[:, 0], jnp.ones((2, 4, 6)), weight)


BAD_INPUTS = [
    ("x", dict(x=jnp.ones((2, 5)))),
    ("weight", dict(weight=jnp.ones((4, 5)))),
    ("weight", dict(weight=jnp.ones((4, 6), jnp.bfloat16))),
    ("bias", dict(bias=jnp.ones((5,)))),
    ("state", dict(initial_state=jnp.ones((2, 4, 6)))),
    ("segment_ids", dict(segment_ids=jnp.ones((2, 5, 1), jnp.int32))),
    ("impl", dict(impl="interpret")),
    ("impl", dict(impl="cuda")),
]


@pytest.mark.parametrize("argument, changes", BAD_INPUTS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(BAD_INPUTS)])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    good = dict(x=jnp.ones((2, 5, 6)), weight=jnp.ones((4, 6)), bias=jnp.ones((6,)))
    with pytest.raises(ValueError, match=argument):
        short_conv(**{**good, **changes})
