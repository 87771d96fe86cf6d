"""GRPO's math against a hand-written NumPy computation, the rewards (shipped, user, failing,
jitted) and the config's errors."""

import json
import sys
import warnings

import jax.numpy as jnp
import numpy as np
import pytest

from ember.core.config import load_config
from ember.core.errors import ConfigError, DataError
from ember.training.rl_lm.config import GRPOConfig, GRPOSection
from ember.training.rl_lm.losses import group_advantages, policy_loss
from ember.training.rl_lm.prompts import read_prompts
from ember.training.rl_lm.rewards import arithmetic_exact_match, python_parses, resolve_reward, score, token_reward
from tests.pipes import pipe_holding
from tests.tolerances import assert_allclose


def numpy_grpo(logp, old, ref, rewards, mask, group, clip_eps, kl_coef, eps=1e-4):
    """DeepSeekMath's GRPO objective, written out loop by loop."""
    rows, _ = logp.shape
    loss, kls, clipped, tokens = 0.0, 0.0, 0, 0
    for row in range(rows):
        members = rewards[(row // group) * group : (row // group + 1) * group]
        advantage = (rewards[row] - members.mean()) / (members.std() + eps)
        terms = []
        for t in np.flatnonzero(mask[row]):
            ratio = np.exp(logp[row, t] - old[row, t])
            surrogate = min(ratio * advantage, np.clip(ratio, 1 - clip_eps, 1 + clip_eps) * advantage)
            kl = np.exp(ref[row, t] - logp[row, t]) - (ref[row, t] - logp[row, t]) - 1
            terms.append(-(surrogate - kl_coef * kl))
            kls += kl
            tokens += 1
            clipped += (advantage > 0 and ratio > 1 + clip_eps) or (advantage < 0 and ratio < 1 - clip_eps)
        loss += np.mean(terms)
    return loss / rows, kls / tokens, clipped / tokens


def test_grpo_loss_equals_numpy_including_a_group_of_equal_rewards():
    rng = np.random.default_rng(7)
    group, rows, seq = 4, 12, 6
    logp = rng.normal(-1.5, 0.4, (rows, seq)).astype(np.float32)
    old = (logp + rng.normal(0, 0.3, (rows, seq))).astype(np.float32)  # ratios well beyond the clip range
    ref = (logp + rng.normal(0, 0.2, (rows, seq))).astype(np.float32)
    rewards = rng.integers(0, 2, rows).astype(np.float32)
    rewards[4:8] = 1.0  # the second group is all correct: zero advantage, no NaN
    rewards[0:4] = [0.0, 1.0, 0.0, 0.5]
    mask = (rng.random((rows, seq)) < 0.7).astype(np.float32)
    mask[:, 0] = 1.0

    advantages = group_advantages(jnp.asarray(rewards).reshape(-1, group)).reshape(-1)
    assert np.all(np.asarray(advantages[4:8]) == 0.0)
    terms = policy_loss(
        jnp.asarray(logp), jnp.asarray(old), jnp.asarray(ref), advantages, jnp.asarray(mask), clip_eps=0.2, kl_coef=0.05
    )
    loss, kl, clip_fraction = numpy_grpo(logp, old, ref, rewards, mask, group, 0.2, 0.05)
    assert terms.count == rows
    assert_allclose(terms.loss_sum / terms.count, loss, scale=10)
    assert_allclose(terms.kl, kl)
    assert_allclose(terms.clip_fraction, clip_fraction)
    assert 0 < clip_fraction < 1, "the fixture should clip some tokens and not others"


def test_reinforce_uses_the_group_mean_as_baseline_and_no_ratio():
    rng = np.random.default_rng(3)
    logp = rng.normal(-1.0, 0.5, (4, 5)).astype(np.float32)
    rewards = np.array([1.0, 0.0, 0.0, 0.0], np.float32)
    mask = np.ones((4, 5), np.float32)
    advantages = group_advantages(jnp.asarray(rewards)[None], algorithm="reinforce")[0]
    assert_allclose(advantages, rewards - rewards.mean())
    terms = policy_loss(jnp.asarray(logp), jnp.asarray(logp) + 1.0, None, advantages, jnp.asarray(mask),
                        algorithm="reinforce")  # fmt: skip
    assert_allclose(terms.loss_sum, -np.sum(logp.mean(axis=1) * (rewards - rewards.mean())))
    assert float(terms.clip_fraction) == 0.0
    assert terms.kl is None  # no reference log-probs (kl_coef 0): no KL to report, rather than a logged 0


def test_shipped_rewards():
    assert arithmetic_exact_match("17+25=", "42") == 1.0
    assert arithmetic_exact_match("17+25=", " 42\n") == 1.0
    assert arithmetic_exact_match("17-25=", "-8") == 1.0
    assert arithmetic_exact_match("17+25=", "420") == 0.0
    with pytest.raises(ValueError, match="not an arithmetic problem"):
        arithmetic_exact_match("hello", "42")
    assert python_parses("def f(x):\n", "    return x\n") == 1.0
    assert python_parses("def f(x):\n", "return (x\n") == 0.0


def test_a_failing_reward_scores_zero_for_that_sample_only():
    def picky(prompt, completion):
        if completion == "boom":
            raise RuntimeError("cannot score boom")
        if completion == "nan":
            return float("nan")
        return len(completion)

    scores = score(picky, ["a", "b", "c"], ["xy", "boom", "nan"], [[1], [2], [3]], [[4, 5], [6], [7]])
    assert scores.rewards.tolist() == [2.0, 0.0, 0.0]
    assert len(scores.failures) == 2
    assert "sample 1: RuntimeError: cannot score boom" in scores.failures[0]
    assert "sample 2" in scores.failures[1]


def test_token_rewards_run_jitted_on_the_whole_batch():
    @token_reward
    def ends_with_seven(prompt_tokens, prompt_lengths, completion_tokens, completion_lengths):
        last = jnp.take_along_axis(completion_tokens, jnp.maximum(completion_lengths - 1, 0)[:, None], axis=1)[:, 0]
        return (last == 7).astype(jnp.float32) + 0.0 * prompt_lengths

    scores = score(ends_with_seven, ["", ""], ["", ""], [[1, 2], [3]], [[5, 7], [7, 1, 2]])
    assert scores.rewards.tolist() == [1.0, 0.0] and scores.failures == []

    @token_reward
    def wrong_shape(prompt_tokens, prompt_lengths, completion_tokens, completion_lengths):
        return completion_tokens

    scores = score(wrong_shape, ["", ""], ["", ""], [[1], [3]], [[5, 7], [7]])
    assert scores.rewards.tolist() == [0.0, 0.0]
    assert "expected (2,)" in scores.failures[0]


def test_rewards_resolve_by_name_or_import_path():
    assert resolve_reward("arithmetic") is arithmetic_exact_match
    assert resolve_reward("tests.training.test_grpo_losses:numpy_grpo") is numpy_grpo
    with pytest.raises(ConfigError, match="neither a shipped reward"):
        resolve_reward("nope")
    with pytest.raises(ConfigError, match="cannot be imported"):
        resolve_reward("tests.training.test_grpo_losses:missing")
    # importlib raised ValueError ("Empty module name") and TypeError (a relative import): tracebacks
    for name in (":numpy_grpo", ".test_grpo_losses:numpy_grpo", "tests.training.test_grpo_losses:"):
        with pytest.raises(ConfigError, match=r"is not 'package\.module:function'"):
            resolve_reward(name)


def test_a_reward_module_that_is_not_importable_says_where_python_looks(tmp_path, monkeypatch):
    # The `ember` console script does not put the current directory on sys.path (`python -m
    # ember` does), so a rewards.py beside the config is not found. Before, the error said only
    # "No module named 'my_rewards'".
    monkeypatch.chdir(tmp_path)
    (tmp_path / "my_rewards.py").write_text("def exact(prompt, completion):\n    return 1.0\n")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    with pytest.raises(ConfigError, match=r"No module named 'my_rewards'.*PYTHONPATH"):
        resolve_reward("my_rewards:exact")


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["grpo.group_size=1"], "grpo.group_size must be >= 2"),
        (["grpo.algorithm=ppo"], "grpo.algorithm must be one of grpo, reinforce"),
        (["grpo.updates_per_rollout=3"], "must divide the rollout's prompts_per_step"),
        # a checkpoint inside a rollout resumed at the next one: not the run it was taken from
        (["grpo.updates_per_rollout=2", "checkpoint.every=3"], r"checkpoint.every \(3\) must be a multiple of"),
        # the engine's SamplingParams refuse these too, but only once the model is loaded and compiled
        (["grpo.top_p=0"], r"grpo.top_p must be in \(0, 1\]"),
        (["grpo.top_p=1.5"], r"grpo.top_p must be in \(0, 1\]"),
        (["grpo.top_k=-1"], "grpo.top_k must be >= 0"),
        # NaN passed `kl_coef < 0` and made every loss NaN (0 * NaN); an infinite temperature sampled uniformly
        (["grpo.kl_coef=nan"], "grpo.kl_coef must be a finite number >= 0"),
        (["grpo.kl_coef=inf"], "grpo.kl_coef must be a finite number >= 0"),
        (["grpo.temperature=inf"], "grpo.temperature must be a finite number > 0"),
        (["grpo.engine_replicas=0"], r"grpo.engine_replicas must be a positive integer or -1"),
        (["method=mixlora"], "method must be one of lora, full"),
        (["adapter.init=pissa"], "adapter.init must be lora or gaussian"),
        (["base_model.quantize=nf4"], "GRPO trains a float policy"),
        (["adapter.dropout=0.1"], "adapter.dropout must be 0 for GRPO"),
        (["prompts.operators=x"], "prompts.operators must be a string of"),
        # a key of the other prompt source would do nothing
        (["prompts.eval=held_out.jsonl"], "prompts.eval .* needs a JSONL prompts.source"),
        (
            ["prompts.source=train.jsonl", "prompts.max_operand=30"],
            "prompts.max_operand only applies to source: arithmetic",
        ),
    ],
)
def test_config_errors_name_the_key(tmp_path, overrides, message):
    path = tmp_path / "grpo.yaml"
    path.write_text("kind: grpo\nbase_model: {path: somewhere}\n")
    with pytest.raises(ConfigError, match=message):
        load_config(GRPOConfig, path, overrides)
    assert GRPOSection(group_size=4, prompts_per_step=2, updates_per_rollout=2).rows_per_update == 4


