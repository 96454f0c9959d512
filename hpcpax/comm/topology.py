"""Process topology: which rank is a server or a worker, and on which node.

:func:`init` splits ``MPI.COMM_WORLD`` once into the communicators each role
needs. Nodes come from ``MPI.COMM_TYPE_SHARED``; ``ranks_per_node`` (or
``HPCPAX_RANKS_PER_NODE``) cuts each physical node into *virtual nodes* of
that many consecutive ranks, so multi-node behaviour (local aggregation,
off-node bytes) is testable on one machine.

Roles: on every node, the first ``servers_per_node`` local ranks are parameter
servers, the rest are workers. With no server rank at all (``0``, or a
single-process world) the workers host the sparse partitions themselves: the
same code path, so a script runs unchanged from a laptop to many nodes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from .accounting import Accounting
from .agreement import check_options
from ..errors import ConfigError, TopologyError
from ..options import counted, options
from .threads import limit_threads

__all__ = ["Topology", "init", "world_comm", "kernel_id", "affinity"]

SERVER = "server"
WORKER = "worker"


def world_comm():
    """``MPI.COMM_WORLD`` (imports mpi4py on first use)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def self_comm():
    """``MPI.COMM_SELF``: this rank alone, a one-rank world (imports mpi4py on first use)."""
    from mpi4py import MPI

    return MPI.COMM_SELF


@dataclass
class Topology:
    """Where this process sits, and the communicators of its role.

    Attributes:
        comm: duplicate of the world communicator hpcpax uses.
        rank, size: world rank and size.
        node, num_nodes: (virtual) node index of this rank, number of nodes.
        local_rank, local_size: rank and size within the node.
        role: ``"server"`` or ``"worker"``.
        node_of: node index of every world rank (NumPy int64 array).
        server_ranks, worker_ranks: world ranks of each role, ascending.
        owner_ranks: ranks that hold sparse partitions (the servers, or the
            workers when there is no server rank).
        node_comm: ranks of this node.
        workers, servers: communicators of each role (None when not a member).
        node_workers: the workers of this node (None on servers).
        node_leaders: the first worker of each node (None elsewhere).
        accounting: this rank's :class:`~hpcpax.comm.accounting.Accounting`.
        oversubscribed: this host runs more of the job's ranks than the cores
            they may use together (the union of their CPU affinities); the
            host is the running kernel, so the nodes of an emulated cluster
            on one machine count together.
    """

    comm: object
    rank: int
    size: int
    node: int
    num_nodes: int
    local_rank: int
    local_size: int
    role: str
    node_of: np.ndarray
    server_ranks: list
    worker_ranks: list
    node_comm: object = None
    workers: object = None
    servers: object = None
    node_workers: object = None
    node_leaders: object = None
    accounting: Accounting = field(default=None, repr=False)
    oversubscribed: bool = False

    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks."""
        return self.role == SERVER

    @property
    def is_worker(self) -> bool:
        """True on worker ranks."""
        return self.role == WORKER

    @property
    def owner_ranks(self) -> list:
        """World ranks that own sparse partitions."""
        return self.server_ranks if self.server_ranks else self.worker_ranks

    @property
    def num_workers(self) -> int:
        """Number of worker ranks in the world."""
        return len(self.worker_ranks)

    @property
    def worker_index(self) -> int:
        """Index of this rank among the workers (-1 on servers)."""
        return self.worker_ranks.index(self.rank) if self.is_worker else -1

    def workers_on_node(self, node: int) -> list:
        """World ranks of the workers on ``node``."""
        return [r for r in self.worker_ranks if self.node_of[r] == node]

    def describe(self) -> dict:
        """JSON-ready summary (no communicators)."""
        return {
            "size": self.size,
            "num_nodes": self.num_nodes,
            "node_of": self.node_of.tolist(),
            "server_ranks": list(self.server_ranks),
            "worker_ranks": list(self.worker_ranks),
        }

    def counts(self) -> str:
        """``"4 ranks (1 server, 3 workers, 1 node)"``: the layout in words."""
        return (f"{counted(self.size, 'rank')} ({counted(len(self.server_ranks), 'server')}, "
                f"{counted(self.num_workers, 'worker')}, {counted(self.num_nodes, 'node')})")

    def free(self) -> None:
        """Free the communicators :func:`init` created (collective)."""
        for name in ("node_leaders", "node_workers", "servers", "workers", "node_comm", "comm"):
            c = getattr(self, name)
            if c is not None:
                c.Free()
                setattr(self, name, None)


def _node_ids(comm, ranks_per_node):
    """Node index of every rank: physical nodes, optionally cut into virtual ones."""
    from mpi4py import MPI

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    local, physical_size = shared.Get_rank(), shared.Get_size()
    leader_world = shared.bcast(comm.Get_rank(), root=0)
    shared.Free()
    virtual = local // ranks_per_node if ranks_per_node else 0
    everyone = comm.allgather((leader_world, virtual, kernel_id(), affinity()))
    keys = [(leader, v) for leader, v, _, _ in everyone]
    order = {k: i for i, k in enumerate(sorted(set(keys)))}
    # the cores are the kernel's: ranks of "nodes" that share one (network namespaces
    # of an emulated cluster) share its cores, though MPI counts them as other hosts
    mine = everyone[comm.Get_rank()][2] or leader_world
    here = [cores for leader, _, kernel, cores in everyone if (kernel or leader) == mine]
    return (np.array([order[k] for k in keys], np.int64), physical_size,
            len(here) > len(set().union(*here)))


def kernel_id() -> str:
    """This machine's boot id (Linux; one per running kernel), or "" where unknown."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return ""


