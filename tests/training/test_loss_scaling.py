"""Dynamic loss scaling: float16 gradients that flush to zero unscaled train with it; a step
whose scaled gradients overflow is skipped and halves the scale, which grows back after a run
of finite steps; at the minimum scale a non-finite gradient is non-finite (``train.on_nan``)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ember.models.config import ModelConfig
from ember.models.decoder import DecoderLM
from ember.training.loss_scaling import (
    GROWTH_INTERVAL,
    INITIAL_SCALE,
    MINIMUM_SCALE,
    LossScaleState,
    next_loss_scale,
    uses_loss_scaling,
    with_dynamic_loss_scale,
)
from ember.training.task import LossTerms, Task
from ember.training.train_step import init_state, train_step
from ember.training.trainable import trainable_mask
from tests.tolerances import assert_allclose

X = np.linspace(0.5, 1.5, 12, dtype=np.float32).reshape(3, 4)


def half_precision_loss(factor, count=1.0):
    """``factor * sum(x @ w)`` over ``count`` (a token count: the mean is their quotient) with
    the product in float16, as a float16 model computes: the cotangent reaching the float16
    product is ``factor / count`` times the loss scale, in float16."""

    def loss(params, batch, *, rng, teacher):
        product = batch["x"].astype(jnp.float16) @ params["w"].astype(jnp.float16)
        return LossTerms(factor * jnp.sum(product.astype(jnp.float32)), jnp.float32(count))

    return loss


PARAMS = {"w": jnp.ones((4, 2), jnp.float32)}


def fresh_state(tx):
    return init_state(
        jax.random.key(0), init_variables=lambda _: {"params": PARAMS}, tx=tx, mask=trainable_mask(PARAMS)
    )


def one_step(factor, tx, *, state=None, count=1.0):
    step = functools.partial(
        train_step,
        loss_fn=half_precision_loss(factor, count),
        tx=tx,
        schedule=optax.constant_schedule(1.0),
        mask=trainable_mask(PARAMS),
    )
    return jax.jit(step)(fresh_state(tx) if state is None else state, {"x": jnp.asarray(X)}, None)


def expected_gradient(factor):
    """``d(factor * sum(x @ w)) / dw``, in float32: each row of w gets ``factor`` times a column sum of x."""
    return np.repeat(factor * X.sum(axis=0)[:, None], 2, axis=1)


def test_gradients_that_flush_to_zero_in_float16_train_with_a_loss_scale():
    factor = 1e-8  # below float16's smallest subnormal (6e-8): the unscaled cotangent is 0
    sgd = optax.sgd(1.0)
    unscaled, _ = one_step(factor, sgd)
    assert np.array_equal(np.asarray(unscaled.params["w"]), np.ones((4, 2)))  # no update at all

    state, metrics = one_step(factor, with_dynamic_loss_scale(sgd))
    update = 1.0 - np.asarray(state.params["w"])
    assert_allclose(update, expected_gradient(factor), dtype=np.float16)
    assert float(metrics["loss_scale"]) == INITIAL_SCALE and int(metrics["skipped"]) == 0
    assert float(state.opt_state.scale) == INITIAL_SCALE and int(state.opt_state.good_steps) == 1


def test_an_overflowing_step_is_skipped_and_halves_the_scale_until_the_gradients_fit():
    """The weight gradient ``1e3 * scale * column sums of x`` (at most 3.41) overflows float16
    (65504) until the scale is at most 16: eleven halvings from ``2**15`` skip eleven steps,
    the twelfth trains."""
    factor, tx = 1e3, with_dynamic_loss_scale(optax.sgd(1e-6))
    state, skipped, scales = None, [], []
    for _ in range(12):
        state, metrics = one_step(factor, tx, state=state)
        skipped.append(int(metrics["skipped"]))
        scales.append(float(metrics["loss_scale"]))
        assert bool(metrics["finite"])  # an overflow is the scaler's business, not train.on_nan's
    assert skipped == [1] * 11 + [0]
    assert scales == [INITIAL_SCALE / 2**i for i in range(12)]
    assert int(state.step) == 12 and int(state.opt_state.good_steps) == 1
    update = 1.0 - np.asarray(state.params["w"])
    assert_allclose(update, 1e-6 * expected_gradient(factor), dtype=np.float16)


def test_the_scale_multiplies_the_mean_loss_not_a_sum_over_tokens():
    """A loss summed over 1e5 tokens: its sum's weight gradient (3.4e5) overflows float16 at any
    scale, its mean's (3.4) times the scale fits from ``2**14`` down. One skipped step, then the
    update of the mean loss."""
    tx = with_dynamic_loss_scale(optax.sgd(1e-3))
    state, first = one_step(1e5, tx, count=1e5)
    state, second = one_step(1e5, tx, state=state, count=1e5)
    assert [int(first["skipped"]), int(second["skipped"])] == [1, 0]
    assert float(second["loss_scale"]) == INITIAL_SCALE / 2
    assert_allclose(1.0 - np.asarray(state.params["w"]), 1e-3 * expected_gradient(1.0), dtype=np.float16)


def test_at_the_minimum_scale_a_non_finite_gradient_is_not_an_overflow():
    tx = with_dynamic_loss_scale(optax.sgd(1.0))
    fresh = fresh_state(tx)
    at_minimum = fresh.replace(opt_state=fresh.opt_state._replace(scale=jnp.float32(MINIMUM_SCALE)))
    state, metrics = one_step(1e6, tx, state=at_minimum)  # 1e6 overflows float16 at any scale
    assert not bool(metrics["finite"]) and int(metrics["skipped"]) == 0
    assert float(state.opt_state.scale) == MINIMUM_SCALE


def test_the_scale_doubles_after_the_growth_interval_and_halves_on_overflow():
    state = LossScaleState(jnp.float32(8.0), jnp.int32(GROWTH_INTERVAL - 2), None)
    state = next_loss_scale(state, jnp.bool_(True))
    assert (float(state.scale), int(state.good_steps)) == (8.0, GROWTH_INTERVAL - 1)
    state = next_loss_scale(state, jnp.bool_(True))
    assert (float(state.scale), int(state.good_steps)) == (16.0, 0)
    state = next_loss_scale(state._replace(good_steps=jnp.int32(5)), jnp.bool_(False))
    assert (float(state.scale), int(state.good_steps)) == (8.0, 0)
    floor = next_loss_scale(state._replace(scale=jnp.float32(MINIMUM_SCALE)), jnp.bool_(False))
    assert float(floor.scale) == MINIMUM_SCALE


def test_auto_scales_models_that_compute_in_float16_only():
    class Lm(Task):
        def __init__(self, precision):
            self.model = DecoderLM(ModelConfig(precision=precision))

    assert Lm("f16").compute_dtype() == jnp.float16 and Lm("bf16").compute_dtype() == jnp.bfloat16
    assert [uses_loss_scaling("auto", Lm(p).compute_dtype()) for p in ("f16", "bf16", "f32")] == [True, False, False]
    assert uses_loss_scaling("dynamic", jnp.float32) and not uses_loss_scaling("off", jnp.float16)
