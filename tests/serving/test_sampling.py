"""Device-side sampling against hand-built masks and ``jax.random.categorical``."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.serving.batch_io import output_record, parse_lines
from ember.serving.requests import MAX_SEED, SamplingParams
from ember.serving.sampling import (
    NUCLEUS_MARGIN,
    TOP_K_BY_SELECTION,
    TOP_P_BY_SELECTION,
    WAYS,
    candidate_logits,
    candidate_way,
    fill_settings,
    sample_tokens,
    settings_array,
)
from tests.tolerances import assert_allclose

sample = jax.jit(sample_tokens)


def settings_for(params_list, indices):
    settings = settings_array(len(params_list))
    for row, (params, index) in enumerate(zip(params_list, indices)):
        fill_settings(settings, row, params, index)
    return settings


@jax.jit
def draw_from(seeds, indices, logits):
    """``categorical`` with each row's request key ``fold_in(PRNGKey(seed), index)``."""
    keys = jax.vmap(lambda seed, index: jax.random.fold_in(jax.random.PRNGKey(seed), index))(seeds, indices)
    return jax.vmap(jax.random.categorical)(keys, logits)


def hand_masked(logits_row, params):
    """Temperature, then top-k, then top-p on the renormalised top-k distribution, in numpy."""
    scaled = np.asarray(logits_row, np.float64) / params.temperature
    order = np.argsort(-scaled, kind="stable")
    keep = np.zeros(scaled.shape, bool)
    k = params.top_k or scaled.size
    top = scaled[order[:k]]
    probs = np.exp(top - top.max())
    probs /= probs.sum()
    above = 0.0
    for rank, token in enumerate(order[:k]):
        if above < params.top_p or rank == 0:
            keep[token] = True
        above += probs[rank]
    return np.where(keep, scaled, -np.inf)


def test_greedy_rows_take_the_argmax_and_report_model_logprobs(rng):
    logits = jax.random.normal(rng, (5, 37)) * 3
    tokens, logprobs = sample(logits, settings_for([SamplingParams(seed=0)] * 5, range(5)))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))
    expected = jax.nn.log_softmax(logits)[np.arange(5), np.argmax(logits, axis=-1)]
    assert_allclose(logprobs, expected)


def test_top_k_one_and_tiny_top_p_are_greedy_at_any_temperature(rng):
    logits = jax.random.normal(rng, (6, 50)) * 2
    params = [SamplingParams(temperature=2.5, top_k=1, seed=s) for s in range(3)]
    params += [SamplingParams(temperature=2.5, top_p=1e-6, seed=s) for s in range(3)]
    tokens, _ = sample(logits, settings_for(params, range(6)))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_a_tiny_temperature_is_greedy(rng):
    """At temperature 2e-38 (a normal float32) logits of size 10 over it overflowed to +-inf,
    and the draw took the first +inf: a token of no special rank, not the argmax."""
    logits = jax.random.normal(rng, (4, 50)) * 10
    params = [SamplingParams(temperature=t, top_p=p, seed=7) for t in (2e-38, 1.5e-38) for p in (1.0, 0.9)]
    tokens, _ = sample(logits, settings_for(params, range(4)))
    np.testing.assert_array_equal(tokens, np.argmax(logits, axis=-1))


def test_hand_computed_nucleus_of_three_tokens():
    # p = [0.5, 0.3, 0.2], top_p = 0.7: token 1 is kept (0.5 above it), token 2 is not
    # (0.8 above it); the draw is from [0.625, 0.375, 0] with the request's key.
    logits = jnp.log(jnp.array([[0.5, 0.3, 0.2]] * 64))
    params = [SamplingParams(temperature=1.0, top_p=0.7, seed=seed) for seed in range(64)]
    tokens, logprobs = sample(logits, settings_for(params, [3] * 64))
    expected = draw_from(jnp.arange(64), jnp.full((64,), 3), jnp.log(jnp.array([[0.625, 0.375, 0.0]] * 64)))
    np.testing.assert_array_equal(tokens, expected)
    assert set(np.asarray(tokens).tolist()) == {0, 1}
    assert_allclose(logprobs, np.log(np.array([0.5, 0.3, 0.2]))[np.asarray(tokens)])


