"""ember.kernels_pallas.linear_attention: the chunked forms (XLA and the Pallas kernels in
the interpreter) against the scan reference and the quadratic form, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.document_boundaries import document_index
from ember.kernels_pallas.linear_attention import (
    ChunkSize,
    linear_attention,
    linear_attention_quadratic,
    linear_attention_reference,
    linear_attention_step,
)
from ember.kernels_pallas.linear_attention_pallas import (
    FORWARD_VALUE_BLOCK,
    KEY_BLOCK,
    LOOP_VALUE_BLOCK,
    STATE_VALUE_BLOCK,
    VALUE_GRADIENT_VALUE_BLOCK,
    column_block_size,
)
from tests.host_random import numpy_rng
from tests.kernels_pallas import scan_checks
from tests.tolerances import assert_allclose

IMPLS = ["xla", "interpret"]


def make_inputs(key, *, dtype=jnp.float32, batch=2, seq=37, qk_heads=1, heads=2, dk=8, dv=4, normalize=False):
    """Random inputs with GQA (2 value heads per query/key head), data-dependent decay, an
    initial state and packed documents; ``seq`` is not a multiple of the chunk sizes used."""
    gen = numpy_rng(key)
    normal = lambda *shape: gen.standard_normal(shape, np.float32)  # noqa: E731
    q, k = normal(batch, seq, qk_heads, dk), normal(batch, seq, qk_heads, dk)
    state = normal(batch, heads, dk, dv + int(normalize))
    if normalize:  # positive feature maps, as normalisation assumes
        q, k, state = np.logaddexp(q, 0), np.logaddexp(k, 0), np.abs(state)
    boundaries = gen.random((batch, seq)) < 0.1
    return dict(
        q=jnp.asarray(q, dtype),
        k=jnp.asarray(k, dtype),
        v=jnp.asarray(normal(batch, seq, heads, dv), dtype),
        log_decay=jnp.asarray(-np.logaddexp(2.0 * normal(batch, seq, heads), 0)),
        initial_state=jnp.asarray(state),
        segment_ids=jnp.asarray(np.cumsum(boundaries, axis=1) + 7, jnp.int32),
    )


GRAD_ARGS = ("q", "k", "v", "log_decay", "initial_state")


def values_and_grads(fn, inputs, cotangent_key, **options):
    return scan_checks.values_and_grads(fn, inputs, cotangent_key, grad_args=GRAD_ARGS, output_like="v", **options)


def test_reference_matches_hand_computed_recurrence(rng):
    """The reference against a numpy loop of S = exp(g) S + k^T v, o = q S (with one reset)."""
    inputs = make_inputs(rng, batch=1, seq=9, qk_heads=2, heads=2)
    segment_ids = jnp.array([[0, 0, 0, 0, 1, 1, 1, 1, 1]])
    outputs = linear_attention_reference(
        inputs["q"],
        inputs["k"],
        inputs["v"],
        log_decay=inputs["log_decay"],
        initial_state=inputs["initial_state"],
        segment_ids=segment_ids,
    )
    q, k, v, g = (np.asarray(inputs[n], np.float64)[0] for n in ("q", "k", "v", "log_decay"))
    for head in range(2):
        state = np.asarray(inputs["initial_state"], np.float64)[0, head]
        for t in range(9):
            state = (0.0 if t == 4 else np.exp(g[t, head])) * state + np.outer(k[t, head], v[t, head])
            assert_allclose(outputs[0, t, head], q[t, head] @ state)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_scan_and_quadratic_agree_in_values_and_gradients(rng, impl, dtype):
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = make_inputs(key_inputs, dtype=dtype)
    expected, expected_grads = values_and_grads(linear_attention_reference, inputs, key_cotangent)
    forms = {
        "chunked": values_and_grads(linear_attention, inputs, key_cotangent, chunk_size=8, impl=impl),
        "quadratic": values_and_grads(linear_attention_quadratic, inputs, key_cotangent),
    }
    scan_checks.assert_forms_agree(
        forms, expected, expected_grads, dtype=dtype, grad_args=GRAD_ARGS, output_name="outputs"
    )


def test_kernel_splits_wide_heads_across_programs_and_loop_steps(rng):
    """dk = dv = 128: the outputs and dv run as two programs of 64 value columns per chunk,
    the state passes as four of 32; dq and dk as two programs of 64 key columns per chunk,
    each adding up the value columns in four loop steps of 32; the decay gradient is the sum
    of the key blocks' partial results."""
    assert column_block_size(128, FORWARD_VALUE_BLOCK) == 64 and column_block_size(96, FORWARD_VALUE_BLOCK) == 96
    assert column_block_size(128, VALUE_GRADIENT_VALUE_BLOCK) == 64
    assert column_block_size(128, STATE_VALUE_BLOCK) == 32
    assert column_block_size(128, KEY_BLOCK) == 64
    assert column_block_size(128, LOOP_VALUE_BLOCK) == 32 and column_block_size(96, LOOP_VALUE_BLOCK) == 32
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = make_inputs(key_inputs, batch=1, seq=20, dk=128, dv=128)
    expected, expected_grads = values_and_grads(linear_attention_reference, inputs, key_cotangent)
    actual, grads = values_and_grads(linear_attention, inputs, key_cotangent, chunk_size=8, impl="interpret")
    assert_allclose(actual[0], expected[0], scale=8.0)  # sums over 128 key columns
    assert_allclose(actual[1], expected[1], scale=8.0)
    for name in GRAD_ARGS:
        # d log_decay sums q.dq - k.dk over 128 columns: entries up to ~700 with cancellation,
        # f32 round-off ~1e-7 of the largest (as on the XLA path).
        scale = 64.0 if name == "log_decay" else 8.0
        assert_allclose(grads[name], expected_grads[name], scale=scale, err_msg=f"d{name}")


