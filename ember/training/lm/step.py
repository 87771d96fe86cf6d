"""The LM train and eval steps: pure module-level functions, jitted by the trainer.

Gradient accumulation is exact: each micro-batch contributes the *sum* of its token losses
and its token count, and the update uses their totals, so ``grad_accum=4`` gives the same
gradient as one batch four times larger (up to float summation order).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax

Batch = dict[str, jax.Array]
"""``tokens``, ``targets``, ``segment_ids``, ``positions`` (int32) and ``loss_mask`` (float32),
each ``[batch, seq_len]``."""


@flax.struct.dataclass
class TrainState:
    """Everything a run checkpoints: the step, the (float32 master) params, the optimizer state."""

    step: jax.Array
    params: Any
    opt_state: Any


def init_state(rng: jax.Array, *, model: nn.Module, tx: optax.GradientTransformation, seq_len: int) -> TrainState:
    """A fresh state. Parameters (and the optimizer moments built from them) keep their
    ``nn.Partitioned`` logical annotations, so ``nn.get_partition_spec`` of the abstract
    state gives the shardings; the trainer unboxes after placement."""
    tokens = jnp.zeros((1, seq_len), jnp.int32)
    params = model.init(rng, tokens, positions=jnp.arange(seq_len, dtype=jnp.int32)[None])["params"]
    return TrainState(step=jnp.zeros((), jnp.int32), params=params, opt_state=tx.init(params))


def loss_sums(params: Any, batch: Batch, *, model: nn.Module) -> tuple[jax.Array, jax.Array]:
    """``(sum of masked token cross-entropies, number of unmasked tokens)`` in float32."""
    logits, _ = model.apply({"params": params}, batch["tokens"], positions=batch["positions"],
                            segment_ids=batch["segment_ids"])
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    mask = batch["loss_mask"].astype(jnp.float32)
    return jnp.sum(losses * mask), jnp.sum(mask)


def _micro_batches(batch: Batch, accum: int) -> Batch:
    """``[batch, ...]`` -> ``[accum, batch // accum, ...]`` taking rows ``a, a + accum, ...``
    into micro-batch ``a``, so every device's contiguous rows split evenly (no resharding)."""
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // accum, accum, *x.shape[1:]).swapaxes(0, 1), batch)


def train_step(state: TrainState, batch: Batch, *, model: nn.Module, tx: optax.GradientTransformation,
               schedule: optax.Schedule, grad_accum: int = 1, skip_nonfinite: bool = False) -> tuple[TrainState, dict]:
    """One optimizer step over ``batch`` (``grad_accum`` micro-batches scanned in sequence).

    Returns the new state and metrics: ``loss`` (mean per token), ``grad_norm``, ``lr``,
    ``tokens`` and ``finite`` (whether loss and gradients were finite). With
    ``skip_nonfinite`` a non-finite step leaves params and optimizer state unchanged.
    """
    grad_of_sums = jax.value_and_grad(lambda p, b: loss_sums(p, b, model=model), has_aux=True)

    def accumulate(carry, micro):
        grads, loss_sum, count = carry
        (micro_loss, micro_count), micro_grads = grad_of_sums(state.params, micro)
        return (jax.tree.map(jnp.add, grads, micro_grads), loss_sum + micro_loss, count + micro_count), None

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    (grads, loss_sum, count), _ = jax.lax.scan(
        accumulate, (zeros, jnp.float32(0), jnp.float32(0)), _micro_batches(batch, grad_accum)
    )
    denominator = jnp.maximum(count, 1.0)
    grads = jax.tree.map(lambda g: g / denominator, grads)
    loss = loss_sum / denominator
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    if skip_nonfinite:
        params, opt_state = jax.tree.map(lambda new, old: jnp.where(finite, new, old),
                                         (params, opt_state), (state.params, state.opt_state))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": schedule(state.step), "tokens": count, "finite": finite}
    return TrainState(step=state.step + 1, params=params, opt_state=opt_state), metrics


def eval_step(params: Any, batch: Batch, *, model: nn.Module) -> tuple[jax.Array, jax.Array]:
    """``(sum of token losses, token count)`` for one validation batch."""
    return loss_sums(params, batch, model=model)
