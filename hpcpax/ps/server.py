"""The MPI parameter server: partitioned sparse tables, BSP push and pull.

Sparse variables live only on *owner* ranks (the server ranks, or the workers
themselves when the job has none), partitioned by row. Workers never hold a
whole table:

- :meth:`ParameterServer.pull` sends the ids a worker needs to their owners;
  the gather runs on the owner and only the touched rows travel back.
- :meth:`ParameterServer.push` sends the step's deduplicated gradient; the
  owner sums every worker's contribution (mean by default) and applies the
  row-wise optimizer once, so the next pull sees the update (BSP).

With *local aggregation* on, the workers of one node first exchange ids and
gradients by partition inside the node; each partition has one delegate
worker per node that deduplicates and sums the node's share, and only the
delegate talks to the owner. Off-node sparse traffic then grows with the
number of nodes, not the number of workers (:mod:`hpcpax.ps.movement`).

Every operation is **collective** over ``topology.comm``: all workers call
the same operations in the same order; server ranks sit in :meth:`serve`,
which follows the workers' operations until :meth:`shutdown`. Each operation
starts with one small header exchange (:mod:`hpcpax.ps.protocol`), which is
how servers learn what to do and how a bad input on one worker makes every
worker raise together instead of deadlocking.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module
from ..comm.agreement import check_same
from ..errors import ConfigError, SparseIndexError
from . import protocol as wire
from .memory import (MemoryBudgetError, RankMemory, check_memory_budget, check_whole_table,
                     owner_budget)
from .movement import DataMovement
from .reshard import export_rows, gather_table, repartition_collective
from .sparse_grad import SparseGrad, check_indices, prepare_push
from .spec import SparseVariableSpec
from .variable import PsVariable

__all__ = ["SparseVariableSpec", "ParameterServer"]


class ParameterServer:
    """Client and server of the sparse tables, on every rank.

    Args:
        topology: from :func:`hpcpax.init`.
        local_aggregation: aggregate per node before leaving it.
        reduce: ``mean`` (default, matches the dense path) or ``sum`` over workers.
        nonfinite: ``raise`` (default) or ``skip`` a push holding NaN/Inf
            (every rank skips that step's update).
        seed: key of the layout-independent row initializer.
        hot_rows: rows that many nodes touch travel once, by trees
            (:mod:`hpcpax.ps.hot_rows`): None (``HPCPAX_HOT_ROWS``), the
            minimum number of nodes (0: off) or ``{name: minimum}``. The
            same on every rank, servers included.

    Construction is local; :meth:`register` is the first collective.
    """

    def __init__(self, topology, *, local_aggregation=True, reduce="mean", nonfinite="raise",
                 seed=0, hot_rows=None):
        if reduce not in ("mean", "sum"):
            raise ConfigError(f"reduce must be 'mean' or 'sum', not {reduce!r}")
        if nonfinite not in ("raise", "skip"):
            raise ConfigError(f"nonfinite must be 'raise' or 'skip', not {nonfinite!r}")
        self.topology = topology
        self.local_aggregation = bool(local_aggregation)
        self.reduce = reduce
        self.nonfinite = nonfinite
        self.seed = int(seed)
        self.accounting = topology.accounting
        #: ``{name: PsVariable}`` of every registered variable.
        self.variables = {}
        self._by_index = []
        self._wire = wire.Protocol(topology, self._by_index, nonfinite)
        self._movement = DataMovement(topology, reduce, hot_rows)
        self._movement.on_owner_error = self._wire.defer  # raised on every rank, next header
        #: Optional object with a ``guard(name)`` context manager (e.g.
        #: :class:`hpcpax.comm.watchdog.Watchdog`); :meth:`serve` runs each
        #: operation inside it, so a server stuck in a collective is reported.
        self.watchdog = None
        #: Bytes this rank may hold (None: a share of the host's memory).
        self.memory_budget = None
        #: The rows this rank holds against that budget, checked as tables grow.
        self.memory = RankMemory(lambda: owner_budget(self))

    @property
    def skipped_pushes(self) -> int:
        """Pushes skipped on every rank under ``nonfinite="skip"``."""
        return self._wire.skipped_pushes

    # ------------------------------------------------------------ register
    def register(self, specs) -> None:
        """Create sparse variables on their owners.

        **Collective**: workers pass the same list of
        :class:`SparseVariableSpec`; servers receive it inside :meth:`serve`.
        Ranks that pass different lists raise :class:`MismatchError` on every
        rank. Partitions are assigned to owners balancing bytes.
        """
        specs = list(specs)
        names = [s.name for s in specs]
        for s in specs:
            s.validate()
        if len(set(names)) != len(names) or any(n in self.variables for n in names):
            raise ValueError(f"sparse variable names must be unique, got {names}")
        self._wire.header(wire.OP_REGISTER, -1, wire.STATUS_OK, len(specs))
        self.register_collective(specs)

    def register_collective(self, specs, whole=False) -> None:
        """The body of :meth:`register` on every rank (servers pass ``[]``).

        **Collective** over ``topology.comm``, without the header: for
        callers that already have every rank at the same point (a method
        switch in a trainer command). Tables start empty (rows are created
        on first touch); ``whole=True`` (same on every rank) says every row
        is about to be loaded, so the budget check counts them all.
        """
        topo = self.topology
        first = topo.worker_ranks[0]
        agreed = topo.comm.bcast(specs if topo.rank == first else None, root=first)
        mine = specs if topo.is_worker else agreed
        check_same(topo.comm, "sparse variable specs",
                   {f"spec[{i}]": s.to_dict() for i, s in enumerate(mine)}
                   | {"count": len(mine)})
        check_memory_budget(self, agreed, whole)  # every rank refuses together
        self.memory.refresh()
        for spec in agreed:
            var = PsVariable(len(self._by_index), spec, topo, self.seed, memory=self.memory)
            self.variables[spec.name] = var
            self._by_index.append(var)

    def _var(self, name) -> PsVariable:
        try:
            return self.variables[name]
        except KeyError:
            raise KeyError(f"unknown sparse variable {name!r}; registered: "
                           f"{sorted(self.variables)}") from None

    def set_local_aggregation(self, name, enabled) -> None:
        """Turn local aggregation on/off for one variable (None: the PS default).

        Local; every worker must make the same call (the servers need not).
        """
        self._var(name).local_aggregation = None if enabled is None else bool(enabled)

    def set_hot_rows(self, settings) -> None:
        """Hot rows per variable as a plan decided: ``{name: entry}`` (see
        :meth:`hpcpax.ps.hot_rows.routing.HotRows.set`); local, the same call on every rank."""
        for name, entry in settings.items():
            self._movement.hot.set(name, entry)

    def hot_rows_of(self, name):
        """The :meth:`set_hot_rows` entry of ``name``, or None (the default applies)."""
        return self._movement.hot.entries.get(name)

    def aggregates(self, name) -> bool:
        """Whether ``name``'s pulls and pushes aggregate per node on this rank."""
        return self._aggregates(self._var(name))

    def _aggregates(self, var) -> bool:
        enabled = self.local_aggregation if var.local_aggregation is None else var.local_aggregation
        topo = self.topology
        return enabled and topo.is_worker and topo.node_workers.Get_size() > 1

    # ---------------------------------------------------------------- pull
    def pull(self, name, ids):
        """Rows ``ids`` of variable ``name``, in the order given.

        **Collective** (every worker calls it, servers serve it). ``ids`` may
        be NumPy or CuPy and hold duplicates; the result lives on the same
        device, shape ``[len(ids), dim]``.
        """
        xp = array_module(ids)
        unique, inverse = xp.unique(xp.asarray(ids).astype(xp.int64, copy=False),
                                    return_inverse=True)
        rows = xp.asarray(self._pull_many([self._var(name)], [unique])[0])
        return rows[inverse.reshape(-1)]

    def pull_unique(self, name, ids):
        """``(unique sorted ids, their rows)`` for ``ids``, on ``ids``' device.

        **Collective**. What a model needs: each row once.
        """
        return self.pull_unique_many({name: ids})[name]

    def pull_unique_many(self, ids_by_name):
        """:meth:`pull_unique` of several variables in one exchange per phase.

        **Collective**; every worker passes the same variable names (in any
        order; ids differ). Returns ``{name: (unique sorted ids, rows)}`` on
        each ids' device. The variables travel together: one header, one
        ``Alltoall`` of counts and one ``Alltoallv`` per direction (plus the
        intra-node pair with local aggregation), whatever their number,
        instead of that much per variable. Deduplication and packing by
        destination run on the ids' device. Bytes are counted per variable
        (the counts travel as 8 bytes per peer and variable). More than
        :data:`~hpcpax.ps.protocol.MAX_BATCH` variables of distant indices
        take more than one exchange.
        """
        names = list(ids_by_name)
        uniques = {}
        for n in names:
            xp = array_module(ids_by_name[n])
            uniques[n] = xp.unique(xp.asarray(ids_by_name[n]).astype(xp.int64, copy=False))
        variables = sorted((self._var(n) for n in names), key=lambda v: v.index)
        rows = self._pull_many(variables, [uniques[v.spec.name] for v in variables])
        return {v.spec.name: (uniques[v.spec.name], array_module(uniques[v.spec.name]).asarray(r))
                for v, r in zip(variables, rows)}

    def _pull_many(self, variables, uniques) -> list:
        """Header(s), status and movement of a pull; host rows per variable."""
        error = None
        for var, unique in zip(variables, uniques):
            try:
                check_indices(var.spec.name, unique, var.spec.rows)
            except SparseIndexError as exc:
                error = error or exc
        rows = []
        for group in wire.batches(variables):
            ids = uniques[len(rows):len(rows) + len(group)]
            if len(group) == 1 and len(variables) == 1:
                headers = self._wire.header(wire.OP_PULL, group[0].index, wire.status_of(error))
            else:
                base, mask = wire.mask_of(group)
                headers = self._wire.header(wire.OP_PULL_MANY, base, wire.status_of(error), mask)
            self._wire.check_status(headers, wire.names_of(group), "pull", error)
            rows += self._movement.pull(group, ids, [self._aggregates(v) for v in group])
        return rows

    # ---------------------------------------------------------------- push
    def push(self, name, grad: SparseGrad) -> bool:
        """Send this step's gradient of ``name``; owners apply the optimizer.

        **Collective** (BSP): returns once every owner has applied the sum
        (or mean) of all workers' gradients, so the next :meth:`pull` sees
        the update. ``grad`` may hold duplicate indices and live on the GPU.
        Returns False when the step was skipped (``nonfinite="skip"``).

        Raises (on every worker, before any data moves, tables untouched):
            SparseIndexError, ValueError, TypeError: bad indices/shape/dtype.
            NonFiniteError: NaN/Inf with ``nonfinite="raise"``.
        """
        return self.push_many({name: grad})

    def push_many(self, grads) -> bool:
        """:meth:`push` of several variables in one exchange per phase.

        **Collective** (BSP); every worker passes the same variable names.
        ``grads`` maps names to :class:`SparseGrad`. Every gradient is
        checked before anything moves: bad input in any of them raises on
        every worker and leaves every table untouched; with
        ``nonfinite="skip"`` a NaN/Inf in any of them skips the whole
        batch (returns False). Bytes are counted per variable as by
        :meth:`push`.
        """
        variables = sorted((self._var(n) for n in grads), key=lambda v: v.index)
        prepared, error = {}, None
        for var in variables:
            try:
                prepared[var.spec.name] = prepare_push(var.spec, grads[var.spec.name])
            except (TypeError, ValueError, FloatingPointError) as exc:
                error = error or exc
        for group in wire.batches(variables):
            if len(variables) == 1:
                headers = self._wire.header(wire.OP_PUSH, group[0].index, wire.status_of(error))
            else:
                base, mask = wire.mask_of(group)
                headers = self._wire.header(wire.OP_PUSH_MANY, base, wire.status_of(error), mask)
            if self._wire.check_status(headers, wire.names_of(group), "push", error):
                return False  # skipped on every rank; later groups are not sent
            ids, values = zip(*(prepared[v.spec.name] for v in group))
            self._movement.push(group, ids, values, [self._aggregates(v) for v in group])
        return True

    # ------------------------------------------------------ export / import
    def export_rows(self, name):
        """This owner's rows of ``name``: ``(global ids, table, row state, scalar state)``.

        Local; empty on ranks that own nothing. Row state holds the
        optimizer's per-row slots, scalar state the rest (e.g. Adam's step),
        identical on every owner.
        """
        return export_rows(self._var(name))

    def gather_table(self, name):
        """The whole table of ``name`` with its optimizer state, on every rank.

        **Collective** over ``topology.comm``, called by every rank outside
        :meth:`serve` (for switching a variable to a replicated method).
        Returns ``(table, row_state, scalar_state)`` as host arrays; rows
        never touched hold their initial values. A table larger than
        ``HPCPAX_REPLICA_MEMORY`` is refused on every rank
        (:class:`~hpcpax.errors.ConfigError`) before anything moves.
        """
        return gather_table(self.topology.comm, self._var(name))

    def load_table(self, name, table, row_state, scalars) -> None:
        """Set this owner's rows of ``name`` from whole-table arrays (local).

        Each owner copies the rows it owns, by global id, with their
        optimizer state; ranks owning nothing do nothing. Call on every
        owner with the same arrays (e.g. broadcast from one worker).
        """
        shard = self._var(name).shard
        if shard is not None:
            try:
                shard.load_whole(table, row_state, scalars)
            except MemoryBudgetError as exc:  # raised on every rank at the next header
                self._wire.defer(exc)

    def repartition(self, name, num_partitions, owners=None) -> None:
        """Move ``name`` to ``num_partitions`` partitions, live and exactly.

        **Collective**. Every row, with its optimizer state, goes to its new
        owner by global id; nothing is recomputed, so training continues as
        if the new layout had been used from the start.
        """
        var = self._var(name)
        if isinstance(num_partitions, bool) or not isinstance(num_partitions, (int, np.integer)) \
                or num_partitions < 1:
            raise ValueError(f"num_partitions must be a positive int, not {num_partitions!r}")
        self._wire.header(wire.OP_REPARTITION, var.index, wire.STATUS_OK, int(num_partitions))
        owners = self.topology.comm.bcast(owners, root=self.topology.worker_ranks[0])
        error = repartition_collective(self.topology, self.accounting, var, int(num_partitions),
                                       owners)
        if error is not None:
            self._wire.defer(error)

    def read_table(self, name):
        """The whole table of ``name`` on every worker (host array).

        **Collective**; for tests, evaluation and small tables only: a
        table larger than ``HPCPAX_REPLICA_MEMORY`` is refused
        (:class:`~hpcpax.errors.ConfigError`, on every worker, before any
        communication). Every row is created on its owner.
        """
        var = self._var(name)
        check_whole_table(var.spec, "read_table")
        return self.pull(name, np.arange(var.spec.rows, dtype=np.int64))

    # --------------------------------------------------------------- serve
    def serve(self) -> None:
        """Run the server loop on a server rank until :meth:`shutdown`.

        **Collective**: follows the workers' operations one by one.
        Returns on server ranks when the workers shut down; returns at once
        on workers.
        """
        if not self.topology.is_server:
            return
        while True:
            headers = self._wire.header(0)
            op, index, _, argument = (int(v) for v in headers[0])
            if op == wire.OP_SHUTDOWN:
                return
            if self.watchdog is None:
                self._serve_one(headers, op, index, argument)
            else:
                with self.watchdog.guard(f"serve {wire.OP_NAMES.get(op, op)}"):
                    self._serve_one(headers, op, index, argument)

    def _serve_one(self, headers, op, index, argument) -> None:
        """The server side of one operation (after its header)."""
        if op == wire.OP_REGISTER:
            self.register_collective([])
            return
        if op == wire.OP_REPARTITION:
            owners = self.topology.comm.bcast(None, root=self.topology.worker_ranks[0])
            error = repartition_collective(self.topology, self.accounting,
                                           self._by_index[index], argument, owners)
            if error is not None:
                self._wire.defer(error)
            return
        group = (self._wire.batch(index, argument) if op in wire.MANY_OPS
                 else [self._by_index[index]])
        if self._wire.check_status(headers, wire.names_of(group), wire.OP_NAMES[op]):
            return
        empty = [np.zeros(0, np.int64) for _ in group]
        no_aggregation = [False] * len(group)
        if op in (wire.OP_PULL, wire.OP_PULL_MANY):
            self._movement.pull(group, empty, no_aggregation)
        elif op in (wire.OP_PUSH, wire.OP_PUSH_MANY):
            self._movement.push(group, empty, [np.zeros((0, v.spec.dim), v.spec.dtype)
                                               for v in group], no_aggregation)

    def shutdown(self) -> None:
        """Release the server ranks from :meth:`serve`. **Collective** on workers."""
        if self.topology.is_worker:
            self._wire.header(wire.OP_SHUTDOWN)