@pytest.mark.parametrize("impl", IMPLS)
def test_normalized_outputs_and_gradients_match_reference(rng, impl):
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = make_inputs(key_inputs, normalize=True, seq=21)
    expected, expected_grads = values_and_grads(linear_attention_reference, inputs, key_cotangent, normalize=True)
    actual, grads = values_and_grads(linear_attention, inputs, key_cotangent, normalize=True, chunk_size=8, impl=impl)
    assert_allclose(actual[0], expected[0])
    assert_allclose(actual[1], expected[1])
    for name in GRAD_ARGS:
        assert_allclose(grads[name], expected_grads[name], scale=4.0, err_msg=f"d{name}")  # summed over seq


def test_results_do_not_depend_on_chunk_size(rng):
    inputs = make_inputs(rng, seq=45)
    results = {
        (impl, size): linear_attention(**inputs, return_final_state=True, chunk_size=size, impl=impl)
        for impl, size in [("xla", 8), ("xla", 16), ("xla", 64), ("interpret", 16)]
    }
    baseline = results[("xla", 8)]
    for config, (outputs, final_state) in results.items():
        assert_allclose(outputs, baseline[0], err_msg=str(config))
        assert_allclose(final_state, baseline[1], err_msg=str(config))


@pytest.mark.parametrize("impl", IMPLS)
def test_two_halves_with_state_passed_equal_the_whole(rng, impl):
    inputs = make_inputs(rng, seq=40)
    split = 19  # inside a chunk and, below, inside a document: a call's first token continues
    # the state's document (a new document starts from a fresh state instead).
    ids = inputs["segment_ids"]
    inputs["segment_ids"] = ids.at[:, split:].add((ids[:, split - 1] - ids[:, split])[:, None])
    whole, whole_state = linear_attention(**inputs, return_final_state=True, chunk_size=8, impl=impl)

    def half(part, initial_state):
        cut = {n: inputs[n][:, part] for n in ("q", "k", "v", "log_decay", "segment_ids")}
        return linear_attention(**cut, initial_state=initial_state, return_final_state=True, chunk_size=8, impl=impl)

    first, state = half(slice(None, split), inputs["initial_state"])
    second, final_state = half(slice(split, None), state)
    assert_allclose(jnp.concatenate([first, second], axis=1), whole)
    assert_allclose(final_state, whole_state)


def test_step_by_step_decode_equals_the_full_scan(rng):
    inputs = make_inputs(rng, seq=12, normalize=True)
    del inputs["segment_ids"]
    full, full_state = linear_attention(**inputs, normalize=True, return_final_state=True, chunk_size=8, impl="xla")
    step = jax.jit(linear_attention_step, static_argnames="normalize")
    state, outputs = inputs["initial_state"], []
    for t in range(12):
        output, state = step(
            inputs["q"][:, t],
            inputs["k"][:, t],
            inputs["v"][:, t],
            state,
            log_decay=inputs["log_decay"][:, t],
            normalize=True,
        )
        outputs.append(output)
    assert_allclose(jnp.stack(outputs, axis=1), full)
    assert_allclose(state, full_state)


