"""The ``rl`` kind for ``ember train``: the config schema and the function that runs it."""

from ember.training.rl.config import RLConfig as CONFIG_SCHEMA
from ember.training.rl.experiment import run_experiment as run

__all__ = ["CONFIG_SCHEMA", "run"]
