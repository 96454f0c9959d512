"""Batched all-to-all exchange of rows, with exact byte accounting.

Every sparse transfer of hpcpax (pull requests, pulled rows, pushed
gradients, the intra-node exchanges of local aggregation, the allgather
method) is one call here: rows grouped by destination, one ``Alltoall`` of
counts, then one ``Alltoallv`` per array. Never one message per row.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["group_by_destination", "alltoallv_rows", "exchange_counts"]


def group_by_destination(dest: np.ndarray, num_dest: int, *arrays):
    """Stable-sort ``arrays`` (first axis) by ``dest``.

    Returns:
        ``(counts, order, sorted arrays...)`` where ``counts[d]`` rows go to
        destination ``d`` and rows keep their order within a destination.
    """
    dest = np.asarray(dest, np.int64)
    counts = np.bincount(dest, minlength=num_dest).astype(np.int64)
    if len(dest) and np.any(dest[1:] < dest[:-1]):
        order = np.argsort(dest, kind="stable")
        return (counts, order, *(a[order] for a in arrays))
    return (counts, None, *arrays)


def exchange_counts(comm, send_counts, accounting=None, phase=None, variable=None,
                    ranks=None) -> np.ndarray:
    """``Alltoall`` of one int64 per peer: how many rows each peer sends me.

    **Collective** over ``comm``. The 8 bytes per peer are counted in
    ``phase`` like the rows that follow.
    """
    from mpi4py import MPI

    start = time.perf_counter()
    recv = np.empty(comm.Get_size(), np.int64)
    comm.Alltoall([np.ascontiguousarray(send_counts, np.int64), MPI.INT64_T],
                  [recv, MPI.INT64_T])
    if accounting is not None:
        eight = np.full(comm.Get_size(), 8, np.int64)
        accounting.record_exchange(phase, variable, eight, eight, time.perf_counter() - start,
                                   ranks=ranks, calls=0)
    return recv


def _mpi_type(dtype):
    from mpi4py import MPI

    return MPI._typedict[np.dtype(dtype).char]


def alltoallv_rows(comm, send_counts, recv_counts, arrays, accounting=None, phase=None,
                   variable=None, ranks=None):
    """Send row blocks of each array in ``arrays`` to every peer.

    **Collective** over ``comm``. Host (NumPy) buffers.

    Args:
        comm: communicator.
        send_counts: rows for each peer (int64, length ``comm.size``).
        recv_counts: rows from each peer (from :func:`exchange_counts`).
        arrays: arrays grouped by destination; each row of array ``k`` is
            ``arrays[k][0].size`` elements. The same list on every rank
            (same number of arrays, same per-row shape and dtype).
        accounting, phase, variable: where to count the bytes.
        ranks: world rank of each peer of ``comm`` (for the intra/inter split).

    Returns:
        List of received arrays, one per input, rows ordered by source rank.
    """
    start = time.perf_counter()
    send_counts = np.asarray(send_counts, np.int64)
    recv_counts = np.asarray(recv_counts, np.int64)
    sdispl = np.zeros_like(send_counts)
    rdispl = np.zeros_like(recv_counts)
    np.cumsum(send_counts[:-1], out=sdispl[1:])
    np.cumsum(recv_counts[:-1], out=rdispl[1:])
    out = []
    sent_bytes = np.zeros(len(send_counts), np.int64)
    recv_bytes = np.zeros(len(recv_counts), np.int64)
    for array in arrays:
        array = np.ascontiguousarray(array)
        row_shape = array.shape[1:]
        width = int(np.prod(row_shape, dtype=np.int64))
        result = np.empty((int(recv_counts.sum()),) + row_shape, array.dtype)
        mpi_type = _mpi_type(array.dtype)
        comm.Alltoallv(
            [array, (send_counts * width, sdispl * width), mpi_type],
            [result, (recv_counts * width, rdispl * width), mpi_type],
        )
        sent_bytes += send_counts * width * array.itemsize
        recv_bytes += recv_counts * width * array.itemsize
        out.append(result)
    if accounting is not None:
        accounting.record_exchange(phase, variable, sent_bytes, recv_bytes,
                                   time.perf_counter() - start, ranks=ranks)
    return out
