"""Rollouts through the serving engine, turned into the trainer's batches.

Every ``updates_per_rollout`` batches, :class:`RolloutBatches` samples a group of completions
of each of a few prompts through an :class:`~ember.serving.engine.Engine` (continuous
batching, chunked prefill, per-request seeds, log-probabilities), scores them with the
reward, computes group advantages, and recomputes every sampled token's log-probability
under the training forward of the policy that sampled it (and of the frozen reference), so
the loss never trusts the sampler's numbers; their disagreement is reported. A rollout's
rows are then served in ``updates_per_rollout`` equal slices.

A batch (``[rows, seq]`` unless noted; a row is ``prompt + completion`` shifted by one):

    tokens, targets, positions, segment_ids   int32
    loss_mask        float32   1 where the target is a completion token (end-of-sequence included)
    old_logprobs     float32   log p(target) under the sampling policy (training forward)
    ref_logprobs     float32   the same under the reference (only when the KL term is on)
    advantages       float32 [rows]
    rewards          float32 [rows]

The iterator's state is the number of rollouts and of slices served, saved in checkpoints;
the samples of rollout ``r`` are seeded by ``(seed, r)``, so a resumed run repeats the
trajectory. Periodic checkpoints fall between rollouts (``GRPOConfig`` makes
``checkpoint.every`` a multiple of ``grpo.updates_per_rollout``); a run stopped in the middle
of a rollout (a signal) and resumed starts the next one: the sampling policy of the
interrupted one is gone. That fresh rollout serves only the slices the interrupted one had
left, so the rollouts stay aligned with the trainer's steps and the later checkpoints still fall
between rollouts.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from ember.core.errors import ConfigError
from ember.serving.engine import Engine
from ember.serving.requests import MAX_SEED, SamplingParams
from ember.training.rl_lm.config import GRPOSection
from ember.training.rl_lm.losses import group_advantages
from ember.training.rl_lm.rewards import TextReward, TokenReward, score

ROW_FIELDS = ("tokens", "targets", "positions", "segment_ids")
"""The int32 ``[rows, seq]`` fields of a batch (the LM's, see ``ember.training.lm.task``)."""

Scorer = Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]
"""``rows -> {"old_logprobs", "engine_view", ("ref_logprobs")}`` (see :class:`RolloutBatches`)."""


@dataclasses.dataclass
class RolloutStats:
    """What one rollout measured, for logging."""

    rollout: int
    seconds: float
    tokens: int
    reward_mean: float
    reward_std: float
    completion_length: float
    zero_advantage_groups: float
    logprob_mismatch_mean: float
    logprob_mismatch_max: float
    failures: list[str]


