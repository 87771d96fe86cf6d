"""GRPO (or REINFORCE) on a pretrained language model as a trainer task, with the serving
engine as the rollout engine.

    task = GRPOTask(config)                    # config: GRPOConfig
    make_trainer(config, task=task).train()    # ember.training.lm.trainer

The trainer runs its ordinary loop: each step takes a batch from :class:`RolloutBatches`
(which samples through the engine), and the task's hooks keep the engine serving the policy
being trained. After every optimizer step the trainable leaves are copied into the engine,
device to device, shapes unchanged, so its compiled steps run them as they are (LoRA: only
the adapters move). The reference policy is the base model as loaded (LoRA: the base
without its adapters), kept beside the engine's weights and placed as they are; the KL term
is computed against it.

Where the engine runs: with the training mesh's ``tensor`` axis of 1 (and ``expert``, for an
MoE policy), on this process's first device (the policy whole there); with ``mesh.tensor`` = n
(``mesh.expert`` = e) > 1, split over the n x e devices of the mesh's tensor x expert block that
holds this process's first device (``ember.training.rl_lm.engine_mesh``): the weights in the
engine's shardings, each copied from the shards the trainer already has on those devices, the
reference split the same way and the scorer's forward run split over them. Each process of a
multi-process run samples its own share on its own devices.

Logged beside the loss: ``reward_mean``, ``reward_std``, ``kl`` (when ``grpo.kl_coef`` > 0),
``clip_fraction``, ``ratio`` and ``completion_tokens`` (per step), and per logging interval the rollouts'
``rollout_tokens_per_second``, ``train_tokens_per_second``, ``rollout_time_fraction``,
``logprob_mismatch_mean/max`` (engine vs training forward: rounding level, about 4e-8 for a
dropless model; a MoE with ``capacity_factor`` drops other tokens in the engine's flat token budget
than in the training batch, so its rollouts come from a slightly different policy, mean about 4e-3 on
the tiny MoE at 1.0: the update stays correct, its old log-probabilities being the training
forward's), ``zero_advantage_groups`` and ``reward_failures``. ``eval_reward`` (held-out
prompts, greedy) is logged every ``train.eval_every`` steps and at the start; the summary holds
``eval_reward_start`` and ``eval_reward``.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from ember.core.errors import ConfigError, DataError
from ember.core.sharding import addressable_here, unbox, use_sharding
from ember.models.adapters import adapter_mask, add_lora
from ember.models.decoder import DecoderLM
from ember.models.variables import as_variables, serving_weights, split_variables
from ember.serving.engine import Engine, prompt_tokens
from ember.serving.loading import LoadedModel
from ember.serving.mesh import SERVING_RULES
from ember.serving.model_program import weight_shardings
from ember.serving.program import owned_copy
from ember.serving.replicas import Replicas
from ember.serving.requests import SamplingParams
from ember.training.finetune.base import boxed_variables, load_base, restore_base_layout
from ember.training.lm.task import BATCH_AXES
from ember.training.metrics import METRICS_FILE, read_metrics
from ember.training.rl_lm.config import GRPOConfig
from ember.training.rl_lm.engine_mesh import held_on, rollout_meshes
from ember.training.rl_lm.losses import policy_loss, token_logprobs
from ember.training.rl_lm.prompts import load_prompts
from ember.training.rl_lm.rewards import resolve_reward, score
from ember.training.rl_lm.rollouts import ROW_FIELDS, RolloutBatches
from ember.training.task import LossTerms, Task, apply_model
from ember.training.trainable import select


class GRPOTask(Task):
    """The ``grpo`` kind's task. ``base``: an already loaded base model (default: the one
    ``config.base_model`` names)."""

    batch_axes = BATCH_AXES
    count_name = "completions"

    def __init__(self, config: GRPOConfig, base: LoadedModel | None = None):
        self.config = config
        self.base = base or load_base(config.base_model)
        self.model = DecoderLM(self.base.config)
        self.base_params, self.base_state = split_variables(as_variables(self.base.params))
        self.prompts, self.held_out = load_prompts(config.prompts)
        self.reward = resolve_reward(config.reward)
        self.seq_len = self._seq_len()
        if config.method == "lora":  # bad targets fail now, not inside the jitted initialisation
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(np.shape(x), np.asarray(x).dtype), self.base_params)
            jax.eval_shape(lambda p: add_lora(p, config.adapter, jax.random.key(0)), shapes)
        self.data = RolloutBatches(
            self.prompts,
            self.reward,
            config.grpo,
            seq_len=self.seq_len,
            tokenizer=self.base.tokenizer,
            seed=config.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        self.engine: Engine | Replicas | None = None  # the rollouts' (Replicas: grpo.engine_replicas > 1)
        self.engines: list[Engine] = []
        self.engine_meshes: list[Any] = []  # each engine's (engine_mesh.rollout_meshes); None: one device
        self.mask: Any = None

    def _seq_len(self) -> int:
        """Rows hold the longest prompt plus ``grpo.max_tokens``; that must fit the model.
        A prompt the engine would refuse (the engine's own check: empty, ids past the model's
        vocabulary, ...) is a ``DataError`` now, not a traceback at the first rollout."""
        config = self.base.config
        lengths = []
        for source, prompts in (("prompt", self.prompts), ("held-out prompt", self.held_out)):
            for index, prompt in enumerate(prompts):
                try:
                    tokens = prompt_tokens(prompt, self.base.tokenizer, config.vocab_size)  # length: below
                except ValueError as error:
                    raise DataError(f"{source} {index} ({prompt[:40]!r}): {error}") from None
                lengths.append(len(tokens))
        longest = max(lengths)
        seq_len = longest + self.config.grpo.max_tokens
        limit = config.max_seq_len
        if seq_len > limit:
            raise ConfigError(
                f"the longest prompt ({longest} tokens) plus grpo.max_tokens ({self.config.grpo.max_tokens}) "
                f"exceeds the model's max_seq_len ({limit})",
                key="grpo.max_tokens",
            )
        return seq_len

    # ---------------------------------------------------------------- variables and masks
    def pretrained(self) -> dict[str, Any]:
        """The base weights (host arrays, see ``load_base``)."""
        return {"params": self.base_params, "state": self.base_state}

    def init_variables(self, rng: jax.Array, pretrained: Any = None) -> dict[str, Any]:
        if pretrained is None:
            raise ValueError("GRPOTask starts from its pretrained() weights")
        variables = boxed_variables(self.model, self.seq_len, pretrained)
        if self.config.method == "lora":
            variables["params"] = add_lora(variables["params"], self.config.adapter, rng)
        return variables

    def trainable(self, params: Any) -> Any | None:
        return adapter_mask(params) if self.config.method == "lora" else None

    def restore_layout(self, saved_params: Any) -> tuple[Task, Any] | None:
        """A checkpoint written with the other ``base_model.scan_layers`` (a runtime setting) is
        read in its own layout and converted, as ``FinetuneTask.restore_layout``."""
        return restore_base_layout(self.base, saved_params, lambda base: GRPOTask(self.config, base))

    # ---------------------------------------------------------------- loss and data
    def loss(
        self, params: Any, batch: dict[str, jax.Array], *, rng: jax.Array, teacher: Any, model_state: Any = None
    ) -> LossTerms:
        """The policy loss of a batch of completions (see ``ember.training.rl_lm.losses``)."""
        grpo = self.config.grpo
        outputs = apply_model(
            self.model,
            params,
            batch["tokens"],
            positions=batch["positions"],
            segment_ids=batch["segment_ids"],
            model_state=model_state,
        )
        logits, _ = outputs.output
        terms = policy_loss(
            token_logprobs(logits, batch["targets"], grpo.temperature),
            batch["old_logprobs"],
            batch.get("ref_logprobs"),
            batch["advantages"],
            batch["loss_mask"],
            algorithm=grpo.algorithm,
            clip_eps=grpo.clip_eps,
            kl_coef=grpo.kl_coef,
        )
        # Means over completions average exactly over micro-batches (weighted by their completions);
        # finish_metrics makes the token means from such means (the rewards' are batch_metrics).
        tokens_per_completion = jnp.mean(jnp.sum(batch["loss_mask"], axis=-1))
        token_means = {"clip_fraction": terms.clip_fraction, "ratio": terms.ratio}
        if terms.kl is not None:  # kl_coef 0 computes no reference log-probs, so no KL
            token_means["kl"] = terms.kl
        metrics = {
            "completion_tokens": tokens_per_completion,
            **{name: value * tokens_per_completion for name, value in token_means.items()},
        }
        return LossTerms(terms.loss_sum, terms.count, outputs.aux, {**outputs.metrics, **metrics}, outputs.model_state)

    def batch_metrics(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """``reward_mean`` and ``reward_std`` over the step's completions, whatever
        ``train.grad_accum`` (each micro-batch's own std would not average into the step's),
        the std from centred rewards: a mean square minus a squared mean in float32 loses the
        spread of rewards with a large common offset (all near 1000: about 0.06 of rounding)."""
        rewards = batch["rewards"]
        return {"reward_mean": jnp.mean(rewards), "reward_std": jnp.std(rewards)}

    def finish_metrics(self, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The step's token means from the means over its completions that :meth:`loss` reports
        (each micro-batch's own token mean would not average into the step's): ``kl``,
        ``clip_fraction`` and ``ratio``, means over completion tokens, from their sums per completion."""
        metrics = dict(metrics)
        tokens = metrics["completion_tokens"]
        for name in ("kl", "clip_fraction", "ratio"):
            if name in metrics:
                metrics[name] = metrics[name] / jnp.where(tokens > 0, tokens, 1.0)
        return metrics

    def train_data(self) -> RolloutBatches:
        return self.data

    def work_per_step(self) -> dict[str, float]:
        return {"tokens": self.config.grpo.rows_per_update * self.seq_len}

    # ---------------------------------------------------------------- the engine and hooks
    def add_hooks(self, trainer) -> None:
        """Builds the rollout engine on the trainer's current policy, then keeps it in step:
        syncs after every step, logs rollout statistics and evaluates on held-out prompts."""
        grpo = self.config.grpo
        self.mask = trainer.mask
        self.engine_meshes = rollout_meshes(trainer.mesh, self.base.config, grpo.engine_replicas)
        # The trainer donates its own buffers every step: the engines keep copies (taken here, in
        # turn: gathering a weight over processes is a collective).
        copies = []
        for mesh in self.engine_meshes:
            weights = _engine_weights(trainer.state, mesh=mesh)
            copies.append(jax.tree.map(owned_copy, weights, self._engine_placement(weights, mesh)))
        options = dict(
            tokenizer=self.base.tokenizer,
            eos_id=self.base.eos_ids,
            num_slots=grpo.num_slots,
            token_budget=grpo.token_budget,
            max_context=self.seq_len,
        )
        replicas = Replicas.build(
            lambda mesh_and_weights: Engine.from_model(
                self.base.config, mesh_and_weights[1], mesh=mesh_and_weights[0], **options
            ),
            list(zip(self.engine_meshes, copies)),
        )
        self.engines = replicas.engines
        self.engine = replicas if len(self.engines) > 1 else self.engines[0]
        first, first_mesh = self.engines[0], self.engine_meshes[0]  # the scorer's and the reference's
        reference = None
        if grpo.kl_coef > 0:
            reference = unbox(self.base.params)
            reference = jax.device_put(reference, self._engine_placement(reference, first_mesh))
        # The scorer's forward takes at most a training micro-batch's rows (what train.grad_accum sizes to fit).
        rows = self.data.batch_spec()["advantages"].shape[0]
        micro = rows // trainer.loop.grad_accum if rows % trainer.loop.grad_accum == 0 else rows
        scorer = _scorer(self.model, first, reference, grpo.temperature, micro, mesh=first_mesh)
        self.data.attach(self.engine, scorer)
        monitor = _RolloutMonitor(self, trainer)
        trainer.add_hook(self._sync, every=1)
        # The held-out rewards before training are written at step 1, and the rollouts' statistics
        # on a stop too: a run stopped (or killed after a checkpoint) before its first log lost both.
        trainer.add_hook(monitor.write_start, every=1)
        trainer.add_hook(monitor.log, every=trainer.loop.log_every, on_last=True, on_stop=True)
        if self.held_out:
            trainer.add_hook(monitor.evaluate, every=trainer.loop.eval_every, on_last=True)
            monitor.start_values()

    def _engine_placement(self, weights: Any, mesh: Any) -> Any:
        """Where an engine on ``mesh`` keeps ``weights`` (the policy's or the reference's serving
        weights), leaf by leaf: this process's first device (``mesh`` None), or their shardings on it."""
        if mesh is None:
            return jax.tree.map(lambda _: jax.local_devices()[0], weights)
        return weight_shardings(self.base.config, weights, mesh)

    def _sync(self, info) -> None:
        """Copies the trainable leaves (and any model state) into every engine."""
        for engine, mesh in zip(self.engines, self.engine_meshes):
            engine.update_params(_engine_weights(info.state, self.mask, mesh))

    def evaluate(self, prompts: list[str] | None = None) -> dict[str, float]:
        """Mean rewards on ``prompts`` (default the held-out ones) under the engine's current
        weights: ``eval_reward`` of greedy completions and ``eval_reward_sampled`` of
        ``prompts.eval_samples`` completions each, sampled as rollouts are (fixed seeds)."""
        prompts = self.held_out if prompts is None else prompts
        grpo, samples = self.config.grpo, self.config.prompts.eval_samples
        greedy = [SamplingParams(max_tokens=grpo.max_tokens, temperature=0.0)] * len(prompts)
        sampled = [
            SamplingParams(
                max_tokens=grpo.max_tokens, temperature=grpo.temperature, top_k=grpo.top_k, top_p=grpo.top_p, seed=seed
            )
            for seed in range(len(prompts) * samples)
        ]
        asked = prompts + [p for p in prompts for _ in range(samples)]
        encoded = [self.engine.encode_prompt(p) for p in prompts]
        prompt_tokens = encoded + [tokens for tokens in encoded for _ in range(samples)]
        results = self.engine.generate(prompt_tokens, greedy + sampled)
        texts = [r.text or "" for r in results]
        rewards = score(self.reward, asked, texts, prompt_tokens, [r.tokens for r in results]).rewards
        values = {"eval_reward": float(rewards[: len(prompts)].mean())}
        if samples:
            values["eval_reward_sampled"] = float(rewards[len(prompts) :].mean())
        return values


