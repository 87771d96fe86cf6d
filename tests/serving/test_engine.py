"""The engine against a plain full-recompute greedy loop on a tiny random softmax-attention
``DecoderLM`` (models with per-sequence state slots: ``test_state_serving.py``), and split
tensor-parallel over a mesh against the single device's engine. Tests share compiled programs,
never an engine: each test's engine runs on a fresh copy of the program's cache."""

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.errors import ConfigError
from ember.core.hf_tokenizer import load_hf_tokenizer
from ember.core.sharding import MeshConfig, make_mesh, unbox
from ember.core.tokenizer import ByteTokenizer
from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.models.quantization import QuantizeConfig, quantize_params
from ember.serving.engine import Engine
from ember.serving.mesh import serving_mesh
from ember.serving.model_program import build_program, step_placement
from ember.serving.requests import SamplingParams
from tests.collectives import collectives
from tests.once_per_session import one_at_a_time
from tests.serving.greedy_reference import greedy_reference, log_prob_reference
from tests.serving.random_workload import assert_serves_alike, random_prompts, run_random_arrivals
from tests.tolerances import assert_allclose
from tests.training.finetune_setup import BOS, WORDS, write_tokenizer

CONFIG = ModelConfig(
    vocab_size=257, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2, mlp_dim=128, page_size=4, max_seq_len=48
)
MAX_CONTEXT = 48
NUM_PAGES = 16  # 12 pages hold one full sequence; 4 slots would want 48: preemption happens.


@pytest.fixture(scope="module")
def params():
    tokens = jnp.zeros((1, 8), jnp.int32)
    return DecoderLM(CONFIG).init(jax.random.PRNGKey(20261122), tokens)["params"]


@pytest.fixture(scope="module")
def program(params, tmp_path_factory):
    with one_at_a_time(tmp_path_factory, "serving-engine-program"):  # compiled once per session
        return build_program(
            CONFIG, params, num_slots=4, token_buckets=(4, 8, 16), max_context=MAX_CONTEXT, num_pages=NUM_PAGES
        )


@pytest.fixture(scope="module")
def mesh_program(params, tmp_path_factory):
    """``program`` split over a tensor=2 mesh (each device: two query heads, one key head), its
    ragged attention in the Pallas interpreter, per shard of the key heads; one bucket."""
    config = dataclasses.replace(CONFIG, attention_impl="interpret")
    with one_at_a_time(tmp_path_factory, "serving-engine-mesh-program"):
        return build_program(
            config,
            params,
            num_slots=4,
            token_buckets=(16,),
            max_context=MAX_CONTEXT,
            num_pages=NUM_PAGES,
            mesh=serving_mesh(MeshConfig(data=1, tensor=2)),
        )


@pytest.fixture
def engine(program):
    return Engine(program.fresh_copy(), tokenizer=ByteTokenizer())


@pytest.fixture(scope="module")
def reference_greedy(params):
    return greedy_reference(CONFIG, params, MAX_CONTEXT)


@pytest.fixture(scope="module")
def reference_log_probs(params):
    return log_prob_reference(CONFIG, params, MAX_CONTEXT)


