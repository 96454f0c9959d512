"""`SparseSync`: every sparse variable of a model, one call per step phase.

Holds one :class:`~hpcpax.sync.variable.VariableSync` per sparse variable and
batches a step's work by method: the ``ps`` variables' pulls (and pushes)
travel together in one exchange per phase
(:meth:`~hpcpax.ps.server.ParameterServer.pull_unique_many`), the
``allgather`` ones in one allgather
(:func:`~hpcpax.sync.replicated.push_many`), the ``allreduce`` ones one by
one.
"""

from __future__ import annotations

from dataclasses import replace

from ..ps.reshard import repartition_collective
from ..ps.sparse_grad import SparseGrad
from .variable import VariableSync

__all__ = ["SparseSync"]


class SparseSync:
    """The sparse variables of one model on this rank.

    Args:
        topology: from :func:`hpcpax.init`.
        ps: the job's :class:`~hpcpax.ps.server.ParameterServer`.
        specs: the :class:`~hpcpax.ps.spec.SparseVariableSpec` s.
        requests: ``{name: {"method", "partitions", "owners",
            "local_aggregation"}}``; missing names and None fields take the
            defaults (``ps``, one partition per owner, balanced owners, the
            server's local aggregation).
        seed: the layout-independent initializer's key.

    Construction is local. :meth:`register` (workers; servers follow in
    :meth:`~hpcpax.ps.server.ParameterServer.serve`) creates the ``ps``
    variables on their owners.
    """

    def __init__(self, topology, ps, specs, requests=None, seed=0):
        requests = requests or {}
        self.topology, self.ps = topology, ps
        self._requests = {s.name: dict(requests.get(s.name) or {}) for s in specs}
        self.specs = {}
        for s in specs:
            partitions = self._requests[s.name].get("partitions")
            self.specs[s.name] = replace(s, num_partitions=partitions) if partitions else s
        #: ``{name: VariableSync}`` in the model's order.
        self.variables = {name: VariableSync(topology, spec, ps,
                                             self._requests[name].get("method") or "ps", seed)
                          for name, spec in self.specs.items()}

    def register(self) -> None:
        """Create the ``ps`` variables; **collective** (workers; servers serve).

        Then applies each request's owner map and local aggregation.
        """
        self.ps.register([self.specs[n] for n, v in self.variables.items()
                          if v.sync_method.on_servers])
        for name, var in self.variables.items():
            request = self._requests[name]
            if not var.sync_method.on_servers:
                continue
            owners = request.get("owners")
            if owners:
                var.repartition(len(owners), owners)
            if request.get("local_aggregation") is not None:
                var.set_local_aggregation(request["local_aggregation"])

    def register_collective(self) -> None:
        """:meth:`register` on every rank at once (servers too), without a header.

        **Collective** over ``topology.comm``: for callers that already have
        every rank at the same point (a set-up shared by servers and workers,
        e.g. :class:`hpcpax.app.model_sync.ModelSync`).
        """
        topo, ps = self.topology, self.ps
        on_ps = [self.specs[n] for n, v in self.variables.items() if v.sync_method.on_servers]
        ps.register_collective(on_ps if topo.is_worker else [])
        for name, var in self.variables.items():
            request = self._requests[name]
            if not var.sync_method.on_servers:
                continue
            owners = request.get("owners")
            if owners:
                repartition_collective(topo, ps.accounting, ps.variables[name], len(owners),
                                       list(owners))
            if request.get("local_aggregation") is not None:
                var.set_local_aggregation(request["local_aggregation"])

    def __getitem__(self, name) -> VariableSync:
        try:
            return self.variables[name]
        except KeyError:
            raise KeyError(f"unknown sparse variable {name!r}; registered: "
                           f"{sorted(self.variables)}") from None

    def __iter__(self):
        return iter(self.variables)

    def switch(self, name, method) -> None:
        """:meth:`VariableSync.switch` of ``name``; **collective** over every rank."""
        self.variables[name].switch(method)

    def describe(self) -> dict:
        """``{name: plan fields}`` of every variable as it is now."""
        return {name: var.describe() for name, var in self.variables.items()}

    # ------------------------------------------------------------------ steps
    def pull(self, ids_by_name) -> dict:
        """``{name: (unique sorted ids, rows)}`` on the ids' device.

        **Collective** over the workers (and the servers through the PS).
        Replicated variables read their replica; ``ps`` ones travel together.
        """
        out = {}
        for batch, group in self._batches(ids_by_name):
            out.update(batch.pull(self, group))
        return {name: out[name] for name in ids_by_name}

    def push(self, grads) -> None:
        """Push ``{name: (indices, values)}`` (or :class:`SparseGrad`); **collective** (workers).

        The ``ps`` variables in one batched exchange, the replicated ones in
        another.
        """
        ready = {}
        for name, grad in grads.items():
            if not isinstance(grad, SparseGrad):
                grad = SparseGrad(grad[0], grad[1], self[name].spec.rows)
            ready[name] = grad
        for batch, group in self._batches(ready):
            batch.push(self, group)

    def _batches(self, by_name) -> list:
        """``[(StepBatch, {name: value})]``: ``by_name`` split by each variable's
        method's :attr:`~hpcpax.sync.methods.SyncMethod.batch`, in the batches' order
        (the same on every rank)."""
        groups = {}
        for name, value in by_name.items():
            batch = self[name].sync_method.batch
            groups.setdefault(id(batch), (batch, {}))[1][name] = value
        return sorted(groups.values(), key=lambda item: item[0].order)

    def read_tables(self) -> dict:
        """``{name: whole table}`` on the workers; **collective** (workers and servers)."""
        return {name: var.read_table() for name, var in self.variables.items()}

    # ------------------------------------------------------------- checkpoint
    def checkpoint_rows(self) -> list:
        """``[(name, ids, table, row state, scalars)]`` this rank writes; local."""
        out = []
        for name, var in self.variables.items():
            rows = var.checkpoint_rows()
            if rows is not None:
                out.append((name, *rows))
        return out

    def restore_rows(self, read_rows) -> None:
        """Load every variable's rows held here; ``read_rows(name, keep)``; local."""
        for name, var in self.variables.items():
            var.restore_rows(lambda keep, name=name: read_rows(name, keep))
