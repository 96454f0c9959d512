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
number of nodes, not the number of workers.

Every operation is **collective** over ``topology.comm``: all workers call
the same operations in the same order; server ranks sit in :meth:`serve`,
which follows the workers' operations until :meth:`shutdown`. Each operation
starts with one small ``Allgather`` of a fixed header (operation, variable,
status), which is how servers learn what to do and how a bad input on one
worker makes every worker raise together instead of deadlocking.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import numpy as np

from ..backend import array_module, to_host
from ..comm.agreement import check_same
from ..errors import ConfigError, MismatchError, NonFiniteError, SparseIndexError
from ..comm.exchange import (
    alltoallv_many,
    alltoallv_rows,
    exchange_counts,
    exchange_counts_many,
    group_by_destination,
)
from .initializers import INITIALIZERS, init_rows
from ..ops import dedup_sum, gather_rows
from ..ops.optimizers import make_optimizer
from ..ops.partitioning import Partitioning
from .placement import assign_owners
from .memory import check_memory_budget
from .sparse_grad import SparseGrad, check_indices

__all__ = ["SparseVariableSpec", "ParameterServer"]

(OP_REGISTER, OP_PULL, OP_PUSH, OP_SHUTDOWN, OP_EXPORT, OP_REPARTITION, OP_IMPORT,
 OP_PULL_MANY, OP_PUSH_MANY) = range(1, 10)
_OP_NAMES = {OP_REGISTER: "register", OP_PULL: "pull", OP_PUSH: "push", OP_SHUTDOWN: "shutdown",
             OP_EXPORT: "export", OP_REPARTITION: "repartition", OP_IMPORT: "import",
             OP_PULL_MANY: "pull_many", OP_PUSH_MANY: "push_many"}
_MANY_OPS = (OP_PULL_MANY, OP_PUSH_MANY)
#: Variables per batched operation: their indices travel as a bit mask in
#: the header's int64 argument, relative to the header's variable index.
MAX_BATCH = 62
STATUS_OK, STATUS_BAD_INDEX, STATUS_NONFINITE, STATUS_BAD_TYPE, STATUS_BAD_VALUE = range(5)
_STATUS_ERRORS = {STATUS_BAD_INDEX: SparseIndexError, STATUS_NONFINITE: NonFiniteError,
                  STATUS_BAD_TYPE: TypeError, STATUS_BAD_VALUE: ValueError}
_HEADER = 4  # op, variable index, status, argument


