"""`VariableSync`: one sparse variable's synchronization, whatever its method.

The object owns the variable's method (``ps``, ``allgather`` or
``allreduce``) and everything that depends on it: where the rows live (on
the parameter server's owners, or a :class:`~hpcpax.sync.replicated.ReplicatedTable`
on every worker), moving them exactly to another method or layout, the rows
a checkpoint writes and reads, and the plan entry describing it now. The
step's pulls and pushes are batched across variables by
:class:`~hpcpax.sync.sparse_set.SparseSync`.

Every rank of the job holds one ``VariableSync`` per sparse variable (servers
too, with no replica), so the collective moves run on every rank.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ps.memory import check_whole_table
from . import METHODS
from .replicated import ReplicatedTable

__all__ = ["VariableSync"]


class VariableSync:
    """One sparse variable on this rank.

    Args:
        topology: from :func:`hpcpax.init`.
        spec: its :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        ps: the job's :class:`~hpcpax.ps.server.ParameterServer`.
        method: ``ps``, ``allgather`` or ``allreduce``.
        seed: the layout-independent initializer's key.

    Construction is local: a ``ps`` variable must be registered on ``ps``
    (by :class:`~hpcpax.sync.sparse_set.SparseSync`, which registers them
    all in one collective), a replicated one builds its replica here.
    """

    def __init__(self, topology, spec, ps, method="ps", seed=0):
        if method not in METHODS:
            raise ConfigError(f"{spec.name}: method must be one of {METHODS}, not {method!r}")
        self.topology, self.spec, self.ps, self.seed = topology, spec, ps, int(seed)
        self.name = spec.name
        self._method = method
        if method != "ps":  # on every rank alike, before any replica is built
            check_whole_table(spec, f"method {method!r}")
        #: The worker's replica when the method is replicated (None otherwise).
        self.replica = (ReplicatedTable(topology, spec, method, seed=seed)
                        if method != "ps" and topology.is_worker else None)

    # ----------------------------------------------------------------- state
    @property
    def method(self) -> str:
        """``ps``, ``allgather`` or ``allreduce``."""
        return self._method

    @property
    def partitions(self) -> int:
        """Row partitions (1 for a replicated variable)."""
        return self.ps.variables[self.name].layout.num_partitions if self._method == "ps" else 1

    @property
    def owners(self) -> list:
        """Owner index of each partition (empty for a replicated variable)."""
        return list(self.ps.variables[self.name].layout.owners) if self._method == "ps" else []

    @property
    def local_aggregation(self) -> bool:
        """Whether pulls and pushes are aggregated per node (``ps`` only)."""
        return self._method == "ps" and self.ps.aggregates(self.name)

    def set_local_aggregation(self, enabled) -> None:
        """Per-variable local aggregation (None: the server's default); local."""
        if self._method == "ps":
            self.ps.set_local_aggregation(self.name, enabled)

    def describe(self) -> dict:
        """The fields of this variable's plan entry, as it is now."""
        return {"method": self._method, "partitions": self.partitions, "owners": self.owners,
                "local_aggregation": self.local_aggregation}

    # ------------------------------------------------------------------ moves
    def switch(self, method) -> None:
        """Move the variable to ``method``, exactly.

        **Collective** over every rank of the job (servers included: call it
        where every rank runs the same command). Every row and its optimizer
        state moves (PS owners <-> replicas on every worker); training
        continues as if ``method`` had been used all along.
        """
        if method not in METHODS:
            raise ConfigError(f"{self.name}: method must be one of {METHODS}, not {method!r}")
        current, topo = self._method, self.topology
        if current == method:
            return
        if current == "ps":
            table, rows, scalars = self.ps.gather_table(self.name)
            if topo.is_worker:
                replica = ReplicatedTable(topo, self.spec, method, seed=self.seed)
                replica.shard.load_whole(table, rows, scalars)
                self.replica = replica
        elif method != "ps":
            if topo.is_worker:
                self.replica.method = method
        else:
            if self.name not in self.ps.variables:
                self.ps.register_collective([self.spec] if topo.is_worker else [], whole=True)
            payload = None
            if topo.is_worker and topo.worker_index == 0:
                table, rows, scalars = self.replica.shard.export()[1:]
                payload = (table, rows, scalars)
            table, rows, scalars = topo.comm.bcast(payload, root=topo.worker_ranks[0])
            self.ps.load_table(self.name, table, rows, scalars)
            self.replica = None
        self._method = method

    def repartition(self, partitions, owners=None) -> None:
        """Move a ``ps`` variable to ``partitions`` partitions, live; **collective** (workers)."""
        if self._method != "ps":
            raise ConfigError(f"{self.name} is synced by {self._method!r}, not 'ps'; "
                              "only ps variables have partitions")
        self.ps.repartition(self.name, int(partitions), owners)

    # ------------------------------------------------------------- checkpoint
    def checkpoint_rows(self):
        """The rows this rank writes: ``(ids, table, row state, scalars)`` or None.

        Local. PS owners write their shard; the first worker writes a
        replicated variable's whole table; every other rank writes nothing.
        """
        topo = self.topology
        if self._method == "ps":
            shard = self.ps.variables[self.name].shard
            return None if shard is None else shard.export()
        if topo.is_worker and topo.worker_index == 0:
            return self.replica.shard.export()
        return None

    def restore_rows(self, read_rows) -> None:
        """Load the rows this rank holds from a checkpoint; local.

        Args:
            read_rows: ``read_rows(keep) -> (global ids, table, row state,
                scalars)``, the checkpoint's rows whose ids ``keep`` selects
                (e.g. :func:`hpcpax.app.checkpoint.load_matching` of one
                variable); see :meth:`~hpcpax.ps.table.TableShard.restore`.
        """
        if self._method == "ps":
            shard = self.ps.variables[self.name].shard
        else:
            shard = self.replica.shard if self.replica is not None else None
        if shard is not None:
            shard.restore(read_rows)

    def read_table(self) -> np.ndarray:
        """The whole table on every worker; **collective** over the workers for ``ps``."""
        if self._method == "ps":
            return self.ps.read_table(self.name)
        return self.replica.read_table()
