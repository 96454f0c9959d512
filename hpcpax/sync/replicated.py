"""Sparse variables kept whole on every worker: the non-PS methods.

For the planner and the benchmarks, a sparse variable can also be synced the
ways Horovod does it, with the table replicated on each worker
(:mod:`hpcpax.comm.sparse_collectives`):

- ``allgather``: every worker receives every other worker's deduplicated
  ``(indices, values)`` and sums them locally;
- ``allreduce``: the gradient is densified and allreduced like a dense
  variable (Horovod's ``sparse_as_dense``).

Both give the same parameters as the PS path (same initializer, same summed
gradient, same optimizer kernel, the same :class:`~hpcpax.ps.table.TableShard`
storage); :class:`ReplicatedTable` has the PS's ``pull``/``pull_unique``/
``push`` interface, for one variable.
"""

from __future__ import annotations

import hashlib

import numpy as np

from ..backend import array_module, is_device_array, to_host
from ..comm.agreement import refuse_together, status_of
from ..comm.polling import wait
from ..comm.reductions import start_allgather
from ..comm.sparse_collectives import allgather_sparse_many, densify_allreduce
from ..errors import ConfigError, NonFiniteError, SparseIndexError
from ..ops import dedup_sum
from ..ops.optimizers import apply_rows_many, make_optimizer
from ..ps.layout import WholeLayout
from ..ps.sparse_grad import SparseGrad, check_indices
from ..ps.table import TableShard
from .methods import method_of

__all__ = ["ReplicatedTable", "push_many"]


class ReplicatedTable:
    """One sparse variable replicated on every worker, synced by ``method``.

    Args:
        topology: from :func:`hpcpax.init` (only workers may use it).
        spec: a :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        method: ``allgather`` or ``allreduce``.
        reduce: ``mean`` or ``sum`` over workers.
        seed: the same key as the PS initializer, so tables start equal.
    """

    def __init__(self, topology, spec, method="allgather", reduce="mean", seed=0):
        if not method_of(method).replicated:
            raise ConfigError(f"method must be a replicated one, not {method!r}")
        if not topology.is_worker:
            raise ConfigError("a ReplicatedTable lives on workers only")
        spec.validate()
        self.topology, self.spec, self.method, self.reduce = topology, spec, method, reduce
        self.optimizer = make_optimizer(spec.optimizer, **spec.optimizer_params)
        #: The whole table and its optimizer state.
        self.shard = TableShard(spec, self.optimizer, WholeLayout(spec.rows), seed)

    @property
    def table(self) -> np.ndarray:
        """This worker's replica (host array)."""
        return self.shard.table

    @property
    def state(self) -> dict:
        """The optimizer state of the replica."""
        return self.shard.state

    def pull(self, ids):
        """Rows ``ids`` (any order, duplicates allowed); local, on ``ids``' device."""
        host = to_host(ids).astype(np.int64, copy=False)
        check_indices(self.spec.name, host, self.spec.rows)
        rows = self.shard.gather(host)
        xp = array_module(ids)
        return rows if xp is np else xp.asarray(rows)

    def pull_unique(self, ids):
        """``(unique sorted ids, rows)`` on ``ids``' device; local."""
        xp = array_module(ids)
        unique = xp.unique(xp.asarray(ids).astype(xp.int64, copy=False))
        check_indices(self.spec.name, unique, self.spec.rows)
        rows = self.shard.gather(to_host(unique))
        return unique, (rows if xp is np else xp.asarray(rows))

    def push(self, grad: SparseGrad) -> bool:
        """Sync this step's gradient and apply it on every replica.

        **Collective** over the workers. A bad gradient raises on every
        worker together (checked before anything moves).
        """
        return push_many({self.spec.name: self}, {self.spec.name: grad})

    def _prepare(self, grad):
        """Validated, deduplicated ``(ids, values)`` of ``grad`` on the host."""
        grad.validate(self.spec.name, self.spec.dim, self.spec.dtype)
        # the row updates trust these ids: the table's rows bound them too
        check_indices(self.spec.name, grad.indices, self.spec.rows)
        ids, values = dedup_sum(grad.indices.astype(array_module(grad.indices).int64,
                                                    copy=False), grad.values)
        ids, values = to_host(ids), to_host(values)
        if not np.isfinite(values).all():
            raise NonFiniteError(f"{self.spec.name}: gradient holds NaN or Inf")
        return ids, values

    def _apply(self, unique, summed):
        apply_rows_many([self._update(unique, summed)], check=False)

    def _update(self, unique, summed):
        """The optimizer update of a synced ``(unique ids, summed rows)``: the rows
        come from :func:`~hpcpax.ops.dedup_sum` over checked ids."""
        workers = self.topology.workers.Get_size()
        if self.reduce == "mean" and workers > 1:
            summed /= workers
        return self.shard.update(unique, summed)

    def read_table(self):
        """The whole table (this worker's replica)."""
        return self.table.copy()


