"""hpcpax.comm.slurm: every variable of the table parsed from a mocked environment."""

import pytest

from hpcpax.errors import ConfigError, TopologyError
from hpcpax.comm.slurm import (
    SLURM_VARIABLES,
    SlurmEnv,
    check_mpi_world,
    parse_device_list,
    parse_tasks_per_node,
)

# What srun sets for task 5 of 8 (two nodes, 4 tasks each), one GPU per task.
SRUN_ENVIRON = {
    "SLURM_PROCID": "5",
    "SLURM_NTASKS": "8",
    "SLURM_LOCALID": "1",
    "SLURM_TASKS_PER_NODE": "4(x2)",
    "SLURM_NODEID": "1",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_ID": "123456",
    "SLURM_RESTART_COUNT": "2",
    "SLURM_CPUS_PER_TASK": "8",
    "SLURM_GPUS_ON_NODE": "4",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3",
    "HOME": "/root",
}


def test_every_variable_parsed():
    env = SlurmEnv.from_environ(SRUN_ENVIRON)
    assert env == SlurmEnv(rank=5, size=8, local_rank=1, tasks_per_node=(4, 4), node=1,
                           nodes=2, job_id="123456", restart_count=2, cpus_per_task=8,
                           gpus_on_node=4, visible_devices=("0", "1", "2", "3"))
    assert env.in_slurm
    assert env.local_size == 4
    assert env.gpus == 4


def test_missing_variables_are_none():
    env = SlurmEnv.from_environ({"HOME": "/root", "PATH": "/bin"})
    assert env == SlurmEnv()
    assert all(getattr(env, concept) is None for concept, _, _ in SLURM_VARIABLES)
    assert not env.in_slurm
    assert env.local_size is None and env.gpus is None


def test_default_environ_is_os_environ(monkeypatch):
    monkeypatch.setenv("SLURM_JOB_ID", "77")
    assert SlurmEnv.from_environ().job_id == "77"


def test_table_covers_every_field():
    concepts = {concept for concept, _, _ in SLURM_VARIABLES}
    assert concepts == set(SlurmEnv.__dataclass_fields__)


@pytest.mark.parametrize("name", sorted({name for _, name, _ in SLURM_VARIABLES}))
def test_each_variable_alone(name):
    concept = next(c for c, n, _ in SLURM_VARIABLES if n == name)
    value = {"tasks_per_node": "3", "visible_devices": "1", "job_id": "42"}.get(concept, "3")
    env = SlurmEnv.from_environ({name: value})
    expected = {"tasks_per_node": (3,), "visible_devices": ("1",), "job_id": "42"}.get(concept, 3)
    assert getattr(env, concept) == expected


def test_step_variables_win_over_job_variables():
    env = SlurmEnv.from_environ({
        "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "8",
        "SLURM_STEP_TASKS_PER_NODE": "2", "SLURM_TASKS_PER_NODE": "4(x2)", "SLURM_NTASKS_PER_NODE": "4",
        "SLURM_STEP_NUM_NODES": "1", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    })
    assert (env.size, env.tasks_per_node, env.nodes) == (2, (2,), 1)


def test_old_aliases():
    env = SlurmEnv.from_environ({"SLURM_NPROCS": "6", "SLURM_NNODES": "3", "SLURM_JOBID": "9",
                                 "SLURM_NTASKS_PER_NODE": "2"})
    assert (env.size, env.nodes, env.job_id, env.tasks_per_node) == (6, 3, "9", (2,))


@pytest.mark.parametrize("value, expected", [
    ("4", (4,)),
    ("4(x2),3", (4, 4, 3)),
    ("2(x3)", (2, 2, 2)),
    ("1,2,3", (1, 2, 3)),
    ("8(x1),4(x2)", (8, 4, 4)),
])
def test_tasks_per_node_forms(value, expected):
    assert parse_tasks_per_node(value) == expected


