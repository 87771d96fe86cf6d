"""Multi-process start-up settings: the config, the environment variables it falls back to, and
the errors for settings that cannot start a run (no process is started here)."""

import pytest

from ember.core.distributed import DistributedConfig, initialize_distributed
from ember.core.errors import ConfigError


def test_config_fields_win_over_the_environment_and_unset_fields_read_it(monkeypatch):
    monkeypatch.setenv("JAX_COORDINATOR_ADDRESS", "10.0.0.1:1234")
    monkeypatch.setenv("JAX_NUM_PROCESSES", "4")
    monkeypatch.setenv("JAX_PROCESS_ID", " 3 ")
    assert DistributedConfig().resolved() == ("10.0.0.1:1234", 4, 3)
    assert DistributedConfig("127.0.0.1:99", 2, 0).resolved() == ("127.0.0.1:99", 2, 0)
    monkeypatch.setenv("JAX_NUM_PROCESSES", "")
    monkeypatch.delenv("JAX_PROCESS_ID")
    assert DistributedConfig().resolved() == ("10.0.0.1:1234", 0, -1)


@pytest.mark.parametrize(
    ("variable", "key"),
    [("JAX_NUM_PROCESSES", "distributed.num_processes"), ("JAX_PROCESS_ID", "distributed.process_id")],
)
def test_an_environment_variable_that_is_not_an_integer_is_a_config_error(monkeypatch, variable, key):
    monkeypatch.setenv(variable, "two")
    with pytest.raises(ConfigError, match=f"{variable}='two' is not an integer") as caught:
        DistributedConfig().resolved()
    assert caught.value.key == key


def test_a_coordinator_without_a_valid_process_count_or_id_is_refused(monkeypatch):
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert initialize_distributed(DistributedConfig()) == 1  # no coordinator: one process
    with pytest.raises(ConfigError, match="num_processes=0") as caught:
        initialize_distributed(DistributedConfig("127.0.0.1:1234"))
    assert caught.value.key == "distributed.num_processes"
    with pytest.raises(ConfigError, match="process_id=2") as caught:
        initialize_distributed(DistributedConfig("127.0.0.1:1234", num_processes=2, process_id=2))
    assert caught.value.key == "distributed.process_id"


SRUN_TASK = {"SLURM_JOB_ID": "77", "SLURM_STEP_NODELIST": "node[1-2]", "SLURM_PROCID": "1", "SLURM_LOCALID": "0"}


@pytest.mark.parametrize(
    ("environment", "joins"),
    [
        ({**SRUN_TASK, "SLURM_NTASKS": "2"}, True),  # srun -n 2: two tasks of one run
        ({**SRUN_TASK, "SLURM_NTASKS": "1"}, False),
        ({"SLURM_JOB_ID": "77", "SLURM_NTASKS": "4"}, False),  # a batch script or salloc shell, not an srun task
        ({"OMPI_MCA_orte_hnp_uri": "1.0;tcp://10.0.0.1:5", "OMPI_COMM_WORLD_SIZE": "2"}, True),  # mpirun -n 2
        ({"OMPI_COMM_WORLD_SIZE": "2"}, False),
    ],
)
def test_the_tasks_of_an_srun_or_mpirun_launch_join_one_run(monkeypatch, environment, joins):
    """With no coordinator configured, each task of ``srun -n 2 ember train`` trained alone
    (both writing one run directory); JAX's own initialisation reads the launcher's settings."""
    import jax

    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID", *SRUN_TASK, "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    calls = []

    class Joined(Exception):
        pass

    def initialize(*args, **kwargs):
        calls.append((args, kwargs))
        raise Joined  # stop before a real start-up

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    monkeypatch.setattr(jax.config, "update", lambda *args: None)
    if joins:
        with pytest.raises(Joined):
            initialize_distributed(DistributedConfig())
        assert calls == [((), {})]
    else:
        assert initialize_distributed(DistributedConfig()) == 1 and calls == []
