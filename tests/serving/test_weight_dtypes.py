"""A program stores each float weight in the dtype its step reads it in
(``ember.serving.model_program.read_weight_dtypes``): a bf16 hybrid of every layer kind, with
MoE MLPs, keeps its projections, embeddings and experts in bf16 and its norm scales, routers
and SSM decay parameters in float32, and serves exactly the tokens and logprobs of the same
program compiled for all-float32 weights. Weights handed over later in float32
(``fresh_copy``, ``Engine.update_params``) are converted on the way in; an artifact stores
them converted and serves the same."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.tree import param_paths, tree_from_paths
from ember.models.config import ModelConfig, MoEConfig, SSMConfig
from ember.serving import model_program
from ember.serving.engine import Engine
from ember.serving.export import export_program, load_artifact
from ember.serving.program import narrowed_weights
from ember.serving.requests import SamplingParams
from tests.once_per_session import one_at_a_time
from tests.serving.random_weights import random_weights

KINDS = ("linear", "global", "cca", "mamba2")
"""Every kind of layer weights: softmax attention (global and local share them), linear attention, CCA, Mamba-2."""
CONFIG = ModelConfig(
    vocab_size=131, d_model=32, num_layers=len(KINDS), num_heads=4, num_kv_heads=2, mlp_dim=48, page_size=4,
    max_seq_len=32, block_pattern=KINDS, mlp_pattern=("moe", "dense"),
    moe=MoEConfig(num_experts=4, top_k=2, expert_dim=16), moe_impl="xla",
    cca_compression=2, cca_heads=2, cca_kv_heads=1, cca_conv_width=3,
    ssm=SSMConfig(state_size=8, head_dim=8, conv_kernel=3, chunk_size=8), attention_impl="xla", precision="bf16",
)  # fmt: skip
OPTIONS = dict(num_slots=2, token_buckets=(8,), max_context=32)
READ_IN_FLOAT32 = ("scale", "norm_scale", "router/kernel", "A_log", "D", "dt_bias")
"""The weights a bf16 model reads in float32 (path endings): norms, routers, Mamba-2's decay."""
PROMPTS = [[5, 9, 2, 77, 3, 14, 15], [100, 1, 2]]


@pytest.fixture(scope="module")
def params():
    """Random weights away from their initial values."""
    return random_weights(CONFIG, seed=20261128, spread=0.2)


@pytest.fixture(scope="module")
def program(params, tmp_path_factory):
    with one_at_a_time(tmp_path_factory, "weight-dtypes-program"):  # compiled once per session
        return model_program.build_program(CONFIG, params, **OPTIONS)


@pytest.fixture(scope="module")
def float32_program(params, tmp_path_factory):
    """The same program with every weight stored as given (float32)."""
    with one_at_a_time(tmp_path_factory, "weight-dtypes-float32-program"), pytest.MonkeyPatch.context() as patch:
        patch.setattr(model_program, "read_weight_dtypes", lambda *args, **kwargs: {})
        return model_program.build_program(CONFIG, params, **OPTIONS)


def served(program, params=None):
    """Tokens and logprobs of a greedy and a sampled request on a fresh copy of ``program``."""
    settings = [
        SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True),
        SamplingParams(max_tokens=8, logprobs=True, ignore_eos=True, temperature=0.9, top_k=20, seed=3),
    ]
    results = Engine(program.fresh_copy(params)).generate(PROMPTS, settings)
    return [r.tokens for r in results], np.array([r.logprobs for r in results])


def test_projections_are_stored_in_bf16_and_what_is_read_in_float32_stays(program, float32_program, params):
    stored = {path: leaf.dtype for path, leaf in param_paths(program.params).items()}
    assert stored.keys() == param_paths(params).keys()
    for path, dtype in stored.items():
        expected = jnp.float32 if path.endswith(READ_IN_FLOAT32) else jnp.bfloat16
        assert dtype == expected, path
    assert program.weight_dtypes == {path: jnp.dtype(jnp.bfloat16) for path, d in stored.items() if d == jnp.bfloat16}
    # Traced too (benchmarks/deviceless_compile.py converts shapes): traced arrays lie on no devices.
    traced = jax.eval_shape(lambda p: narrowed_weights(p, program.weight_dtypes), params)
    assert {path: leaf.dtype for path, leaf in param_paths(traced).items()} == stored
    assert float32_program.weight_dtypes == {}
    assert {leaf.dtype for leaf in jax.tree.leaves(float32_program.params)} == {jnp.dtype(jnp.float32)}


def test_stored_in_bf16_they_serve_the_same_tokens_and_logprobs(program, float32_program, params):
    tokens, logprobs = served(program)
    float32_tokens, float32_logprobs = served(float32_program)
    assert tokens == float32_tokens
    np.testing.assert_array_equal(logprobs, float32_logprobs)
    # The comparison sees a rounding of a weight read in float32: norm scales rounded to bf16 move logprobs.
    rounded = {
        p: v.astype(jnp.bfloat16).astype(jnp.float32) for p, v in param_paths(params).items() if p.endswith("scale")
    }
    moved = served(program, tree_from_paths({**param_paths(params), **rounded}))[1]
    assert not np.array_equal(moved, logprobs)


def test_float32_weights_handed_over_later_are_converted(program, float32_program, params):
    flat = param_paths(params)
    updates = {p: v * 1.5 for p, v in flat.items() if "attn" in p or "moe" in p}  # float32, norms and routers too
    new_params = tree_from_paths({**flat, **updates})

    engine = Engine(program.fresh_copy())
    engine.update_params(tree_from_paths(updates))
    for path, leaf in param_paths(engine.program.params).items():
        assert leaf.dtype == (jnp.float32 if path.endswith(READ_IN_FLOAT32) else jnp.bfloat16), path
    settings = SamplingParams(max_tokens=6, logprobs=True, ignore_eos=True)
    updated = [(r.tokens, r.logprobs) for r in engine.generate(PROMPTS, settings)]
    expected = [
        (r.tokens, r.logprobs) for r in Engine(float32_program.fresh_copy(new_params)).generate(PROMPTS, settings)
    ]
    assert updated == expected
    assert updated != [(r.tokens, r.logprobs) for r in Engine(program.fresh_copy()).generate(PROMPTS, settings)]

    path = next(p for p in program.weight_dtypes)
    with pytest.raises(ValueError, match=f"weight '{path}' is int32.*compiled for bfloat16"):
        engine.update_params(tree_from_paths({path: jnp.zeros(flat[path].shape, jnp.int32)}))


def test_an_artifact_stores_the_weights_as_its_steps_read_them_and_serves_the_same(program, params, tmp_path):
    out = export_program(CONFIG, params, tmp_path, eos_id=[7, 9], **OPTIONS)
    artifact, _, eos_ids = load_artifact(out)
    assert eos_ids == (7, 9)
    stored = {path: leaf.dtype for path, leaf in param_paths(program.params).items()}
    assert {path: leaf.dtype for path, leaf in param_paths(artifact.params).items()} == stored
    with np.load(out / "params.npz") as saved:
        assert sum(saved[name].nbytes for name in saved.files) == sum(
            leaf.nbytes for leaf in jax.tree.leaves(program.params)
        )
    (tokens, logprobs), (program_tokens, program_logprobs) = served(artifact), served(program)
    assert tokens == program_tokens
    np.testing.assert_array_equal(logprobs, program_logprobs)
    # A format-2 manifest (written before "eos_ids") held one "eos_id".
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["eos_ids"]
    (out / "manifest.json").write_text(json.dumps({**manifest, "format_version": 2, "eos_id": 7}))
    assert load_artifact(out)[2] == (7,)