@pytest.mark.parametrize("value", ["", "4(2)", "x", "4(x0)", "4,,3", "-1"])
def test_tasks_per_node_malformed_names_variable(value):
    with pytest.raises(ConfigError, match="SLURM_TASKS_PER_NODE"):
        SlurmEnv.from_environ({"SLURM_TASKS_PER_NODE": value})


def test_local_size_per_node():
    env = SlurmEnv.from_environ({"SLURM_TASKS_PER_NODE": "4(x2),3", "SLURM_NODEID": "2"})
    assert env.local_size == 3
    assert SlurmEnv(tasks_per_node=(4, 3)).local_size is None  # node unknown


@pytest.mark.parametrize("value, expected", [
    ("0,1", ("0", "1")),
    ("GPU-1a2b,GPU-3c4d", ("GPU-1a2b", "GPU-3c4d")),
    ("", ()),
    ("NoDevFiles", ()),
])
def test_visible_devices(value, expected):
    assert parse_device_list(value) == expected
    assert SlurmEnv.from_environ({"CUDA_VISIBLE_DEVICES": value}).gpus == len(expected)


@pytest.mark.parametrize("name, value", [
    ("SLURM_PROCID", "abc"), ("SLURM_NTASKS", "-2"), ("SLURM_JOB_ID", " "),
    ("CUDA_VISIBLE_DEVICES", "0,,1"),
])
def test_malformed_value_names_variable(name, value):
    with pytest.raises(ConfigError, match=name):
        SlurmEnv.from_environ({name: value})


def test_env_is_frozen():
    env = SlurmEnv(rank=0)
    with pytest.raises(AttributeError):
        env.rank = 1


# ---- check_mpi_world -------------------------------------------------------

def test_matching_world_is_direct_launch():
    env = SlurmEnv.from_environ(SRUN_ENVIRON)
    assert check_mpi_world(env, mpi_size=8, mpi_rank=5) is True


def test_outside_slurm_nothing_to_check():
    assert check_mpi_world(SlurmEnv(), mpi_size=4, mpi_rank=2) is False
    assert check_mpi_world(SlurmEnv(), mpi_size=1, mpi_rank=0) is False


def test_single_task_single_rank():
    assert check_mpi_world(SlurmEnv(rank=0, size=1, job_id="1"), 1, 0) is True


def test_srun_without_pmi_names_the_fix():
    env = SlurmEnv.from_environ({**SRUN_ENVIRON, "SLURM_PROCID": "3"})
    with pytest.raises(TopologyError) as info:
        check_mpi_world(env, mpi_size=1, mpi_rank=0)
    message = str(info.value)
    assert "Slurm started 8 tasks" in message and "size 1" in message
    assert "srun --mpi=pmi2" in message and "srun --mpi=pmix" in message
    assert "srun --mpi=list" in message
    assert "mpi4py is built against the same MPI as the launcher" in message


def test_fewer_mpi_ranks_than_tasks():
    env = SlurmEnv(rank=1, size=8)
    with pytest.raises(TopologyError, match=r"8 tasks .* MPI world has size 4.*srun --mpi=pmi2"):
        check_mpi_world(env, mpi_size=4, mpi_rank=1)


def test_rank_mismatch():
    env = SlurmEnv(rank=3, size=4)
    with pytest.raises(TopologyError, match=r"Slurm task rank 3 \(SLURM_PROCID\) is MPI rank 2"):
        check_mpi_world(env, mpi_size=4, mpi_rank=2)


def test_mpirun_inside_allocation_is_not_an_error():
    # Hydra/ORTE start one srun task per node and the ranks below it.
    env = SlurmEnv(rank=0, size=1, local_rank=0, job_id="6")
    assert check_mpi_world(env, mpi_size=4, mpi_rank=3) is False


@pytest.mark.parametrize("size, rank, error", [
    (2.0, 0, TypeError), (2, "0", TypeError), (True, 0, TypeError),
    (0, 0, ValueError), (2, 2, ValueError), (2, -1, ValueError),
])
def test_bad_arguments(size, rank, error):
    with pytest.raises(error):
        check_mpi_world(SlurmEnv(size=2, rank=0), size, rank)
