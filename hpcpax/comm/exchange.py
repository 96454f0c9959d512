"""Batched all-to-all exchange of rows, with exact byte accounting.

Every sparse transfer of hpcpax (pull requests, pulled rows, pushed
gradients, the intra-node exchanges of local aggregation, the allgather
method) is one call here: rows grouped by destination, one ``Alltoall`` of
counts, then one ``Alltoallv``. Never one message per row. Both are
non-blocking, completed by the one wait policy (:func:`~hpcpax.comm.polling.wait`).

The mechanism is :func:`exchange_counts_many` and :func:`alltoallv_many`:
``K`` variables of one phase travel together, one ``Alltoall`` of a
``[peers, K]`` count matrix and one ``Alltoallv`` of bytes whatever ``K``, so
a model with many tables pays the latency of one exchange per phase. Several
arrays of one variable (ids beside values) travel as one record per row.
:func:`exchange_counts` and :func:`alltoallv_rows` are the one-variable case.
"""

from __future__ import annotations

import math
import time

import numpy as np

from .polling import wait

__all__ = ["group_by_destination", "alltoallv_rows", "exchange_counts", "exchange_counts_many",
           "alltoallv_many"]


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
    ``phase`` like the rows that follow. One-variable
    :func:`exchange_counts_many`.
    """
    counts = np.asarray(send_counts, np.int64).reshape(-1, 1)
    return exchange_counts_many(comm, counts, accounting, phase, [variable], ranks)[:, 0]


def exchange_counts_many(comm, send_counts, accounting=None, phase=None, variables=None,
                         ranks=None) -> np.ndarray:
    """``Alltoall`` of a ``[comm.size, K]`` int64 count matrix (K variables at once).

    **Collective** over ``comm``; every rank passes the same ``K``. Returns
    ``recv[peer, k]``, the rows of variable ``k`` that ``peer`` sends me.
    Each variable is charged 8 bytes per peer in ``phase`` and no call (the
    call is the data exchange's that follows).
    """
    from mpi4py import MPI

    start = time.perf_counter()
    send = np.ascontiguousarray(send_counts, np.int64)
    size, k = send.shape
    recv = np.empty_like(send)
    wait([comm.Ialltoall([send, MPI.INT64_T], [recv, MPI.INT64_T])], within="counts")
    if accounting is not None:
        eight = np.full((k, size), 8, np.int64)
        accounting.record_batched_exchange(phase, variables, eight, eight,
                                           time.perf_counter() - start, ranks=ranks, calls=0)
    return recv


def alltoallv_rows(comm, send_counts, recv_counts, arrays, accounting=None, phase=None,
                   variable=None, ranks=None):
    """Send row blocks of each array in ``arrays`` to every peer.

    **Collective** over ``comm``. Host (NumPy) buffers. One-variable
    :func:`alltoallv_many` (no extra copy for a single array).

    Args:
        comm: communicator.
        send_counts: rows for each peer (int64, length ``comm.size``).
        recv_counts: rows from each peer (from :func:`exchange_counts`).
        arrays: arrays grouped by destination; the same list on every rank
            (same number of arrays, same per-row shape and dtype). Several
            arrays travel as one record per row (ids beside values).
        accounting, phase, variable: where to count the bytes.
        ranks: world rank of each peer of ``comm`` (for the intra/inter split).

    Returns:
        List of received arrays, one per input, rows ordered by source rank.
    """
    (out,) = alltoallv_many(comm, np.asarray(send_counts, np.int64).reshape(-1, 1),
                            np.asarray(recv_counts, np.int64).reshape(-1, 1), [arrays],
                            accounting, phase, [variable], ranks)
    return out


def alltoallv_many(comm, send_counts, recv_counts, arrays, accounting=None, phase=None,
                   variables=None, ranks=None):
    """Row blocks of ``K`` variables to every peer in **one** ``Alltoallv``.

    **Collective** over ``comm``. Host (NumPy) buffers.

    Args:
        comm: communicator.
        send_counts: ``[comm.size, K]`` rows of each variable for each peer.
        recv_counts: ``[comm.size, K]`` from :func:`exchange_counts_many`.
        arrays: ``K`` lists of arrays, each list as in :func:`alltoallv_rows`
            (grouped by destination; the same number, per-row shapes and
            dtypes on every rank).
        accounting, phase: where to count the bytes.
        variables: the ``K`` variable names (bytes counted per variable).
        ranks: world rank of each peer of ``comm``.

    Returns:
        ``K`` lists of received arrays, rows ordered by source rank.

    The message to each peer holds its segment of variable 0, then of
    variable 1, ...; with several variables, segments are copied once into
    the send buffer and once out of the receive buffer.
    """
    from mpi4py import MPI

    start = time.perf_counter()
    send_counts = np.asarray(send_counts, np.int64)
    recv_counts = np.asarray(recv_counts, np.int64)
    size, k_vars = send_counts.shape
    widths = np.array([_row_bytes(a) for a in arrays], np.int64)
    flat = [_as_bytes(a, int(w)).reshape(-1) for a, w in zip(arrays, widths)]
    send_bytes = send_counts * widths  # [size, K]
    recv_bytes = recv_counts * widths
    if k_vars == 1:
        buffer = flat[0]  # already grouped by destination
    else:
        # Python-level work is one slice per non-empty (peer, variable)
        # segment, with plain ints (a server of W workers and K tables has up
        # to W K of them).
        byte_start = np.zeros((size + 1, k_vars), np.int64)
        np.cumsum(send_bytes, axis=0, out=byte_start[1:])
        starts = byte_start.tolist()
        segments = [flat[k][starts[d][k]:starts[d + 1][k]]
                    for d, k in zip(*(i.tolist() for i in np.nonzero(send_counts)))]
        buffer = np.concatenate(segments) if segments else np.zeros(0, np.uint8)
    per_peer_send, per_peer_recv = send_bytes.sum(axis=1), recv_bytes.sum(axis=1)
    sdispl = np.zeros(size, np.int64)
    rdispl = np.zeros(size, np.int64)
    np.cumsum(per_peer_send[:-1], out=sdispl[1:])
    np.cumsum(per_peer_recv[:-1], out=rdispl[1:])
    result = np.empty(int(per_peer_recv.sum()), np.uint8)
    wait([comm.Ialltoallv([buffer, (per_peer_send, sdispl), MPI.BYTE],
                          [result, (per_peer_recv, rdispl), MPI.BYTE])], within="rows")
    out = _split_segments(result, rdispl, recv_counts, widths, arrays)
    if accounting is not None:
        accounting.record_batched_exchange(phase, variables, send_bytes.T, recv_bytes.T,
                                           time.perf_counter() - start, ranks=ranks)
    return out


def _row_bytes(arrays) -> int:
    """Bytes of one row across ``arrays`` (the same on every rank, even when empty)."""
    return sum(math.prod(a.shape[1:]) * a.itemsize for a in arrays)


def _as_bytes(arrays, width):
    """Rows of ``arrays`` as one ``[n, width]`` uint8 array (a view for one array)."""
    if len(arrays) > 1:
        return _pack_records(arrays)
    a = np.ascontiguousarray(arrays[0])
    return a.reshape(a.shape[0], width // a.itemsize).view(np.uint8)


def _from_bytes(rows, like):
    """Inverse of :func:`_as_bytes` for ``rows`` (``[m, width]`` uint8)."""
    m = rows.shape[0]
    out, offset = [], 0
    for array in like:
        width = _row_bytes([array])
        column = rows[:, offset:offset + width]
        if len(like) > 1:
            column = np.ascontiguousarray(column)
        out.append(column.view(array.dtype).reshape((m,) + array.shape[1:]))
        offset += width
    return out


def _split_segments(buffer, displs, counts, widths, likes):
    """Each variable's rows out of a buffer of per-source segments.

    ``buffer`` holds, from ``displs[s]`` for each source ``s``, the rows of
    variable 0, then 1, ... (``counts[s, k]`` rows of ``widths[k]`` bytes);
    a source's segments may be followed by padding before the next one's.
    Returns ``K`` lists of arrays shaped like ``likes[k]``, rows in source
    order. Shared by :func:`alltoallv_many` and the batched allgather.
    """
    k_vars = len(widths)
    totals = counts.sum(axis=0).tolist()
    seg_bytes = counts * widths
    back_to_back = np.array_equal(np.asarray(displs, np.int64)[1:],
                                  np.cumsum(seg_bytes.sum(axis=1))[:-1])
    if k_vars == 1 and back_to_back:  # one contiguous run of rows: no copy
        return [_from_bytes(buffer[:totals[0] * int(widths[0])].reshape(totals[0],
                                                                       int(widths[0])), likes[0])]
    seg_start = np.asarray(displs, np.int64)[:, None] + np.cumsum(seg_bytes, axis=1) - seg_bytes
    starts, ends = seg_start.tolist(), (seg_start + seg_bytes).tolist()
    pieces = [[] for _ in range(k_vars)]
    for k, s in zip(*(i.tolist() for i in np.nonzero(counts.T))):  # by variable, then source
        pieces[k].append(buffer[starts[s][k]:ends[s][k]])
    out = []
    for k in range(k_vars):
        rows = np.concatenate(pieces[k]) if pieces[k] else np.zeros(0, np.uint8)
        out.append(_from_bytes(rows.reshape(totals[k], int(widths[k])), likes[k]))
    return out


def _pack_records(arrays):
    """Rows of ``arrays`` side by side as bytes: ``[n, sum of row bytes]`` uint8."""
    n = arrays[0].shape[0]
    packed = np.empty((n, _row_bytes(arrays)), np.uint8)
    offset = 0
    for array in arrays:
        width = _row_bytes([array])
        packed[:, offset:offset + width] = (np.ascontiguousarray(array)
                                            .reshape(n, width // array.itemsize).view(np.uint8))
        offset += width
    return packed
