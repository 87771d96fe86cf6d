"""What a task gives the trainer: the model, the loss, the data, the trainable mask, a teacher.

    class Regression(Task):
        model = MyFlaxModule()
        def init_params(self, rng):            return self.model.init(rng, x0)["params"]
        def loss(self, params, batch, *, rng, teacher):
            error = self.model.apply({"params": params}, batch["x"]) - batch["y"]
            return LossTerms(jnp.sum(error ** 2), jnp.float32(error.size))
        def train_data(self):                  return MyBatches()   # next(), state(), restore()

    Trainer(Regression(), ...).train()

Pretraining the decoder LM is one task (``ember.training.lm.task.LMTask``). The loss
returns *sums* and a count so gradient accumulation is exact; auxiliary losses (MoE
balance, ...) come back by name in ``LossTerms.aux`` (see :func:`apply_with_aux` for the
ones a model sows) and the trainer weights them with ``train.aux_loss_weights``.

Models with **state** (non-gradient collections their forward pass updates, see
``ember.models.variables``) override :meth:`Task.init_variables`; their ``loss`` then takes
a ``model_state`` keyword (the current state) and returns the updated one in
``LossTerms.model_state`` (:func:`apply_model` does both). Scalars or small vectors a model
sows into ``"metrics"`` come back in ``LossTerms.metrics`` and are logged per step.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

if TYPE_CHECKING:
    from ember.training.trainer import Trainer

Batch = Any
"""A pytree of host arrays whose leading axis is the (process-local) batch."""
AUX_COLLECTION = "losses"
"""The Linen collection auxiliary losses are sown into: ``self.sow("losses", "balance", value)``."""
METRICS_COLLECTION = "metrics"
"""The Linen collection logged metrics are sown into: ``self.sow("metrics", "expert_load", load)``."""


class LossTerms(NamedTuple):
    """One (micro-)batch's loss: ``loss_sum / count`` is its mean. ``aux``: scalar auxiliary
    losses by name, each already a mean over this batch. ``metrics``: scalars or small
    vectors to log by name (means over this batch). ``model_state``: the updated model state
    (``None``: the model has none, or left it unchanged)."""

    loss_sum: jax.Array
    count: jax.Array
    aux: Mapping[str, jax.Array] = MappingProxyType({})
    metrics: Mapping[str, jax.Array] = MappingProxyType({})
    model_state: Any = None


class BatchIterator(Protocol):
    """Training data: an endless iterator whose position can be saved and restored, so a
    resumed run sees the same batches."""

    def next(self) -> Batch: ...

    def state(self) -> dict[str, Any]: ...

    def restore(self, state: dict[str, Any]) -> None: ...

    # Optional: ``batch_spec() -> pytree of jax.ShapeDtypeStruct``, the shapes of every batch,
    # for iterators whose batches are costly to make (the trainer otherwise peeks one).


class Task:
    """Base class of a trainer task; override what your task needs (see the module docstring).

    Required: ``model``, :meth:`init_params`, :meth:`loss`, :meth:`train_data`.
    """

    model: nn.Module
    batch_axes: tuple[str | None, ...] = ("batch",)
    """Logical axes of every batch leaf's leading dimensions (the rest are replicated)."""
    count_name: str = "count"
    """The metric name of ``LossTerms.count`` summed over a step (the LM says ``tokens``)."""

    def init_params(self, rng: jax.Array) -> Any:
        """Fresh parameters (they may carry ``nn.with_logical_partitioning`` boxes)."""
        raise NotImplementedError

    def init_variables(self, rng: jax.Array, pretrained: Any = None) -> dict[str, Any]:
        """Fresh variables: ``{"params": ..., <state collection>: ...}`` (what ``model.init``
        returns). Override it when the model has state; by default ``{"params": init_params}``.
        A task with :meth:`pretrained` weights receives them as ``pretrained`` (traced arrays)."""
        return {"params": self.init_params(rng)}

    def pretrained(self) -> Any | None:
        """The weights a run starts from (fine-tuning: host arrays, any pytree), or None to
        start from :meth:`init_variables` alone. The trainer passes them to
        ``init_variables(rng, pretrained)`` as an argument of the jitted initialisation, so a
        large model is not compiled in as constants (a resumed run uses only their shapes)."""
        return None

    def loss(self, params: Any, batch: Batch, *, rng: jax.Array, teacher: Any) -> LossTerms:
        """The loss of one micro-batch; ``teacher`` is :meth:`teacher_params` (or None). A
        task whose model has state also receives ``model_state=`` (see the module docstring)."""
        raise NotImplementedError

    def train_data(self) -> BatchIterator:
        raise NotImplementedError

    def eval_data(self) -> Iterable[Batch] | None:
        """A fresh, finite iterable of validation batches (``None``: no evaluation)."""
        return None

    def trainable(self, params: Any) -> Any | None:
        """A mask of the parameters to train (see ``ember.training.trainable``); ``None`` trains all.
        ``train.freeze`` patterns freeze further parameters on top of it."""
        return None

    def teacher_params(self) -> Any | None:
        """A frozen teacher's parameters, passed to :meth:`loss` (distillation); never trained
        or checkpointed. May carry logical-partitioning boxes for their shardings."""
        return None

    def work_per_step(self) -> dict[str, float]:
        """Amounts per optimizer step for throughput metrics: ``tokens`` gives
        ``tokens_per_second``, ``flops`` gives ``mfu``."""
        return {}

    def add_hooks(self, trainer: Trainer) -> None:
        """Registers the task's own periodic work (samples, ...) with ``trainer.add_hook``."""

    def compute_dtype(self) -> jnp.dtype:
        """The dtype the model computes in (float16 turns on dynamic loss scaling under
        ``train.loss_scale=auto``): the precision policy of a model with an Ember
        ``config`` (``DecoderLM``), else float32. Override it for a model of your own that
        computes in float16."""
        policy = getattr(getattr(self.model, "config", None), "policy", None)
        return jnp.dtype(policy.compute_dtype if policy is not None else jnp.float32)

    def batch_metrics(self, batch: Any) -> dict[str, jax.Array]:
        """Statistics of a train step's whole batch, before it is split into ``train.grad_accum``
        micro-batches (in the jitted step), logged with its metrics: the place for what is no
        mean of per-micro-batch values, such as a standard deviation of the data (computed from
        centred values, which a mean square minus a squared mean is not). Default: none."""
        return {}

    def finish_metrics(self, metrics: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """The step's metrics once each of ``LossTerms.metrics`` is averaged over the step's
        micro-batches (in the jitted step): what is not such a mean is computed here from means
        the loss reported (a mean over tokens from sums per completion). Default: as given."""
        return metrics

    def restore_layout(self, saved_params: Any) -> tuple[Task, Any] | None:
        """``None`` when a checkpoint whose params look like ``saved_params`` (metadata) loads
        as is; otherwise ``(task whose params have the saved layout, convert)`` where
        ``convert(tree)`` maps a train-state tree from that layout to this task's."""
        return None


class ModelOutputs(NamedTuple):
    """What :func:`apply_model` returns."""

    output: Any
    aux: dict[str, jax.Array]
    """Auxiliary losses sown into ``"losses"``, each name's values summed over layers (a value
    sown inside the scanned layers has a leading ``[groups]`` axis, summed too)."""
    metrics: dict[str, jax.Array]
    """Metrics sown into ``"metrics"``, each name's values averaged over the layers that sowed it."""
    model_state: dict[str, Any] | None
    """The updated model state (``None`` when called without one)."""


def apply_model(
    model: nn.Module, params: Any, *args: Any, model_state: Mapping[str, Any] | None = None, **kwargs: Any
) -> ModelOutputs:
    """``model.apply`` on ``params`` and ``model_state`` (updated in the pass: its
    collections are mutable), collecting what the model sows (see :class:`ModelOutputs`)."""
    state = dict(model_state or {})
    mutable = [AUX_COLLECTION, METRICS_COLLECTION, *state]
    output, updated = model.apply({"params": params, **state}, *args, mutable=mutable, **kwargs)
    aux = _sown_by_name(updated.get(AUX_COLLECTION, {}))
    metrics = _sown_by_name(updated.get(METRICS_COLLECTION, {}))
    return ModelOutputs(
        output,
        {name: sum(jnp.sum(jnp.asarray(v, jnp.float32)) for v in values) for name, values in aux.items()},
        {name: sum(jnp.asarray(v, jnp.float32) for v in values) / len(values) for name, values in metrics.items()},
        {name: updated[name] for name in state} if model_state is not None else None,
    )


def apply_with_aux(model: nn.Module, params: Any, *args: Any, **kwargs: Any) -> tuple[Any, dict[str, jax.Array]]:
    """``model.apply`` that also returns the auxiliary losses it sowed into ``"losses"``,
    each name's sown values summed (``{}`` when it sowed none)."""
    outputs = apply_model(model, params, *args, **kwargs)
    return outputs.output, outputs.aux


def _sown_by_name(tree: dict) -> dict[str, list]:
    """Sown tuples keyed by their sow name (the last path element), across modules."""
    found: dict[str, list] = {}
    for key, value in tree.items():
        if isinstance(value, tuple):
            found.setdefault(key, []).extend(value)
        else:
            for name, values in _sown_by_name(value).items():
                found.setdefault(name, []).extend(values)
    return found


def next_token_loss(logits: jax.Array, targets: jax.Array, loss_mask: jax.Array) -> tuple[jax.Array, jax.Array]:
    """``(sum of masked token cross-entropies, number of unmasked tokens)`` in float32 for
    ``logits [batch, seq, vocab]``, ``targets [batch, seq]`` ints and ``loss_mask [batch, seq]``."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
    mask = loss_mask.astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def next_token_kl(
    student_logits: jax.Array, teacher_logits: jax.Array, loss_mask: jax.Array, temperature: float = 1.0
) -> jax.Array:
    """Sum over unmasked tokens of ``KL(teacher || student)`` between the next-token
    distributions at ``temperature`` (times ``temperature**2``, so gradients keep their scale),
    float32; logits ``[batch, seq, vocab]``, ``loss_mask [batch, seq]``."""
    student = jax.nn.log_softmax(student_logits.astype(jnp.float32) / temperature, axis=-1)
    teacher = jax.nn.log_softmax(teacher_logits.astype(jnp.float32) / temperature, axis=-1)
    per_token = jnp.sum(jnp.exp(teacher) * (teacher - student), axis=-1) * temperature**2
    return jnp.sum(per_token * loss_mask.astype(jnp.float32))


__all__ = [
    "AUX_COLLECTION",
    "METRICS_COLLECTION",
    "Batch",
    "BatchIterator",
    "LossTerms",
    "ModelOutputs",
    "Task",
    "apply_model",
    "apply_with_aux",
    "next_token_kl",
    "next_token_loss",
]
