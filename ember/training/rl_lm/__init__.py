"""Reinforcement learning for language models: GRPO and REINFORCE with the serving engine as
the rollout engine (``kind: grpo`` configs for ``ember train``).

- ``losses``: group advantages and the policy objectives (pure functions).
- ``rewards``: shipped rewards, user rewards, and the scorer that survives a failing one.
- ``prompts``: the prompts a run learns from and its held-out prompts.
- ``rollouts``: sampling through the engine, turned into the trainer's batches.
- ``task``: the trainer task that keeps the engine serving the policy being trained.
- ``engine_mesh``: where the engine runs when the policy trains tensor-parallel.
"""

from ember.training.rl_lm.config import GRPOConfig
from ember.training.rl_lm.losses import group_advantages, policy_loss, token_logprobs
from ember.training.rl_lm.rewards import REWARDS, arithmetic_exact_match, python_parses, resolve_reward, token_reward

__all__ = [
    "REWARDS",
    "GRPOConfig",
    "arithmetic_exact_match",
    "group_advantages",
    "policy_loss",
    "python_parses",
    "resolve_reward",
    "token_logprobs",
    "token_reward",
]
