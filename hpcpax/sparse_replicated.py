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
:class:`~hpcpax.ps.ParameterServer`, for one variable.
"""

from __future__ import annotations

import time

import numpy as np

from .accounting import ring_allreduce_bytes
from .backend import array_module, to_host
from .errors import ConfigError, NonFiniteError
from .initializers import init_rows
from .ops import dedup_sum, gather_rows
from .ops.optimizers import make_optimizer
from .sparse_grad import SparseGrad, check_indices

__all__ = ["ReplicatedTable", "allgather_sparse", "densify_allreduce", "METHODS"]

METHODS = ("allgather", "dense")


def allgather_sparse(topology, name, ids, values):
    """Sum of every worker's ``(ids, values)`` on every worker (Horovod's way).

    **Collective** over ``topology.workers``. Inputs deduplicated host arrays;
    returns ``(unique ids, summed rows)``; bytes counted in phase ``allgather``
    as direct sends to each peer (what the gathered result implies).
    """
    from mpi4py import MPI

    comm, acct = topology.workers, topology.accounting
    start = time.perf_counter()
    counts = np.array(comm.allgather(len(ids)), np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    dim = values.shape[1]
    all_ids = np.empty(int(counts.sum()), np.int64)
    all_vals = np.empty((int(counts.sum()), dim), values.dtype)
    comm.Allgatherv([np.ascontiguousarray(ids, np.int64), MPI.INT64_T],
                    [all_ids, (counts, displs), MPI.INT64_T])
    vtype = MPI._typedict[values.dtype.char]
    comm.Allgatherv([np.ascontiguousarray(values), vtype],
                    [all_vals, (counts * dim, displs * dim), vtype])
    row = 8 + dim * values.itemsize
    peers = np.asarray(topology.worker_ranks)
    acct.record_exchange("allgather", name, np.full(len(peers), len(ids) * row),
                         counts * row, time.perf_counter() - start, ranks=peers)
    return dedup_sum(all_ids, all_vals)


def densify_allreduce(topology, name, ids, values, num_rows):
    """Densify ``(ids, values)`` and allreduce (sum) over the workers.

    **Collective** over ``topology.workers``. Returns ``(touched ids, rows)``
    where touched are the rows any worker sent. Bytes counted in phase
    ``dense_sparse`` by the ring formula
    (:func:`~hpcpax.accounting.ring_allreduce_bytes`).
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
        spec: a :class:`~hpcpax.ps.SparseVariableSpec`.
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
        from mpi4py import MPI

        error = None
        try:
            grad.validate(self.spec.name, self.spec.dim, self.spec.dtype)
            ids, values = dedup_sum(grad.indices.astype(array_module(grad.indices).int64,
                                                        copy=False), grad.values)
            ids, values = to_host(ids), to_host(values)
            if not np.isfinite(values).all():
                raise NonFiniteError(f"{self.spec.name}: gradient holds NaN or Inf")
        except (TypeError, ValueError, FloatingPointError) as exc:
            error = exc
        comm = self.topology.workers
        bad = comm.allreduce(error is not None, op=MPI.LOR)
        if bad:
            raise error if error is not None else ValueError(
                f"push of {self.spec.name!r} refused: another worker sent bad input")
        if self.method == "allgather":
            unique, summed = allgather_sparse(self.topology, self.spec.name, ids, values)
        else:
            unique, summed = densify_allreduce(self.topology, self.spec.name, ids, values,
                                               self.spec.rows)
        if self.reduce == "mean" and comm.Get_size() > 1:
            summed /= comm.Get_size()
        self.optimizer.apply_rows(self.table, self.state, unique, summed)
        return True

    def read_table(self):
        """The whole table (this worker's replica)."""
        return self.table.copy()
