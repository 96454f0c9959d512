"""``gather_rows`` and ``scatter_add_rows``: row access to an embedding table.

Both bounds-check the ids with one min and one max reduction and raise
:class:`hpcpax.errors.SparseIndexError` naming the offending value.
``scatter_add_rows`` is deterministic: repeated ids accumulate in the order
of :mod:`hpcpax.ops.summation`, starting from the table row: exactly
``np.add.at(table, ids, values)`` for ids given at most ``SUM_CHUNK`` times,
within rounding of it for more.
"""

from __future__ import annotations

import numpy as np

from ..backend import is_device_array
from . import _numba
from ._validate import (
    check_bounds,
    check_float_matrix,
    check_index_array,
    check_same_device,
    check_same_dtype,
)
from .summation import SUM_CHUNK, SUM_CHUNK_SHIFT, segment_sums

__all__ = [
    "gather_rows",
    "gather_rows_reference",
    "scatter_add_rows",
    "scatter_add_rows_reference",
]

# Below this many ids the serial scatter beats grouping by row.
_SCATTER_PARALLEL_MIN = 1 << 14


def _check_table(table):
    check_float_matrix("table", table)
    if not table.flags.c_contiguous:
        raise ValueError("table must be C-contiguous, not strided")
    return table


def _check_gather(table, ids, out):
    table = _check_table(table)
    ids = check_index_array("ids", ids)
    check_same_device("ids", ids, "table", table)
    check_bounds("ids", ids, table.shape[0])
    if out is not None:
        check_same_device("out", out, "table", table)
        check_same_dtype("out", out, "table", table)
        expected = (ids.shape[0], table.shape[1])
        if tuple(out.shape) != expected:
            raise ValueError(f"out must have shape {expected}, not {tuple(out.shape)}")
        if not out.flags.c_contiguous:
            raise ValueError("out must be C-contiguous, not strided")
    return table, ids


def gather_rows_reference(table, ids, out=None):
    """Plain-NumPy twin of :func:`gather_rows`; returns a NumPy array."""
    table, ids = _check_gather(table, ids, out)
    if out is None:
        out = np.empty((ids.size, table.shape[1]), table.dtype)
    np.take(table, ids, axis=0, out=out)
    return out


def gather_rows(table, ids, out=None):
    """Copy rows ``table[ids]`` into a new (or the given) array.

    Dispatches on the table's device: CuPy runs ``kernels/gather_rows.cu``,
    NumPy the Numba kernel (parallel over ids) or :func:`gather_rows_reference`.
    Not collective.

    Args:
        table: C-contiguous 2-D float32/float64 array ``[rows, dim]``.
        ids: 1-D integer array of row ids, ``0 <= id < rows``, same device.
        out: optional C-contiguous ``[len(ids), dim]`` array of the table's
            dtype on the same device; written and returned.

    Returns:
        ``[len(ids), dim]`` array on the table's device.

    Raises:
        SparseIndexError: an id is negative or ``>= rows`` (the message names it).
        TypeError / ValueError: bad dtype, shape, device or contiguity.
    """
    table, ids = _check_gather(table, ids, out)
    if is_device_array(table):
        from . import _cuda  # noqa: PLC0415

        return _cuda.gather_rows(table, ids, out)
    if ids.size and _numba.enabled():
        if out is None:
            out = np.empty((ids.size, table.shape[1]), table.dtype)
        with _numba.threads_for(out.size):
            _numba.kernels().gather_rows(table, ids, out)
        return out
    return gather_rows_reference(table, ids, out)


def _check_scatter(table, ids, values):
    table = _check_table(table)
    ids = check_index_array("ids", ids)
    check_same_device("ids", ids, "table", table)
    values = check_float_matrix("values", values, rows=ids.shape[0], dim=table.shape[1])
    check_same_device("values", values, "table", table)
    check_same_dtype("values", values, "table", table)
    check_bounds("ids", ids, table.shape[0])
    return table, ids, values


def scatter_add_rows_reference(table, ids, values):
    """Plain-NumPy twin of :func:`scatter_add_rows`; in place."""
    table, ids, values = _check_scatter(table, ids, values)
    if ids.size:
        unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
        table[unique] = segment_sums(values, inverse.reshape(-1), counts, initial=table[unique])
    return table


def scatter_add_rows(table, ids, values):
    """Add ``values[k]`` to ``table[ids[k]]`` for every k, in place.

    Repeated ids accumulate in the order of :mod:`hpcpax.ops.summation`
    (input order in chunks of ``SUM_CHUNK``, chunk 0 starting from the table
    row, chunk sums combined by a fixed tree), bit-equal on every path (CUDA:
    ``kernels/dedup_sum.cu`` after a stable sort; Numba: grouped by row,
    parallel over rows) and to ``np.add.at(table, ids, values)`` wherever no
    id repeats more than ``SUM_CHUNK`` times. Not collective.

    Args:
        table: C-contiguous 2-D float32/float64 array ``[rows, dim]``, updated
            in place.
        ids: 1-D integer array of row ids, ``0 <= id < rows``, same device.
        values: ``[len(ids), dim]`` array of the table's dtype, same device.

    Returns:
        ``table`` (the same object), on its own device.

    Raises:
        SparseIndexError: an id is negative or ``>= rows``.
        TypeError / ValueError: bad dtype, shape, device or contiguity.
    """
    table, ids, values = _check_scatter(table, ids, values)
    if is_device_array(table):
        from . import _cuda  # noqa: PLC0415

        return _cuda.scatter_add_rows(table, ids, values)
    if ids.size == 0:
        return table
    if not _numba.enabled():
        return scatter_add_rows_reference(table, ids, values)
    with _numba.threads_for(values.size):
        _scatter_add_numba(table, ids, values)
    return table


def _sorted_unique(ids):
    unique, inverse, counts = np.unique(ids, return_inverse=True, return_counts=True)
    return unique, np.ascontiguousarray(inverse.reshape(-1), np.int64), counts.astype(np.int64)


def _scatter_add_numba(table, ids, values):
    kernels = _numba.kernels()
    serial = ids.size < _SCATTER_PARALLEL_MIN or _numba.num_chunks(ids.size) == 1
    # serial, in input order: the chunked order itself while no id passes one chunk
    if serial and not kernels.may_repeat_more_than(ids, SUM_CHUNK):
        kernels.scatter_add_serial(table, ids, values)
        return
    if ids.size < _SCATTER_PARALLEL_MIN:
        kernels.scatter_add_hashed(table, ids, values, SUM_CHUNK_SHIFT)
        return
    if table.shape[0] <= kernels.DENSE_SPAN_FACTOR * ids.size + 1024 and ids.size < 2**31:
        unique, inverse, counts = _numba.dense_unique(ids, 0, table.shape[0])
    else:
        unique, inverse, counts = _sorted_unique(ids)
    bounds = kernels.balanced_bounds(counts, 1 if serial else
                                     _numba.num_chunks(unique.size, per_thread=1))
    cursor, total_chunks = kernels.long_segment_cursors(counts, SUM_CHUNK_SHIFT, False)
    if total_chunks == 0:
        cursor = cursor[:0]
    positions, starts = kernels.chunk_buckets(inverse, counts, bounds)
    # inverse becomes each row's table row, or ~ its chunk's scratch row
    kernels.bucket_scatter_add(table, unique, values, inverse, positions, starts, bounds, counts,
                               cursor, total_chunks, SUM_CHUNK_SHIFT)