@pytest.mark.parametrize("top_k, top_p", [(0, 1.0), (5, 1.0), (0, 0.6), (7, 0.8)])
def test_masked_sampling_matches_categorical_over_the_hand_mask(rng, top_k, top_p):
    logit_key, temperature_key = jax.random.split(rng)
    rows = 16
    logits = np.asarray(jax.random.normal(logit_key, (rows, 40)) * 2)
    temperatures = np.asarray(jax.random.uniform(temperature_key, (rows,), minval=0.3, maxval=2.0))
    params = [
        SamplingParams(temperature=float(t), top_k=top_k, top_p=top_p, seed=1000 + r)
        for r, t in enumerate(temperatures)
    ]
    indices = list(range(rows))
    tokens, _ = sample(jnp.asarray(logits), settings_for(params, indices))
    masked = np.stack([hand_masked(logits[row], params[row]) for row in range(rows)]).astype(np.float32)
    expected = draw_from(jnp.array([p.seed for p in params]), jnp.array(indices), jnp.asarray(masked))
    np.testing.assert_array_equal(tokens, expected)


def test_a_seeded_row_draws_the_same_token_in_any_batch_position(rng):
    logits = jax.random.normal(rng, (1, 64))
    mine = SamplingParams(temperature=1.0, top_k=20, seed=42)
    alone, _ = sample(logits, settings_for([mine], [7]))
    others = [SamplingParams(temperature=0.7, seed=s) for s in range(5)]
    batch = jnp.concatenate([jax.random.normal(jax.random.fold_in(rng, 1), (5, 64)), logits])
    together, _ = sample(
        batch[jnp.array([0, 1, 5, 2, 3, 4])], settings_for([*others[:2], mine, *others[2:]], [0, 1, 7, 2, 3, 4])
    )
    assert int(together[2]) == int(alone[0])
    # Over the sample index, the draws vary: the key depends on it.
    draws, _ = sample(jnp.repeat(logits, 12, axis=0), settings_for([mine] * 12, range(12)))
    assert len(set(np.asarray(draws).tolist())) > 1


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(temperature=-1.0), "temperature"),
        # Infinity would sample uniformly whatever the model says.
        (dict(temperature=float("inf")), r"temperature must be a finite number >= 0 \(0 = greedy\), got inf"),
        (dict(top_k=-2), "top_k"),
        (dict(top_p=0.0), "top_p"),
        (dict(seed=-1), "seed"),
        (dict(stop=[""]), "stop"),
        # Wrong types: the message says what is allowed, never a Python-internal error.
        (dict(temperature="hot"), r"temperature must be a finite number >= 0 \(0 = greedy\), got 'hot' \(str\)"),
        (dict(top_p="0.5"), r"top_p must be a number in \(0, 1\], got '0.5' \(str\)"),
        (dict(temperature=True), r"temperature must be a finite number .*, got True \(bool\)"),
        (dict(max_tokens=True), r"max_tokens must be a positive integer, got True \(bool\)"),
        (dict(top_k=2.0), r"top_k must be an integer >= 0 \(0 = off\), got 2.0 \(float\)"),
        (dict(seed=False), r"seed must be an integer in \[0, 2147483647\], got False \(bool\)"),
        (dict(stop_token_ids=[5]), r"stop_token_ids must be a list of non-empty lists of token ids .*, got \[5\]"),
        (dict(stop_token_ids=[[1.7]]), r"stop_token_ids must be .*, got \[\[1.7\]\]"),
        (dict(stop_token_ids=[[True]]), "stop_token_ids must be"),
        (dict(stop_token_ids=[[]]), "stop_token_ids must be"),
        (dict(stop=5), r"stop must be a string or a list of non-empty strings, got 5 \(int\)"),
        (dict(logprobs="yes"), r"logprobs must be true or false, got 'yes' \(str\)"),
        (dict(prompt_logprobs=1), r"prompt_logprobs must be true or false, got 1 \(int\)"),
        (dict(logprobs=True, top_logprobs=21), r"top_logprobs must be an integer in \[0, 20\], got 21 \(int\)"),
        (dict(top_logprobs=2), r"top_logprobs=2 gives alternatives .*; set one of them"),
        (dict(max_tokens=-1, prompt_logprobs=True), r"max_tokens must be an integer >= 0, got -1 \(int\)"),
    ],
)
def test_sampling_params_reject_bad_values(fields, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**fields)


