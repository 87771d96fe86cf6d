"""ember.kernels_pallas.ssd: Mamba-2's SSD chunked (XLA and the Pallas kernels in the
interpreter) against the scan reference and the quadratic form, values and gradients."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.kernels_pallas.ssd import ssd, ssd_quadratic, ssd_reference, ssd_step
from tests.host_random import numpy_rng
from tests.kernels_pallas import scan_checks
from tests.tolerances import assert_allclose

IMPLS = ["xla", "interpret"]
# SSD runs linear attention's chunked paths (tests/kernels_pallas/test_linear_attention.py
# checks each property for both impls); here the state-passing and segment properties use
# one impl each, to keep the suite fast, while the agreement test covers both.
GRAD_ARGS = ("x", "dt", "A", "B", "C", "D", "dt_bias", "initial_state")


def make_inputs(key, *, dtype=jnp.float32, batch=2, seq=37, heads=4, head_dim=4, groups=2, state=8):
    """Random Mamba-2 inputs: 2 heads per B/C group, an initial state and packed documents;
    ``seq`` is not a multiple of the chunk sizes used."""
    gen = numpy_rng(key)
    normal = lambda *shape: gen.standard_normal(shape, np.float32)  # noqa: E731
    boundaries = gen.random((batch, seq)) < 0.1
    return dict(
        x=jnp.asarray(normal(batch, seq, heads, head_dim), dtype),
        dt=jnp.asarray(normal(batch, seq, heads)),
        A=jnp.asarray(-np.exp(normal(heads))),
        B=jnp.asarray(normal(batch, seq, groups, state), dtype),
        C=jnp.asarray(normal(batch, seq, groups, state), dtype),
        D=jnp.asarray(normal(heads)),
        dt_bias=jnp.asarray(normal(heads)),
        initial_state=jnp.asarray(normal(batch, heads, head_dim, state)),
        segment_ids=jnp.asarray(np.cumsum(boundaries, axis=1), jnp.int32),
    )


def values_and_grads(fn, inputs, cotangent_key, **options):
    return scan_checks.values_and_grads(fn, inputs, cotangent_key, grad_args=GRAD_ARGS, output_like="x", **options)


def test_reference_matches_hand_computed_recurrence(rng):
    """The reference against a numpy loop of Mamba-2's recurrence, one head per group."""
    inputs = make_inputs(rng, batch=1, seq=7, heads=2, groups=2, state=3)
    y = ssd_reference(**{n: inputs[n] for n in GRAD_ARGS})
    x, dt, A, B, C, D, bias = (np.asarray(inputs[n], np.float64) for n in ("x", "dt", "A", "B", "C", "D", "dt_bias"))
    for head in range(2):
        state = np.asarray(inputs["initial_state"], np.float64)[0, head]
        for t in range(7):
            step = np.log1p(np.exp(dt[0, t, head] + bias[head]))
            state = np.exp(step * A[head]) * state + step * np.outer(x[0, t, head], B[0, t, head])
            assert_allclose(y[0, t, head], state @ C[0, t, head] + D[head] * x[0, t, head])


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("impl", IMPLS)
def test_chunked_scan_and_quadratic_agree_in_values_and_gradients(rng, impl, dtype):
    key_inputs, key_cotangent = jax.random.split(rng)
    inputs = make_inputs(key_inputs, dtype=dtype)
    expected, expected_grads = values_and_grads(ssd_reference, inputs, key_cotangent)
    forms = {
        "chunked": values_and_grads(ssd, inputs, key_cotangent, chunk_size=8, impl=impl),
        "quadratic": values_and_grads(ssd_quadratic, inputs, key_cotangent),
    }
    scan_checks.assert_forms_agree(forms, expected, expected_grads, dtype=dtype, grad_args=GRAD_ARGS, output_name="y")


def test_results_do_not_depend_on_chunk_size(rng):
    inputs = make_inputs(rng, seq=45)
    results = {
        (impl, size): ssd(**inputs, return_final_state=True, chunk_size=size, impl=impl)
        for impl, size in [("xla", 8), ("xla", 32), ("xla", 128), ("interpret", 16)]
    }
    baseline = results[("xla", 8)]
    for config, (y, final_state) in results.items():
        assert_allclose(y, baseline[0], err_msg=str(config))
        assert_allclose(final_state, baseline[1], err_msg=str(config))


def test_two_halves_with_state_passed_equal_the_whole(rng, impl="interpret"):
    inputs = make_inputs(rng, seq=40)
    split = 21  # inside a chunk and, below, inside a document (the state's document continues)
    ids = inputs["segment_ids"]
    inputs["segment_ids"] = ids.at[:, split:].add((ids[:, split - 1] - ids[:, split])[:, None])
    whole, whole_state = ssd(**inputs, return_final_state=True, chunk_size=8, impl=impl)

    def half(part, initial_state):
        cut = {n: (inputs[n][:, part] if inputs[n].ndim > 1 else inputs[n]) for n in GRAD_ARGS if n != "initial_state"}
        cut["segment_ids"] = inputs["segment_ids"][:, part]
        return ssd(**cut, initial_state=initial_state, return_final_state=True, chunk_size=8, impl=impl)

    first, state = half(slice(None, split), inputs["initial_state"])
    second, final_state = half(slice(split, None), state)
    assert_allclose(jnp.concatenate([first, second], axis=1), whole)
    assert_allclose(final_state, whole_state)


