"""Serving models whose layers keep an O(1) state slot per sequence (``STATE_KINDS``) beside
the paged KV cache: a tiny random hybrid of every state kind interleaved with global and
local attention, served with continuous batching, random chunked prefill, mid-flight
arrivals and preemption, equals a full-recompute greedy loop; so does its exported artifact.
Every other layer's MLP is a mixture of experts, so hybrids with MoE MLPs serve in the same program.
State slots are donated like the pages; a preempted sequence restarts its state from
position 0 whatever its slot holds.

One program (and one artifact) per module; each test's engine runs on a fresh cache.
A new state kind is one more entry of ``STATE_KINDS`` (plus its settings in ``CONFIG``)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.sharding import MeshConfig
from ember.core.tokenizer import ByteTokenizer
from ember.models.cache import init_cache_layers
from ember.models.config import ModelConfig, MoEConfig, SSMConfig
from ember.serving.engine import Engine
from ember.serving.export import export_program, load_artifact
from ember.serving.mesh import serving_mesh
from ember.serving.model_program import build_program
from ember.serving.requests import SamplingParams
from tests.collectives import collectives
from tests.host_random import numpy_rng
from tests.once_per_session import one_at_a_time
from tests.serving.greedy_reference import greedy_reference, log_prob_reference
from tests.serving.random_weights import random_weights
from tests.serving.random_workload import assert_serves_alike, run_random_arrivals
from tests.tolerances import assert_allclose

STATE_KINDS = ("linear", "cca", "mamba2")
"""Layer kinds with a per-sequence state slot in the ragged cache (``ember.models.cache``)."""
HYBRID_PATTERN = tuple(itertools.chain(*zip(STATE_KINDS, itertools.cycle(("global", "local")))))
"""Each state kind followed by an attention layer: ``(linear, global, cca, local, mamba2, global)``."""

MAX_CONTEXT = 48
NUM_PAGES = 16  # 12 pages hold one full sequence; 4 slots would want 48: preemption happens.
NUM_SLOTS = 4
BUCKETS = (16,)
REFERENCE_BATCH = 15  # every reference call runs this many rows: the loop compiles once
CONFIG = ModelConfig(
    vocab_size=257,
    d_model=64,
    num_layers=2 * len(HYBRID_PATTERN),  # two scanned groups
    num_heads=4,
    num_kv_heads=2,
    mlp_dim=96,
    page_size=4,
    max_seq_len=MAX_CONTEXT,
    block_pattern=HYBRID_PATTERN,
    mlp_pattern=("moe", "dense"),
    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=32),
    moe_impl="xla",
    sliding_window=6,  # local layers see less than a prompt
    cca_compression=2,
    cca_heads=2,
    cca_kv_heads=1,
    cca_conv_width=3,
    ssm=SSMConfig(state_size=8, head_dim=16, conv_kernel=3, chunk_size=8),
    attention_impl="xla",
)


@pytest.fixture(scope="module")
def params():
    return random_weights(CONFIG, seed=20261123, spread=0.1)


@pytest.fixture(scope="module")
def program(params, tmp_path_factory):
    with one_at_a_time(tmp_path_factory, "state-serving-program"):  # compiled once per session
        return build_program(
            CONFIG, params, num_slots=NUM_SLOTS, token_buckets=BUCKETS, max_context=MAX_CONTEXT, num_pages=NUM_PAGES
        )


@pytest.fixture(scope="module")
def mesh_program(params, tmp_path_factory):
    """``program`` split over an expert=2 x tensor=4 mesh: four query heads and the recurrent
    states' heads split four ways; the two key heads' pages (and CCA's one) whole on every
    device; the four experts of each MoE layer two per device pair, their columns four ways."""
    with one_at_a_time(tmp_path_factory, "state-serving-mesh-program"):
        return build_program(
            CONFIG,
            params,
            num_slots=NUM_SLOTS,
            token_buckets=BUCKETS,
            max_context=MAX_CONTEXT,
            num_pages=NUM_PAGES,
            mesh=serving_mesh(MeshConfig(data=1, expert=2, tensor=4)),
        )


@pytest.fixture(scope="module")
def reference(params):
    """``(prompts, max_tokens) -> token lists`` of the full-recompute greedy loop, in batches
    padded to ``REFERENCE_BATCH`` rows (repeats of the first prompt) so it compiles once."""
    run = greedy_reference(CONFIG, params, MAX_CONTEXT)

    def padded(prompts, max_tokens):
        fill = REFERENCE_BATCH - len(prompts)
        return run([*prompts, *[prompts[0]] * fill], [*max_tokens, *[max_tokens[0]] * fill])[: len(prompts)]

    return padded


def state_blocks(kind):
    """Names of the cache entries (``block_<j>``) of the layers of ``kind``."""
    return [f"block_{j}" for j, k in enumerate(CONFIG.layer_kinds[: CONFIG.layer_period]) if k == kind]


def assert_serves_like_full_recompute(program, reference, rng):
    engine = Engine(program.fresh_copy(), tokenizer=ByteTokenizer())
    first_cache = engine.program.kv
    prompts, max_tokens, results = run_random_arrivals(engine, numpy_rng(rng), MAX_CONTEXT, max(BUCKETS))
    expected = reference(prompts, max_tokens)
    for index, (result, tokens) in enumerate(zip(results, expected)):
        assert result.tokens == tokens, f"prompt {index} (length {len(prompts[index])})"
    assert len(results[-1].tokens) == min(max_tokens[-1], 3)  # the near-full prompt stops at the context
    assert engine.scheduler.num_preemptions > 0, "the tiny pool should have forced a preemption"
    assert engine.scheduler.pages.num_free == NUM_PAGES
    # Every step donates the cache, state slots as well as pages: the first one's buffers are gone.
    leaves = jax.tree_util.tree_leaves_with_path(first_cache)
    kept = [jax.tree_util.keystr(path) for path, leaf in leaves if not leaf.is_deleted()]
    assert not kept, f"cache buffers not donated: {kept}"


def test_hybrid_with_arrivals_chunks_and_preemption_equals_full_recompute(program, reference, rng):
    assert_serves_like_full_recompute(program, reference, rng)


def test_hybrid_prompt_logprobs_over_chunks_equal_a_full_forward_pass(program, params, rng):
    """Prompt log-probabilities and alternatives of prompts prefilled in chunks of random budgets
    (each state carried from chunk to chunk) equal the ``log_softmax`` of a full forward pass."""
    generator = numpy_rng(rng)
    prompts = [generator.integers(0, 256, size=int(n)).tolist() for n in generator.integers(20, 40, size=3)]
    engine = Engine(program.fresh_copy())
    asks = SamplingParams(max_tokens=0, prompt_logprobs=True, top_logprobs=2)
    ids = [engine.add_request(prompt, asks) for prompt in prompts]
    while engine.has_unfinished:
        engine.step(token_budget=int(generator.integers(1, max(BUCKETS) + 1)))
    results = [engine.result(i) for i in ids]
    for prompt, result, rows in zip(prompts, results, log_prob_reference(CONFIG, params, MAX_CONTEXT)(prompts)):
        assert_allclose(
            result.prompt_logprobs, [rows[p, prompt[p + 1]] for p in range(len(prompt) - 1)], dtype=np.float32
        )
        assert [[t for t, _ in a] for a in result.prompt_top_logprobs] == np.argsort(-rows[:-1], axis=-1)[
            :, :2
        ].tolist()


def test_exported_hybrid_artifact_serves_the_same_tokens(params, reference, tmp_path, rng):
    export_program(
        CONFIG,
        params,
        tmp_path,
        tokenizer=ByteTokenizer(),
        num_slots=NUM_SLOTS,
        token_buckets=BUCKETS,
        max_context=MAX_CONTEXT,
        num_pages=NUM_PAGES,
    )
    artifact, _, _ = load_artifact(tmp_path)
    expected_cache = jax.eval_shape(lambda: init_cache_layers(CONFIG, NUM_SLOTS, NUM_PAGES))
    assert jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), artifact.kv) == jax.tree.map(
        lambda leaf: (leaf.shape, leaf.dtype), expected_cache
    )
    assert_serves_like_full_recompute(artifact, reference, rng)
    with pytest.raises(ValueError, match=r"prompt_logprobs and top_logprobs need the model's scoring steps"):
        Engine(artifact).add_request([1, 2], SamplingParams(max_tokens=0, prompt_logprobs=True))


def preempted_generation(program, prompt, poison_kind, generator):
    """Generates 10 greedy tokens (with log-probabilities) of ``prompt``, preempting it after
    its 4th token; first, if ``poison_kind`` is set, the cache entries of those layers (of
    every slot) are overwritten with noise. Returns the finished request."""
    engine = Engine(program.fresh_copy())
    engine.add_request(prompt, SamplingParams(max_tokens=10, ignore_eos=True, logprobs=True))
    request = engine.scheduler.waiting[0]
    while len(request.output) < 4:
        engine.step(token_budget=7)
    for name in state_blocks(poison_kind) if poison_kind else ():
        engine.program.kv[name] = {
            leaf_name: jnp.asarray(3.0 * generator.standard_normal(leaf.shape), leaf.dtype)
            for leaf_name, leaf in engine.program.kv[name].items()
        }
    engine.scheduler.preempt(request)
    while engine.has_unfinished:
        engine.step(token_budget=7)
    assert request.num_preemptions == 1 and request.finished
    return request


@pytest.mark.parametrize("kind", STATE_KINDS)
def test_a_preempted_sequence_restarts_its_state_from_position_zero(program, reference, kind, rng):
    """Recomputed from position 0 in a slot full of noise, the sequence must ignore what the
    slot held: the same tokens as the full recompute, the same log-probabilities as a
    preemption with a clean cache."""
    generator = numpy_rng(rng)
    prompt = generator.integers(0, 256, size=20).tolist()
    clean = preempted_generation(program, prompt, None, generator)
    poisoned = preempted_generation(program, prompt, kind, generator)
    assert poisoned.output == clean.output == reference([prompt], [10])[0]
    assert_allclose(poisoned.logprobs, clean.logprobs, dtype=np.float32)


def test_a_hybrid_split_over_heads_and_experts_serves_the_single_device_engine_s_tokens_and_logprobs(
    mesh_program, program, rng
):
    """On an expert=2 x tensor=4 mesh the hybrid gives the single-device engine's greedy and
    sampled tokens and log-probabilities. Each device holds a quarter of every state kind's heads
    (the linear and Mamba-2 states, CCA's query tail) and, two key heads not splitting four ways,
    the attention layers' pages whole; and half the routed experts, a quarter of their columns
    (each device runs its experts on the step's tokens, summed over both axes). Before, serving
    refused an expert axis."""
    experts = mesh_program.params["layers"]["block_0"]["moe"]["experts"]
    for name, leaf in experts.items():  # [groups, experts, embed, f] (down: [groups, experts, f, embed])
        groups, total, rows, columns = leaf.shape
        local = (groups, total // 2, rows // 4, columns) if name == "down" else (groups, total // 2, rows, columns // 4)
        assert {shard.data.shape for shard in leaf.addressable_shards} == {local}, name
        assert len({str(shard.index) for shard in leaf.addressable_shards}) == 8, name
    assert_serves_alike(
        Engine(mesh_program.fresh_copy()),
        Engine(program.fresh_copy()),
        int(numpy_rng(rng).integers(2**31)),
        MAX_CONTEXT,
        max(BUCKETS),
    )
    shard_shapes = lambda array: {shard.data.shape for shard in array.addressable_shards}  # noqa: E731
    kv = mesh_program.kv
    for kind, entry, dim in (("linear", "state", 2), ("mamba2", "ssm_state", 2), ("cca", "q_tail", 3)):
        whole = kv[state_blocks(kind)[0]][entry].shape
        assert shard_shapes(kv[state_blocks(kind)[0]][entry]) == {
            tuple(size // 4 if axis == dim else size for axis, size in enumerate(whole))
        }, (kind, entry)
    pages = kv[state_blocks("global")[0]]["k_pages"]
    assert len(pages.addressable_shards) == 8 and shard_shapes(pages) == {pages.shape}
    # Replicated, the attention layers' page pools are read where they lie: XLA's partitioning of
    # the ragged attention split the query heads four ways and gathered every pool at every step.
    pools = {
        f"f32[{','.join(map(str, kv[block]['k_pages'].shape))}]"
        for block in state_blocks("global") + state_blocks("local")
    }
    gathered = {
        result.split("{")[0] for result, op in collectives(mesh_program.steps[max(BUCKETS)]) if op == "all-gather"
    }
    assert not pools & gathered, pools & gathered