@dataclass(frozen=True)
class SparseVariableSpec:
    """A sparse variable (an embedding table) as workers register it.

    Attributes:
        name: unique name.
        rows, dim: table shape.
        dtype: ``float32`` or ``float64``.
        initializer: ``uniform`` (U(-init_scale, init_scale)), ``zeros`` or
            ``constant`` (every value ``init_scale``).
        init_scale: see ``initializer``.
        optimizer: ``sgd``, ``momentum``, ``adagrad`` or ``adam``.
        optimizer_params: hyper-parameters, e.g. ``{"lr": 0.1}``.
        partitioning: ``mod`` (row r in partition r % P) or ``range``.
        num_partitions: P; None = one per owner rank.
    """

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"
    init_scale: float = 0.05
    optimizer: str = "sgd"
    optimizer_params: dict = field(default_factory=lambda: {"lr": 0.1})
    partitioning: str = "mod"
    num_partitions: int | None = None

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for a bad field (local check)."""
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, not {self.name!r}")
        for key in ("rows", "dim"):
            value = getattr(self, key)
            if not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"{self.name}: {key} must be a positive int, not {value!r}")
        if np.dtype(self.dtype) not in (np.dtype("float32"), np.dtype("float64")):
            raise TypeError(f"{self.name}: dtype must be float32 or float64, not {self.dtype}")
        if self.initializer not in INITIALIZERS:
            raise ValueError(f"{self.name}: initializer must be one of {sorted(INITIALIZERS)}, "
                             f"not {self.initializer!r}")
        if self.partitioning not in ("mod", "range"):
            raise ValueError(f"{self.name}: partitioning must be 'mod' or 'range', "
                             f"not {self.partitioning!r}")
        if self.num_partitions is not None and (
                not isinstance(self.num_partitions, (int, np.integer)) or self.num_partitions < 1):
            raise ValueError(f"{self.name}: num_partitions must be a positive int, "
                             f"not {self.num_partitions!r}")
        make_optimizer(self.optimizer, **self.optimizer_params)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        d = asdict(self)
        d["dtype"] = str(np.dtype(self.dtype))
        return d

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.dim * np.dtype(self.dtype).itemsize


class _Variable:
    """A registered variable: its layout everywhere, its rows on owners."""

    def __init__(self, index, spec, topology, seed, partitions=None, owners=None):
        self.index = index
        self.spec = spec
        self.set_layout(topology, partitions or spec.num_partitions or len(topology.owner_ranks),
                        owners)
        self.optimizer = make_optimizer(spec.optimizer, **spec.optimizer_params)
        self.local_aggregation = None  # None: the ParameterServer's setting
        self.table = None
        self.state = None
        if topology.rank in self.owner_rank_of_part:
            gids = self.owned_global_ids()
            self.table = init_rows(spec.initializer, seed, spec.name, gids, spec.dim, spec.dtype,
                                   spec.init_scale)
            self.state = self.optimizer.init_state(self.table.shape, self.table.dtype, np)

    def set_layout(self, topology, num_partitions, owners=None):
        spec = self.spec
        self.partitioning = Partitioning(spec.partitioning, spec.rows, int(num_partitions))
        part_bytes = [self.partitioning.part_rows(p) * spec.row_bytes
                      for p in range(num_partitions)]
        owner_ranks = topology.owner_ranks
        if owners is None:
            owners = assign_owners(part_bytes, len(owner_ranks))
        if len(owners) != num_partitions or not all(0 <= o < len(owner_ranks) for o in owners):
            raise ConfigError(f"{spec.name}: owners must list one of {len(owner_ranks)} owners "
                              f"for each of {num_partitions} partitions, not {owners!r}")
        self.owners = [int(o) for o in owners]
        self.owner_rank_of_part = np.array([owner_ranks[o] for o in self.owners], np.int64)
        mine = np.flatnonzero(self.owner_rank_of_part == topology.rank)
        self.my_parts = [int(p) for p in mine]
        # Rows of all my partitions are stored back to back in one table.
        self.offset = np.zeros(num_partitions, np.int64)
        position = 0
        for p in self.my_parts:
            self.offset[p] = position
            position += self.partitioning.part_rows(p)
        self.num_local_rows = position

    def owned_global_ids(self) -> np.ndarray:
        parts = [self.partitioning.global_index(p, np.arange(self.partitioning.part_rows(p)))
                 for p in self.my_parts]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def local_rows(self, ids) -> np.ndarray:
        """Row of each global id in this owner's table."""
        return self.offset[self.partitioning.partition_of(ids)] + self.partitioning.local_index(ids)

    def dest_of(self, ids) -> np.ndarray:
        return self.owner_rank_of_part[self.partitioning.partition_of(ids)]


