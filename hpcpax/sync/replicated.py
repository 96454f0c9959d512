"""Sparse variables kept whole on every worker: the non-PS methods.

For the planner and the benchmarks, a sparse variable can also be synced the
ways Horovod does it, with the table replicated on each worker:

- ``allgather``: every worker receives every other worker's deduplicated
  ``(indices, values)`` (``Allgatherv``) and sums them locally. Traffic grows
  with the number of workers.
- ``dense``: the gradient is densified and allreduced like a dense variable
  (Horovod's ``sparse_as_dense``), plus a one-byte-per-row mask so the lazy
  optimizer still touches only rows some worker touched.

Both give the same parameters as the PS path (same initializer, same summed
gradient, same optimizer kernel); :class:`ReplicatedTable` has the same
``pull``/``pull_unique``/``push`` interface as
:class:`~hpcpax.ps.server.ParameterServer`, for one variable.
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.accounting import ring_allreduce_bytes
from ..backend import array_module, to_host
from ..errors import ConfigError, NonFiniteError
from ..comm.exchange import _as_bytes, _row_bytes, _split_segments
from ..ps.initializers import init_rows
from ..ops import dedup_sum, gather_rows
from ..ops.optimizers import make_optimizer
from ..ps.sparse_grad import SparseGrad, check_indices

__all__ = ["ReplicatedTable", "allgather_sparse", "allgather_sparse_many", "densify_allreduce",
           "push_many", "METHODS"]

METHODS = ("allgather", "dense")


def allgather_sparse(topology, name, ids, values):
    """Sum of every worker's ``(ids, values)`` on every worker (Horovod's way).

    **Collective** over ``topology.workers``. Inputs deduplicated host arrays;
    returns ``(unique ids, summed rows)``; bytes counted in phase ``allgather``
    as direct sends to each peer (what the gathered result implies). The
    one-variable :func:`allgather_sparse_many`.
    """
    return allgather_sparse_many(topology, [name], [ids], [values])[0]


def allgather_sparse_many(topology, names, id_lists, value_lists):
    """:func:`allgather_sparse` of several variables in one ``Allgatherv``.

    **Collective** over ``topology.workers``; every worker passes the same
    ``names`` in the same order. One ``Allgather`` of the ``K`` row counts,
    then one ``Allgatherv`` of bytes holding, for each worker, its rows of
    variable 0, then 1, ... (id beside values, one record per row). Returns
    ``[(unique ids, summed rows), ...]``: row ``u`` of a variable is the sum,
    in worker order, of every worker's row for that id (so each variable's
    result is bit-identical to syncing it alone); bytes are counted per
    variable as direct sends to each peer.
    """
    from mpi4py import MPI

    comm, acct = topology.workers, topology.accounting
    start = time.perf_counter()
    k_vars = len(names)
    mine = np.array([len(ids) for ids in id_lists], np.int64)
    counts = np.empty((comm.Get_size(), k_vars), np.int64)
    comm.Allgather([mine, MPI.INT64_T], [counts, MPI.INT64_T])
    arrays = [[np.ascontiguousarray(i, np.int64), np.ascontiguousarray(v)]
              for i, v in zip(id_lists, value_lists)]
    rows = np.array([_row_bytes(a) for a in arrays], np.int64)
    packed = [_as_bytes(a, int(w)).reshape(-1) for a, w in zip(arrays, rows)]
    send = np.concatenate(packed) if packed else np.zeros(0, np.uint8)
    per_worker = counts @ rows
    displs = np.concatenate([[0], np.cumsum(per_worker)[:-1]]).astype(np.int64)
    gathered = np.empty(int(per_worker.sum()), np.uint8)
    comm.Allgatherv([send, MPI.BYTE], [gathered, (per_worker, displs), MPI.BYTE])
    out = []
    for all_ids, all_vals in _split_segments(gathered, displs, counts, rows, arrays):
        out.append(dedup_sum(all_ids, all_vals))
    peers = np.asarray(topology.worker_ranks)
    sent = np.repeat((mine * rows)[:, None], len(peers), axis=1)
    acct.record_batched_exchange("allgather", list(names), sent, (counts * rows).T,
                                 time.perf_counter() - start, ranks=peers)
    return out


def densify_allreduce(topology, name, ids, values, num_rows):
    """Densify ``(ids, values)`` and allreduce (sum) over the workers.

    **Collective** over ``topology.workers``. Returns ``(touched ids, rows)``
    where touched are the rows any worker sent. Bytes counted in phase
    ``dense_sparse`` by the ring formula
    (:func:`~hpcpax.comm.accounting.ring_allreduce_bytes`).
    """
    from mpi4py import MPI

    comm, acct = topology.workers, topology.accounting
    start = time.perf_counter()
    dense = np.zeros((num_rows, values.shape[1]), values.dtype)
    dense[ids] = values
    mask = np.zeros(num_rows, np.uint8)
    mask[ids] = 1
    comm.Allreduce(MPI.IN_PLACE, dense, op=MPI.SUM)
    comm.Allreduce(MPI.IN_PLACE, mask, op=MPI.MAX)
    sent, recv, s_inter, r_inter = ring_allreduce_bytes(
        topology.node_of, topology.worker_ranks, topology.rank, dense.nbytes + mask.nbytes)
    acct.record_bytes("dense_sparse", name, sent, recv, s_inter, r_inter,
                      time.perf_counter() - start)
    touched = np.flatnonzero(mask)
    return touched, dense[touched]


class ReplicatedTable:
    """One sparse variable replicated on every worker, synced by ``method``.

    Args:
        topology: from :func:`hpcpax.init` (only workers may use it).
        spec: a :class:`~hpcpax.ps.server.SparseVariableSpec`.
        method: ``allgather`` or ``dense``.
        reduce: ``mean`` or ``sum`` over workers.
        seed: the same key as the PS initializer, so tables start equal.
    """

    def __init__(self, topology, spec, method="allgather", reduce="mean", seed=0):
        if method not in METHODS:
            raise ConfigError(f"method must be one of {METHODS}, not {method!r}")
        if not topology.is_worker:
            raise ConfigError("a ReplicatedTable lives on workers only")
        spec.validate()
        self.topology, self.spec, self.method, self.reduce = topology, spec, method, reduce
        self.optimizer = make_optimizer(spec.optimizer, **spec.optimizer_params)
        self.table = init_rows(spec.initializer, seed, spec.name, np.arange(spec.rows),
                               spec.dim, spec.dtype, spec.init_scale)
        self.state = self.optimizer.init_state(self.table.shape, self.table.dtype, np)

    def pull(self, ids):
        """Rows ``ids`` (any order, duplicates allowed); local, on ``ids``' device."""
        host = to_host(ids).astype(np.int64, copy=False)
        check_indices(self.spec.name, host, self.spec.rows)
        rows = gather_rows(self.table, host)
        xp = array_module(ids)
        return rows if xp is np else xp.asarray(rows)

    def pull_unique(self, ids):
        """``(unique sorted ids, rows)``; local."""
        unique = np.unique(to_host(ids).astype(np.int64, copy=False))
        check_indices(self.spec.name, unique, self.spec.rows)
        return unique, gather_rows(self.table, unique)

    def push(self, grad: SparseGrad) -> bool:
        """Sync this step's gradient and apply it on every replica.

        **Collective** over the workers. A bad gradient raises on every
        worker together (checked with one small allreduce first).
        """
        return push_many({self.spec.name: self}, {self.spec.name: grad})

    def _prepare(self, grad):
        """Validated, deduplicated ``(ids, values)`` of ``grad`` on the host."""
        grad.validate(self.spec.name, self.spec.dim, self.spec.dtype)
        ids, values = dedup_sum(grad.indices.astype(array_module(grad.indices).int64,
                                                    copy=False), grad.values)
        ids, values = to_host(ids), to_host(values)
        if not np.isfinite(values).all():
            raise NonFiniteError(f"{self.spec.name}: gradient holds NaN or Inf")
        return ids, values

    def _apply(self, unique, summed):
        workers = self.topology.workers.Get_size()
        if self.reduce == "mean" and workers > 1:
            summed /= workers
        self.optimizer.apply_rows(self.table, self.state, unique, summed)

    def read_table(self):
        """The whole table (this worker's replica)."""
        return self.table.copy()


