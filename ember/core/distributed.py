"""Multi-process start-up through JAX's own engine (``jax.distributed.initialize``).

The same program runs as one process or many: with no coordinator configured (neither in
the config nor in ``JAX_COORDINATOR_ADDRESS``) it stays single-process, unless it was
launched as one of several tasks by ``srun`` or ``mpirun`` (:func:`launcher_processes`): then
JAX reads the coordinator, process count and id from the launcher's environment, as
``jax.distributed.initialize()`` does on its own. On CPU, collectives across processes go
through gloo.
"""

from __future__ import annotations

import dataclasses
import os

import jax

from ember.core.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    """Where the processes of a run meet. Empty/zero/negative fields fall back to the
    environment variables ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``,
    ``JAX_PROCESS_ID``."""

    coordinator_address: str = ""
    num_processes: int = 0
    process_id: int = -1

    def resolved(self) -> tuple[str, int, int]:
        """``(address, num_processes, process_id)`` after applying the environment.

        Raises:
          ConfigError: ``JAX_NUM_PROCESSES`` or ``JAX_PROCESS_ID`` is consulted and is not an integer.
        """
        address = self.coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
        num = self.num_processes or _environment_integer("JAX_NUM_PROCESSES", 0, "distributed.num_processes")
        pid = (
            self.process_id
            if self.process_id >= 0
            else _environment_integer("JAX_PROCESS_ID", -1, "distributed.process_id")
        )
        return address, num, pid


def _environment_integer(name: str, default: int, key: str) -> int:
    """The integer in environment variable ``name`` (``default`` when unset or empty)."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ConfigError(
            f"environment variable {name}={text!r} is not an integer (it stands in for {key})", key=key
        ) from None


_LAUNCHERS = {
    # launcher: (the variables JAX's cluster detection requires, the one holding the task count)
    "srun (SLURM)": (
        ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_NTASKS", "SLURM_PROCID", "SLURM_LOCALID"),
        "SLURM_NTASKS",
    ),
    "mpirun (Open MPI)": (("OMPI_MCA_orte_hnp_uri", "OMPI_COMM_WORLD_SIZE"), "OMPI_COMM_WORLD_SIZE"),
}


def launcher_processes() -> tuple[str, int] | None:
    """``(launcher, task count)`` when this process is one of several tasks started by
    ``srun`` or ``mpirun`` (the environment JAX's cluster detection reads), else None.

    Without joining them, each of ``srun -n 4 ember train ...``'s tasks would train alone,
    all four writing the same run directory."""
    for launcher, (required, count) in _LAUNCHERS.items():
        if all(name in os.environ for name in required):
            tasks = _environment_integer(count, 1, "distributed.num_processes")
            if tasks > 1:
                return launcher, tasks
    return None


def initialize_distributed(config: DistributedConfig) -> int:
    """Joins the run's processes if a coordinator is configured, or the tasks of an ``srun``
    or ``mpirun`` launch (:func:`launcher_processes`); returns the process count.

    Must run before anything touches a JAX backend. Idempotent.

    Raises:
      ConfigError: when a coordinator is set but the process count or id is missing or
        out of range.
    """
    if jax.distributed.is_initialized():
        return jax.process_count()
    address, num, pid = config.resolved()
    if not address:
        if launcher_processes() is None:
            return 1
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize()  # JAX reads the launcher's coordinator, count and id
        return jax.process_count()
    if num < 1 or not 0 <= pid < num:
        raise ConfigError(
            f"distributed.coordinator_address is {address!r} but num_processes={num} and process_id={pid}; "
            "set distributed.num_processes >= 1 and 0 <= distributed.process_id < num_processes "
            "(or JAX_NUM_PROCESSES / JAX_PROCESS_ID)",
            key="distributed.process_id" if num >= 1 else "distributed.num_processes",
        )
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=address, num_processes=num, process_id=pid)
    return jax.process_count()