def test_prompt_and_alternative_logprobs_equal_a_full_forward_pass(engine, reference_greedy, reference_log_probs, rng):
    """Prompt log-probabilities (prefilled in chunks of random budgets, one request preempted
    mid-prompt and again mid-output), alternatives of prompt and generated tokens and a prompt
    scored alone (``max_tokens`` 0), beside a request that asks for none of them, equal the
    ``log_softmax`` of a full forward pass over the finished sequence."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompts = [*random_prompts(generator, 3, low=2), generator.integers(0, 256, size=30).tolist()]
    asks = [
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True, prompt_logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True),
        SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=2),
        SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True, prompt_logprobs=True, top_logprobs=1),
    ]
    ids = [engine.add_request(prompt, ask) for prompt, ask in zip(prompts, asks)]
    preempted = engine.scheduler.waiting[-1]
    preemptions = 0
    while engine.has_unfinished:
        engine.step(token_budget=int(generator.integers(1, 9)))
        scored, generated = len(preempted.prompt_logprobs), len(preempted.output)
        if (preemptions == 0 and 0 < scored < 29) or (preemptions == 1 and generated == 2):
            engine.scheduler.preempt(preempted)
            preemptions += 1
    assert preemptions == 2
    results = [engine.result(i) for i in ids]
    assert [r.tokens for r in results] == [
        *reference_greedy(prompts[:2], [5, 5]),
        [],
        *reference_greedy(prompts[3:], [4]),
    ]
    assert results[2].finish_reason == "length"
    log_probs = reference_log_probs([prompt + result.tokens for prompt, result in zip(prompts, results)])
    for index, (prompt, ask, result, rows) in enumerate(zip(prompts, asks, results, log_probs)):
        sequence = prompt + result.tokens
        given = [rows[p, sequence[p + 1]] for p in range(len(sequence) - 1)]
        top = [sorted(enumerate(row), key=lambda pair: -pair[1])[: ask.top_logprobs] for row in rows[:-1]]
        message = f"request {index}"
        if ask.prompt_logprobs:
            assert_allclose(result.prompt_logprobs, given[: len(prompt) - 1], dtype=np.float32, err_msg=message)
            assert [[t for t, _ in a] for a in result.prompt_top_logprobs] == [
                [t for t, _ in a] for a in top[: len(prompt) - 1]
            ], message
            assert_allclose(
                [[v for _, v in a] for a in result.prompt_top_logprobs],
                [[v for _, v in a] for a in top[: len(prompt) - 1]],
                dtype=np.float32,
                err_msg=message,
            )
        else:
            assert result.prompt_logprobs is None and result.prompt_top_logprobs is None
        if ask.logprobs:
            assert_allclose(result.logprobs, given[len(prompt) - 1 :], dtype=np.float32, err_msg=message)
        if ask.logprobs and ask.top_logprobs:
            assert [[t for t, _ in a] for a in result.top_logprobs] == [
                [t for t, _ in a] for a in top[len(prompt) - 1 :]
            ], message
            # A greedy token's log-probability is its first alternative's, to the bit (what
            # lm-evaluation-harness's is_greedy compares).
            assert [a[0] for a in result.top_logprobs] == list(zip(result.tokens, result.logprobs)), message
        else:
            assert result.top_logprobs is None
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_scored_choices_of_one_context_share_its_pages_and_their_rows_scores(program, reference_log_probs, rng):
    """lm-evaluation-harness's multiple-choice shape: each choice scored whole after a shared
    context (``max_tokens`` 0, ``prompt_logprobs``, alternatives). Four sent together: the first
    computes the 21-token context, keeping its pages and their rows' scores; the others wait for
    it, then start after its five full pages, reading those scores. One asking for more
    alternatives than were kept computes it again (keeping them), which the next one reads. After
    a 20-token context, a page's last row scores the choice's first token: a choice starting
    with another token shares one page fewer. Every score is a full forward pass's."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    contexts = [generator.integers(0, 256, length).tolist() for length in (21, 20)]
    choices = [contexts[0] + generator.integers(0, 256, int(generator.integers(1, 6))).tolist() for _ in range(6)]
    choices += [contexts[1] + [first, *generator.integers(0, 256, 2).tolist()] for first in (7, 8, 7)]
    widths = [2, 1, 2, 1, 3, 3, 1, 1, 1]
    asks = [SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=width) for width in widths]
    engine = Engine(program.fresh_copy())
    results = engine.generate(choices[:4], asks[:4])
    hits = [engine.scheduler.pages.hit_tokens]
    for choice, ask in zip(choices[4:], asks[4:]):
        results += engine.generate([choice], ask)
        hits.append(engine.scheduler.pages.hit_tokens)
    assert np.diff([0, *hits]).tolist() == [3 * 20, 0, 20, 0, 16, 20]
    rows = [r for i in range(0, 12, 4) for r in reference_log_probs((choices + [[0]] * 3)[i : i + 4])]
    for index, (choice, width, result) in enumerate(zip(choices, widths, results)):
        log_probs, message = rows[index][:-1], f"choice {index}"
        top = np.argsort(-log_probs, axis=-1, kind="stable")[:, :width]
        assert_allclose(
            result.prompt_logprobs, log_probs[np.arange(len(choice) - 1), choice[1:]], dtype=np.float32, err_msg=message
        )
        assert [[t for t, _ in a] for a in result.prompt_top_logprobs] == top.tolist(), message
        assert_allclose(
            [[v for _, v in a] for a in result.prompt_top_logprobs],
            np.take_along_axis(log_probs, top, axis=-1),
            dtype=np.float32,
            err_msg=message,
        )
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_scores_a_request_had_before_new_weights_never_reach_the_cache(program, params):
    """A scored request preempted mid-prompt keeps the scores of the rows it had when it comes
    back, which ``update_params`` in between made the old weights'. It computes every page
    again, but keeps with them only the rows it scored afresh: a request scoring the same prompt
    after it reads no old score (it shares no page: the first three pages' rows were not kept)."""
    prompt, scored = list(range(60, 90)), SamplingParams(max_tokens=0, prompt_logprobs=True)
    moved = jax.tree.map(lambda leaf: leaf * 1.5, params)
    engine = Engine(program.fresh_copy())
    engine.add_request(prompt, scored)
    for _ in range(3):
        engine.step(token_budget=4)
    (request,) = engine.scheduler.running
    assert len(request.prompt_logprobs) == 12
    engine.scheduler.preempt(request)
    engine.update_params(moved)
    while engine.has_unfinished:
        engine.step()
    (again,) = engine.generate([prompt], scored)
    expected = Engine(program.fresh_copy(moved), prefix_caching=False).generate([prompt], scored)[0]
    assert engine.scheduler.pages.hit_tokens == 0
    assert_allclose(again.prompt_logprobs, expected.prompt_logprobs, dtype=np.float32)


