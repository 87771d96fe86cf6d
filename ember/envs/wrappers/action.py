"""Action wrappers: ``ClipAction``, ``RescaleAction`` (continuous) and ``CheckActions``."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

from ember.envs.spaces import Box
from ember.envs.wrappers.base import Wrapper


def _box_action_space(env, params, wrapper: str) -> Box:
    space = env.action_space(params)
    if not isinstance(space, Box) or not space.bounded:
        raise ValueError(f"{wrapper}: needs a bounded Box action space, got {space!r}")
    return space


class ClipAction(Wrapper):
    """Accepts any real action and clips it to the inner Box (whose action space it
    advertises as unbounded, so a policy may output raw Gaussian samples)."""

    def action_space(self, params):
        inner = _box_action_space(self.env, params, "ClipAction")
        return Box(-np.inf, np.inf, inner.shape, inner.dtype)

    def step_from_noise(self, noise, state, action, params):
        inner = _box_action_space(self.env, params, "ClipAction")
        return self.env.step_from_noise(noise, state, inner.clip(action), params)


class RescaleAction(Wrapper):
    """Actions in ``[low, high]`` (default ``[-1, 1]``) mapped affinely onto the inner Box."""

    def __init__(self, env, low: float = -1.0, high: float = 1.0):
        super().__init__(env)
        if not (np.isfinite(low) and np.isfinite(high) and low < high):  # an infinite end maps every action to one
            raise ValueError(f"RescaleAction: need finite low < high, got low={low}, high={high}")
        self.low, self.high = float(low), float(high)

    def action_space(self, params):
        inner = _box_action_space(self.env, params, "RescaleAction")
        return Box(self.low, self.high, inner.shape, inner.dtype)

    def step_from_noise(self, noise, state, action, params):
        inner = _box_action_space(self.env, params, "RescaleAction")
        fraction = (jnp.asarray(action) - self.low) / (self.high - self.low)
        inner_action = inner.low + fraction * (inner.high - inner.low)
        return self.env.step_from_noise(noise, state, inner_action.astype(inner.dtype), params)


class CheckActions(Wrapper):
    """Makes an action outside the action space (out-of-range integer, NaN, out of
    bounds) a ``checkify`` error instead of being clipped:

        step = checkify.checkify(jax.jit(env.step))
        error, out = step(key, state, action, params); error.throw()
    """

    one_environment = True

    def step_from_noise(self, noise, state, action, params):
        space = self.env.action_space(params)
        checkify.check(space.contains(action), f"action outside the action space {space!r}")
        return self.env.step_from_noise(noise, state, action, params)
