"""What Slurm says about this process, read from its environment variables.

One declarative table, :data:`SLURM_VARIABLES`, maps each environment variable
to a concept in the rank vocabulary (``rank, size, local_rank, node, ...``) and
to the parser for its value. :class:`SlurmEnv` is filled from that table and
nothing else, so adding a variable is one line.

:func:`check_mpi_world` compares Slurm's view with MPI's and turns the most
common launch mistake -- ``srun`` starting N copies of a 1-rank MPI world --
into an error that names the fix. Nothing here imports mpi4py or communicates.
"""

from __future__ import annotations

import dataclasses
import os
import re
from typing import Callable, Mapping, Optional, Tuple

from ..errors import ConfigError, TopologyError

__all__ = [
    "SLURM_VARIABLES",
    "SlurmEnv",
    "check_mpi_world",
    "parse_tasks_per_node",
    "parse_device_list",
]


def _parse_int(name: str, value: str) -> int:
    try:
        number = int(value.strip())
    except ValueError:
        raise ConfigError(f"{name} must be an integer, not {value!r}") from None
    if number < 0:
        raise ConfigError(f"{name} must be >= 0, not {number}")
    return number


def _parse_str(name: str, value: str) -> str:
    value = value.strip()
    if not value:
        raise ConfigError(f"{name} must not be empty")
    return value


_TASKS_ITEM = re.compile(r"^(\d+)(?:\(x(\d+)\))?$")


def parse_tasks_per_node(value: str, name: str = "SLURM_TASKS_PER_NODE") -> Tuple[int, ...]:
    """Expand Slurm's compressed tasks-per-node list, one entry per node.

    ``"4(x2),3"`` means two nodes with 4 tasks then one with 3, so it gives
    ``(4, 4, 3)``. A plain ``"4"`` (as in ``SLURM_NTASKS_PER_NODE``) gives ``(4,)``.

    Raises:
        ConfigError: the value is malformed; the message names ``name``.
    """
    counts = []
    for item in value.replace(" ", "").split(","):
        match = _TASKS_ITEM.match(item)
        if match is None:
            raise ConfigError(
                f"{name} must look like '4(x2),3', not {value!r}")
        repeat = int(match.group(2) or 1)
        if repeat < 1:
            raise ConfigError(f"{name} repeat count must be >= 1, not {value!r}")
        counts.extend([int(match.group(1))] * repeat)
    return tuple(counts)


def parse_device_list(value: str, name: str = "CUDA_VISIBLE_DEVICES") -> Tuple[str, ...]:
    """Split a device list (``"0,1"``, or UUIDs ``"GPU-ab12,GPU-cd34"``).

    An empty value, or Slurm's ``NoDevFiles``, means no device is visible: ``()``.
    """
    value = value.strip()
    if value in ("", "NoDevFiles"):
        return ()
    devices = tuple(item.strip() for item in value.split(","))
    if any(not device for device in devices):
        raise ConfigError(f"{name} must be a comma-separated list, not {value!r}")
    return devices


#: (concept, environment variable, parser(name, value)). For a concept named
#: by several variables, the first one present wins: the job step's view
#: (what ``srun`` launched, hence what MPI should see) comes before the job's.
SLURM_VARIABLES: Tuple[Tuple[str, str, Callable[[str, str], object]], ...] = (
    ("rank", "SLURM_PROCID", _parse_int),
    ("size", "SLURM_STEP_NUM_TASKS", _parse_int),
    ("size", "SLURM_NTASKS", _parse_int),
    ("size", "SLURM_NPROCS", _parse_int),
    ("local_rank", "SLURM_LOCALID", _parse_int),
    ("tasks_per_node", "SLURM_STEP_TASKS_PER_NODE", lambda n, v: parse_tasks_per_node(v, n)),
    ("tasks_per_node", "SLURM_TASKS_PER_NODE", lambda n, v: parse_tasks_per_node(v, n)),
    ("tasks_per_node", "SLURM_NTASKS_PER_NODE", lambda n, v: parse_tasks_per_node(v, n)),
    ("node", "SLURM_NODEID", _parse_int),
    ("nodes", "SLURM_STEP_NUM_NODES", _parse_int),
    ("nodes", "SLURM_JOB_NUM_NODES", _parse_int),
    ("nodes", "SLURM_NNODES", _parse_int),
    ("job_id", "SLURM_JOB_ID", _parse_str),
    ("job_id", "SLURM_JOBID", _parse_str),
    ("restart_count", "SLURM_RESTART_COUNT", _parse_int),
    ("cpus_per_task", "SLURM_CPUS_PER_TASK", _parse_int),
    ("gpus_on_node", "SLURM_GPUS_ON_NODE", _parse_int),
    ("visible_devices", "CUDA_VISIBLE_DEVICES", lambda n, v: parse_device_list(v, n)),
)