def test_a_group_of_one_prompt_prefills_it_once(program, reference_greedy, rng, monkeypatch):
    """Prefix caching: four copies of a 21-token prompt submitted together (a GRPO group, ``n``
    choices) prefill it once. The first computes it (16 then 5 tokens: the budget is 16) while
    the others wait for its pages, then each starts after its five full pages, computing one
    token; all give the full-recompute greedy tokens."""
    engine = Engine(program.fresh_copy())
    fed = []
    schedule = engine.scheduler.schedule
    monkeypatch.setattr(engine.scheduler, "schedule", lambda *args: fed.append(chunks := schedule(*args)) or chunks)
    prompt = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1))).integers(0, 256, 21).tolist()
    results = engine.generate([prompt] * 4, SamplingParams(max_tokens=3, ignore_eos=True))
    assert [r.tokens for r in results] == reference_greedy([prompt], [3]) * 4
    assert [[len(chunk.tokens) for chunk in chunks] for chunks in fed[:3]] == [[16], [5], [1, 1, 1, 1]]
    assert sum(len(chunk.tokens) for chunks in fed for chunk in chunks) == 21 + 3 + 4 * 2  # prefills + decodes
    assert engine.scheduler.pages.hit_tokens == 3 * 20
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_requests_that_begin_alike_share_pages_through_arrivals_and_preemption(program, reference_greedy, rng):
    """Prompts that begin as earlier ones (two shared beginnings of random lengths, random tails),
    arriving at random steps of random budgets in a pool that forces preemption, start after
    their cached pages and give the full-recompute greedy tokens; every page comes back."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    beginnings = [generator.integers(0, 256, 30).tolist() for _ in range(2)]
    prompts = [
        beginnings[i % 2][: int(generator.integers(5, 31))]
        + generator.integers(0, 256, int(generator.integers(0, 8))).tolist()
        for i in range(14)
    ]
    max_tokens = [int(generator.integers(1, 10)) for _ in prompts]
    engine = Engine(program.fresh_copy())
    ids, arriving = [], list(zip(prompts, max_tokens))
    while engine.has_unfinished or arriving:
        if arriving and (not ids or generator.random() < 0.4):
            prompt, count = arriving.pop(0)
            ids.append(engine.add_request(prompt, SamplingParams(max_tokens=count, ignore_eos=True)))
        engine.step(token_budget=int(generator.integers(1, 17)))
    results = [engine.result(i) for i in ids]
    assert [r.tokens for r in results] == reference_greedy(prompts, max_tokens)
    assert engine.scheduler.pages.hit_tokens > 0
    assert engine.scheduler.num_preemptions > 0, "the tiny pool should have forced a preemption"
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_new_weights_empty_the_prefix_cache_and_an_engine_may_go_without_it(program, params, reference_greedy):
    """A prompt served again finds its pages cached, unless it asks for its log-probabilities
    and their rows were never scored, or the weights changed in between (``update_params``: the
    pages hold the old weights' keys and values); ``prefix_caching=False`` shares nothing."""
    prompt, greedy = list(range(40, 53)), SamplingParams(max_tokens=2, ignore_eos=True)
    engine = Engine(program.fresh_copy())
    engine.generate([prompt], greedy)
    engine.generate([prompt], greedy)
    assert engine.scheduler.pages.hit_tokens == 12
    # A request for the prompt's log-probabilities computes every prompt row (keeping their
    # scores with the pages); a second sent with it waits for them and reads them.
    scored = engine.generate([prompt] * 2, SamplingParams(max_tokens=0, prompt_logprobs=True))
    assert len(scored[0].prompt_logprobs) == 12 and scored[1].prompt_logprobs == scored[0].prompt_logprobs
    assert engine.scheduler.pages.hit_tokens == 24
    engine.update_params(jax.tree.map(lambda leaf: leaf * 1.5, params))
    moved = engine.generate([prompt], greedy)
    assert engine.scheduler.pages.hit_tokens == 24
    assert (
        moved[0].tokens
        == Engine(program.fresh_copy(jax.tree.map(lambda leaf: leaf * 1.5, params)))
        .generate([prompt], greedy)[0]
        .tokens
    )
    plain = Engine(program.fresh_copy(), prefix_caching=False)
    assert [r.tokens for r in plain.generate([prompt] * 2, greedy)] == reference_greedy([prompt], [2]) * 2
    assert plain.scheduler.pages.hit_tokens == 0


def test_requests_waiting_for_pages_go_on_when_their_computing_request_is_aborted_or_the_weights_change(
    program, params, reference_greedy, rng
):
    """Three copies of a 30-token prompt, prefilled 4 tokens a step: the first computes it while
    the others wait for its pages. Aborted mid-prompt, it leaves them to compute the rest of the
    prompt (once, the third sharing the second's pages) into the full-recompute greedy tokens. New weights
    mid-prompt (``update_params``) end the wait too: the waiting copy and a copy sent after all
    finished give the new weights' tokens and log-probabilities, never reading the pages the
    first computed partly under the old ones. Every page comes back."""
    prompt = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1))).integers(0, 256, 30).tolist()
    greedy = SamplingParams(max_tokens=4, ignore_eos=True, logprobs=True)

    def run(engine, ids):
        results = {}
        while engine.has_unfinished:
            for event in engine.step(token_budget=8):
                if event.finish_reason is not None:
                    results[event.request_id] = engine.result(event.request_id)
        return [results[i] for i in ids]

    engine = Engine(program.fresh_copy())
    ids = [engine.add_request(prompt, greedy) for _ in range(3)]
    engine.step(token_budget=4)
    engine.step(token_budget=4)
    assert len(engine.scheduler.waiting) == 2  # waiting for the first one's pages
    engine.abort(ids[0])
    assert [r.tokens for r in run(engine, ids[1:])] == reference_greedy([prompt], [4]) * 2
    # The second starts after the aborted one's two full pages, the third after its own seven.
    assert engine.scheduler.pages.hit_tokens == 8 + 28
    assert engine.scheduler.pages.num_free == NUM_PAGES

    moved = jax.tree.map(lambda leaf: leaf * 1.5, params)
    expected = Engine(program.fresh_copy(moved), prefix_caching=False).generate([prompt], greedy)[0]
    engine = Engine(program.fresh_copy())
    ids = [engine.add_request(prompt, greedy) for _ in range(2)]
    engine.step(token_budget=4)
    assert len(engine.scheduler.waiting) == 1
    engine.update_params(moved)
    first, waited = run(engine, ids)
    # The first one's first four tokens' keys and values are the old weights'.
    assert not np.allclose(first.logprobs, expected.logprobs, atol=1e-3)
    assert waited.tokens == expected.tokens and engine.scheduler.pages.hit_tokens == 0
    assert_allclose(waited.logprobs, expected.logprobs, dtype=np.float32)
    (again,) = engine.generate([prompt], greedy)
    assert again.tokens == expected.tokens and engine.scheduler.pages.hit_tokens == 28  # the waited one's pages
    assert_allclose(again.logprobs, expected.logprobs, dtype=np.float32)
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_prefix_caching_gives_the_tokens_and_scores_of_computing_every_prompt(program, rng):
    """Prompts that begin alike, with generated tokens' log-probabilities and alternatives, a
    prompt's scores, sampled and greedy, at random budgets in a pool that forces preemption: an
    engine sharing pages gives what one computing every prompt gives; every page comes back."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    beginning = generator.integers(0, 256, 40).tolist()
    prompts = [
        beginning[: int(generator.integers(2, 30))] + generator.integers(0, 256, int(generator.integers(0, 9))).tolist()
        for _ in range(12)
    ]
    asks = [
        SamplingParams(max_tokens=int(generator.integers(4, 12)), ignore_eos=True, logprobs=True, top_logprobs=3),
        SamplingParams(max_tokens=int(generator.integers(4, 12)), ignore_eos=True, logprobs=True, temperature=0.8),
        SamplingParams(max_tokens=2, ignore_eos=True, logprobs=True, prompt_logprobs=True, top_logprobs=2),
    ] * 4
    served = []
    for prefix_caching in (True, False):
        engine, budgets = Engine(program.fresh_copy(), prefix_caching=prefix_caching), np.random.default_rng(1)
        ids, results = [], {}
        while engine.has_unfinished or len(ids) < len(prompts):
            if len(ids) < len(prompts) and (not ids or budgets.random() < 0.5):
                ids.append(engine.add_request(prompts[len(ids)], asks[len(ids)]))
            for event in engine.step(token_budget=int(budgets.integers(1, 17))):
                if event.finish_reason is not None:
                    results[event.request_id] = engine.result(event.request_id)
        assert engine.scheduler.pages.num_free == NUM_PAGES
        served.append(([results[i] for i in ids], engine.scheduler))
    (cached, scheduler), (computed, _) = served
    assert scheduler.pages.hit_tokens > 0 and scheduler.num_preemptions > 0
    for index, (result, expected) in enumerate(zip(cached, computed)):
        message = f"request {index}"
        assert result.tokens == expected.tokens, message
        assert_allclose(result.logprobs, expected.logprobs, dtype=np.float32, err_msg=message)
        for name in ("top_logprobs", "prompt_top_logprobs"):
            alternatives = [getattr(r, name) or [] for r in (result, expected)]
            assert [[t for t, _ in a] for a in alternatives[0]] == [[t for t, _ in a] for a in alternatives[1]]
        if expected.prompt_logprobs is not None:
            assert_allclose(result.prompt_logprobs, expected.prompt_logprobs, dtype=np.float32, err_msg=message)


def test_continuous_batching_with_random_chunks_and_arrivals_equals_full_recompute(engine, reference_greedy, rng):
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompts, max_tokens, results = run_random_arrivals(engine, generator, MAX_CONTEXT)
    expected = reference_greedy(prompts, max_tokens)
    for index, (result, tokens) in enumerate(zip(results, expected)):
        assert result.tokens == tokens, f"prompt {index} (length {len(prompts[index])})"
    # The near-full prompt stops at the context: 48 - 46 + 1 tokens at most.
    assert len(results[-1].tokens) == min(max_tokens[-1], 3)
    assert engine.scheduler.num_preemptions > 0, "the tiny pool should have forced a preemption"
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_generate_keeps_order_reports_errors_and_decodes_text(engine, reference_greedy, rng):
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    good = random_prompts(generator, 3)
    prompts = [good[0], [], good[1], [5, 300], list(range(MAX_CONTEXT + 1)), "héllo", good[2]]
    results = engine.generate(prompts, SamplingParams(max_tokens=5, ignore_eos=True, logprobs=True))
    errors = [r.error for r in results]
    assert errors[0] is None and errors[2] is None and errors[5] is None and errors[6] is None
    assert "empty" in errors[1]
    assert "300 at index 1" in errors[3]
    assert "49 tokens" in errors[4] and "48" in errors[4]
    text_prompt = list("héllo".encode())
    expected = reference_greedy([good[0], good[1], text_prompt, good[2]], [5] * 4)
    assert [results[i].tokens for i in (0, 2, 5, 6)] == expected
    assert results[5].text == ByteTokenizer().decode(expected[2])
    assert all(len(results[i].logprobs) == 5 and max(results[i].logprobs) <= 0 for i in (0, 2, 5, 6))
    assert results[1].to_json() == {"request_id": -1, "tokens": [], "finish_reason": "error", "error": errors[1]}
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_seeded_sampling_is_the_same_alone_or_in_a_batch(engine, rng):
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompt = random_prompts(generator, 1, 5, 20)[0]
    mine = SamplingParams(
        max_tokens=10, temperature=0.9, top_k=40, top_p=0.95, seed=int(generator.integers(0, 1000)), ignore_eos=True
    )
    alone = engine.generate([prompt], mine)[0].tokens
    others = random_prompts(generator, 5)
    other_params = [SamplingParams(max_tokens=12, temperature=1.2, seed=s, ignore_eos=True) for s in range(5)]
    batch = engine.generate([*others[:3], prompt, *others[3:]], [*other_params[:3], mine, *other_params[3:]])
    assert batch[3].tokens == alone
    # A different seed draws differently (so the check above is not vacuous).
    other_seed = engine.generate([prompt], SamplingParams(**{**mine.__dict__, "seed": mine.seed + 1}))[0].tokens
    assert other_seed != alone


def test_without_a_seed_repeated_prompts_sample_differently_and_reproducibly(program, engine, rng):
    """The default seed was 0 for every request: four copies of a prompt at a temperature
    gave four identical samples."""
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompt = random_prompts(generator, 1, 5, 20)[0]
    unseeded = SamplingParams(max_tokens=8, temperature=1.0, ignore_eos=True)
    samples = [r.tokens for r in engine.generate([prompt] * 4, unseeded)]
    assert len({tuple(tokens) for tokens in samples}) > 1
    again = Engine(program.fresh_copy(), tokenizer=ByteTokenizer())
    assert [r.tokens for r in again.generate([prompt] * 4, unseeded)] == samples


def test_stream_yields_the_generated_tokens_then_the_finish(engine, reference_greedy):
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    events = list(engine.stream(prompts, SamplingParams(max_tokens=4, ignore_eos=True)))
    first_id = events[0].request_id
    expected = reference_greedy(prompts, [4, 4])
    for offset, tokens in enumerate(expected):
        mine = [e for e in events if e.request_id == first_id + offset]
        assert [e.token for e in mine] == tokens
        assert [e.finish_reason for e in mine] == [None] * 3 + ["length"]
    with pytest.raises(ValueError, match="empty"):
        list(engine.stream([[1], []]))


def test_two_streams_consumed_in_turns_each_get_all_their_events(engine, reference_greedy, monkeypatch):
    """Two clients' streams, read in turns: before, a step run for one stream dropped the other's
    events (tokens missing), and a stream whose request finished in the other's step waited
    for its finish forever."""
    prompts, p = [[3, 1, 4, 1, 5], [9, 2, 6]], SamplingParams(max_tokens=4, ignore_eos=True)
    steps, step = [], engine.step
    monkeypatch.setattr(engine, "step", lambda *args: steps.append(1) or step(*args) if len(steps) < 30 else 1 / 0)
    streams = [engine.stream([prompt], p) for prompt in prompts]
    events = [[], []]
    while any(not mine or mine[-1].finish_reason is None for mine in events):
        for stream, mine in zip(streams, events):
            if not mine or mine[-1].finish_reason is None:
                mine.append(next(stream))
    assert [[e.token for e in mine] for mine in events] == reference_greedy(prompts, [4, 4])
    for stream in streams:
        stream.close()
    assert not engine.has_unfinished and engine._queues == {}


def test_a_rejected_or_abandoned_request_leaves_nothing_queued(program, engine, reference_greedy):
    """Every request is checked before any is queued, and a stream closed early aborts its own."""
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    with pytest.raises(
        ValueError,
        match=r"unknown adapter 'nope'; this engine's adapters: none \(.*Engine.from_model\(\.\.\., adapters=",
    ):
        list(engine.stream([[1, 2], [3, 4]], [p, SamplingParams(adapter="nope")]))
    assert not engine.has_unfinished
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        list(Engine(program.fresh_copy()).stream([[1, 2], [3, 4]], [p, SamplingParams(stop=["ab"])]))
    # A dict of fields for SamplingParams: before, its keys were taken for params ('str' object has no attribute)
    with pytest.raises(ValueError, match="params must be a SamplingParams or a list of them, got dict"):
        engine.generate([[1, 2]], {"max_tokens": 3})
    with pytest.raises(ValueError, match=r"params must be SamplingParams .*, got a dict"):
        engine.generate([[1, 2]], [{"max_tokens": 3}])
    results = engine.generate([[1, 2], 5], p)
    assert results[1].error == "a prompt is a string or a list of token ids, got int"
    assert results[0].tokens == reference_greedy([[1, 2]], [3])[0] and not engine.has_unfinished

    stream = engine.stream([[1, 2], [3, 4]], SamplingParams(max_tokens=8, ignore_eos=True))
    next(stream)
    stream.close()
    assert not engine.has_unfinished and engine.scheduler.pages.num_free == NUM_PAGES
    assert engine.generate([[9]], p)[0].tokens == reference_greedy([[9]], [3])[0]


def test_a_request_aborted_mid_stream_ends_the_stream_for_it(engine, reference_greedy):
    """A consumer that aborts one of its stream's requests gets the others' events, and the
    stream ends once they finish (it does not wait on the aborted one)."""
    step = engine.step

    def checked_step(*args, **kwargs):
        assert engine.has_unfinished, "the stream stepped an engine with nothing left to run (forever)"
        return step(*args, **kwargs)

    engine.step = checked_step
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6]]
    events = []
    for event in engine.stream(prompts, SamplingParams(max_tokens=4, ignore_eos=True)):
        events.append(event)
        if len(events) == 1:
            engine.abort(event.request_id)
    aborted = events[0].request_id
    rest = [e for e in events[1:] if e.request_id != aborted]
    assert [e.token for e in rest] == reference_greedy(prompts[1:], [4])[0]
    assert rest[-1].finish_reason == "length" and len(rest) == len(events) - 1
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_a_step_moves_nothing_implicitly_between_host_and_device(engine):
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    with jax.transfer_guard("disallow"):
        while engine.has_unfinished:
            engine.step()
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_stop_token_sequences_and_stop_strings_end_the_output(engine, reference_greedy, rng):
    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    prompt = random_prompts(generator, 1, 4, 12)[0]
    greedy = reference_greedy([prompt], [10])[0]
    stop = (greedy[3], greedy[4])
    # The output ends before the first occurrence of the stop pair, which is not part of it.
    first = next(i for i in range(len(greedy) - 1) if (greedy[i], greedy[i + 1]) == stop)
    result = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(stop,)))[0]
    assert result.tokens == greedy[:first] and result.finish_reason == "stop"
    # Stop strings become token sequences through the tokenizer (bytes here).
    request_id = engine.add_request(prompt, SamplingParams(max_tokens=1, stop=("ab", "é")))
    queued = next(r for r in engine.scheduler.waiting if r.request_id == request_id)
    assert queued.stop_sequences == ((97, 98), (0xC3, 0xA9))
    list(engine.run_until_done([request_id]))
    engine.result(request_id)
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_every_eos_id_ends_a_request(program, reference_greedy, rng):
    """Several end-of-sequence ids (Llama-3-Instruct has three): the first generated ends it."""
    prompt, greedy = random_prompt_and_greedy(reference_greedy, rng)
    eos = greedy[3]
    engine = Engine(program.fresh_copy(), tokenizer=ByteTokenizer(), eos_id=[ByteTokenizer.eos_id, eos])
    assert engine.eos_ids == (ByteTokenizer.eos_id, eos)
    result = engine.generate([prompt], SamplingParams(max_tokens=10))[0]
    end = next(i for i, t in enumerate(greedy) if t in engine.eos_ids)
    assert result.tokens == greedy[:end] and result.finish_reason == "stop" and result.eos_token == greedy[end]
    # One id still works as before.
    assert Engine(program.fresh_copy(), eos_id=eos).eos_ids == (eos,)


def word_tokenizer(directory):
    """``(words, tokenizer)``: a Llama-style Hugging Face tokenizer (it prepends BOS) of one word
    per id of the tiny model's vocabulary, written to ``directory``."""
    words = [*WORDS, *(f"w{i}" for i in range(len(WORDS), CONFIG.vocab_size))]
    write_tokenizer(directory, words)
    return words, load_hf_tokenizer(directory)