def push_many(tables, grads) -> bool:
    """Push several replicated variables: their ``allgather`` syncs share one exchange.

    **Collective** over the workers; every worker passes the same names.
    ``tables`` maps names to :class:`ReplicatedTable`, ``grads`` the same
    names to :class:`~hpcpax.ps.sparse_grad.SparseGrad`. Every gradient is
    checked first and one small allreduce makes a bad one raise on every
    worker before anything moves. The ``allgather`` tables then travel in
    one :func:`allgather_sparse_many`; ``dense`` tables are allreduced one by
    one. The result equals pushing each table alone, bit for bit.
    """
    from mpi4py import MPI

    names = list(tables)
    prepared, error = {}, None
    for name in names:
        try:
            prepared[name] = tables[name]._prepare(grads[name])
        except (TypeError, ValueError, FloatingPointError) as exc:
            error = error or exc
    comm = tables[names[0]].topology.workers if names else None
    if comm is None:
        return True
    if comm.allreduce(error is not None, op=MPI.LOR):
        raise error if error is not None else ValueError(
            f"push of {', '.join(map(repr, names))} refused: another worker sent bad input")
    gathered = [n for n in names if tables[n].method == "allgather"]
    topology = tables[names[0]].topology
    if gathered:
        results = allgather_sparse_many(topology, gathered, [prepared[n][0] for n in gathered],
                                        [prepared[n][1] for n in gathered])
        for name, (unique, summed) in zip(gathered, results):
            tables[name]._apply(unique, summed)
    for name in names:
        if tables[name].method == "dense":
            ids, values = prepared[name]
            tables[name]._apply(*densify_allreduce(topology, name, ids, values,
                                                   tables[name].spec.rows))
    return True