@pytest.mark.parametrize(
    "overrides, unused",
    [
        (["method=full", "adapter.rank=4", "adapter.targets=[q]"], "adapter.rank, adapter.targets"),
        (["grpo.algorithm=reinforce", "grpo.clip_eps=0.1"], r"grpo.clip_eps \(read by grpo.algorithm grpo only\)"),
        (["adapter.ga_gamma=4"], r"adapter.ga_gamma \(read by adapter.init lora_ga only\)"),
    ],
)
def test_settings_the_run_never_reads_are_named_in_a_warning(tmp_path, overrides, unused):
    """method full trained every weight with the adapter section dropped without a word, and
    reinforce, which has no policy ratio, ignored grpo.clip_eps: now named as kind: finetune
    names its unused settings. The settings the run reads warn of nothing."""
    path = tmp_path / "grpo.yaml"
    path.write_text("kind: grpo\nbase_model: {path: somewhere}\n")
    with pytest.warns(
        UserWarning, match=rf"this run \(method \w+, grpo.algorithm \w+\) does not use {unused}: ignored"
    ):
        load_config(GRPOConfig, path, overrides)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        load_config(GRPOConfig, path, ["adapter.rank=4", "grpo.clip_eps=0.1"])
        load_config(GRPOConfig, path, ["method=full", "grpo.algorithm=reinforce"])


def test_prompt_files_split_at_newlines_only_and_refuse_what_is_not_text(tmp_path):
    path = tmp_path / "prompts.jsonl"
    text = "a\u2028b\x85c"  # JSON allows these unescaped inside a string
    path.write_text(json.dumps({"prompt": text}, ensure_ascii=False) + "\n" + json.dumps({"prompt": "2+2="}) + "\n")
    assert read_prompts(path) == [text, "2+2="]
    path.write_text('{"prompt": "1+1="}\n{"prompt": "x\\ud800"}\n')
    with pytest.raises(DataError, match=r"prompts.jsonl:2: the prompt holds a lone surrogate U\+D800"):
        read_prompts(path)
    path.write_bytes('{"prompt": "caf\u00e9"}\n'.encode("latin-1"))
    with pytest.raises(DataError, match="is not UTF-8 text"):
        read_prompts(path)
    # A pipe (a shell's <(...)) was refused as a prompts file that does not exist.
    with pipe_holding(tmp_path / "prompts.fifo", '{"prompt": "3+4="}\n') as fifo:
        assert read_prompts(fifo) == ["3+4="]
