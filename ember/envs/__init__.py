"""Vectorized, jit-compiled JAX RL environments with the gymnax 1.0 functional contract
(DESIGN.md section 5). Imports nothing from Ember but ``ember.core``.

    import ember.envs
    env, params = ember.envs.make("CartPole-v1")
    obs, state = env.reset(key, params)
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

See ``ember.envs.environment`` for the exact step/auto-reset contract,
``ember.envs.multi_agent`` for the dict-per-agent one, ``EnvConfig``/``make_from_config``
for an environment named by a config section, ``BatchedEnv`` for batches drawing
their randomness in one call, ``ember.envs.wrappers``, and ``ember.envs.adapters`` (gymnax,
JaxMARL, gymnasium vector env; imported on demand).
"""

from ember.envs import spaces
from ember.envs.batched import BatchedEnv
from ember.envs.config import EnvConfig, make_from_config
from ember.envs.environment import Environment, EnvParams, EnvState
from ember.envs.multi_agent import MultiAgentEnvironment
from ember.envs.registry import make, register, registered
from ember.envs.rendering import save_gif
from ember.envs.wrappers import LogWrapper, Wrapper

__all__ = [
    "BatchedEnv",
    "EnvConfig",
    "EnvParams",
    "EnvState",
    "Environment",
    "LogWrapper",
    "MultiAgentEnvironment",
    "Wrapper",
    "make",
    "make_from_config",
    "register",
    "registered",
    "save_gif",
    "spaces",
]