def random_prompt_and_greedy(reference_greedy, rng, max_tokens=10):
    """A random prompt and its ``max_tokens`` greedy continuation."""
    prompt = random_prompts(np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1))), 1, 4, 12)[0]
    return prompt, reference_greedy([prompt], [max_tokens])[0]


def test_stop_strings_match_without_the_bos_an_hf_tokenizer_adds(program, reference_greedy, rng, tmp_path):
    """A Llama-style tokenizer prepends BOS to what it encodes; a stop string is matched without it."""
    words, tokenizer = word_tokenizer(tmp_path)
    engine = Engine(program.fresh_copy(), tokenizer=tokenizer)
    prompt, greedy = random_prompt_and_greedy(reference_greedy, rng)
    stop = next(t for t in greedy[2:] if t not in (tokenizer.bos_id, tokenizer.eos_id, 0))  # a word's token
    assert tokenizer.encode(words[stop]).tolist() == [BOS, stop]
    result = engine.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True, stop=[words[stop]]))[0]
    assert result.tokens == greedy[: greedy.index(stop)] and result.finish_reason == "stop"
    assert result.text == tokenizer.decode(result.tokens)


def test_a_stop_string_ends_the_output_however_the_tokens_split_its_text(program, reference_greedy, rng, tmp_path):
    """Stop strings inside a word and across two: their own encodings (``<unk>``) are never
    written by the model (as a BPE model writes " world" as one token, not the tokens of
    "world"). Before, such requests ran to max_tokens; now each stops before the token where
    its string starts (a stop string starting inside a token takes that token with it)."""
    words, tokenizer = word_tokenizer(tmp_path)
    engine = Engine(program.fresh_copy(), tokenizer=tokenizer)
    prompt, greedy = random_prompt_and_greedy(reference_greedy, rng)
    first, second = (words[t] for t in greedy[3:5])
    assert min(greedy[3:5]) > BOS + 1, "special tokens decode to nothing"
    text = tokenizer.decode(greedy)
    for stop in (first[1:], f" {second[:2]}"):  # "ow" of "cow"; " sa" of "cow say"
        # the tokens whose text ends before the stop string starts
        kept = max(j for j in range(len(greedy) + 1) if len(tokenizer.decode(greedy[:j])) <= text.index(stop))
        params = SamplingParams(max_tokens=10, ignore_eos=True, stop=["never written", stop], logprobs=True)
        result = engine.generate([prompt], params)[0]
        assert (result.tokens, result.finish_reason, len(result.logprobs)) == (greedy[:kept], "stop", kept), stop
        assert stop not in result.text
    assert engine.scheduler.pages.num_free == NUM_PAGES


