"""``allreduce`` and ``allgather``: a whole replica of the table on every worker.

The replica is a :class:`~hpcpax.sync.replicated.ReplicatedTable`; the
gradient is densified and allreduced (``allreduce``, Horovod's
``sparse_as_dense``) or its deduplicated rows allgathered (``allgather``).
A step's replicated variables pull locally and push in one
:func:`~hpcpax.sync.replicated.push_many`. Switching between the two
relabels the replica; switching in from ``ps`` gathers the table.

The MPI layers are imported inside the methods: the registry stays pure.
"""

from __future__ import annotations

from .methods import StepBatch, SyncMethod, register

__all__ = ["ReplicaBatch", "ReplicatedMethod", "AllreduceMethod", "AllgatherMethod"]


class ReplicaBatch(StepBatch):
    """The replicated variables of a step: local pulls, one shared push."""

    order = 0

    def pull(self, sync, ids_by_name) -> dict:
        """Each replica read locally."""
        return {name: sync[name].replica.pull_unique(ids) for name, ids in ids_by_name.items()}

    def push(self, sync, grads) -> None:
        """One :func:`~hpcpax.sync.replicated.push_many`; **collective** (workers)."""
        from .replicated import push_many

        push_many({n: sync.variables[n].replica for n in grads}, grads)


class ReplicatedMethod(SyncMethod):
    """A whole table on every worker (servers hold nothing of it)."""

    replicated = True
    batch = ReplicaBatch()

    def create(self, var) -> None:
        """Check the whole table fits, then build the worker's replica."""
        from ..ps.memory import check_whole_table
        from .replicated import ReplicatedTable

        # on every rank alike, before any replica is built
        check_whole_table(var.spec, f"method {self.name!r}")
        var.replica = (ReplicatedTable(var.topology, var.spec, self.name, seed=var.seed)
                       if var.topology.is_worker else None)

    def enter(self, var, source) -> None:
        """Relabel a replica, or build one from the table ``source`` exports."""
        if source.replicated:  # the same replica, synced another way from now on
            if var.topology.is_worker:
                var.replica.method = self.name
            return
        from .replicated import ReplicatedTable

        table, rows, scalars = source.export_whole(var)
        if var.topology.is_worker:
            var.replica = ReplicatedTable(var.topology, var.spec, self.name, seed=var.seed)
            self.load_whole(var, table, rows, scalars)

    def export_whole(self, var):
        """The first worker's replica, broadcast to every rank; **collective**."""
        topo = var.topology
        payload = None
        if topo.is_worker and topo.worker_index == 0:
            payload = tuple(var.replica.shard.export()[1:])
        return topo.comm.bcast(payload, root=topo.worker_ranks[0])

    def load_whole(self, var, table, row_state, scalars) -> None:
        """Copy the whole table into this worker's replica (nothing elsewhere)."""
        if var.replica is not None:
            var.replica.shard.load_whole(table, row_state, scalars)

    def shard(self, var):
        """This worker's replica (None on servers)."""
        return var.replica.shard if var.replica is not None else None

    def checkpoint_rows(self, var):
        """The whole replica on the first worker (None elsewhere)."""
        topo = var.topology
        if topo.is_worker and topo.worker_index == 0:
            return var.replica.shard.export()
        return None

    def read_table(self, var):
        """A copy of this worker's replica."""
        return var.replica.read_table()


@register
class AllreduceMethod(ReplicatedMethod):
    """``allreduce``: the gradient densified and allreduced (a dense variable: allreduced)."""

    name = "allreduce"
    densified = True


@register
class AllgatherMethod(ReplicatedMethod):
    """``allgather``: every worker's deduplicated rows allgathered, summed locally."""

    name = "allgather"
    gathers = True
    dense_ok = False
