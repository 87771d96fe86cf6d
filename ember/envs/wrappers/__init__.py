"""Wrappers: each takes an ``Environment`` and is one (except the ``LegacyStep`` adapter),
so they stack and vectorise. Wrap single environments first, then ``BatchedEnv``; the
normalisation wrappers may also wrap a ``BatchedEnv`` to share statistics over the batch, and
``FrameStack``, ``FlattenObservation`` and ``CheckActions`` refuse to (``ValueError``)."""

from ember.envs.wrappers.action import CheckActions, ClipAction, RescaleAction
from ember.envs.wrappers.base import Wrapper
from ember.envs.wrappers.legacy import LegacyStep
from ember.envs.wrappers.log import LogEnvState, LogWrapper
from ember.envs.wrappers.normalize import (
    MultiAgentObsStats,
    NormalizeObservation,
    NormalizeReward,
    RunningMeanVar,
)
from ember.envs.wrappers.observation import FlattenObservation, FrameStack
from ember.envs.wrappers.time_limit import TimeLimit, max_episode_steps

__all__ = [
    "CheckActions",
    "ClipAction",
    "FlattenObservation",
    "FrameStack",
    "LegacyStep",
    "LogEnvState",
    "LogWrapper",
    "MultiAgentObsStats",
    "NormalizeObservation",
    "NormalizeReward",
    "RescaleAction",
    "RunningMeanVar",
    "TimeLimit",
    "Wrapper",
    "max_episode_steps",
]
