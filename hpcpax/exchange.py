"""Batched all-to-all exchange of rows, with exact byte accounting.

Every sparse transfer of hpcpax (pull requests, pulled rows, pushed
gradients, the intra-node exchanges of local aggregation, the allgather
method) is one call here: rows grouped by destination, one ``Alltoall`` of
counts, then one ``Alltoallv`` per array. Never one message per row.

Several variables of one phase travel together through
:func:`exchange_counts_many` and :func:`alltoallv_many`: one ``Alltoall`` of a
``[peers, K]`` count matrix and one ``Alltoallv`` of bytes, whatever the
number ``K`` of variables, so a model with many tables pays the latency of
one exchange per phase.
"""

from __future__ import annotations

import time

import numpy as np

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
    arrays = [np.ascontiguousarray(a) for a in arrays]
    if len(arrays) == 1:
        buffer, widths = arrays[0], None
        width = int(np.prod(buffer.shape[1:], dtype=np.int64))
    else:
        # Several arrays travel as one record per row (ids beside values):
        # one Alltoallv instead of one per array, the latency that matters.
        buffer, widths = _pack_records(arrays)
        width = buffer.shape[1]
    row_shape = buffer.shape[1:]
    result = np.empty((int(recv_counts.sum()),) + row_shape, buffer.dtype)
    mpi_type = _mpi_type(buffer.dtype)
    comm.Alltoallv(
        [buffer, (send_counts * width, sdispl * width), mpi_type],
        [result, (recv_counts * width, rdispl * width), mpi_type],
    )
    out = [result] if widths is None else _unpack_records(result, arrays, widths)
    if accounting is not None:
        row_bytes = width * buffer.itemsize
        accounting.record_exchange(phase, variable, send_counts * row_bytes,
                                   recv_counts * row_bytes, time.perf_counter() - start,
                                   ranks=ranks)
    return out


def _pack_records(arrays):
    """Rows of ``arrays`` side by side as bytes: ``[n, sum of row bytes]`` uint8."""
    n = arrays[0].shape[0]
    widths = [a[0:1].nbytes if n else int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize
              for a in arrays]
    packed = np.empty((n, sum(widths)), np.uint8)
    offset = 0
    for array, width in zip(arrays, widths):
        packed[:, offset:offset + width] = array.reshape(n, width // array.itemsize).view(np.uint8)
        offset += width
    return packed, widths


def _unpack_records(packed, like, widths):
    """Inverse of :func:`_pack_records` for received rows."""
    m = packed.shape[0]
    out, offset = [], 0
    for array, width in zip(like, widths):
        column = np.ascontiguousarray(packed[:, offset:offset + width])
        out.append(column.view(array.dtype).reshape((m,) + array.shape[1:]))
        offset += width
    return out


def exchange_counts_many(comm, send_counts, accounting=None, phase=None, variables=None,
                         ranks=None) -> np.ndarray:
    """``Alltoall`` of a ``[comm.size, K]`` int64 count matrix (K variables at once).

    **Collective** over ``comm``; every rank passes the same ``K``. Returns
    ``recv[peer, k]``, the rows of variable ``k`` that ``peer`` sends me.
    Each variable is charged 8 bytes per peer in ``phase``.
    """
    from mpi4py import MPI

    start = time.perf_counter()
    send = np.ascontiguousarray(send_counts, np.int64)
    size, k = send.shape
    recv = np.empty_like(send)
    comm.Alltoall([send, MPI.INT64_T], [recv, MPI.INT64_T])
    if accounting is not None:
        eight = np.full((k, size), 8, np.int64)
        accounting.record_batched_exchange(phase, variables, eight, eight,
                                           time.perf_counter() - start, ranks=ranks)
    return recv


def _row_bytes(arrays) -> int:
    """Bytes of one row across ``arrays`` (the same on every rank, even when empty)."""
    return sum(int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize for a in arrays)


def _as_bytes(arrays, width):
    """Rows of ``arrays`` as one ``[n, width]`` uint8 array."""
    if len(arrays) > 1:
        return _pack_records(arrays)[0]
    a = np.ascontiguousarray(arrays[0])
    return a.reshape(a.shape[0], width // a.itemsize).view(np.uint8)


def _from_bytes(rows, like, width):
    """Inverse of :func:`_as_bytes` for ``rows`` (``[m, width]`` uint8)."""
    if len(like) > 1:
        widths = [int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize for a in like]
        return _unpack_records(rows, like, widths)
    a = like[0]
    return [np.ascontiguousarray(rows).view(a.dtype).reshape((rows.shape[0],) + a.shape[1:])]


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
    variable 1, ...; segments are copied once into the send buffer and once
    out of the receive buffer.
    """
    from mpi4py import MPI

    start = time.perf_counter()
    send_counts = np.asarray(send_counts, np.int64)
    recv_counts = np.asarray(recv_counts, np.int64)
    size, k_vars = send_counts.shape
    widths = np.array([_row_bytes(a) for a in arrays], np.int64)
    packed = [_as_bytes(a, int(w)) for a, w in zip(arrays, widths)]
    send_bytes = send_counts * widths  # [size, K]
    recv_bytes = recv_counts * widths
    row_start = np.zeros((size + 1, k_vars), np.int64)
    np.cumsum(send_counts, axis=0, out=row_start[1:])
    # Python-level work is one slice per non-empty (peer, variable) segment,
    # with plain ints (a server of W workers and K tables has up to W K).
    flat = [p.reshape(-1) for p in packed]
    byte_start = (row_start * widths).tolist()
    segments = [flat[k][byte_start[d][k]:byte_start[d + 1][k]]
                for d, k in zip(*(i.tolist() for i in np.nonzero(send_counts)))]
    buffer = np.concatenate(segments) if segments else np.zeros(0, np.uint8)
    per_peer_send, per_peer_recv = send_bytes.sum(axis=1), recv_bytes.sum(axis=1)
    sdispl = np.zeros(size, np.int64)
    rdispl = np.zeros(size, np.int64)
    np.cumsum(per_peer_send[:-1], out=sdispl[1:])
    np.cumsum(per_peer_recv[:-1], out=rdispl[1:])
    result = np.empty(int(per_peer_recv.sum()), np.uint8)
    comm.Alltoallv([buffer, (per_peer_send, sdispl), MPI.BYTE],
                   [result, (per_peer_recv, rdispl), MPI.BYTE])
    # segment (source s, variable k) starts at rdispl[s] + bytes of variables < k from s
    seg_start = rdispl[:, None] + np.cumsum(recv_bytes, axis=1) - recv_bytes
    starts, ends = seg_start.tolist(), (seg_start + recv_bytes).tolist()
    pieces = [[] for _ in range(k_vars)]
    for k, s in zip(*(i.tolist() for i in np.nonzero(recv_counts.T))):  # by k, then source
        pieces[k].append(result[starts[s][k]:ends[s][k]])
    out = []
    for k in range(k_vars):
        rows = np.concatenate(pieces[k]) if pieces[k] else np.zeros(0, np.uint8)
        out.append(_from_bytes(rows.reshape(int(recv_counts[:, k].sum()), int(widths[k])),
                               arrays[k], int(widths[k])))
    if accounting is not None:
        accounting.record_batched_exchange(phase, variables, send_bytes.T, recv_bytes.T,
                                           time.perf_counter() - start, ranks=ranks)
    return out