@dataclasses.dataclass(frozen=True)
class SlurmEnv:
    """Slurm's description of this process; every field is None when unset.

    Attributes:
        rank: global task rank (``SLURM_PROCID``).
        size: number of tasks in the step, else the job.
        local_rank: task rank on this node (``SLURM_LOCALID``).
        tasks_per_node: tasks on each node, expanded (``"2(x2)"`` -> ``(2, 2)``).
        node: index of this node in the allocation (``SLURM_NODEID``).
        nodes: number of nodes in the step, else the job.
        job_id: the job id as a string.
        restart_count: times the job was requeued (0 or None on first start).
        cpus_per_task: ``--cpus-per-task``.
        gpus_on_node: GPUs allocated on this node (``SLURM_GPUS_ON_NODE``).
        visible_devices: ``CUDA_VISIBLE_DEVICES`` split, ``()`` for none.
    """

    rank: Optional[int] = None
    size: Optional[int] = None
    local_rank: Optional[int] = None
    tasks_per_node: Optional[Tuple[int, ...]] = None
    node: Optional[int] = None
    nodes: Optional[int] = None
    job_id: Optional[str] = None
    restart_count: Optional[int] = None
    cpus_per_task: Optional[int] = None
    gpus_on_node: Optional[int] = None
    visible_devices: Optional[Tuple[str, ...]] = None

    @classmethod
    def from_environ(cls, environ: Mapping[str, str] = os.environ) -> "SlurmEnv":
        """Read every variable of :data:`SLURM_VARIABLES` from ``environ``.

        Not collective; reads nothing but ``environ``.

        Raises:
            ConfigError: a variable is set but malformed; the message names it.
        """
        values = {}
        for concept, name, parse in SLURM_VARIABLES:
            if concept in values or name not in environ:
                continue
            values[concept] = parse(name, environ[name])
        return cls(**values)

    @property
    def in_slurm(self) -> bool:
        """True inside a Slurm job (``SLURM_JOB_ID`` is set)."""
        return self.job_id is not None

    @property
    def local_size(self) -> Optional[int]:
        """Tasks on this node, from ``tasks_per_node`` and ``node``; None if unknown."""
        if not self.tasks_per_node:
            return None
        if len(self.tasks_per_node) == 1:
            return self.tasks_per_node[0]
        if self.node is not None and self.node < len(self.tasks_per_node):
            return self.tasks_per_node[self.node]
        return None

    @property
    def gpus(self) -> Optional[int]:
        """GPUs this task may use: ``SLURM_GPUS_ON_NODE``, else the visible devices."""
        if self.gpus_on_node is not None:
            return self.gpus_on_node
        if self.visible_devices is not None:
            return len(self.visible_devices)
        return None


_LAUNCH_FIX = (
    "launch with `srun --mpi=pmi2` or `srun --mpi=pmix` (whichever your MPI "
    "library supports; `srun --mpi=list` shows what Slurm offers), or check "
    "that mpi4py is built against the same MPI as the launcher "
    "(python -c 'from mpi4py import MPI; print(MPI.Get_library_version())')")


def check_mpi_world(slurm: SlurmEnv, mpi_size: int, mpi_rank: int) -> bool:
    """Check that the MPI world is the set of tasks Slurm launched.

    Not collective; every rank reaches the same verdict on sizes, so under a
    broken ``srun`` launch all ranks raise together. Call it once at start-up.

    When MPI sees *more* ranks than Slurm has tasks, the ranks were started by
    ``mpirun``/``mpiexec`` inside the allocation (Slurm's variables then
    describe the launcher's one-per-node proxies, not the ranks), so there is
    nothing to compare and it returns False.

    Args:
        slurm: Slurm's view, usually ``SlurmEnv.from_environ()``.
        mpi_size: ``COMM_WORLD.Get_size()``.
        mpi_rank: ``COMM_WORLD.Get_rank()``.

    Returns:
        True when the MPI ranks are Slurm's tasks (so ``local_rank`` etc. apply
        to them), False outside Slurm or under another launcher.

    Raises:
        TopologyError: Slurm launched N > 1 tasks but MPI sees size 1, or MPI
            sees fewer ranks than Slurm tasks, or the ranks differ.
    """
    for name, value in (("mpi_size", mpi_size), ("mpi_rank", mpi_rank)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be int, not {type(value).__name__}")
    if mpi_size < 1 or not 0 <= mpi_rank < mpi_size:
        raise ValueError(f"mpi_rank must be in [0, mpi_size), not rank {mpi_rank} of size {mpi_size}")
    if slurm.size is None:
        return False
    if slurm.size > 1 and mpi_size == 1:
        raise TopologyError(
            f"Slurm started {slurm.size} tasks but MPI sees a world of size 1 "
            f"in each (Slurm task {slurm.rank}): every task runs alone. "
            f"Likely fix: {_LAUNCH_FIX}.")
    if mpi_size > slurm.size:
        return False
    if mpi_size != slurm.size:
        raise TopologyError(
            f"Slurm started {slurm.size} tasks (SLURM_NTASKS) but the MPI world "
            f"has size {mpi_size}. Likely fix: {_LAUNCH_FIX}.")
    if slurm.rank is not None and slurm.rank != mpi_rank:
        raise TopologyError(
            f"Slurm task rank {slurm.rank} (SLURM_PROCID) is MPI rank {mpi_rank}; "
            f"the MPI library does not take its ranks from Slurm. "
            f"Likely fix: {_LAUNCH_FIX}.")
    return True