def push_many(tables, grads) -> bool:
    """Push several replicated variables: their ``allgather`` syncs share one exchange.

    **Collective** over the workers; every worker passes the same names.
    ``tables`` maps names to :class:`ReplicatedTable`, ``grads`` the same
    names to :class:`~hpcpax.ps.sparse_grad.SparseGrad`. Every gradient is
    checked first; a bad one raises on every worker before anything moves
    (:func:`~hpcpax.comm.agreement.refuse_together`). The ``allgather`` tables
    then travel in one :func:`~hpcpax.comm.sparse_collectives.allgather_sparse_many`;
    ``allreduce`` tables are densified and allreduced one by one. The result
    equals pushing each table alone, bit for bit. A gradient marked
    :attr:`~hpcpax.ps.sparse_grad.SparseGrad.agreed` that is the same on every
    worker (hashes compared in the status exchange) is applied as it is, with
    no exchange (the mean of equal gradients is the gradient).
    """
    names = list(tables)
    if not names:
        return True
    prepared, error = _prepare_many(tables, grads)
    topology = tables[names[0]].topology
    if topology.workers.Get_size() == 1:  # one replica: its own gradient is the sum
        if error is not None:
            raise error
        _count_nothing_moved(topology, [n for n in names if method_of(tables[n].method).gathers],
                             [n for n in names if method_of(tables[n].method).densified])
        apply_rows_many([tables[n]._update(*prepared[n]) for n in names], check=False)
        return True
    same = _agree(topology, names, grads, prepared, error)
    if same:  # every worker holds this mean already: nothing to exchange
        apply_rows_many([tables[n].shard.update(*prepared[n]) for n in same], check=False)
        names = [n for n in names if n not in same]
    gathered = [n for n in names if method_of(tables[n].method).gathers]
    if gathered:
        results = allgather_sparse_many(topology, gathered, [prepared[n][0] for n in gathered],
                                        [prepared[n][1] for n in gathered])
        apply_rows_many([tables[n]._update(unique, summed)
                         for n, (unique, summed) in zip(gathered, results)], check=False)
    for name in names:
        if method_of(tables[name].method).densified:
            ids, values = prepared[name]
            tables[name]._apply(*densify_allreduce(topology, name, ids, values,
                                                   tables[name].spec.rows))
    return True


def _agree(topology, names, grads, prepared, error) -> set:
    """Raise on every worker if any worker's gradients were bad
    (:func:`~hpcpax.comm.agreement.refuse_together`); else the ``names`` whose
    gradient is marked ``agreed`` on every worker and whose deduplicated
    ``(ids, rows)`` are bit for bit the same on every worker (a 63-bit hash
    of each, -1 where not marked). **Collective** over the workers: one
    ``allgather`` of the status and the hashes (every worker passes the same
    names)."""
    mine = np.full(1 + len(names), -1, np.int64)
    mine[0] = status_of(error)
    if error is None:
        for k, name in enumerate(names):
            if grads[name].agreed:
                digest = hashlib.blake2b(digest_size=8)
                for array in prepared[name]:
                    digest.update(np.ascontiguousarray(array).view(np.uint8))
                mine[1 + k] = int.from_bytes(digest.digest(), "little") >> 1
    comm = topology.workers
    everyone = np.empty((comm.Get_size(), mine.size), np.int64)
    wait([start_allgather(comm, mine, everyone)])
    refuse_together(comm, everyone[:, 0], list(topology.worker_ranks), error,
                    f"push of {', '.join(map(repr, names))}")
    first = everyone[0, 1:]
    return {name for name, agreed in zip(names, (first >= 0) & (everyone[:, 1:] == first).all(0))
            if agreed}