def test_text_that_is_not_unicode_is_one_request_s_error(program, reference_greedy, tmp_path):
    """A lone surrogate (what JSON's ``"\\ud800"`` decodes to) in a prompt or a stop string is
    that request's error; a Hugging Face tokenizer raises ``TypeError`` on it, which took the
    whole batch down."""
    engine = Engine(program.fresh_copy(), tokenizer=word_tokenizer(tmp_path)[1])
    p = SamplingParams(max_tokens=3, ignore_eos=True)
    results = engine.generate(
        ["what \ud800", [5, 6, 7], [5, 6]], [p, p, SamplingParams(**{**p.__dict__, "stop": ("a\udfff",)})]
    )
    assert results[0].error == "the prompt is not valid Unicode text: it holds a lone surrogate U+D800 at index 5"
    assert results[2].error == "a stop string is not valid Unicode text: it holds a lone surrogate U+DFFF at index 1"
    assert results[1].tokens == reference_greedy([[5, 6, 7]], [3])[0]


def test_updated_weights_serve_like_a_fresh_engine_without_recompiling(program, params, rng):
    """``Engine.update_params`` (GRPO's weight sync): after replacing part of the weights, greedy
    output equals a fresh engine built on the new weights, and nothing compiles."""
    import flax.linen as nn

    from ember.core.sharding import box_like
    from ember.core.tree import param_paths, tree_from_paths

    flat = param_paths(nn.unbox(params))
    keys = jax.random.split(rng, len(flat))
    moved = {p: v + 0.3 * jax.random.normal(k, v.shape, v.dtype) for (p, v), k in zip(flat.items(), keys)}
    updates = tree_from_paths({p: v for p, v in moved.items() if "attn" in p or "mlp" in p})
    new_params = box_like(tree_from_paths({**flat, **param_paths(updates)}), params)
    # As a trainer holds them: replicated over every device (one of which holds the engine's).
    replicated = jax.sharding.NamedSharding(jax.make_mesh((jax.device_count(),), ("data",)), jax.P())
    updates = jax.device_put(updates, replicated)
    prompts = random_prompts(np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1))), 4)
    settings = SamplingParams(max_tokens=6, ignore_eos=True)

    engine = Engine(program.fresh_copy(), tokenizer=ByteTokenizer())
    before = [r.tokens for r in engine.generate(prompts, settings)]
    compiles = []
    listener = lambda event, *_args, **_kw: compiles.append(event) if "compile" in event else None  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        engine.update_params(updates)
        after = [r.tokens for r in engine.generate(prompts, settings)]
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    assert compiles == []
    fresh = Engine(program.fresh_copy(new_params), tokenizer=ByteTokenizer())
    assert after == [r.tokens for r in fresh.generate(prompts, settings)]
    assert after != before, "the perturbed weights should change some greedy token"
    # The engine holds copies: deleting (donating) the caller's arrays leaves it serving.
    jax.tree.map(lambda x: x.delete(), updates)
    assert [r.tokens for r in engine.generate(prompts, settings)] == after

    with pytest.raises(ValueError, match="'layers/nope' is not one of the served weights"):
        engine.update_params({"layers": {"nope": jnp.zeros(3)}})
    path = next(p for p in flat if p.endswith("kernel"))
    bad = tree_from_paths({path: jnp.zeros((3,), flat[path].dtype)})
    with pytest.raises(ValueError, match=f"weight '{path}' is float32\\[3\\]; the steps were compiled for"):
        engine.update_params(bad)