def test_a_prompt_may_be_scored_without_generating():
    assert SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=20).max_tokens == 0


def test_a_wrongly_typed_field_rejects_its_jsonl_line_only():
    lines = [
        '{"prompt": "a", "temperature": "hot"}',
        '{"prompt": "b", "stop_token_ids": [5]}',
        '{"prompt": "c", "max_tokens": true}',
        '{"prompt": "d", "max_tokens": 3, "stop_token_ids": [[1, 2]], "top_p": 0.5}',
    ]
    parsed = parse_lines(lines)
    assert [output_record(line, None)["error"] for line in parsed[:3]] == [
        "line 1: temperature must be a finite number >= 0 (0 = greedy), got 'hot' (str)",
        "line 2: stop_token_ids must be a list of non-empty lists of token ids (integers >= 0), got [5] (list)",
        "line 3: max_tokens must be a positive integer, got True (bool)",
    ]
    assert parsed[3].error is None
    assert parsed[3].params == SamplingParams(max_tokens=3, stop_token_ids=((1, 2),), top_p=0.5)


def test_a_line_without_a_seed_samples_with_the_base_seed_plus_its_line_number():
    """Repeated prompt lines at a temperature sample differently, and the same file again gives
    the same seeds; before, every such line had --seed itself, so its samples were identical."""
    lines = ['{"prompt": "a", "temperature": 0.8}'] * 2 + ["", '{"prompt": "a", "seed": 9}']
    lines.append('{"prompt": "a"}')
    assert [line.params.seed for line in parse_lines(lines, {"seed": 4})] == [4, 5, 9, 8]
    assert parse_lines(lines[:1], {"seed": MAX_SEED})[0].params.seed == MAX_SEED
    assert parse_lines(lines[:2], {"seed": MAX_SEED})[1].params.seed == 0  # wraps within the seeds allowed


def test_sampling_params_from_dict_names_unknown_fields():
    assert SamplingParams.from_dict({"max_tokens": 3, "stop": "x"}) == SamplingParams(max_tokens=3, stop=("x",))
    with pytest.raises(ValueError, match="temprature"):
        SamplingParams.from_dict({"temprature": 1.0})


def test_a_top_k_beyond_int32_keeps_every_token_like_top_k_off(rng):
    logits = jax.random.normal(rng, (8, 40)) * 2
    huge = [SamplingParams(temperature=1.0, top_k=3_000_000_000, seed=s) for s in range(8)]
    settings = settings_for(huge, range(8))
    assert settings["top_k"].tolist() == [2**31 - 1] * 8
    tokens, _ = sample(logits, settings)
    expected = draw_from(jnp.arange(8), jnp.arange(8), logits)
    np.testing.assert_array_equal(tokens, expected)  # the draw over the whole vocabulary


def test_greedy_rows_filter_nothing_so_their_batch_never_sorts_for_them(rng):
    """A greedy row's draw is not used: its top-k or top-p (an OpenAI client sends top_p with
    temperature 0) made a batch sort its vocabulary (the top-p way or the sort, here the sort)
    for nothing. The greedy rows still take the argmax, the sampled row its own draw."""
    logits = jax.random.normal(rng, (3, VOCAB)) * 0.01  # flat: a top-p of 0.5 keeps half
    greedy = [SamplingParams(top_p=0.5, seed=0), SamplingParams(top_k=300, top_p=0.9, seed=0)]
    batch = [*greedy, SamplingParams(temperature=1.0, seed=4)]
    settings = settings_for(batch, range(3))
    assert WAYS[int(way_of(logits, settings))] == "plain"
    tokens, _ = jax.jit(sample_tokens)(logits, settings)
    assert tokens[:2].tolist() == jnp.argmax(logits[:2], axis=-1).tolist()
    assert int(tokens[2]) == int(draw_from(jnp.asarray([4]), jnp.asarray([2]), logits[2:])[0])


def test_top_p_one_keeps_the_far_tail():
    """top_p=1 is "off": a token of probability 1e-8, past where the float32 sum of the
    probabilities above it reaches 1, stays a candidate (it was cut); top_p 0.5 keeps the top one."""
    logits = jnp.array([[0.0, -18.4, -30.0]] * 2)  # probabilities ~1, 1e-8, 1e-13
    settings = settings_for(
        [SamplingParams(temperature=1.0, seed=0), SamplingParams(temperature=1.0, top_p=0.5, seed=0)], [0, 0]
    )
    candidates = np.asarray(jax.jit(candidate_logits)(logits, settings))
    assert np.isfinite(candidates[0]).all()
    assert np.isfinite(candidates[1]).tolist() == [True, False, False]