class ParameterServer:
    """Client and server of the sparse tables, on every rank.

    Args:
        topology: from :func:`hpcpax.init`.
        local_aggregation: aggregate per node before leaving it.
        reduce: ``mean`` (default, matches the dense path) or ``sum`` over workers.
        nonfinite: ``raise`` (default) or ``skip`` a push holding NaN/Inf
            (every rank skips that step's update).
        seed: key of the layout-independent row initializer.

    Construction is local; :meth:`register` is the first collective.
    """

    def __init__(self, topology, *, local_aggregation=True, reduce="mean", nonfinite="raise",
                 seed=0):
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
        self.variables = {}
        self._by_index = []
        self.skipped_pushes = 0
        #: Optional object with a ``guard(name)`` context manager (e.g.
        #: :class:`hpcpax.comm.watchdog.Watchdog`); :meth:`serve` runs each
        #: operation inside it, so a server stuck in a collective is reported.
        self.watchdog = None
        nw = topology.node_workers
        self._node_worker_ranks = (np.array(nw.allgather(topology.rank), np.int64)
                                   if nw is not None else None)

    # ----------------------------------------------------------------- header
    def _header(self, op, var_index=-1, status=STATUS_OK, argument=0):
        from mpi4py import MPI

        comm = self.topology.comm
        mine = np.array([op, var_index, status, argument], np.int64)
        everyone = np.empty((comm.Get_size(), _HEADER), np.int64)
        start = time.perf_counter()
        comm.Allgather([mine, MPI.INT64_T], [everyone, MPI.INT64_T])
        n = comm.Get_size() - 1
        self.accounting.record_bytes("control", None, sent=n * mine.nbytes,
                                     recv=n * mine.nbytes, seconds=time.perf_counter() - start)
        workers = everyone[self.topology.worker_ranks]
        first = workers[0]
        disagree = [r for r, h in zip(self.topology.worker_ranks, workers)
                    if (h[0], h[1], h[3]) != (first[0], first[1], first[3])]
        if disagree:
            def describe(h):
                if int(h[0]) in _MANY_OPS:
                    names = [v.spec.name for v in self._batch_vars(int(h[1]), int(h[3]))]
                    return f"{_OP_NAMES[int(h[0])]}({', '.join(names)})"
                name = self._by_index[h[1]].spec.name if 0 <= h[1] < len(self._by_index) else h[1]
                return f"{_OP_NAMES.get(int(h[0]), h[0])}({name}, {int(h[3])})"
            raise MismatchError(
                f"workers called different parameter-server operations: rank "
                f"{self.topology.worker_ranks[0]} {describe(first)}, ranks {disagree} "
                f"{describe(everyone[disagree[0]])}")
        return workers

    def _check_status(self, workers, var_name, op_name, error=None):
        """Raise on every worker if any worker reported bad input.

        **Collective** on the error path only: the first offender's message
        is broadcast so every rank's error names the variable and the value.
        Returns True when the operation is to be skipped (servers, or the
        ``nonfinite="skip"`` policy), False when it goes ahead.
        """
        statuses = workers[:, 2]
        bad = [r for r, st in zip(self.topology.worker_ranks, statuses) if st != STATUS_OK]
        if not bad:
            return False
        if self.nonfinite == "skip" and all(st in (STATUS_OK, STATUS_NONFINITE) for st in statuses):
            self.skipped_pushes += 1
            return True
        message = self.topology.comm.bcast(str(error) if self.topology.rank == bad[0] else None,
                                           root=bad[0])
        if self.topology.is_server:
            return True
        if error is not None:
            raise error
        status = int(statuses[self.topology.worker_ranks.index(bad[0])])
        raise _STATUS_ERRORS[status](f"{op_name} of {var_name!r} refused on every rank: rank "
                                     f"{bad[0]} sent bad input ({message}); ranks with bad "
                                     f"input: {bad}")

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
        self._header(OP_REGISTER, -1, STATUS_OK, len(specs))
        self._register_collective(specs)

    def _register_collective(self, specs):
        topo = self.topology
        first = topo.worker_ranks[0]
        agreed = topo.comm.bcast(specs if topo.rank == first else None, root=first)
        mine = specs if topo.is_worker else agreed
        check_same(topo.comm, "sparse variable specs",
                   {f"spec[{i}]": s.to_dict() for i, s in enumerate(mine)}
                   | {"count": len(mine)})
        check_memory_budget(self, agreed)  # every rank refuses together, before allocating
        for spec in agreed:
            var = _Variable(len(self._by_index), spec, topo, self.seed)
            self.variables[spec.name] = var
            self._by_index.append(var)

    def _var(self, name) -> _Variable:
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
        unique, inverse = np.unique(to_host(ids).astype(np.int64, copy=False),
                                    return_inverse=True)
        rows = self._pull(name, unique)
        out = rows[inverse.reshape(-1)]
        return out if xp is np else xp.asarray(out)

    def pull_unique(self, name, ids):
        """``(unique sorted ids, their rows)`` for ``ids`` (host arrays).

        **Collective**. What a model needs: each row once.
        """
        unique = np.unique(to_host(ids).astype(np.int64, copy=False))
        return unique, self._pull(name, unique)

    def pull_unique_many(self, ids_by_name):
        """:meth:`pull_unique` of several variables in one exchange per phase.

        **Collective**; every worker passes the same variable names (in any
        order; ids differ). Returns ``{name: (unique sorted ids, rows)}``.
        The variables travel together: one header, one ``Alltoall`` of
        counts and one ``Alltoallv`` per direction (plus the intra-node
        pair with local aggregation), whatever their number, instead of that
        much per variable. Bytes are counted per variable as by
        :meth:`pull_unique` (the counts travel as 8 bytes per peer and
        variable). More than :data:`MAX_BATCH` variables of distant indices
        take more than one exchange.
        """
        names = list(ids_by_name)
        uniques = {n: np.unique(to_host(ids_by_name[n]).astype(np.int64, copy=False))
                   for n in names}
        variables = sorted((self._var(n) for n in names), key=lambda v: v.index)
        if len(variables) == 1:
            name = variables[0].spec.name
            return {name: (uniques[name], self._pull(name, uniques[name]))}
        error = None
        for var in variables:
            try:
                check_indices(var.spec.name, uniques[var.spec.name], var.spec.rows)
            except SparseIndexError as exc:
                error = error or exc
        rows = {}
        for group in _batches(variables):
            base, mask = _mask_of(group)
            workers = self._header(OP_PULL_MANY, base, _status_of(error), mask)
            self._check_status(workers, _names_of(group), "pull", error)
            got = self._pull_many_collective(group, [uniques[v.spec.name] for v in group])
            rows.update((v.spec.name, r) for v, r in zip(group, got))
        return {n: (uniques[n], rows[n]) for n in names}

    def _pull_many_collective(self, variables, id_lists):
        """The data movement of every pull, of one variable or several (workers and servers)."""
        topo, acct = self.topology, self.accounting
        names = [v.spec.name for v in variables]
        outgoing = list(id_lists)
        la = [k for k, v in enumerate(variables) if self._aggregates(v)]
        if la:
            nw, node_ranks = topo.node_workers, self._node_worker_ranks
            la_names = [names[k] for k in la]
            n_counts = np.zeros((nw.Get_size(), len(la)), np.int64)
            n_orders, n_sends, inverses = [], [], []
            for j, k in enumerate(la):
                delegate = variables[k].partitioning.partition_of(outgoing[k]) % nw.Get_size()
                n_counts[:, j], order, ids = group_by_destination(delegate, nw.Get_size(),
                                                                  outgoing[k])
                n_orders.append(order)
                n_sends.append([ids])
            n_recv = exchange_counts_many(nw, n_counts, acct, "intra_node", la_names, node_ranks)
            requests = alltoallv_many(nw, n_counts, n_recv, n_sends, acct, "intra_node",
                                      la_names, ranks=node_ranks)
            for j, k in enumerate(la):
                outgoing[k], inverse = np.unique(requests[j][0], return_inverse=True)
                inverses.append(inverse.reshape(-1))
        counts = np.zeros((topo.size, len(variables)), np.int64)
        orders, sends = [], []
        for k, var in enumerate(variables):
            counts[:, k], order, ids = group_by_destination(var.dest_of(outgoing[k]), topo.size,
                                                            outgoing[k])
            orders.append(order)
            sends.append([ids])
        recv = exchange_counts_many(topo.comm, counts, acct, "pull", names)
        wanted = alltoallv_many(topo.comm, counts, recv, sends, acct, "pull", names)
        rows = []
        for k, var in enumerate(variables):
            ids = wanted[k][0]
            rows.append([gather_rows(var.table, var.local_rows(ids)) if len(ids)
                         else np.zeros((0, var.spec.dim), var.spec.dtype)])
        got = alltoallv_many(topo.comm, recv, counts, rows, acct, "pull", names)
        result = [_unsort(got[k][0], orders[k]) for k in range(len(variables))]
        if la:
            back = alltoallv_many(nw, n_recv, n_counts,
                                  [[result[k][inverses[j]]] for j, k in enumerate(la)],
                                  acct, "intra_node", la_names, ranks=node_ranks)
            for j, k in enumerate(la):
                result[k] = _unsort(back[j][0], n_orders[j])
        return result

    def _pull(self, name, unique):
        var = self._var(name)
        error = None
        try:
            check_indices(name, unique, var.spec.rows)
        except SparseIndexError as exc:
            error = exc
        workers = self._header(OP_PULL, var.index, _status_of(error))
        self._check_status(workers, name, "pull", error)
        return self._pull_many_collective([var], [unique])[0]

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
        var = self._var(name)
        ids = values = error = None
        try:
            ids, values = self._prepare_push(var, grad)
        except (TypeError, ValueError, FloatingPointError) as exc:
            error = exc
        workers = self._header(OP_PUSH, var.index, _status_of(error))
        if self._check_status(workers, name, "push", error):
            return False
        return self._push_many_collective([var], [ids], [values])

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
        names = list(grads)
        variables = sorted((self._var(n) for n in names), key=lambda v: v.index)
        if len(variables) == 1:
            return self.push(names[0], grads[names[0]])
        prepared, error = {}, None
        for var in variables:
            try:
                prepared[var.spec.name] = self._prepare_push(var, grads[var.spec.name])
            except (TypeError, ValueError, FloatingPointError) as exc:
                error = error or exc
        for group in _batches(variables):
            base, mask = _mask_of(group)
            workers = self._header(OP_PUSH_MANY, base, _status_of(error), mask)
            if self._check_status(workers, _names_of(group), "push", error):
                return False  # skipped on every rank; later groups are not sent
            self._push_many_collective(group, *zip(*(prepared[v.spec.name] for v in group)))
        return True

    def _prepare_push(self, var, grad):
        """Validate ``grad`` for ``var``; its deduplicated ``(ids, values)`` on the host."""
        name = var.spec.name
        if not isinstance(grad, SparseGrad):
            raise TypeError(f"{name}: push needs a SparseGrad, not {type(grad).__name__}")
        if grad.num_rows != var.spec.rows:
            raise ValueError(f"{name}: SparseGrad.num_rows must be {var.spec.rows}, "
                             f"not {grad.num_rows}")
        grad.validate(name, var.spec.dim, var.spec.dtype)
        ids, values = dedup_sum(grad.indices.astype(array_module(grad.indices).int64,
                                                    copy=False), grad.values)
        ids, values = to_host(ids), to_host(values)
        if not np.isfinite(values).all():
            raise NonFiniteError(f"{name}: gradient holds NaN or Inf "
                                 f"(set nonfinite='skip' to skip such steps)")
        return ids, values

    def _push_many_collective(self, variables, id_lists, value_lists):
        """The data movement and updates of every push, one variable or several."""
        topo, acct = self.topology, self.accounting
        names = [v.spec.name for v in variables]
        id_lists, value_lists = list(id_lists), list(value_lists)
        la = [k for k, v in enumerate(variables) if self._aggregates(v)]
        if la:
            nw, node_ranks = topo.node_workers, self._node_worker_ranks
            la_names = [names[k] for k in la]
            n_counts = np.zeros((nw.Get_size(), len(la)), np.int64)
            n_sends = []
            for j, k in enumerate(la):
                delegate = variables[k].partitioning.partition_of(id_lists[k]) % nw.Get_size()
                n_counts[:, j], _, ids, vals = group_by_destination(
                    delegate, nw.Get_size(), id_lists[k], value_lists[k])
                n_sends.append([ids, vals])
            n_recv = exchange_counts_many(nw, n_counts, acct, "intra_node", la_names, node_ranks)
            got = alltoallv_many(nw, n_counts, n_recv, n_sends, acct, "intra_node", la_names,
                                 ranks=node_ranks)
            for j, k in enumerate(la):
                with acct.timer("aggregate", names[k]):
                    id_lists[k], value_lists[k] = dedup_sum(got[j][0], got[j][1])
        counts = np.zeros((topo.size, len(variables)), np.int64)
        sends = []
        for k, var in enumerate(variables):
            counts[:, k], _, ids, vals = group_by_destination(var.dest_of(id_lists[k]), topo.size,
                                                              id_lists[k], value_lists[k])
            sends.append([ids, vals])
        recv = exchange_counts_many(topo.comm, counts, acct, "push", names)
        got = alltoallv_many(topo.comm, counts, recv, sends, acct, "push", names)
        for k, var in enumerate(variables):
            self._apply(var, got[k][0], got[k][1])
        return True

    def _apply(self, var, ids, values):
        """Owner side of a push: sum (or mean) the received rows, run the optimizer."""
        if var.table is None:
            return
        with self.accounting.timer("apply", var.spec.name):
            unique, summed = dedup_sum(ids, values)
            if self.reduce == "mean" and self.topology.num_workers > 1:
                summed /= self.topology.num_workers
            var.optimizer.apply_rows(var.table, var.state, var.local_rows(unique), summed)

    # ------------------------------------------------------ export / import
    def export_rows(self, name):
        """This owner's rows of ``name``: ``(global ids, table, row state, scalar state)``.

        Local; empty on ranks that own nothing. Row state holds the
        optimizer slots with one row per table row; scalar state the rest
        (e.g. Adam's step), identical on every owner.
        """
        var = self._var(name)
        gids = var.owned_global_ids()
        if var.table is None:
            return gids, np.zeros((0, var.spec.dim), var.spec.dtype), {}, {}
        rows, scalars = _split_state(var.state, var.table.shape[0])
        return gids, var.table, rows, scalars

    def gather_table(self, name):
        """The whole table of ``name`` with its optimizer state, on every rank.

        **Collective** over ``topology.comm``, called by every rank outside
        :meth:`serve` (for switching a variable to a replicated method).
        Returns ``(table, row_state, scalar_state)`` as host arrays.
        """
        var = self._var(name)
        pieces = self.topology.comm.allgather(self.export_rows(name))
        table = np.empty((var.spec.rows, var.spec.dim), var.spec.dtype)
        row_state, scalars = {}, {}
        for gids, rows, state, scalar in pieces:
            if len(gids) == 0:
                continue
            table[gids] = rows
            for key, value in state.items():
                row_state.setdefault(key, np.empty((var.spec.rows,) + value.shape[1:],
                                                   value.dtype))[gids] = value
            scalars = scalar or scalars
        return table, row_state, {k: np.array(v, copy=True) for k, v in scalars.items()}

    def load_table(self, name, table, row_state, scalars) -> None:
        """Set this owner's rows of ``name`` from whole-table arrays (local).

        Each owner copies the rows it owns, by global id, with their
        optimizer state; ranks owning nothing do nothing. Call on every
        owner with the same arrays (e.g. broadcast from one worker).
        """
        var = self._var(name)
        if var.table is None:
            return
        gids = var.owned_global_ids()
        var.table[...] = table[gids]
        for key, value in row_state.items():
            var.state[key][...] = value[gids]
        for key, value in scalars.items():
            var.state[key] = np.array(value, copy=True)

    def repartition(self, name, num_partitions, owners=None) -> None:
        """Move ``name`` to ``num_partitions`` partitions, live and exactly.

        **Collective**. Every row, with its optimizer state, goes to its new
        owner by global id; nothing is recomputed, so training continues as
        if the new layout had been used from the start.
        """
        var = self._var(name)
        if not isinstance(num_partitions, (int, np.integer)) or num_partitions < 1:
            raise ValueError(f"num_partitions must be a positive int, not {num_partitions!r}")
        self._header(OP_REPARTITION, var.index, STATUS_OK, int(num_partitions))
        owners = self.topology.comm.bcast(owners, root=self.topology.worker_ranks[0])
        self._repartition_collective(var, int(num_partitions), owners)

    def _repartition_collective(self, var, num_partitions, owners):
        topo = self.topology
        gids, table, row_state, scalars = self.export_rows(var.spec.name)
        scalars = topo.comm.bcast(scalars, root=int(var.owner_rank_of_part[0]))
        old_rows = var.num_local_rows
        var.set_layout(topo, num_partitions, owners)
        state_names = sorted(row_state) if row_state else sorted(
            k for k, v in var.optimizer.init_state((1, var.spec.dim), table.dtype, np).items()
            if np.ndim(v) == 2)
        arrays = [gids, table] + [row_state[k] for k in state_names] if old_rows else \
            [gids, table] + [np.zeros((0, var.spec.dim), table.dtype) for _ in state_names]
        counts, _, *sorted_arrays = group_by_destination(var.dest_of(gids), topo.size, *arrays)
        recv = exchange_counts(topo.comm, counts, self.accounting, "repartition", var.spec.name)
        got = alltoallv_rows(topo.comm, counts, recv, sorted_arrays, self.accounting,
                             "repartition", var.spec.name)
        if var.my_parts:
            local = var.local_rows(got[0])
            var.table = np.empty((var.num_local_rows, var.spec.dim), var.spec.dtype)
            var.table[local] = got[1]
            var.state = var.optimizer.init_state(var.table.shape, var.table.dtype, np)
            for k, arr in zip(state_names, got[2:]):
                var.state[k][local] = arr
            for k, v in scalars.items():
                var.state[k] = np.array(v, copy=True)
        else:
            var.table, var.state = None, None

    def read_table(self, name):
        """The whole table of ``name`` on every worker (host array).

        **Collective**; for tests, evaluation and small tables only.
        """
        var = self._var(name)
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
            workers = self._header(0)
            op, index, _, argument = (int(v) for v in workers[0])
            if op == OP_SHUTDOWN:
                return
            if self.watchdog is None:
                self._serve_one(workers, op, index, argument)
            else:
                with self.watchdog.guard(f"serve {_OP_NAMES.get(op, op)}"):
                    self._serve_one(workers, op, index, argument)

    def _serve_one(self, workers, op, index, argument):
        """The server side of one operation (after its header)."""
        if op == OP_REGISTER:
            self._register_collective([])
            return
        if op in _MANY_OPS:
            group = self._batch_vars(index, argument)
            if self._check_status(workers, _names_of(group), _OP_NAMES[op]):
                return
            empty = [np.zeros(0, np.int64) for _ in group]
            if op == OP_PULL_MANY:
                self._pull_many_collective(group, empty)
            else:
                self._push_many_collective(group, empty, [np.zeros((0, v.spec.dim), v.spec.dtype)
                                                          for v in group])
            return
        var = self._by_index[index]
        if op == OP_REPARTITION:
            owners = self.topology.comm.bcast(None, root=self.topology.worker_ranks[0])
            self._repartition_collective(var, argument, owners)
            return
        if self._check_status(workers, var.spec.name, _OP_NAMES[op]):
            return
        if op == OP_PULL:
            self._pull_many_collective([var], [np.zeros(0, np.int64)])
        elif op == OP_PUSH:
            self._push_many_collective([var], [np.zeros(0, np.int64)],
                                       [np.zeros((0, var.spec.dim), var.spec.dtype)])

    def _batch_vars(self, base, mask):
        """The variables of a batched header: indices ``base + i`` for set bits ``i``."""
        return [self._by_index[base + i] for i in range(MAX_BATCH)
                if mask >> i & 1 and base + i < len(self._by_index)]

    def shutdown(self) -> None:
        """Release the server ranks from :meth:`serve`. **Collective** on workers."""
        if self.topology.is_worker:
            self._header(OP_SHUTDOWN)


def _batches(variables):
    """Split variables (sorted by index) into groups whose indices span < MAX_BATCH."""
    groups = []
    for var in variables:
        if groups and var.index - groups[-1][0].index < MAX_BATCH:
            groups[-1].append(var)
        else:
            groups.append([var])
    return groups


def _mask_of(group):
    """``(base index, bit mask)`` of a group from :func:`_batches`."""
    base = group[0].index
    return base, sum(1 << (v.index - base) for v in group)


def _names_of(group) -> str:
    return ", ".join(v.spec.name for v in group)


def _status_of(error) -> int:
    """Header status code of a local validation error (0 when none)."""
    if error is None:
        return STATUS_OK
    for status, cls in _STATUS_ERRORS.items():
        if isinstance(error, cls):
            return status
    return STATUS_BAD_VALUE


def _unsort(values, order):
    """Undo :func:`group_by_destination`'s permutation."""
    if order is None:
        return values
    out = np.empty_like(values)
    out[order] = values
    return out


def _split_state(state, num_rows):
    rows = {k: v for k, v in state.items() if np.ndim(v) == 2 and v.shape[0] == num_rows}
    scalars = {k: v for k, v in state.items() if k not in rows}
    return rows, scalars
