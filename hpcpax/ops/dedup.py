"""``dedup_sum``: merge the rows of a sparse gradient that share an index.

The result is deterministic and bit-equal on every path (NumPy, Numba,
CUDA): unique row ``u`` sums the rows with that index in the order of
:mod:`hpcpax.ops.summation` (input order in chunks of ``SUM_CHUNK`` rows,
chunk sums combined by a fixed tree), in the input dtype. An index with at
most ``SUM_CHUNK`` rows is summed sequentially from ``+0.0``, exactly as
``np.add.at(zeros, inverse, values)``; longer ones differ from it by rounding.
"""

from __future__ import annotations

import numpy as np

from ..backend import is_device_array
from . import _numba
from ._validate import check_float_matrix, check_index_array, check_same_device
from .summation import SUM_CHUNK_SHIFT, segment_sums

__all__ = ["dedup_sum", "dedup_sum_reference"]


def _check(indices, values):
    indices = check_index_array("indices", indices)
    values = check_float_matrix("values", values, rows=indices.shape[0])
    check_same_device("values", values, "indices", indices)
    return indices, values


def dedup_sum_reference(indices, values):
    """Plain-NumPy twin of :func:`dedup_sum` (the oracle of the tests).

    Args:
        indices: 1-D integer NumPy array of row ids (any values, repeats allowed).
        values: NumPy array ``[len(indices), dim]``, float32 or float64.

    Returns:
        ``(unique_indices, summed)`` as NumPy arrays: int64 ids sorted
        ascending, and ``[len(unique_indices), dim]`` sums in ``values.dtype``.
    """
    if is_device_array(indices) or is_device_array(values):
        raise TypeError("dedup_sum_reference inputs must be NumPy arrays, not cupy")
    indices, values = _check(indices, values)
    unique, inverse, counts = np.unique(indices, return_inverse=True, return_counts=True)
    return unique, segment_sums(values, inverse.reshape(-1), counts)


def _dedup_sum_numba(indices, values):
    kernels = _numba.kernels()
    n = indices.size
    low, high = kernels.min_max(indices)
    span = int(high) - int(low) + 1
    if span <= kernels.DENSE_SPAN_FACTOR * n + 1024 and span <= kernels.DENSE_SPAN_LIMIT and n < 2**31:
        unique, inverse, counts = _numba.dense_unique(indices, low, span)
    else:  # ids spread too thin for a counting table: sort instead
        unique, inverse, counts = np.unique(indices, return_inverse=True, return_counts=True)
        inverse = np.ascontiguousarray(inverse.reshape(-1), dtype=np.int64)
        counts = counts.astype(np.int64, copy=False)
    bounds = kernels.balanced_bounds(counts, _numba.num_chunks(unique.size, per_thread=1))
    cursor, total_chunks = kernels.long_segment_cursors(counts, SUM_CHUNK_SHIFT, True)
    if total_chunks == 0:
        positions, starts = kernels.chunk_buckets(inverse, counts, bounds)
    else:  # inverse becomes each row's output row (the chunk rows of long ids past the ids)
        positions, starts = kernels.chunk_rows(inverse, counts, bounds, cursor, SUM_CHUNK_SHIFT)
    summed = kernels.bucket_sum(values, inverse, positions, starts, bounds, counts, cursor,
                                total_chunks, SUM_CHUNK_SHIFT)
    return unique, summed[:unique.size]  # past them: the long ids' chunk sums


def dedup_sum(indices, values):
    """Sum the rows of ``values`` that share an index.

    Dispatches on the arrays' device: CuPy input runs the CUDA kernels
    (``kernels/dedup_sum.cu``), NumPy input the Numba kernels when Numba is
    importable and ``hpcpax.options.numba`` is on, else
    :func:`dedup_sum_reference`. All three give bit-equal results. Not
    collective.

    Args:
        indices: 1-D integer array (NumPy or CuPy) of row ids; repeats allowed.
        values: 2-D float32/float64 array ``[len(indices), dim]`` on the same
            device as ``indices``.

    Returns:
        ``(unique_indices, summed)`` on the input's device: int64 ids sorted
        ascending, and ``[len(unique_indices), dim]`` sums in ``values.dtype``.
        Row ``u`` of ``summed`` is ``((0 + v_a) + v_b) + ...`` over the rows
        with index ``unique_indices[u]`` in their input order when there are
        at most ``SUM_CHUNK`` of them, else those chunk sums combined by the
        fixed tree of :mod:`hpcpax.ops.summation`.

    Raises:
        TypeError: ``indices`` is not integer, ``values`` not float32/float64,
            or they live on different devices.
        ValueError: wrong number of dimensions or mismatched lengths.
    """
    indices, values = _check(indices, values)
    if is_device_array(indices):
        from . import _cuda  # noqa: PLC0415  (lazy: no CuPy at import)

        return _cuda.dedup_sum(indices, values)
    if indices.size == 0:
        return np.empty(0, np.int64), np.empty((0, values.shape[1]), values.dtype)
    if _numba.enabled():
        with _numba.threads_for(values.size):
            return _dedup_sum_numba(indices, values)
    return dedup_sum_reference(indices, values)