@pytest.mark.parametrize("impl", IMPLS)
def test_segment_resets_equal_documents_run_separately(rng, impl):
    lengths = [5, 11, 9]  # document boundaries fall inside chunks of 8 and on none of them
    inputs = make_inputs(rng, batch=1, seq=sum(lengths))
    segment_ids = jnp.repeat(jnp.array([3, 1, 3]), jnp.array(lengths))[None]  # ids may repeat: changes reset
    packed = linear_attention(**{**inputs, "segment_ids": segment_ids}, chunk_size=8, impl=impl)
    start = 0
    for index, length in enumerate(lengths):
        document = {n: inputs[n][:, start : start + length] for n in ("q", "k", "v", "log_decay")}
        # The initial state belongs to the first document only.
        initial_state = inputs["initial_state"] if index == 0 else None
        alone = linear_attention(**document, initial_state=initial_state, chunk_size=8, impl=impl)
        assert_allclose(packed[:, start : start + length], alone, err_msg=f"document {index}")
        start += length


def test_document_index_counts_changes_of_segment_id():
    segment_ids = jnp.array([[3, 3, 1, 1, 3], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(document_index(segment_ids, 2, 5), [[0, 0, 1, 1, 2], [0, 0, 0, 0, 0]])
    np.testing.assert_array_equal(document_index(None, 1, 3), [[0, 0, 0]])


def test_strong_decay_and_long_chunks_stay_finite(rng):
    inputs = make_inputs(rng, seq=64)
    inputs["log_decay"] = inputs["log_decay"] * 20.0  # decays down to exp(-200) per step
    expected = linear_attention_reference(**inputs)
    # Cumulative log decays reach ~-1e4 inside a chunk, where float32 spacing is ~1e-3:
    # weights exp(b_t - b_s) carry that relative error (as in the Mamba-2 and fla kernels).
    assert_allclose(linear_attention(**inputs, chunk_size=64, impl="xla"), expected, scale=10.0)


def _bad(**changes):
    return changes


BAD_INPUTS = [
    ("q", _bad(q=jnp.ones((2, 5, 1)))),
    ("k", _bad(k=jnp.ones((2, 5, 2, 3)))),
    ("v", _bad(v=jnp.ones((2, 5, 3, 4)))),  # 3 value heads for 2 query/key heads
    ("v", _bad(v=jnp.ones((2, 6, 4, 4)))),
    ("v", _bad(q=jnp.ones((2, 5, 0, 8)), k=jnp.ones((2, 5, 0, 8)))),  # was "integer modulo by zero"
    ("q", _bad(q=jnp.ones((2, 5, 2, 8), jnp.int32), k=jnp.ones((2, 5, 2, 8), jnp.int32))),
    ("q, k and v", _bad(v=jnp.ones((2, 5, 4, 4), jnp.bfloat16))),
    ("log_decay", _bad(log_decay=jnp.zeros((2, 5, 2)))),
    ("initial_state", _bad(initial_state=jnp.zeros((2, 4, 8, 5)))),
    ("segment_ids", _bad(segment_ids=jnp.zeros((2, 5), jnp.float32))),
    ("chunk_size", _bad(chunk_size=12)),
    ("impl", _bad(impl="cuda")),
]


@pytest.mark.parametrize("argument, changes", BAD_INPUTS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(BAD_INPUTS)])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    good = dict(q=jnp.ones((2, 5, 2, 8)), k=jnp.ones((2, 5, 2, 8)), v=jnp.ones((2, 5, 4, 4)))
    with pytest.raises(ValueError, match=argument):
        linear_attention(**{**good, **changes})


def test_step_names_a_token_with_a_seq_axis_left_in():
    """linear_attention_step takes one token, [batch, heads, d]; a [batch, 1, heads, d] slice
    of the sequence used to fail with 'too many values to unpack (expected 3)'."""
    one = jnp.ones((2, 1, 1, 8))
    with pytest.raises(ValueError, match=r"linear_attention_step: q must be \[batch, qk_heads, dk\] \(one token\)"):
        linear_attention_step(one, one, one, jnp.zeros((2, 1, 8, 8)))
    with pytest.raises(ValueError, match=r"linear_attention_step: v must be \[batch, heads, dv\]"):
        linear_attention_step(one[:, 0], one[:, 0], one, jnp.zeros((2, 1, 8, 8)))


@pytest.mark.parametrize("impl", ["xla", "interpret", "interpret_tpu"])
@pytest.mark.parametrize("batch, seq", [(2, 0), (0, 5)])
def test_empty_inputs_give_empty_outputs_and_pass_the_state_through(impl, batch, seq):
    """No tokens (or no rows) attend nothing: the kernels' paths used to fail inside Pallas
    ('slice_sizes must be less than or equal to operand shape' for seq 0) and every path
    with 'integer modulo by zero' for batch 0, where the reference returns empty outputs."""
    q = jnp.ones((batch, seq, 1, 8))
    v = jnp.ones((batch, seq, 2, 4))
    state = jnp.asarray(numpy_rng(jax.random.key(0)).standard_normal((batch, 2, 8, 5)), jnp.float32)
    options = dict(normalize=True, initial_state=state, return_final_state=True)
    out, final = linear_attention(q, q, v, chunk_size=8, impl=impl, **options)
    expected_out, expected_final = linear_attention_reference(q, q, v, **options)
    assert out.shape == expected_out.shape == (batch, seq, 2, 4)
    assert_allclose(final, expected_final)
    assert_allclose(final, state)


def test_step_names_its_state_argument():
    """linear_attention_step's argument is ``state``; its error called it initial_state."""
    one = jnp.ones((2, 1, 8))
    with pytest.raises(ValueError, match=r"linear_attention_step: state must be a float array \(2, 1, 8, 8\)"):
        linear_attention_step(one, one, one, jnp.zeros((2, 1, 8, 9)))


@pytest.mark.parametrize("impl", ["xla", "interpret", "interpret_tpu"])
def test_infinite_log_decay_resets_the_state_like_the_reference(impl):
    """log_decay = -inf (exp 0: a full reset, allowed by '<= 0') made the chunked forms
    compute -inf - -inf = NaN for every output after it in its chunk; the reference resets.
    Now values and the gradients of q, k, v and the finite log decays match it."""
    gen = numpy_rng(jax.random.key(1))
    q, k, v = (jnp.asarray(gen.standard_normal((1, 20, 1, 8)), jnp.float32) for _ in range(3))
    log_decay = -jnp.asarray(gen.uniform(0.0, 0.5, (1, 20, 1)), jnp.float32)
    log_decay = log_decay.at[0, 5, 0].set(-jnp.inf).at[0, 13, 0].set(-jnp.inf)

    def loss(op, **options):
        return lambda q, k, v, ld: jnp.sum(op(q, k, v, log_decay=ld, **options) ** 2)

    grads = jax.grad(loss(linear_attention, chunk_size=8, impl=impl), argnums=(0, 1, 2, 3))(q, k, v, log_decay)
    expected = jax.grad(loss(linear_attention_reference), argnums=(0, 1, 2, 3))(q, k, v, log_decay)
    out = linear_attention(q, k, v, log_decay=log_decay, chunk_size=8, impl=impl)
    assert_allclose(out, linear_attention_reference(q, k, v, log_decay=log_decay), scale=10)
    # Relative to each gradient's largest entry: the clamped reset puts cumulative log decays
    # near -200, where float32 spacing is 1.5e-5 (as the ~-1e4 of the test above, smaller).
    finite = np.isfinite(np.asarray(log_decay))
    assert not np.any(np.asarray(grads[3])[~finite])  # a reset's log decay gets no gradient (exp(-inf) = 0)
    pairs = [*zip(grads[:3], expected[:3]), (np.asarray(grads[3])[finite], np.asarray(expected[3])[finite])]
    for name, (got, want) in zip(("dq", "dk", "dv", "dlog_decay"), pairs):
        size = float(np.max(np.abs(want)))
        assert_allclose(np.asarray(got) / size, np.asarray(want) / size, err_msg=name)


def test_chunk_size_validates_itself():
    assert ChunkSize(16).chunk_size == 16
    for bad in (0, 4, 24, 16.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            ChunkSize(bad)