def _count_nothing_moved(topology, gathered, reduced) -> None:
    """A one-worker push in the accounting as the collectives would count it: one
    ``allgather`` call for the gathered tables, one ``dense_sparse`` record per
    densified table, no bytes."""
    acct = topology.accounting
    if gathered:
        acct.record_empty("allgather", gathered)
    for name in reduced:
        acct.record_bytes("dense_sparse", name)


def _prepare_many(tables, grads):
    """``({name: (ids, summed rows)}, first error)``: every gradient validated and
    deduplicated, as :meth:`ReplicatedTable._prepare` does one by one.

    Host gradients of the same width and dtype are deduplicated together, in one
    :func:`~hpcpax.ops.dedup_sum` over ids offset by table (a model's dozens of
    small tables paid one call each, ~0.1 ms apiece): each id's rows are summed
    in the same order either way, so the result is the same bit for bit.
    """
    prepared, error, groups = {}, None, {}
    for name, table in tables.items():
        grad = grads[name]
        try:
            if (type(grad.indices) is not np.ndarray or type(grad.values) is not np.ndarray) \
                    and (is_device_array(grad.indices) or is_device_array(grad.values)):
                prepared[name] = table._prepare(grad)
                continue
            grad.validate(name, table.spec.dim, table.spec.dtype, bounds=False)
        except (TypeError, ValueError, FloatingPointError) as exc:
            error = error or exc
            continue
        groups.setdefault((grad.values.shape[1], grad.values.dtype.str), []).append(name)
    for group in groups.values():
        if len(group) == 1:
            try:
                prepared[group[0]] = tables[group[0]]._prepare(grads[group[0]])
            except (TypeError, ValueError, FloatingPointError) as exc:
                error = error or exc
            continue
        ids = [np.asarray(grads[n].indices, np.int64) for n in group]
        rows = np.array([tables[n].spec.rows for n in group], np.int64)
        limits = np.minimum(rows, [grads[n].num_rows for n in group])
        flat = np.concatenate(ids)
        # each id's table, and the table's offset in the group's key space
        owner = np.repeat(np.arange(len(group)), [i.size for i in ids])
        if flat.size and (int(flat.min()) < 0 or bool((flat >= limits[owner]).any())):
            error = error or _out_of_range(group, ids, limits)
            continue
        bases = np.zeros(len(group) + 1, np.int64)
        np.cumsum(rows, out=bases[1:])
        unique, summed = dedup_sum(flat + bases[owner],
                                   np.concatenate([grads[n].values for n in group]))
        cuts = np.searchsorted(unique, bases).tolist()
        finite = bool(np.isfinite(summed).all())
        for k, name in enumerate(group):
            table_rows = summed[cuts[k]:cuts[k + 1]]
            if not finite and not np.isfinite(table_rows).all():
                error = error or NonFiniteError(f"{name}: gradient holds NaN or Inf")
                continue
            prepared[name] = (unique[cuts[k]:cuts[k + 1]] - bases[k], table_rows)
    return prepared, error


def _out_of_range(names, ids, rows):
    """The :class:`~hpcpax.errors.SparseIndexError` of the first table whose ids
    leave ``[0, rows)`` (the group's one vector check found one)."""
    for name, i, n in zip(names, ids, rows):
        try:
            check_indices(name, i, int(n))
        except SparseIndexError as exc:
            return exc
    return None