def test_a_tensor_parallel_engine_serves_the_single_device_engine_s_tokens_and_logprobs(mesh_program, program, rng):
    """Split over a tensor=2 mesh (``build_program(..., mesh=...)``), the engine gives the
    single-device engine's greedy and sampled tokens and their log-probabilities, and the
    donated cache comes back from every step in the shards it went in."""
    engine = Engine(mesh_program.fresh_copy())
    seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
    assert_serves_alike(engine, Engine(program.fresh_copy()), seed, MAX_CONTEXT, max_budget=16)
    placed = lambda tree: jax.tree.map(lambda leaf: leaf.sharding, tree)  # noqa: E731
    assert placed(engine.program.kv) == placed(mesh_program.kv)
    # Its scoring step too: prompt log-probabilities and alternatives, the cache left in its shards.
    prompts = random_prompts(np.random.default_rng(seed), 2, low=20)
    asks = SamplingParams(max_tokens=2, ignore_eos=True, logprobs=True, prompt_logprobs=True, top_logprobs=2)
    split, single = (e.generate(prompts, asks) for e in (engine, Engine(program.fresh_copy())))
    for result, want in zip(split, single):
        assert result.tokens == want.tokens
        assert [[t for t, _ in a] for a in result.prompt_top_logprobs + result.top_logprobs] == [
            [t for t, _ in a] for a in want.prompt_top_logprobs + want.top_logprobs
        ]
        assert_allclose(
            result.prompt_logprobs + result.logprobs, want.prompt_logprobs + want.logprobs, dtype=np.float32
        )
    assert placed(engine.program.kv) == placed(mesh_program.kv)


