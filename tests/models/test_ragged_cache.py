"""A ragged cache (a serving step's flat token budget) gives the logits of one uncached pass,
for every layer kind: three sequences advance by random chunks, prefill and decode mixed in
each step, their runs packed in random order with padding between them, over a shuffled
page table and a shuffled assignment of sequences to state slots; a slot that held an
earlier sequence is reused without a reset."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.models.cache import init_cache_layers
from ember.models.config import LAYER_KINDS
from ember.models.decoder import DecoderLM
from tests.host_random import numpy_rng, perturbed
from tests.models.test_cache import KINDS, make
from tests.tolerances import assert_allclose

SEQS, SLOTS, SEQ, PROMPT, CHUNK, BUDGET = 3, 4, 20, 11, 5, 16


def test_every_layer_kind_is_covered():
    assert set(LAYER_KINDS) <= {kind for name in KINDS for kind in make(name).block_pattern}


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
    starts, offset = [0] * len(counts), 0
    spare = BUDGET - sum(counts)
    for s in generator.permutation(len(counts)):
        gap = int(generator.integers(0, spare + 1))
        spare -= gap
        offset += gap
        starts[s] = offset
        offset += counts[s]
    return starts


def run_step(apply, params, cache, flat_tokens, runs):
    """One ragged call; ``runs`` maps slot -> (start, count, kv_len). Returns (logits [BUDGET, vocab], cache)."""
    metadata = {name: np.zeros(SLOTS, np.int32) for name in ("query_starts", "query_lens", "kv_lens")}
    for slot, (start, count, kv_len) in runs.items():
        metadata["query_starts"][slot], metadata["query_lens"][slot], metadata["kv_lens"][slot] = start, count, kv_len
    cache = {**cache, **{name: jnp.asarray(value) for name, value in metadata.items()}}
    logits, cache = apply({"params": params}, jnp.asarray(flat_tokens)[None], cache=cache)
    return logits[0], cache


@pytest.mark.parametrize("name", sorted(KINDS))
def test_ragged_steps_equal_the_full_pass(name, rng):
    config = make(name)
    model = DecoderLM(config)
    init_rng, token_rng, plan_rng, noise_rng = jax.random.split(rng, 4)
    tokens = jax.random.randint(token_rng, (SEQS + 1, SEQ), 0, config.vocab_size)
    params = perturbed(jax.jit(model.init)(init_rng, tokens)["params"], noise_rng)
    expected, _ = jax.jit(model.apply)({"params": params}, tokens)

    generator = numpy_rng(plan_rng)
    pages_per_seq = -(-SEQ // config.page_size)
    table = generator.permutation(SLOTS * pages_per_seq).reshape(SLOTS, pages_per_seq)
    slots = generator.permutation(SLOTS)[:SEQS]
    layers = init_cache_layers(config, SLOTS, SLOTS * pages_per_seq)
    cache = {"page_table": jnp.asarray(table, jnp.int32), "layers": layers}
    apply = jax.jit(model.apply)
    host_tokens = np.asarray(tokens)
    # An earlier sequence (the last row) fills the slots first, so every state slot is dirty.
    stale = {int(slot): (0, PROMPT // 2, PROMPT // 2) for slot in slots}
    flat = np.zeros(BUDGET, np.int32)
    for slot in slots:
        flat[stale[slot][0] : stale[slot][1]] = host_tokens[SEQS, : PROMPT // 2]
        _, cache = run_step(apply, params, cache, flat, {int(slot): stale[int(slot)]})

    got = np.zeros(expected.shape, np.float32)[:SEQS]
    done = [0] * SEQS
    for counts in ragged_steps(generator):
        starts = pack(generator, counts)
        flat = np.zeros(BUDGET, np.int32)
        for s in range(SEQS):
            flat[starts[s] : starts[s] + counts[s]] = host_tokens[s, done[s] : done[s] + counts[s]]
        kv_lens = [done[s] + counts[s] for s in range(SEQS)]
        runs = {int(slots[s]): (starts[s], counts[s], kv_lens[s]) for s in range(SEQS) if counts[s]}
        logits, cache = run_step(apply, params, cache, flat, runs)
        for s in range(SEQS):
            got[s, done[s] : kv_lens[s]] = np.asarray(logits[starts[s] : starts[s] + counts[s]], np.float32)
        done = kv_lens
    assert_allclose(got, expected[:SEQS], scale=10)


def test_logits_at_computes_the_head_only_where_asked(rng):
    config = make("global")
    model = DecoderLM(config)
    tokens = jax.random.randint(rng, (1, BUDGET), 0, config.vocab_size)
    params = jax.jit(model.init)(rng, tokens)["params"]
    cache = {
        "page_table": jnp.arange(SLOTS * 4, dtype=jnp.int32).reshape(SLOTS, 4),
        "query_starts": jnp.asarray([0, 5, 9, 0], jnp.int32),
        "query_lens": jnp.asarray([5, 4, 7, 0], jnp.int32),
        "kv_lens": jnp.asarray([5, 4, 7, 0], jnp.int32),
        "layers": init_cache_layers(config, SLOTS, SLOTS * 4),
    }
    apply = jax.jit(model.apply)
    logits, _ = apply({"params": params}, tokens, cache=cache)
    last = jnp.asarray([[4, 8, 15]], jnp.int32)
    selected, _ = apply({"params": params}, tokens, cache=cache, logits_at=last)
    assert_allclose(selected[0], logits[0, last[0]])


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unrolled"])
def test_a_step_writes_the_pages_in_place(scan_layers):
    """A step writes its tokens' keys and values into the pages where they lie, and the
    attention reads them there: the compiled step needs less scratch memory than a quarter of
    one layer's pages. (When each layer's pages were sliced out of the stacked cache and put
    back, the step copied all of them, twice, in either layer layout.)"""
    config = dataclasses.replace(make("global"), scan_layers=scan_layers)
    model = DecoderLM(config)
    tokens = jax.ShapeDtypeStruct((1, BUDGET), jnp.int32)
    params = jax.eval_shape(model.init, jax.random.key(0), tokens)["params"]
    num_pages = 4096
    layers = jax.eval_shape(lambda: init_cache_layers(config, SLOTS, num_pages))
    cache = {
        "page_table": jax.ShapeDtypeStruct((SLOTS, 8), jnp.int32),
        **{name: jax.ShapeDtypeStruct((SLOTS,), jnp.int32) for name in ("query_starts", "query_lens", "kv_lens")},
        "layers": layers,
    }
    step = jax.jit(lambda params, tokens, cache: model.apply({"params": params}, tokens, cache=cache), donate_argnums=2)
    scratch = step.lower(params, tokens, cache).compile().memory_analysis().temp_size_in_bytes
    one_layer = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(layers)) // config.num_layers
    assert scratch < one_layer / 4, (scratch, one_layer)


def test_ragged_cache_rejects_positions_and_segment_ids(rng):
    tokens = jnp.ones((1, 4), jnp.int32)
    metadata = {name: jnp.zeros((1,), jnp.int32) for name in ("query_starts", "query_lens", "kv_lens")}
    config = make("global")
    model = DecoderLM(config)
    params = jax.jit(model.init)(rng, tokens)["params"]
    cache = {"page_table": jnp.zeros((1, 2), jnp.int32), "layers": init_cache_layers(config, 1, 2), **metadata}
    with pytest.raises(ValueError, match=r"tokens \[1, num_tokens\]"):
        model.apply({"params": params}, tokens, cache=cache, positions=jnp.zeros((1, 4), jnp.int32))
    with pytest.raises(ValueError, match=r"tokens \[1, num_tokens\]"):
        model.apply({"params": params}, jnp.ones((2, 4), jnp.int32), cache=cache)