def _engine_weights(state: Any, mask: Any = None, mesh: Any = None) -> Any:
    """The policy's serving weights in the train ``state`` (with ``mask``: its selected params
    only) as this process's engine takes them: with the engine's ``mesh``, each weight the
    trainer splits only over the engine's axes as the shards it has on that mesh's devices
    (``engine_mesh.held_on``: sharing the trainer's buffers, which the engine copies); every
    other weight whole, gathered where a mesh over several processes shards or replicates it
    (a collective: every process runs the task's hooks)."""
    params = state.params if mask is None else select(state.params, mask)
    weights = serving_weights(params, state.model_state)
    if mesh is not None:
        weights = jax.tree.map(lambda x: held_on(x, mesh), weights)
    return addressable_here(weights)


def _scorer(model: DecoderLM, engine: Engine, reference: Any, temperature: float, rows_per_call: int, mesh: Any = None):
    """``rows -> {"old_logprobs", "engine_view", ("ref_logprobs")}``: the training forward's
    log-probs of the rows' targets under the engine's current weights (at ``temperature``,
    and untempered as the engine reports them) and under ``reference`` (if given, placed as
    the engine's weights), computed ``rows_per_call`` rows at a time (a whole rollout's logits
    at once need not fit). With the engine's ``mesh`` the forward runs split over it as the
    engine's step does: the weights in their shards, the rows replicated."""

    @jax.jit
    def logprobs(weights, rows):
        logits, _ = model.apply(
            as_variables(weights), rows["tokens"], positions=rows["positions"], segment_ids=rows["segment_ids"]
        )
        return token_logprobs(logits, rows["targets"], temperature), token_logprobs(logits, rows["targets"])

    def scorer(rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        parts = []
        for start in range(0, len(rows["tokens"]), rows_per_call):
            inputs = {name: rows[name][start : start + rows_per_call] for name in ROW_FIELDS}
            with contextlib.nullcontext() if mesh is None else use_sharding(mesh, SERVING_RULES):
                if mesh is not None:
                    inputs = jax.device_put(inputs, NamedSharding(mesh, PartitionSpec()))
                old, untempered = logprobs(engine.program.params, inputs)
                scored = {"old_logprobs": old, "engine_view": untempered}
                if reference is not None:
                    scored["ref_logprobs"] = logprobs(reference, inputs)[0]
            parts.append(scored)
        parts = jax.device_get(parts)
        return {name: np.concatenate([part[name] for part in parts]) for name in parts[0]}

    return scorer


class _RolloutMonitor:
    """Logs what rollouts measured and the held-out reward (see the module docstring)."""

    def __init__(self, task: GRPOTask, trainer):
        self.task, self.trainer = task, trainer
        self.logged_rollouts = 0
        self.logged_step = int(trainer.state.step)  # a resumed run starts from its restored step
        self.resumed_step = self.logged_step
        self.since = time.perf_counter()
        self.eval_seconds = 0.0
        self.start: tuple[int, dict[str, float]] | None = None

    def write_start(self, info) -> None:
        """Writes the held-out rewards evaluated before training (the writer opens with the loop)."""
        if self.start is not None:
            self.trainer.writer.write(*self.start)
            self.start = None

    def log(self, info) -> None:
        history = self.task.data.history[self.logged_rollouts :]
        self.logged_rollouts = len(self.task.data.history)
        now = time.perf_counter()
        wall, self.since = now - self.since - self.eval_seconds, now
        steps, self.logged_step = info.step - self.logged_step, info.step  # trained since the last log
        self.eval_seconds = 0.0
        if not history:
            return
        rollout_seconds = sum(s.seconds for s in history)
        update_seconds = max(wall - rollout_seconds, 1e-9)
        values = {
            "rollout_tokens_per_second": sum(s.tokens for s in history) / max(rollout_seconds, 1e-9),
            "train_tokens_per_second": self.task.work_per_step()["tokens"] * steps / update_seconds,
            "rollout_time_fraction": rollout_seconds / max(wall, 1e-9),
            "logprob_mismatch_mean": float(np.mean([s.logprob_mismatch_mean for s in history])),
            "logprob_mismatch_max": max(s.logprob_mismatch_max for s in history),
            "zero_advantage_groups": float(np.mean([s.zero_advantage_groups for s in history])),
            "reward_failures": float(sum(len(s.failures) for s in history)),
        }
        self.trainer.writer.write(info.step, values)
        self.trainer.last_metrics.update(values)
        for stats in history:
            for failure in stats.failures[:3]:
                self.trainer.writer.event(info.step, f"reward failed in rollout {stats.rollout}, {failure}")

    def start_values(self) -> None:
        """The held-out rewards before training (the summary's ``*_start``): evaluated now on a
        fresh start; a resumed run takes them from its log (its policy is no longer the start's)."""
        if int(self.trainer.state.step) == 0:
            self.evaluate(None)
            return
        start = self._logged_rewards(0)
        self.trainer.results.update({f"{name}_start": value for name, value in start.items()})

    def evaluate(self, info) -> None:
        """The held-out rewards now (``info`` None: before training, written at the first step).
        A finished run resumed (no steps left) takes its final ones from its log when they are there."""
        logged = self._logged_rewards(info.step) if info is not None and info.step <= self.resumed_step else {}
        if logged:
            self.trainer.last_metrics.update(logged)
            self.trainer.results.update(logged)
            return
        start = time.perf_counter()
        values = self.task.evaluate()
        self.eval_seconds += time.perf_counter() - start
        self.trainer.last_metrics.update(values)
        self.trainer.results.update(values)
        if info is None:
            self.trainer.results.update({f"{name}_start": value for name, value in values.items()})
            self.start = (int(self.trainer.state.step), values)
        else:
            self.trainer.writer.write(info.step, values)

    def _logged_rewards(self, step: int) -> dict[str, float]:
        """The held-out rewards the run's log holds for ``step`` (``{}``: none)."""
        records = read_metrics(self.trainer.run_dir) if (self.trainer.run_dir / METRICS_FILE).is_file() else []
        record = next((r for r in records if r["step"] == step and "eval_reward" in r), {})
        return {name: value for name, value in record.items() if name.startswith("eval_reward")}


__all__ = ["GRPOTask"]