def test_step_by_step_decode_equals_the_full_scan(rng):
    inputs = make_inputs(rng, seq=10)
    per_head = {n: inputs[n] for n in ("A", "D", "dt_bias")}
    full, full_state = ssd(**{n: inputs[n] for n in GRAD_ARGS}, return_final_state=True, chunk_size=8, impl="xla")
    step = jax.jit(ssd_step)
    state, ys = inputs["initial_state"], []
    for t in range(10):
        y, state = step(
            inputs["x"][:, t],
            inputs["dt"][:, t],
            per_head["A"],
            inputs["B"][:, t],
            inputs["C"][:, t],
            state,
            D=per_head["D"],
            dt_bias=per_head["dt_bias"],
        )
        ys.append(y)
    assert_allclose(jnp.stack(ys, axis=1), full)
    assert_allclose(state, full_state)


def test_segment_resets_equal_documents_run_separately(rng, impl="xla"):
    lengths = [6, 13, 9]
    inputs = make_inputs(rng, batch=1, seq=sum(lengths))
    segment_ids = jnp.repeat(jnp.array([0, 1, 2]), jnp.array(lengths))[None]
    arguments = {n: inputs[n] for n in GRAD_ARGS}
    packed = ssd(**arguments, segment_ids=segment_ids, chunk_size=8, impl=impl)
    start = 0
    for index, length in enumerate(lengths):
        document = {n: (v[:, start : start + length] if v.ndim > 1 else v) for n, v in arguments.items()}
        document["initial_state"] = inputs["initial_state"] if index == 0 else None  # first document only
        alone = ssd(**document, chunk_size=8, impl=impl)
        assert_allclose(packed[:, start : start + length], alone, err_msg=f"document {index}")
        start += length


def test_no_softplus_and_no_optional_arguments_match_reference(rng):
    inputs = make_inputs(rng, seq=20)
    core = {n: inputs[n] for n in ("x", "A", "B", "C")}
    dt = jax.nn.softplus(inputs["dt"])  # already positive: dt_softplus=False uses it as is
    expected = ssd_reference(**core, dt=dt, dt_softplus=False)
    assert_allclose(ssd(**core, dt=dt, dt_softplus=False, chunk_size=8, impl="xla"), expected)


def test_step_names_a_token_with_a_seq_axis_left_in():
    """ssd_step takes one token; a [batch, 1, heads, head_dim] slice used to be refused as
    'x must be [batch, seq, heads, head_dim], got shape (2, 1, 1, 4, 4)', a shape never passed."""
    with pytest.raises(
        ValueError, match=r"ssd_step: x must be \[batch, heads, head_dim\] \(one token\), got shape \(2, 1, 4, 4\)"
    ):
        ssd_step(
            jnp.ones((2, 1, 4, 4)), jnp.ones((2, 4)), -jnp.ones((4,)), jnp.ones((2, 2, 8)), jnp.ones((2, 2, 8)),
            jnp.zeros((2, 4, 4, 8)),
        )  # fmt: skip


def test_step_names_its_state_argument():
    """ssd_step's argument is ``state``; its error called it initial_state."""
    with pytest.raises(ValueError, match=r"ssd_step: state must be a float array \(2, 4, 4, 8\)"):
        ssd_step(
            jnp.ones((2, 4, 4)), jnp.ones((2, 4)), -jnp.ones((4,)), jnp.ones((2, 2, 8)), jnp.ones((2, 2, 8)),
            jnp.zeros((2, 4, 4, 7)),
        )  # fmt: skip


BAD_INPUTS = [
    ("x", dict(x=jnp.ones((2, 5, 4)))),
    ("B", dict(B=jnp.ones((2, 5, 3, 8)))),  # 3 groups do not divide 4 heads
    ("C", dict(C=jnp.ones((2, 5, 2, 7)))),
    ("B", dict(B=jnp.ones((2, 5, 0, 8)), C=jnp.ones((2, 5, 0, 8)))),  # was "integer modulo by zero"
    ("dt", dict(dt=jnp.ones((2, 5, 2)))),
    ("A", dict(A=jnp.ones((4, 1)))),
    ("D", dict(D=jnp.ones((3,)))),
    ("dt_bias", dict(dt_bias=jnp.ones((4,), jnp.int32))),
    ("x, B and C", dict(x=jnp.ones((2, 5, 4, 4), jnp.bfloat16))),
    ("initial_state", dict(initial_state=jnp.ones((2, 4, 8, 4)))),
    ("segment_ids", dict(segment_ids=jnp.ones((2, 4), jnp.int32))),
    ("chunk_size", dict(chunk_size=100)),
    ("impl", dict(impl="triton")),
]


@pytest.mark.parametrize("argument, changes", BAD_INPUTS, ids=[f"{name}-{i}" for i, (name, _) in enumerate(BAD_INPUTS)])
def test_bad_arguments_raise_value_error_naming_them(argument, changes):
    good = dict(
        x=jnp.ones((2, 5, 4, 4)),
        dt=jnp.ones((2, 5, 4)),
        A=-jnp.ones((4,)),
        B=jnp.ones((2, 5, 2, 8)),
        C=jnp.ones((2, 5, 2, 8)),
    )
    with pytest.raises(ValueError, match=argument):
        ssd(**{**good, **changes})
