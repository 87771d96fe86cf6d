"""The ``lm`` kind for ``ember train``: the config schema and the function that runs it."""

from ember.training.lm.config import LMConfig as CONFIG_SCHEMA
from ember.training.lm.trainer import train as run

__all__ = ["CONFIG_SCHEMA", "run"]
