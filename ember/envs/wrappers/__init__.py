"""Wrappers: each takes an ``Environment`` and is one, so they stack and vectorise."""

from ember.envs.wrappers.base import Wrapper
from ember.envs.wrappers.log import LogEnvState, LogWrapper

__all__ = ["Wrapper", "LogWrapper", "LogEnvState"]