VOCAB = 700
"""The vocabulary of the tests of the ways: past TOP_P_BY_SELECTION, which then selects a part."""

candidates_of = jax.jit(candidate_logits)
way_of = jax.jit(candidate_way)


def test_a_batch_sorts_its_vocabulary_only_where_a_row_needs_it_and_every_way_gives_the_same_candidates():
    """Candidates four ways, chosen on device: a batch without top-k or top-p takes the scaled
    logits as they are (a sort of the vocabulary was most of a CPU decode step at temperature 1);
    one whose filtering rows keep at most TOP_K_BY_SELECTION tokens by top-k selects them
    (``lax.top_k``, top-p within them); one whose rows keep at most TOP_P_BY_SELECTION by top-k
    or by a nucleus that ends within them selects that many; only a row filtering by a larger
    top-k or a wider nucleus sorts the whole row. The same rows get the same candidates whichever
    way their batch takes."""
    assert TOP_K_BY_SELECTION < TOP_P_BY_SELECTION < VOCAB
    logits = jax.random.normal(jax.random.PRNGKey(3), (7, VOCAB)) * 3
    logits = logits.at[5].multiply(3)  # peaked: a nucleus of a few tokens
    sampled = lambda **kw: SamplingParams(temperature=0.7, seed=0, **kw)  # noqa: E731
    jaxpr = jax.make_jaxpr(candidate_logits)(logits, settings_for([sampled()] * 7, range(7))).jaxpr
    uses = lambda primitive, jaxpr: re.search(rf"\b{primitive}\[", str(jaxpr)) is not None  # noqa: E731
    assert not any(uses("sort", eqn) or uses("top_k", eqn) for eqn in jaxpr.eqns if eqn.primitive.name != "cond")
    conds = [eqn.params["branches"] for eqn in jaxpr.eqns if eqn.primitive.name == "cond"]
    (branches,) = [branches for branches in conds if len(branches) == len(WAYS)]
    # The top-p way's selection is made while choosing the way (to see whether it will do).
    assert [(uses("sort", b), uses("top_k", b)) for b in branches] == [
        (False, False),
        (False, True),
        (False, False),
        (True, False),
    ]
    choosing = [branch for branches in conds if len(branches) < len(WAYS) for branch in branches]
    assert not any(uses("sort", branch) for branch in choosing)
    assert sum(f"top_k[axis=1 k={TOP_P_BY_SELECTION}]" in str(branch) for branch in choosing) == 1
    rows = [sampled(), sampled(top_k=5), sampled(top_k=40, top_p=0.8), sampled(top_k=TOP_K_BY_SELECTION, top_p=0.9)]
    rows += [sampled(top_k=200, top_p=0.9), sampled(top_p=0.9)]
    batches = {
        "plain": [sampled()] * 7,
        "top_k": [*rows[:4], sampled(), sampled(), sampled()],
        "top_p": [*rows, sampled()],
        "sort": [*rows, sampled(top_k=300)],
    }
    got = {}
    for way, batch in batches.items():
        settings = settings_for(batch, range(7))
        assert WAYS[int(way_of(logits, settings))] == way
        got[way] = np.asarray(candidates_of(logits, settings))
    assert np.isfinite(got["plain"]).all() and np.isfinite(got["top_k"][[0, 4, 5, 6]]).all()
    assert np.isfinite(got["top_p"][[0, 6]]).all()
    np.testing.assert_array_equal(got["top_k"][:4], got["sort"][:4])
    np.testing.assert_array_equal(got["top_p"][:6], got["sort"][:6])
    np.testing.assert_array_equal(got["plain"][0], got["sort"][0])
    kept = np.isfinite(got["sort"]).sum(axis=-1)
    assert kept[1] == 5 and 1 <= kept[2] < 40 and 1 <= kept[3] < TOP_K_BY_SELECTION
    assert 1 <= kept[4] < 200 and 1 <= kept[5] < 10 and kept[6] == 300
    for row, params in enumerate(batches["sort"][1:], start=1):  # the hand-built mask of each filtering row
        np.testing.assert_array_equal(np.isfinite(got["sort"][row]), np.isfinite(hand_masked(logits[row], params)))


