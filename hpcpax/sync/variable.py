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

from .methods import method_of

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
        sync_method = method_of(method, f"{spec.name}: method")
        self.topology, self.spec, self.ps, self.seed = topology, spec, ps, int(seed)
        self.name = spec.name
        self._method = sync_method
        #: The worker's replica when the method is replicated (None otherwise).
        self.replica = None
        sync_method.create(self)

    # ----------------------------------------------------------------- state
    @property
    def method(self) -> str:
        """``ps``, ``allgather`` or ``allreduce``."""
        return self._method.name

    @property
    def sync_method(self):
        """The method, as its :class:`~hpcpax.sync.methods.SyncMethod`."""
        return self._method

    @property
    def partitions(self) -> int:
        """Row partitions (1 for a replicated variable)."""
        return self._method.partitions(self)

    @property
    def owners(self) -> list:
        """Owner index of each partition (empty for a replicated variable)."""
        return self._method.owners(self)

    @property
    def local_aggregation(self) -> bool:
        """Whether pulls and pushes are aggregated per node (``ps`` only)."""
        return self._method.local_aggregation(self)

    def set_local_aggregation(self, enabled) -> None:
        """Per-variable local aggregation (None: the server's default); local."""
        self._method.set_local_aggregation(self, enabled)

    def describe(self) -> dict:
        """The fields of this variable's plan entry, as it is now."""
        return {"method": self.method, "partitions": self.partitions, "owners": self.owners,
                "local_aggregation": self.local_aggregation}

    # ------------------------------------------------------------------ moves
    def switch(self, method) -> None:
        """Move the variable to ``method``, exactly.

        **Collective** over every rank of the job (servers included: call it
        where every rank runs the same command). Every row and its optimizer
        state moves (PS owners <-> replicas on every worker); training
        continues as if ``method`` had been used all along: the current
        method exports the table, the new one imports it
        (:meth:`~hpcpax.sync.methods.SyncMethod.enter`).
        """
        target = method_of(method, f"{self.name}: method")
        if target is self._method:
            return
        target.enter(self, self._method)
        self._method = target

    def repartition(self, partitions, owners=None) -> None:
        """Move a ``ps`` variable to ``partitions`` partitions, live; **collective** (workers)."""
        self._method.repartition(self, partitions, owners)

    # ------------------------------------------------------------- checkpoint
    def checkpoint_rows(self):
        """The rows this rank writes: ``(ids, table, row state, scalars)`` or None.

        Local. PS owners write their shard; the first worker writes a
        replicated variable's whole table; every other rank writes nothing.
        """
        return self._method.checkpoint_rows(self)

    def restore_rows(self, read_rows) -> None:
        """Load the rows this rank holds from a checkpoint; local.

        Args:
            read_rows: ``read_rows(keep) -> (global ids, table, row state,
                scalars)``, the checkpoint's rows whose ids ``keep`` selects
                (e.g. :func:`hpcpax.app.checkpoint_files.load_matching` of one
                variable); see :meth:`~hpcpax.ps.table.TableShard.restore`.
        """
        shard = self._method.shard(self)
        if shard is not None:
            shard.restore(read_rows)

    def load_whole(self, table, row_state=None, scalars=None) -> None:
        """Set the rows this rank holds from the whole table (e.g. given initial
        values); local."""
        self._method.load_whole(self, table, row_state or {}, scalars or {})

    def read_table(self) -> np.ndarray:
        """The whole table on every worker; **collective** over the workers for ``ps``."""
        return self._method.read_table(self)
