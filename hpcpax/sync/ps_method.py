"""``ps``: the rows live on the parameter server's owners (Parallax's sparse path).

Partitions, owners, per-node local aggregation, hot-row trees and relaxed
consistency apply. A step's ``ps`` variables pull and push in one batched
exchange each (:meth:`~hpcpax.ps.server.ParameterServer.pull_unique_many`,
:meth:`~hpcpax.ps.server.ParameterServer.push_many`).
"""

from __future__ import annotations

from .methods import StepBatch, SyncMethod, register

__all__ = ["ServerBatch", "ParameterServerMethod"]


class ServerBatch(StepBatch):
    """The ``ps`` variables of a step: one exchange per phase."""

    order = 1  # after the replicas, as the step always ran

    def pull(self, sync, ids_by_name) -> dict:
        """One :meth:`~hpcpax.ps.server.ParameterServer.pull_unique_many`; **collective**."""
        return sync.ps.pull_unique_many(ids_by_name)

    def push(self, sync, grads) -> None:
        """One :meth:`~hpcpax.ps.server.ParameterServer.push_many`; **collective**."""
        sync.ps.push_many(grads)


@register
class ParameterServerMethod(SyncMethod):
    """``ps``: sharded over the server owners."""

    name = "ps"
    on_servers = True
    relaxed = True
    batch = ServerBatch()

    def create(self, var) -> None:
        """Nothing here: :class:`~hpcpax.sync.sparse_set.SparseSync` registers on the PS."""
        var.replica = None  # registered on the PS by SparseSync, in one collective

    def enter(self, var, source) -> None:
        """Register on the owners if needed, then load the table ``source`` exports."""
        topo = var.topology
        if var.name not in var.ps.variables:
            var.ps.register_collective([var.spec] if topo.is_worker else [], whole=True)
        self.load_whole(var, *source.export_whole(var))
        var.replica = None

    def export_whole(self, var):
        """The whole table gathered from the owners; **collective** (every rank)."""
        return var.ps.gather_table(var.name)

    def load_whole(self, var, table, row_state, scalars) -> None:
        """Each owner copies its rows (:meth:`~hpcpax.ps.server.ParameterServer.load_table`)."""
        var.ps.load_table(var.name, table, row_state, scalars)

    def partitions(self, var) -> int:
        """The layout's partitions."""
        return var.ps.variables[var.name].layout.num_partitions

    def owners(self, var) -> list:
        """The layout's owner of each partition."""
        return list(var.ps.variables[var.name].layout.owners)

    def local_aggregation(self, var) -> bool:
        """Whether the server aggregates ``var`` per node on this rank."""
        return var.ps.aggregates(var.name)

    def set_local_aggregation(self, var, enabled) -> None:
        """Set it on the server (None: the server's default); local."""
        var.ps.set_local_aggregation(var.name, enabled)

    def repartition(self, var, partitions, owners=None) -> None:
        """Repartition live on the PS; **collective** (workers)."""
        var.ps.repartition(var.name, int(partitions), owners)

    def shard(self, var):
        """This owner's shard (None on other ranks)."""
        return var.ps.variables[var.name].shard

    def checkpoint_rows(self, var):
        """This owner's shard, exported (None elsewhere)."""
        shard = self.shard(var)
        return None if shard is None else shard.export()

    def read_table(self, var):
        """The whole table from the owners; **collective**."""
        return var.ps.read_table(var.name)
