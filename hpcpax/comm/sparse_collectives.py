"""Horovod's ways to sync a sparse gradient among workers holding whole replicas.

- :func:`allgather_sparse_many`: every worker receives every other worker's
  deduplicated ``(indices, values)`` (one allgather for all tables) and
  sums them locally. Traffic grows with the number of workers. Blocks of
  nearly equal size are padded to the largest and go through
  ``Iallgather`` (:func:`padded_block_bytes`).
- :func:`densify_allreduce`: the gradient is densified and allreduced like a
  dense variable (``sparse_as_dense``), plus a one-byte-per-row mask so a
  lazy optimizer still touches only rows some worker touched.

Both are **collective** over ``topology.workers`` and count their bytes.
"""

from __future__ import annotations

import time

import numpy as np

from ..ops import dedup_sum
from .accounting import ring_allreduce_bytes
from .exchange import _as_bytes, _row_bytes, _split_segments
from .polling import wait

__all__ = ["allgather_sparse", "allgather_sparse_many", "densify_allreduce",
           "padded_block_bytes", "PAD_LIMIT"]

#: Pad the workers' blocks to the largest when that adds at most this share of
#: the bytes. MPICH 5.0's nonblocking ``Iallgatherv`` ran 1.7-1.8x longer on
#: unequal blocks than on equal ones: 16 emulated nodes (31.25 Mbit/s links),
#: 400 kB blocks 0.3-3 % apart, 2.84-2.95 s against 1.72 s padded to the
#: largest and 1.61 s blocking (``docs/measurements.md``, 2026-12-07).
PAD_LIMIT = 0.25


def padded_block_bytes(per_worker_bytes):
    """The block every worker sends in the batched allgather, or None.

    ``per_worker_bytes``: each worker's packed bytes, in worker order. Where
    padding every block to the largest adds at most :data:`PAD_LIMIT` of
    the bytes, returns that largest block (the exchange is then one
    ``Iallgather`` of equal blocks, each worker's padding zero bytes that
    nobody reads); None otherwise (one ``Iallgatherv`` of the blocks as
    they are), and for fewer than two workers or no bytes at all. Local; every
    worker computes the same from the same counts.
    """
    per = np.asarray(per_worker_bytes, np.int64).ravel()
    total = int(per.sum())
    if per.size < 2 or total == 0:
        return None
    block = int(per.max())
    return block if block * per.size <= (1.0 + PAD_LIMIT) * total else None


def allgather_sparse(topology, name, ids, values):
    """Sum of every worker's ``(ids, values)`` on every worker (Horovod's way).

    **Collective** over ``topology.workers``. Inputs deduplicated host arrays;
    returns ``(unique ids, summed rows)``; bytes counted in phase ``allgather``
    as direct sends to each peer (what the gathered result implies). The
    one-variable :func:`allgather_sparse_many`.
    """
    return allgather_sparse_many(topology, [name], [ids], [values])[0]


def allgather_sparse_many(topology, names, id_lists, value_lists):
    """:func:`allgather_sparse` of several variables in one allgather.

    **Collective** over ``topology.workers``; every worker passes the same
    ``names`` in the same order. One ``Allgather`` of the ``K`` row counts,
    then one allgather of bytes holding, for each worker, its rows of
    variable 0, then 1, ... (id beside values, one record per row): an
    ``Iallgather`` of the blocks padded to the largest where
    :func:`padded_block_bytes` says so (the padding's bytes are counted
    for the phase, not for a variable), else an ``Iallgatherv``. Returns
    ``[(unique ids, summed rows), ...]``: row ``u`` of a variable is the sum,
    in worker order, of every worker's row for that id (so each variable's
    result is bit-identical to syncing it alone); bytes are counted per
    variable as direct sends to each peer.
    """
    from mpi4py import MPI

    comm, acct = topology.workers, topology.accounting
    start = time.perf_counter()
    k_vars = len(names)
    if comm.Get_size() == 1:  # one worker: nothing to gather, nothing moves
        out = [dedup_sum(np.asarray(ids, np.int64), values)
               for ids, values in zip(id_lists, value_lists)]
        zero = np.zeros((k_vars, 1), np.int64)
        acct.record_batched_exchange("allgather", list(names), zero, zero,
                                     time.perf_counter() - start, ranks=topology.worker_ranks)
        return out
    mine = np.array([len(ids) for ids in id_lists], np.int64)
    counts = np.empty((comm.Get_size(), k_vars), np.int64)
    wait([comm.Iallgather([mine, MPI.INT64_T], [counts, MPI.INT64_T])])
    arrays = [[np.ascontiguousarray(i, np.int64), np.ascontiguousarray(v)]
              for i, v in zip(id_lists, value_lists)]
    rows = np.array([_row_bytes(a) for a in arrays], np.int64)
    packed = [_as_bytes(a, int(w)).reshape(-1) for a, w in zip(arrays, rows)]
    send = np.concatenate(packed) if packed else np.zeros(0, np.uint8)
    per_worker = counts @ rows
    block = padded_block_bytes(per_worker)
    if block is None:
        displs = np.concatenate([[0], np.cumsum(per_worker)[:-1]]).astype(np.int64)
        gathered = np.empty(int(per_worker.sum()), np.uint8)
        wait([comm.Iallgatherv([send, MPI.BYTE], [gathered, (per_worker, displs), MPI.BYTE])])
    else:  # equal blocks: MPICH's fast schedule (see PAD_LIMIT)
        padded = send
        if send.size < block:
            padded = np.zeros(block, np.uint8)
            padded[:send.size] = send
        displs = np.arange(comm.Get_size(), dtype=np.int64) * block
        gathered = np.empty(block * comm.Get_size(), np.uint8)
        wait([comm.Iallgather([padded, MPI.BYTE], [gathered, MPI.BYTE])])
    out = []
    for all_ids, all_vals in _split_segments(gathered, displs, counts, rows, arrays):
        out.append(dedup_sum(all_ids, all_vals))
    peers = np.asarray(topology.worker_ranks)
    sent = np.repeat((mine * rows)[:, None], len(peers), axis=1)
    recv = (counts * rows).T
    names = list(names)
    if block is not None:  # the padding: the phase's bytes, no variable's
        names.append(None)
        sent = np.vstack([sent, np.full((1, len(peers)), block - int(per_worker[comm.Get_rank()]))])
        recv = np.vstack([recv, (block - per_worker)[None, :]])
    acct.record_batched_exchange("allgather", names, sent, recv,
                                 time.perf_counter() - start, ranks=peers)
    return out


def densify_allreduce(topology, name, ids, values, num_rows):
    """Densify ``(ids, values)`` and allreduce (sum) over the workers (``sparse_as_dense``).

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
    wait([comm.Iallreduce(MPI.IN_PLACE, dense, op=MPI.SUM),
          comm.Iallreduce(MPI.IN_PLACE, mask, op=MPI.MAX)])
    sent, recv, s_inter, r_inter = ring_allreduce_bytes(
        topology.node_of, topology.worker_ranks, topology.rank, dense.nbytes + mask.nbytes)
    acct.record_bytes("dense_sparse", name, sent, recv, s_inter, r_inter,
                      time.perf_counter() - start)
    # the mask holds 0 and 1 only, so its bool view is exact (and NumPy scans bools
    # 7-10x faster than uint8: 13 against 99 us for 50,000 rows here)
    touched = np.flatnonzero(mask.view(np.bool_))
    return touched, dense[touched]
