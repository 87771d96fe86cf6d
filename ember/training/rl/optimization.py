"""The gradient machinery of the on-policy algorithms (PPO, IPPO, MAPPO): the optimizer and
the epochs of shuffled minibatch steps over one rollout."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax.training.train_state import TrainState


def make_optimizer(
    learning_rate: jax.Array, max_grad_norm: jax.Array, *, anneal_steps: int | None
) -> optax.GradientTransformation:
    """Adam after a global-norm clip; with ``anneal_steps``, the learning rate decays
    linearly to 0 over that many optimizer steps."""
    if anneal_steps is not None:
        learning_rate = optax.linear_schedule(learning_rate, 0.0, anneal_steps)
    return optax.chain(optax.clip_by_global_norm(max_grad_norm), optax.adam(learning_rate, eps=1e-5))


def minibatch_epochs(
    train_state: TrainState,
    batch: Any,
    loss_fn: Callable[[Any, Any], tuple[jax.Array, dict[str, jax.Array]]],
    rng: jax.Array,
    *,
    num_epochs: int,
    num_minibatches: int,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """``num_epochs`` passes over ``batch`` (a pytree with a leading ``[batch]`` axis), each
    split into ``num_minibatches`` shuffled minibatches, one gradient step per minibatch.

    Returns:
      The updated train state and ``loss_fn``'s aux (plus ``loss``) averaged over all steps.
    """
    batch_size = jax.tree.leaves(batch)[0].shape[0]

    def epoch(state, key):
        permutation = jax.random.permutation(key, batch_size)
        shuffled = jax.tree.map(lambda x: x[permutation].reshape(num_minibatches, -1, *x.shape[1:]), batch)

        def step(state, minibatch):
            (loss, aux), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params, minibatch)
            return state.apply_gradients(grads=grads), {"loss": loss, **aux}

        return jax.lax.scan(step, state, shuffled)

    train_state, stats = jax.lax.scan(epoch, train_state, jax.random.split(rng, num_epochs))
    return train_state, jax.tree.map(jnp.mean, stats)


__all__ = ["make_optimizer", "minibatch_epochs"]