def test_a_tensor_parallel_step_gathers_no_weight_nor_page_and_each_device_holds_its_share(mesh_program):
    """On the mesh every device holds half of the heads' weights and of the pages, and the step
    moves no weight and no page between devices: its only collectives are the all-reduces of the
    row-parallel projections' ``[1, tokens, embed]`` partial sums (the attention output's and the
    MLP's, once per scanned layer). Without the per-shard ragged attention, the Pallas kernel's
    operands, the pages among them, were gathered whole onto both devices."""
    found = collectives(mesh_program.steps[16])
    assert found and all(op == "all-reduce" and result.startswith("f32[1,16,64]") for result, op in found), found
    weights = mesh_program.params["layers"]["block_0"]
    page_shape = mesh_program.kv["block_0"]["k_pages"].shape  # [groups, pages, page_size, kv_heads, head_dim]
    for array, whole, dim in (
        (weights["attn"]["q"]["kernel"], weights["attn"]["q"]["kernel"].shape, 2),  # [groups, embed, heads, dim]
        (weights["mlp"]["up"], weights["mlp"]["up"].shape, 2),  # [groups, embed, mlp]
        (mesh_program.kv["block_0"]["k_pages"], page_shape, 3),
    ):
        half = tuple(size // 2 if axis == dim else size for axis, size in enumerate(whole))
        assert [shard.data.shape for shard in array.addressable_shards] == [half, half]


def test_updated_weights_on_a_mesh_keep_their_shards_and_serve_like_the_single_device(
    mesh_program, program, params, rng
):
    """``update_params`` on a tensor-parallel engine puts each new weight in the shards of the
    one it replaces, and the outputs change as the single-device engine's do."""
    from ember.core.tree import param_paths, tree_from_paths

    generator = np.random.default_rng(int(jax.random.randint(rng, (), 0, 2**31 - 1)))
    flat = param_paths(nn.unbox(params))
    updates = tree_from_paths(
        {p: v + 0.3 * generator.standard_normal(v.shape).astype(v.dtype) for p, v in flat.items() if "attn" in p}
    )
    engines = Engine(mesh_program.fresh_copy()), Engine(program.fresh_copy())
    shardings = jax.tree.map(lambda leaf: leaf.sharding, engines[0].program.params)
    prompts, settings = random_prompts(generator, 3), SamplingParams(max_tokens=6, ignore_eos=True, logprobs=True)
    before = engines[0].generate(prompts, settings)
    for engine in engines:
        engine.update_params(updates)
    assert jax.tree.map(lambda leaf: leaf.sharding, engines[0].program.params) == shardings
    after, expected = (engine.generate(prompts, settings) for engine in engines)
    assert [r.tokens for r in after] == [r.tokens for r in expected] != [r.tokens for r in before]
    assert_allclose([r.logprobs for r in after], [r.logprobs for r in expected], dtype=np.float32)


def test_a_mesh_that_splits_the_batch_or_a_dense_model_s_experts_is_refused(params):
    """One engine splits only the model: a data (or fsdp) axis of more than one device is a
    ConfigError naming it (data: replicas of the engine are ``ember.serving.replicas``), before
    anything compiles; so is an expert axis for a model without MoE layers (every device would
    hold and compute the same)."""
    mesh = make_mesh(MeshConfig(data=2, tensor=2), jax.devices()[:4])
    with pytest.raises(ConfigError, match=r"mesh.data=2: one engine splits only the model.*serving.replicas") as error:
        build_program(CONFIG, params, num_slots=4, token_budget=8, mesh=mesh)
    assert error.value.key == "mesh.data"
    with pytest.raises(ConfigError, match=r"mesh.expert=2: the model has no mixture-of-experts layer") as error:
        build_program(CONFIG, params, num_slots=4, token_budget=8, mesh=serving_mesh(MeshConfig(data=1, expert=2)))
    assert error.value.key == "mesh.expert"


@pytest.fixture(scope="module")
def int4_params(params):
    """``params`` stored int4, 32 rows per scale."""
    # Jitted: one program for the tree, not one per weight shape.
    return jax.jit(quantize_params, static_argnums=1)(params, QuantizeConfig(format="int4", group_size=32))


@pytest.fixture(scope="module")
def int4_programs(int4_params, tmp_path_factory):
    """``int4_params`` compiled for one device (as ``program``) and split over a tensor=2 mesh
    (as ``mesh_program``); one bucket each."""
    quantized = int4_params
    options = dict(num_slots=4, token_buckets=(16,), max_context=MAX_CONTEXT, num_pages=NUM_PAGES)
    mesh, config = serving_mesh(MeshConfig(data=1, tensor=2)), dataclasses.replace(CONFIG, attention_impl="interpret")
    with one_at_a_time(tmp_path_factory, "serving-engine-int4-programs"):
        return build_program(CONFIG, quantized, **options), build_program(config, quantized, mesh=mesh, **options)


def test_a_quantized_model_on_a_mesh_keeps_its_codes_split_and_serves_the_single_device_s_tokens(int4_programs, rng):
    """A quantized weight's stored parts (codes, scales) are placed by the logical axes the
    quantized layout implies, not replicated: each device holds half of each projection's
    codes and scales, the step gathers none of them (its quantized matmuls run per shard), and
    the engine serves the single-device engine's greedy and sampled tokens and logprobs. Before,
    the parts' shapes matched no weight of the model's init, and every device held them whole."""
    program, mesh_program = int4_programs
    weights = mesh_program.params["layers"]["block_0"]
    # Parts [groups, K rows, *out]: q and up split by their columns (heads, mlp), o and down by their rows.
    split = ((weights["attn"]["q"]["kernel"], 2), (weights["mlp"]["up"], 2))
    for stored, dim in (*split, (weights["attn"]["o"]["kernel"], 1), (weights["mlp"]["down"], 1)):
        for part in stored.values():
            half = tuple(size // 2 if axis == dim else size for axis, size in enumerate(part.shape))
            assert [shard.data.shape for shard in part.addressable_shards] == [half, half]
    found = collectives(mesh_program.steps[16])
    assert found and all(op == "all-reduce" and result.startswith("f32[1,16,64]") for result, op in found), found
    seed = int(jax.random.randint(rng, (), 0, 2**31 - 1))
    assert_serves_alike(Engine(mesh_program.fresh_copy()), Engine(program.fresh_copy()), seed, MAX_CONTEXT, 16)


def test_a_quantized_weights_parts_split_their_rows_alike_or_not_at_all(int4_params):
    """On tensor=4, ``o``'s 64 input rows in groups of 32 give 2 scale rows, which four devices
    cannot split: its codes' 32 (packed) rows stay whole too, where they were split four ways
    beside whole scales (the per-shard quantized matmul then split neither: the step gathered the
    codes). ``down``'s 128 rows (4 scale rows) split four
    ways in every part; ``q``'s columns (4 heads) split in every part. Placement only: nothing compiles."""
    params = unbox(int4_params)
    kv = jax.eval_shape(lambda: init_cache_layers(CONFIG, 4, NUM_PAGES))
    placement = step_placement(CONFIG, params, kv, serving_mesh(MeshConfig(data=1, tensor=4)))
    block = placement.params["layers"]["block_0"]

    def split_dims(stored):  # {part: the dimensions the tensor axis splits}
        return {key: [d for d, axes in enumerate(part.spec) if "tensor" in str(axes)] for key, part in stored.items()}

    assert split_dims(block["attn"]["o"]["kernel"]) == {"int4": [], "scales": []}
    assert split_dims(block["mlp"]["down"]) == {"int4": [1], "scales": [1]}
    assert split_dims(block["attn"]["q"]["kernel"]) == {"int4": [2], "scales": [2]}