def test_a_batch_filtering_by_top_p_alone_sorts_only_where_a_nucleus_may_end_past_its_selection():
    """A row filtering by top-p alone has the whole vocabulary's mass as its nucleus's normaliser;
    its batch selects the TOP_P_BY_SELECTION largest tokens when the mass of those reaches top_p
    by NUCLEUS_MARGIN of that, and sorts otherwise. A peaked row selects and a flat one sorts; a
    row whose nucleus is the selection goes either way by the margin, one of a token more sorts;
    each has its hand-built mask and the same candidates in a batch that sorts for another row."""
    n = TOP_P_BY_SELECTION
    rng = np.random.default_rng(0)
    # The n largest fall from 0 to -2, the others lie below -2.5: each of the last selected has
    # a share of about 1e-3 and the first past them 6e-4, so a top_p just under the selection's
    # share keeps all n, just over it n + 1.
    edge = rng.permutation(np.concatenate([np.linspace(0.0, -2.0, n), -2.5 - rng.uniform(size=VOCAB - n)]))
    weights = np.exp(np.sort(edge)[::-1])
    share = float(weights[:n].sum() / weights.sum())
    cases = [  # (logits of the row, its top_p, the way its batch takes, the tokens it keeps or None)
        (rng.normal(size=VOCAB) * 9, 0.9, "top_p", None),
        (edge, share - 2 * NUCLEUS_MARGIN, "top_p", n),
        (edge, share - NUCLEUS_MARGIN / 2, "sort", n),
        (edge, share + 3e-4, "sort", n + 1),
        (rng.normal(size=VOCAB) * 0.01, 0.9, "sort", None),
    ]
    others = np.asarray(jax.random.normal(jax.random.PRNGKey(4), (6, VOCAB)))
    for row, top_p, way, count in cases:
        params = SamplingParams(temperature=1.0, top_p=top_p, seed=0)
        logits = jnp.asarray(np.concatenate([row[None], others]), jnp.float32)
        alone = settings_for([params] + [SamplingParams(temperature=1.0, seed=0)] * 6, range(7))
        sorting = settings_for([params] + [SamplingParams(temperature=1.0, top_k=300, seed=0)] * 6, range(7))
        assert WAYS[int(way_of(logits, alone))] == way and WAYS[int(way_of(logits, sorting))] == "sort"
        candidates = np.asarray(candidates_of(logits, alone))
        np.testing.assert_array_equal(candidates[0], np.asarray(candidates_of(logits, sorting))[0])
        assert np.isfinite(candidates[1:]).all()
        hand = hand_masked(np.asarray(logits[0]), params)
        np.testing.assert_array_equal(np.isfinite(candidates[0]), np.isfinite(hand))
        assert np.isfinite(candidates[0]).sum() in ({count} if count else range(1, VOCAB))
    # Rows whose top_p is the share of their 10 largest tokens rounded to float32: whether the
    # 11th is kept is decided by rounding (a float32 sum or normaliser formed otherwise in one
    # way decides some of them otherwise), yet each row is the same whichever way.
    logits = jnp.asarray(np.concatenate([rng.normal(size=(6, VOCAB)) * 3, others[:1]]), jnp.float32)
    weights = np.sort(np.exp(np.asarray(logits[:6], np.float64)), axis=-1)[:, ::-1]
    shares = weights / weights.sum(axis=-1, keepdims=True)
    params = [SamplingParams(temperature=1.0, top_p=float(np.float32(share[:10].sum())), seed=0) for share in shares]
    alone = settings_for([*params, SamplingParams(temperature=1.0, seed=0)], range(7))
    sorting = settings_for([*params, SamplingParams(temperature=1.0, top_k=300, seed=0)], range(7))
    assert [WAYS[int(way_of(logits, settings))] for settings in (alone, sorting)] == ["top_p", "sort"]
    candidates = np.asarray(candidates_of(logits, alone))
    np.testing.assert_array_equal(candidates[:6], np.asarray(candidates_of(logits, sorting))[:6])
    assert set(np.isfinite(candidates[:6]).sum(axis=-1).tolist()) == {10, 11}
