"""``Wrapper``: an ``Environment`` around another one that forwards what it does not change.

A wrapper overrides ``reset_from_noise`` / ``step_from_noise`` (the full contract,
auto-reset included); ``reset`` / ``step`` of the base class then draw the right number of
random words for the whole stack.
"""

from __future__ import annotations

from ember.envs.environment import Environment


class Wrapper(Environment):
    #: True when this wrapper's state is a dataclass holding the inner state as ``env_state``.
    wraps_state: bool = False
    #: True when this wrapper reads one environment's values (an observation's shape, an
    #: action's space): it refuses to wrap a batch (``BatchedEnv``), whose values have a leading
    #: ``[num_envs]`` axis, and goes inside it instead.
    one_environment: bool = False

    def __init__(self, env: Environment):
        if not isinstance(env, Environment):
            raise ValueError(f"{type(self).__name__}: env must be an ember Environment, got {type(env).__name__}")
        if self.one_environment and num_envs(env) is not None:
            name = type(self).__name__
            raise ValueError(
                f"{name}: wraps one environment, not a batch of {num_envs(env)} ({env!r}); wrap each environment "
                f"first and batch the result: BatchedEnv({name}(env, ...), num_envs)"
            )
        self.env = env

    @property
    def default_params(self):
        return self.env.default_params

    @property
    def reset_noise_shape(self):
        return self.env.reset_noise_shape

    @property
    def step_noise_shape(self):
        return self.env.step_noise_shape

    def draw_noise(self, key, shape):
        return self.env.draw_noise(key, shape)

    def reset_from_noise(self, noise, params):
        return self.env.reset_from_noise(noise, params)

    def step_from_noise(self, noise, state, action, params):
        return self.env.step_from_noise(noise, state, action, params)

    def observation_space(self, params):
        return self.env.observation_space(params)

    def action_space(self, params):
        return self.env.action_space(params)

    def render(self, state, params):
        return self.env.render(state.env_state if self.wraps_state else state, params)

    def action_masks(self, state, params):
        """The wrapped multi-agent environment's legal actions in ``state`` (``ember.envs.multi_agent``)."""
        return self.env.action_masks(state.env_state if self.wraps_state else state, params)

    def global_state(self, state, params):
        """The wrapped multi-agent environment's global state of ``state`` (``ember.envs.multi_agent``)."""
        return self.env.global_state(state.env_state if self.wraps_state else state, params)

    def global_state_space(self, params):
        return self.env.global_state_space(params)

    @property
    def name(self) -> str:
        return self.env.name

    @property
    def unwrapped(self) -> Environment:
        return getattr(self.env, "unwrapped", self.env)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.env!r})"


def require_array_observation(obs, wrapper: str) -> None:
    """Raises ``ValueError`` when ``obs`` (what ``wrapper`` got from a reset) is a dict or
    tuple of arrays rather than one array."""
    if not hasattr(obs, "shape"):
        raise ValueError(
            f"{wrapper}: the observation must be one array, got {type(obs).__name__}; "
            "wrap a pytree-observation env in FlattenObservation first"
        )


def num_envs(env) -> int | None:
    """``num_envs`` of the nearest ``BatchedEnv`` inside ``env`` through other wrappers, or
    ``None`` for a single environment."""
    while getattr(env, "num_envs", None) is None and isinstance(env, Wrapper):
        env = env.env
    return getattr(env, "num_envs", None)
