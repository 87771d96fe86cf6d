"""The train and eval steps of every task: pure module-level functions, jitted by the trainer.

Gradient accumulation is exact: each micro-batch contributes the *sum* of its losses and
their count, and the update uses the totals, so ``grad_accum=4`` gives the gradient of one
batch four times larger (up to float summation order). The totals are float32 even for
bfloat16 / float16 parameters; the averaged gradient is cast back to the parameter's dtype.
An auxiliary loss ``a`` with weight ``w`` adds ``w * a`` to the objective, ``a`` averaged over
micro-batches weighted by their counts (with one micro-batch: exactly ``mean loss + w * a``).

Only ``select(params, mask)`` is differentiated and held in the optimizer state; frozen
parameters are closed-over constants, returned unchanged.

Model state (``ember.models.variables``) is updated by the forward passes, not by the
optimizer: micro-batches apply it **sequentially** (micro-batch ``a + 1`` sees the state
micro-batch ``a`` left), so ``grad_accum=k`` updates it as ``k`` smaller steps would. Sown
metrics are averaged over micro-batches weighted by their counts, like auxiliary losses.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

from ember.core.errors import ConfigError, EmberError
from ember.models.variables import split_variables
from ember.training.loss_scaling import MINIMUM_SCALE, LossScaleState, next_loss_scale
from ember.training.task import LossTerms
from ember.training.trainable import Mask, merge, select

LossFn = Callable[..., LossTerms]
"""``loss_fn(params, batch, *, rng, teacher) -> LossTerms`` (a task's ``loss``)."""


@flax.struct.dataclass
class TrainState:
    """Everything a run checkpoints: the step, all (float32 master) params, the optimizer
    state of the trainable ones, and the model state (``{}`` for models without any)."""

    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any


def init_state(
    rng: jax.Array,
    *,
    init_variables: Callable[[jax.Array], Any],
    tx: optax.GradientTransformation,
    mask: Mask,
) -> TrainState:
    """A fresh state from ``init_variables(rng)`` (a task's). Parameters (and the optimizer
    moments built from them, see :func:`init_opt_state`) keep their ``nn.Partitioned`` logical
    annotations, so ``nn.get_partition_spec`` of the abstract state gives the shardings; the
    trainer unboxes after placement."""
    params, model_state = split_variables(init_variables(rng))
    return TrainState(
        step=jnp.zeros((), jnp.int32),
        params=params,
        opt_state=init_opt_state(tx, select(params, mask)),
        model_state=model_state,
    )


def init_opt_state(tx: optax.GradientTransformation, params: Any) -> Any:
    """``tx.init(params)`` with a parameter's logical axes kept on the state leaves of its
    shape (moments: sharded like the parameter) and dropped from the others (Adafactor's
    factored rows and columns, GaLore's projected moments and projectors: replicated).

    ``tx.init`` maps over the boxed ``params``, so every leaf it derives from a parameter
    inherits the parameter's box, whatever its shape; the parameter's shape travels in the
    box's names through ``init`` to tell the two apart."""
    is_box = lambda x: isinstance(x, nn.Partitioned)  # noqa: E731

    def tag(box):
        return box.replace(names=(box.names, jnp.shape(box.value))) if is_box(box) else box

    def untag(box):
        if not is_box(box):
            return box
        names, shape = box.names
        return box.replace(names=names) if getattr(box.value, "shape", None) == shape else box.value

    state = tx.init(jax.tree.map(tag, params, is_leaf=is_box))
    return jax.tree.map(untag, state, is_leaf=is_box)


def call_loss(
    loss_fn: LossFn, params: Any, batch: Any, model_state: Any, *, rng: jax.Array, teacher: Any, step: Any = None
) -> LossTerms:
    """``loss_fn`` on one micro-batch, given ``model_state=`` only when the model has state
    and ``step=`` (the optimizer step, a traced int) only when the loss takes it (a schedule
    inside the loss, as QAT's phases); other tasks keep ``loss(params, batch, *, rng, teacher)``."""
    extra = {"model_state": model_state} if model_state else {}
    if step is not None and _takes_step(loss_fn):
        extra["step"] = step
    return loss_fn(params, batch, rng=rng, teacher=teacher, **extra)


def _takes_step(loss_fn: LossFn) -> bool:
    try:
        return "step" in inspect.signature(loss_fn).parameters
    except (TypeError, ValueError):  # a callable without an inspectable signature
        return False


def _micro_batches(batch: Any, accum: int) -> Any:
    """``[batch, ...]`` -> ``[accum, batch // accum, ...]`` taking rows ``a, a + accum, ...``
    into micro-batch ``a``, so every device's contiguous rows split evenly (no resharding)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)


def _weighted_aux(aux: dict[str, jax.Array], weights: dict[str, float]) -> jax.Array:
    """``sum(weights[name] * aux[name])``; every aux loss needs a weight and every weight a loss."""
    unweighted = [name for name in aux if name not in weights]
    if unweighted:
        losses = f"loss{'es' if len(unweighted) > 1 else ''} {', '.join(map(repr, unweighted))}"
        raise ConfigError(
            f"the model returns auxiliary {losses} but train.aux_loss_weights has no weight for "
            f"{'it' if len(unweighted) == 1 else 'them'}; set "
            f"{', '.join(f'train.aux_loss_weights.{name}' for name in unweighted)} (0 logs it without training on it)",
            key=f"train.aux_loss_weights.{unweighted[0]}",
        )
    unknown = [name for name in weights if name not in aux]
    if unknown:
        raise ConfigError(
            f"{', '.join(f'train.aux_loss_weights.{name}' for name in unknown)} "
            f"{'names' if len(unknown) == 1 else 'name'} no auxiliary loss of the model "
            f"(it returns: {', '.join(sorted(aux)) or 'none'})",
            key=f"train.aux_loss_weights.{unknown[0]}",
        )
    return sum((weights[name] * value for name, value in aux.items()), jnp.float32(0))


def train_step(
    state: TrainState,
    batch: Any,
    teacher: Any,
    *,
    loss_fn: LossFn,
    tx: optax.GradientTransformation,
    schedule: optax.Schedule,
    mask: Mask,
    aux_weights: dict[str, float] | None = None,
    grad_accum: int = 1,
    skip_nonfinite: bool = False,
    seed: int = 0,
    count_name: str = "count",
    batch_metrics: Callable[[Any], dict] | None = None,
    finish_metrics: Callable[[dict], dict] | None = None,
) -> tuple[TrainState, dict]:
    """One optimizer step over ``batch`` (``grad_accum`` micro-batches scanned in sequence).

    Returns the new state and metrics: ``loss`` (the mean main loss), each auxiliary loss by
    name, ``objective`` (loss plus weighted aux; only with aux losses), ``grad_norm``, ``lr``,
    ``count_name`` (the summed count), ``finite`` (loss and gradients finite) and each
    metric the model sowed (scalar or vector). With ``skip_nonfinite`` a non-finite step
    leaves params, optimizer moments and model state unchanged; the learning-rate schedule's
    step counts advance, so the rate follows the trainer's step (as the RNG and QAT's phases
    do) and the logged ``lr``, ``schedule(step)``, is the rate the step applied. The loss's
    ``rng`` is ``fold_in(fold_in(key(seed), step), micro_batch)``.

    With a :class:`~ember.training.loss_scaling.LossScaleState` optimizer state (float16
    training), every micro-batch's mean objective is multiplied by the scale before
    differentiation and its float32 gradients brought back to the sum's after; a step whose
    scaled gradients overflow while its loss is finite is skipped as above and counts as
    finite (the scale halves; at the minimum scale it is a non-finite step like any other).
    Metrics add ``loss_scale`` (the scale this step used) and, with loss scaling or
    ``skip_nonfinite``, ``skipped`` (1 for a skipped step). ``batch_metrics`` (a task's
    ``Task.batch_metrics``) adds statistics of the whole ``batch``; ``finish_metrics`` (a task's
    ``Task.finish_metrics``) maps the metrics last.
    """
    weights = dict(aux_weights or {})
    trainable = select(state.params, mask)
    step_rng = jax.random.fold_in(jax.random.key(seed), state.step)
    scaled = isinstance(state.opt_state, LossScaleState)
    loss_scale = state.opt_state.scale if scaled else None

    def objective(subset, micro, rng, model_state):
        params = merge(state.params, subset)
        terms = call_loss(loss_fn, params, micro, model_state, rng=rng, teacher=teacher, step=state.step)
        total = terms.loss_sum + terms.count * _weighted_aux(terms.aux, weights)
        if scaled:  # the scaled *mean*: a sum over many tokens would overflow float16 weight gradients
            total = total * (loss_scale / jnp.maximum(terms.count, 1.0))
        sums = (
            terms.loss_sum,
            terms.count,
            {k: terms.count * v for k, v in terms.aux.items()},
            {k: terms.count * v for k, v in terms.metrics.items()},
        )
        return total, (sums, model_state if terms.model_state is None else terms.model_state)

    grad_fn = jax.value_and_grad(objective, has_aux=True)
    micro_batches = _micro_batches(batch, grad_accum)

    def accumulate(carry, inputs):
        grads, sums, model_state = carry
        micro, index = inputs
        (_, (micro_sums, model_state)), micro_grads = grad_fn(
            trainable, micro, jax.random.fold_in(step_rng, index), model_state
        )
        if scaled:  # back to the gradient of the micro-batch's sum, in float32
            unscale = jnp.maximum(micro_sums[1], 1.0) / loss_scale
            micro_grads = jax.tree.map(lambda g: g * unscale, micro_grads)
        grads = jax.tree.map(lambda total, g: total + g.astype(total.dtype), grads, micro_grads)
        return (grads, jax.tree.map(jnp.add, sums, micro_sums), model_state), None

    first = jax.tree.map(lambda x: x[0], micro_batches)
    sums_shape = jax.eval_shape(lambda: objective(trainable, first, step_rng, state.model_state)[1][0])
    grad_zeros = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), _accumulation_dtype(p, grad_accum)), trainable)
    (grads, (loss_sum, count, aux_sums, metric_sums), model_state), _ = jax.lax.scan(
        accumulate,
        (grad_zeros, jax.tree.map(jnp.zeros_like, sums_shape), state.model_state),
        (micro_batches, jnp.arange(grad_accum)),
    )
    denominator = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g, p: (g / denominator).astype(jnp.result_type(p)), grads, trainable)
    loss = loss_sum / denominator
    aux = {name: value / denominator for name, value in aux_sums.items()}
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, trainable)
    new_trainable = optax.apply_updates(trainable, updates)
    grads_finite = jnp.isfinite(grad_norm)
    overflow = jnp.isfinite(loss) & ~grads_finite & (loss_scale > MINIMUM_SCALE) if scaled else False
    finite = jnp.isfinite(loss) & (grads_finite | overflow)
    skipped = overflow | (~finite if skip_nonfinite else False)
    if scaled or skip_nonfinite:
        new_trainable, opt_state, model_state = jax.tree.map(
            lambda new, old: new if _is_schedule(new) else jnp.where(skipped, old, new),
            (new_trainable, opt_state, model_state),
            (trainable, state.opt_state, state.model_state),
            is_leaf=_is_schedule,
        )
    if scaled:  # the wrapped optimizer's update left the scale as this step used it
        opt_state = next_loss_scale(opt_state, grads_finite)
    metrics = {
        "loss": loss,
        **aux,
        "grad_norm": grad_norm,
        "lr": schedule(state.step),
        count_name: count,
        "finite": finite,
    }
    if scaled:
        metrics["loss_scale"] = loss_scale
    if scaled or skip_nonfinite:
        metrics["skipped"] = skipped.astype(jnp.int32)
    if aux:
        metrics["objective"] = loss + _weighted_aux(aux, weights)
    clashing = sorted(set(metric_sums) & (set(metrics) | {"objective"}))
    if clashing:
        raise EmberError(
            f"the model sows metric(s) {', '.join(clashing)} under names the trainer's own metrics use; rename them"
        )
    metrics.update({name: value / denominator for name, value in metric_sums.items()})
    if batch_metrics is not None:
        metrics.update(batch_metrics(batch))
    if finish_metrics is not None:
        metrics = finish_metrics(metrics)
    new_state = TrainState(
        step=state.step + 1, params=merge(state.params, new_trainable), opt_state=opt_state, model_state=model_state
    )
    return new_state, metrics


def _accumulation_dtype(param: Any, grad_accum: int) -> jnp.dtype:
    """The dtype ``grad_accum`` micro-batches' gradients of ``param`` are summed in: float32 for
    a narrower float parameter (bf16 / f16 params), so the sum rounds no more than one batch's
    gradient does; the parameter's own dtype otherwise (one micro-batch adds to zero exactly)."""
    dtype = jnp.result_type(param)
    if grad_accum > 1 and jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize < 4:
        return jnp.dtype(jnp.float32)
    return dtype


def _is_schedule(node: Any) -> bool:
    """A schedule's step count in an optimizer state (``optax.scale_by_learning_rate``'s): it
    counts the trainer's steps, skipped ones included, so it equals ``TrainState.step``."""
    return isinstance(node, optax.ScaleByScheduleState)


def eval_step(
    params: Any, model_state: Any, batch: Any, teacher: Any, *, loss_fn: LossFn
) -> tuple[jax.Array, jax.Array]:
    """``(sum of losses, count)`` of one validation batch (auxiliary losses left out), the
    model reading ``model_state`` (its updates in this pass are dropped)."""
    terms = call_loss(loss_fn, params, batch, model_state, rng=jax.random.key(0), teacher=teacher)
    return terms.loss_sum, terms.count


__all__ = ["LossFn", "TrainState", "call_loss", "eval_step", "init_opt_state", "init_state", "train_step"]
