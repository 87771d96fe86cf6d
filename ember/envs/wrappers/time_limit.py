"""``TimeLimit``: a different episode length without touching the params you pass;
``max_episode_steps``: how many steps an episode of a wrapper stack can last at most."""

from __future__ import annotations

from ember.core.integers import is_integer
from ember.envs.registry import MAX_EPISODE_STEPS
from ember.envs.wrappers.base import Wrapper


class TimeLimit(Wrapper):
    """Truncates episodes after ``max_steps`` steps, whatever ``params.max_steps_in_episode``
    says (the wrapped environment's truncation and auto-reset then apply unchanged)."""

    def __init__(self, env, max_steps: int):
        super().__init__(env)
        if not is_integer(max_steps) or not 1 <= max_steps <= MAX_EPISODE_STEPS:
            # Past int32 the comparison with the int32 step counter overflows at the first step.
            raise ValueError(f"TimeLimit: max_steps must be an int in [1, {MAX_EPISODE_STEPS}], got {max_steps!r}")
        self.max_steps = max_steps

    def _limited(self, params):
        return params.replace(max_steps_in_episode=self.max_steps)

    @property
    def default_params(self):
        return self._limited(self.env.default_params)

    def reset_from_noise(self, noise, params):
        return self.env.reset_from_noise(noise, self._limited(params))

    def step_from_noise(self, noise, state, action, params):
        return self.env.step_from_noise(noise, state, action, self._limited(params))


def max_episode_steps(env, params) -> int:
    """A cap on the length of one episode of ``env`` under ``params``: the largest of
    ``params.max_steps_in_episode`` and the ``max_steps`` of every ``TimeLimit`` in the
    stack of wrappers (followed through ``.env``). The limit that applies is the innermost
    ``TimeLimit``'s, or the params' without one; the largest is never shorter."""
    limits = [int(params.max_steps_in_episode)]
    while env is not None:
        if isinstance(env, TimeLimit):
            limits.append(env.max_steps)
        env = getattr(env, "env", None)
    return max(limits)
