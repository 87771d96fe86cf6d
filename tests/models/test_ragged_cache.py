"""A ragged cache (a serving step's flat token budget) gives the logits of one uncached pass:
three sequences advance by random chunks, prefill and decode mixed in each step, their
runs packed in random order with padding between them, over a shuffled page table."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.models.cache import init_cache
from ember.models.decoder import DecoderLM
from tests.host_random import numpy_rng
from tests.models.test_cache import make
from tests.tolerances import assert_allclose

SEQS, SEQ, PROMPT, CHUNK, BUDGET = 3, 20, 11, 5, 16


def ragged_steps(generator):
    """Per step, per sequence, the number of new tokens (0: sits out): chunks of up to
    ``CHUNK`` until ``PROMPT``, then one token per step."""
    done = [0] * SEQS
    steps = []
    while min(done) < SEQ:
        step = []
        for s in range(SEQS):
            if done[s] >= SEQ or generator.random() < 0.2:
                step.append(0)
            else:
                step.append(1 if done[s] >= PROMPT else int(generator.integers(1, min(CHUNK, PROMPT - done[s]) + 1)))
            done[s] += step[-1]
        steps.append(step)
    return steps


def pack(generator, counts):
    """``query_starts`` of runs of ``counts`` in a random order with random gaps (<= BUDGET)."""
    starts, offset = [0] * SEQS, 0
    spare = BUDGET - sum(counts)
    for s in generator.permutation(SEQS):
        gap = int(generator.integers(0, spare + 1))
        spare -= gap
        offset += gap
        starts[s] = offset
        offset += counts[s]
    return starts


@pytest.mark.parametrize("name", ["global", "block_sparse", "sigmoid"])
def test_ragged_steps_equal_the_full_pass(name, rng):
    config = make(name)
    model = DecoderLM(config)
    init_rng, token_rng, plan_rng = jax.random.split(rng, 3)
    tokens = jax.random.randint(token_rng, (SEQS, SEQ), 0, config.vocab_size)
    params = jax.jit(model.init)(init_rng, tokens)["params"]
    expected, _ = jax.jit(model.apply)({"params": params}, tokens)

    generator = numpy_rng(plan_rng)
    cache = init_cache(config, batch=SEQS, max_len=SEQ)
    shuffled = generator.permutation(cache["page_table"].size).reshape(cache["page_table"].shape)
    ragged = {"page_table": jnp.asarray(shuffled, jnp.int32), "layers": cache["layers"]}
    apply = jax.jit(model.apply)
    host_tokens = np.asarray(tokens)
    got = np.zeros(expected.shape, np.float32)
    done = [0] * SEQS
    for counts in ragged_steps(generator):
        starts = pack(generator, counts)
        flat = np.zeros(BUDGET, np.int32)
        for s in range(SEQS):
            flat[starts[s] : starts[s] + counts[s]] = host_tokens[s, done[s] : done[s] + counts[s]]
        kv_lens = [done[s] + counts[s] for s in range(SEQS)]
        ragged = {**ragged, **{name: jnp.asarray(v, jnp.int32) for name, v in
                               (("query_starts", starts), ("query_lens", counts), ("kv_lens", kv_lens))}}
        logits, ragged = apply({"params": params}, jnp.asarray(flat)[None], cache=ragged)
        for s in range(SEQS):
            got[s, done[s] : kv_lens[s]] = np.asarray(logits[0, starts[s] : starts[s] + counts[s]], np.float32)
        done = kv_lens
    assert_allclose(got, expected, scale=10)

    # logits_at computes the head only where asked: the last token of each run.
    last = jnp.asarray([starts[s] + counts[s] - 1 for s in range(SEQS)], jnp.int32)
    # (Running the last step again rewrites the same keys and values.)
    selected, _ = apply({"params": params}, jnp.asarray(flat)[None], cache=ragged, logits_at=last[None])
    assert_allclose(selected[0], logits[0, last])


def test_ragged_cache_rejects_state_layers_and_positions(rng):
    tokens = jnp.ones((1, 4), jnp.int32)
    metadata = {name: jnp.zeros((1,), jnp.int32) for name in ("query_starts", "query_lens", "kv_lens")}
    config = make("mixed_unscanned")
    model = DecoderLM(config)
    params = jax.jit(model.init)(rng, tokens)["params"]
    cache = init_cache(config, batch=1, max_len=8)
    with pytest.raises(ValueError, match="softmax-attention layers .* cca, linear"):
        model.apply({"params": params}, tokens, cache={**cache, **metadata})
    config = make("global")
    model = DecoderLM(config)
    params = jax.jit(model.init)(rng, tokens)["params"]
    cache = {**init_cache(config, batch=1, max_len=8), **metadata}
    with pytest.raises(ValueError, match=r"tokens \[1, num_tokens\]"):
        model.apply({"params": params}, tokens, cache=cache, positions=jnp.zeros((1, 4), jnp.int32))