def affinity() -> list:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def init(ranks_per_node: int | None = None, servers_per_node: int | None = None,
         comm=None) -> Topology:
    """Split the world into nodes, servers and workers.

    Also caps this rank's BLAS and Numba threads at the host's cores divided
    by the ranks on the host (:mod:`hpcpax.comm.threads`; ``HPCPAX_THREADS``).

    **Collective** over ``comm`` (default ``MPI.COMM_WORLD``). A process
    started without ``mpirun`` is a valid one-rank world.

    Args:
        ranks_per_node: group consecutive ranks of each physical node into
            virtual nodes of this many ranks (default ``$HPCPAX_RANKS_PER_NODE``,
            else physical nodes only).
        servers_per_node: parameter-server ranks per node; 0 = no dedicated
            server (workers host the partitions). Default
            ``$HPCPAX_SERVERS_PER_NODE``, else 1 when the world has more than
            one rank and 0 otherwise.
        comm: communicator to split (it is duplicated, never used directly).

    Returns:
        The :class:`Topology` of this rank.

    Raises:
        ConfigError: bad arguments (same on every rank).
        MismatchError: ranks hold different job-shaping ``HPCPAX_*`` options
            or arguments (:func:`~hpcpax.comm.agreement.check_options`), on every rank.
        TopologyError: the layout leaves no worker, or Slurm and MPI disagree.
    """
    from .slurm import SlurmEnv, check_mpi_world

    comm = (comm if comm is not None else world_comm()).Dup()
    rank, size = comm.Get_rank(), comm.Get_size()
    check_mpi_world(SlurmEnv.from_environ(), size, rank)

    options.warn_unknown()
    try:  # before any of them is used: a rank with another layout would split differently
        check_options(comm, {"HPCPAX_RANKS_PER_NODE": ranks_per_node,
                             "HPCPAX_SERVERS_PER_NODE": servers_per_node})
    except Exception:
        comm.Free()
        raise
    if ranks_per_node is None:
        ranks_per_node = options.ranks_per_node
    if ranks_per_node is not None and (not isinstance(ranks_per_node, (int, np.integer))
                                       or ranks_per_node < 1):
        raise ConfigError(f"ranks_per_node must be a positive int, not {ranks_per_node!r}")
    if servers_per_node is None:
        servers_per_node = options.servers_per_node
    if servers_per_node is None:
        servers_per_node = 1 if size > 1 else 0
    if not isinstance(servers_per_node, (int, np.integer)) or servers_per_node < 0:
        raise ConfigError(f"servers_per_node must be an int >= 0, not {servers_per_node!r}")

    node_of, ranks_on_host, oversubscribed = _node_ids(comm, ranks_per_node)
    limit_threads(ranks_on_host)
    node = int(node_of[rank])
    on_node = [r for r in range(size) if node_of[r] == node]
    local_rank, local_size = on_node.index(rank), len(on_node)
    local_rank_of = np.zeros(size, np.int64)
    for n in np.unique(node_of):
        members = np.flatnonzero(node_of == n)
        local_rank_of[members] = np.arange(len(members))
    is_server = local_rank_of < servers_per_node
    server_ranks = [int(r) for r in np.flatnonzero(is_server)]
    worker_ranks = [int(r) for r in np.flatnonzero(~is_server)]
    if not worker_ranks:
        raise TopologyError(
            f"servers_per_node={servers_per_node} leaves no worker among {size} ranks; "
            "launch more ranks or lower servers_per_node"
        )
    role = SERVER if is_server[rank] else WORKER

    from mpi4py import MPI

    node_comm = comm.Split(node, key=rank)
    role_comm = comm.Split(0 if role == WORKER else 1, key=rank)
    workers = role_comm if role == WORKER else None
    servers = role_comm if role == SERVER else None
    color = node if role == WORKER else MPI.UNDEFINED
    node_workers = comm.Split(color, key=rank)
    node_workers = None if node_workers == MPI.COMM_NULL else node_workers
    first_worker_of_node = {}
    for r in worker_ranks:
        first_worker_of_node.setdefault(int(node_of[r]), r)
    is_leader = role == WORKER and first_worker_of_node[node] == rank
    leaders = comm.Split(0 if is_leader else MPI.UNDEFINED, key=rank)
    leaders = None if leaders == MPI.COMM_NULL else leaders

    return Topology(
        comm=comm, rank=rank, size=size, node=node, num_nodes=int(node_of.max()) + 1,
        local_rank=local_rank, local_size=local_size, role=role, node_of=node_of,
        server_ranks=server_ranks, worker_ranks=worker_ranks, node_comm=node_comm,
        workers=workers, servers=servers, node_workers=node_workers, node_leaders=leaders,
        accounting=Accounting(node_of, rank), oversubscribed=bool(oversubscribed),
    )