class RolloutBatches:
    """The trainer's data for a GRPO run (see the module docstring).

    Args:
      prompts: the prompts to sample from (text).
      reward: a text or token reward (``ember.training.rl_lm.rewards``).
      config: the ``grpo`` section.
      seq_len: the rows' length (longest prompt + ``max_tokens``).
      tokenizer: encodes prompts and decodes completions for text rewards.
      seed: seeds prompt choice and sampling.
      process_index, process_count: this process samples its own share of every rollout.
    """

    def __init__(
        self,
        prompts: list[str],
        reward: TextReward | TokenReward,
        config: GRPOSection,
        *,
        seq_len: int,
        tokenizer: Any,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
    ):
        if config.prompts_per_step % process_count:
            raise ConfigError(
                f"grpo.prompts_per_step ({config.prompts_per_step}) must divide among {process_count} processes",
                key="grpo.prompts_per_step",
            )
        local_rows = config.rows // process_count
        if local_rows % config.updates_per_rollout:
            raise ConfigError(
                f"grpo.updates_per_rollout ({config.updates_per_rollout}) must divide each of the {process_count} "
                f"processes' {local_rows} completions per rollout",
                key="grpo.updates_per_rollout",
            )
        self.prompts, self.reward, self.config = prompts, reward, config
        self.seq_len, self.tokenizer, self.seed = seq_len, tokenizer, seed
        self.process_index, self.process_count = process_index, process_count
        self.local_prompts = config.prompts_per_step // process_count
        self.engine: Engine | None = None
        self.scorer: Scorer | None = None
        self.rollouts, self.served = 0, 0
        self._current: dict[str, np.ndarray] | None = None
        self.history: list[RolloutStats] = []

    def attach(self, engine: Engine, scorer: Scorer) -> None:
        """Gives the iterator the engine that samples and the scorer that recomputes log-probs."""
        self.engine, self.scorer = engine, scorer

    # ---------------------------------------------------------------- the BatchIterator protocol
    def batch_spec(self) -> dict[str, jax.ShapeDtypeStruct]:
        """The shapes and dtypes of every batch (without sampling one)."""
        rows = self.local_prompts * self.config.group_size // self.config.updates_per_rollout
        grid = (rows, self.seq_len)
        spec = {
            name: jax.ShapeDtypeStruct(grid, np.int32) for name in ("tokens", "targets", "positions", "segment_ids")
        }
        spec |= {name: jax.ShapeDtypeStruct(grid, np.float32) for name in ("loss_mask", "old_logprobs")}
        if self.config.kl_coef > 0:
            spec["ref_logprobs"] = jax.ShapeDtypeStruct(grid, np.float32)
        spec |= {name: jax.ShapeDtypeStruct((rows,), np.float32) for name in ("advantages", "rewards")}
        return spec

    def next(self) -> dict[str, np.ndarray]:
        updates = self.config.updates_per_rollout
        if self._current is None or self.served % updates == 0:
            self._current = self._rollout()
        share = self._current["advantages"].shape[0] // updates
        part = self.served % updates
        self.served += 1
        batch = {name: value[part * share : (part + 1) * share] for name, value in self._current.items()}
        return {name: batch[name] for name in self.batch_spec()}

    def state(self) -> dict[str, Any]:
        return {"rollouts": self.rollouts, "served": self.served}

    def restore(self, state: dict[str, Any]) -> None:
        # Saved inside a rollout (a stop by signal), the next batch comes from a fresh rollout that
        # serves only the slices the interrupted one had left: ``served`` keeps counting the
        # trainer's steps, so the later periodic checkpoints still fall between rollouts.
        self.rollouts, self.served = int(state["rollouts"]), int(state["served"])
        self._current = None

    # ---------------------------------------------------------------- one rollout
    def _rollout(self) -> dict[str, np.ndarray]:
        if self.engine is None or self.scorer is None:
            raise RuntimeError("RolloutBatches needs attach(engine, scorer) before it can sample")
        config, index = self.config, self.rollouts
        self.rollouts += 1
        rng = np.random.default_rng([self.seed, index, self.process_index])
        chosen = rng.choice(len(self.prompts), size=self.local_prompts, replace=len(self.prompts) < self.local_prompts)
        prompts = [self.prompts[i] for i in chosen for _ in range(config.group_size)]
        encoded = {i: self.engine.encode_prompt(self.prompts[i]) for i in set(chosen.tolist())}
        prompt_tokens = [encoded[i] for i in chosen.tolist() for _ in range(config.group_size)]
        seeds = rng.integers(0, MAX_SEED, size=len(prompts))
        settings = [
            SamplingParams(
                max_tokens=config.max_tokens,
                temperature=config.temperature,
                top_k=config.top_k,
                top_p=config.top_p,
                seed=int(seed),
                logprobs=True,
            )
            for seed in seeds
        ]
        start = time.perf_counter()
        results = self.engine.generate(prompt_tokens, settings)
        seconds = time.perf_counter() - start
        failed = [r.error for r in results if r.error is not None]
        if failed:
            raise ValueError(f"a rollout prompt was rejected by the engine: {failed[0]}")
        completions = [list(r.tokens) for r in results]
        eos_tokens = [r.eos_token for r in results]
        texts = [r.text if r.text is not None else self.tokenizer.decode(r.tokens) for r in results]
        scores = score(self.reward, prompts, texts, prompt_tokens, completions)
        rewards = scores.rewards
        advantages = np.asarray(
            group_advantages(rewards.reshape(-1, config.group_size), algorithm=config.algorithm)
        ).reshape(-1)
        rows = self._rows(prompt_tokens, completions, eos_tokens, [r.logprobs for r in results])
        scored = self.scorer(rows)
        view = rows.pop("engine_mask")
        engine_logprobs = rows.pop("engine_logprobs")
        mismatch = np.abs(scored.pop("engine_view") - engine_logprobs)[view > 0]
        groups = rewards.reshape(-1, config.group_size)
        self.history.append(
            RolloutStats(
                rollout=index,
                seconds=seconds,
                tokens=sum(len(c) for c in completions),
                reward_mean=float(rewards.mean()),
                reward_std=float(rewards.std()),
                completion_length=float(np.mean([len(c) for c in completions])),
                zero_advantage_groups=float(np.mean(groups.max(axis=1) == groups.min(axis=1))),
                logprob_mismatch_mean=float(mismatch.mean()) if mismatch.size else 0.0,
                logprob_mismatch_max=float(mismatch.max()) if mismatch.size else 0.0,
                failures=scores.failures,
            )
        )
        return {**rows, **scored, "advantages": advantages.astype(np.float32), "rewards": rewards}

    def _rows(
        self,
        prompt_tokens: list[list[int]],
        completions: list[list[int]],
        eos_tokens: list[int | None],
        engine_logprobs: list[list[float] | None],
    ) -> dict[str, np.ndarray]:
        """The padded rows of ``prompt + completion (+ the end-of-sequence token it sampled, if
        it ended on one)``, with the engine's log-probs placed at their targets
        (``engine_mask``: where it reported one)."""
        shape = (len(completions), self.seq_len)
        arrays = {name: np.zeros(shape, np.int32) for name in ROW_FIELDS}
        arrays |= {name: np.zeros(shape, np.float32) for name in ("loss_mask", "engine_logprobs", "engine_mask")}
        for row, (prompt, completion, eos, logprobs) in enumerate(
            zip(prompt_tokens, completions, eos_tokens, engine_logprobs)
        ):
            sequence = prompt + completion + ([eos] if eos is not None else [])
            length = len(sequence) - 1
            arrays["tokens"][row, :length] = sequence[:-1]
            arrays["targets"][row, :length] = sequence[1:]
            arrays["positions"][row, :length] = np.arange(length)
            arrays["segment_ids"][row, :length] = 1
            first = len(prompt) - 1  # the target index of the first completion token
            arrays["loss_mask"][row, first:length] = 1.0
            arrays["engine_logprobs"][row, first : first + len(completion)] = logprobs or ()
            arrays["engine_mask"][row, first : first + len(completion)] = 1.0
        return arrays


__all__ = ["RolloutBatches", "RolloutStats", "Scorer"]
