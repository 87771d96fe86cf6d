"""Gradient accumulation sums the micro-batches' gradients in float32 whatever the parameters'
dtype, so ``grad_accum`` changes a bfloat16 model's gradient no more than one batch's rounding."""

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ember.training.task import LossTerms
from ember.training.train_step import init_state, train_step
from ember.training.trainable import trainable_mask


def test_bfloat16_gradients_accumulate_in_float32():
    """Micro-batch gradients 256, 1, 1, 1 of a bfloat16 parameter summed to 256 in bfloat16
    (256 + 1 rounds back to 256: bfloat16 has 8 significant bits), so the step's gradient was
    256 / 4 = 64 where the batch's is 259 / 4 = 64.75 (65 in bfloat16): every micro-batch after
    a large one was lost."""
    params = {"w": jnp.zeros((), jnp.bfloat16)}

    def loss(params, batch, *, rng, teacher):  # d loss_sum / d w = the micro-batch's g
        return LossTerms(jnp.sum(batch["g"] * params["w"].astype(jnp.float32)), jnp.float32(1.0))

    tx = optax.sgd(1.0)
    state = init_state(
        jax.random.key(0), init_variables=lambda _: {"params": params}, tx=tx, mask=trainable_mask(params)
    )
    batch = {"g": jnp.asarray([256.0, 1.0, 1.0, 1.0], jnp.float32)}
    new, metrics = train_step(
        state,
        batch,
        None,
        loss_fn=loss,
        tx=tx,
        schedule=optax.constant_schedule(1.0),
        mask=trainable_mask(params),
        grad_accum=4,
    )
    assert new.params["w"].dtype == jnp.bfloat16
    expected = -np.float32(jnp.bfloat16(259.0 / 4))  # sgd at rate 1 from 0: minus the mean gradient
    assert float(new.params["w"]) == expected == -65.0
    np.testing.assert_allclose(float(metrics["grad_norm"]), 65.0)


def test_bfloat16_parameters_train_with_a_dynamic_loss_scale():
    """``train.loss_scale=dynamic`` with bfloat16 parameters (``pure_bf16``) crashed at the first
    step: the unscaled gradients came out float32 and ``lax.scan`` refused the bfloat16 gradient
    carry turning float32 (a TypeError traceback). The step now equals the unscaled one."""
    from ember.training.loss_scaling import with_dynamic_loss_scale

    params = {"w": jnp.zeros((), jnp.bfloat16)}

    def loss(params, batch, *, rng, teacher):
        return LossTerms(jnp.sum(batch["g"] * params["w"].astype(jnp.float32)), jnp.float32(1.0))

    batch = {"g": jnp.asarray([256.0, 1.0, 1.0, 1.0], jnp.float32)}
    for grad_accum in (1, 4):
        steps = []
        for tx in (optax.sgd(1.0), with_dynamic_loss_scale(optax.sgd(1.0))):
            mask = trainable_mask(params)
            state = init_state(jax.random.key(0), init_variables=lambda _: {"params": params}, tx=tx, mask=mask)
            new, _ = train_step(
                state, batch, None, loss_fn=loss, tx=tx, schedule=optax.constant_schedule(1.0), mask=mask,
                grad_accum=grad_accum,
            )  # fmt: skip
            steps.append(float(new.params["w"]))
        assert steps[0] == steps[1] == -float(jnp.bfloat16(259.0 / grad_accum))
