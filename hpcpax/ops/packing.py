"""``partition_pack``: order sparse rows by destination partition.

The packed buffers are ready for ``Alltoallv``: rows bound for partition
``p`` sit at ``[displs[p], displs[p] + counts[p])`` and keep their input
order (a stable counting sort), so the receiver's sums stay deterministic.
Ids stay global; the caller converts them with
:meth:`Partitioning.local_index` where it needs local rows.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..backend import is_device_array
from .partitioning import Partitioning
from . import _numba
from ._validate import check_bounds, check_float_matrix, check_index_array, check_same_device

__all__ = ["PackedPartitions", "partition_pack", "partition_pack_reference"]


class PackedPartitions(NamedTuple):
    """Rows packed by destination partition.

    Attributes:
        counts: int64 NumPy array ``[num_parts]``: rows per partition (always
            on the host, since MPI needs the counts there).
        indices: int64 global row ids, packed, on the input's device.
        values: packed ``[n, dim]`` rows on the input's device, or None when
            no values were given.
        displs: int64 NumPy array ``[num_parts]``: exclusive prefix sum of
            ``counts`` (host).
    """

    counts: np.ndarray
    indices: object
    values: object
    displs: object


def _check(indices, values, partitioning):
    if not isinstance(partitioning, Partitioning):
        raise TypeError(f"partitioning must be a Partitioning, not {type(partitioning).__name__}")
    indices = check_index_array("indices", indices)
    if values is not None:
        values = check_float_matrix("values", values, rows=indices.shape[0])
        check_same_device("values", values, "indices", indices)
    check_bounds("indices", indices, partitioning.num_rows)
    return indices, values


def _displs(counts):
    displs = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=displs[1:])
    return displs


def partition_pack_reference(indices, values, partitioning):
    """Plain-NumPy twin of :func:`partition_pack` (stable argsort)."""
    indices, values = _check(indices, values, partitioning)
    parts = partitioning.partition_of(indices)
    order = np.argsort(parts, kind="stable")
    counts = np.bincount(parts, minlength=partitioning.num_parts).astype(np.int64)
    packed_values = None if values is None else values[order]
    return PackedPartitions(counts, indices[order], packed_values, _displs(counts))


def partition_pack(indices, values, partitioning):
    """Pack rows by the partition that owns their index.

    Dispatches on the input's device: CuPy runs ``kernels/partition_pack.cu``
    (a stable sort by partition, then a row gather), NumPy a parallel
    stable counting sort in Numba or :func:`partition_pack_reference`. All
    paths return the same arrays. Not collective.

    Args:
        indices: 1-D integer array of global row ids in ``[0, num_rows)``.
        values: ``[len(indices), dim]`` float32/float64 rows on the same
            device, or None to pack ids alone (pull requests).
        partitioning: the :class:`~hpcpax.ops.partitioning.Partitioning` of the
            variable.

    Returns:
        :class:`PackedPartitions`; ``counts``/``displs`` on the host, the
        packed ``indices``/``values`` on the input's device.

    Raises:
        SparseIndexError: an index is negative or ``>= num_rows``.
        TypeError / ValueError: bad dtype, shape or device.
    """
    indices, values = _check(indices, values, partitioning)
    if is_device_array(indices):
        from . import _cuda  # noqa: PLC0415

        return _cuda.partition_pack(indices, values, partitioning)
    if not _numba.enabled() or indices.size == 0:
        return partition_pack_reference(indices, values, partitioning)
    rows = values if values is not None else np.empty((indices.size, 0), np.float64)
    with _numba.threads_for(max(rows.size, indices.size)):
        counts, displs, packed_ids, packed_values = _numba.kernels().partition_pack(
            indices,
            rows,
            partitioning.kind == "range",
            partitioning.num_parts,
            partitioning.base,
            partitioning.remainder,
            _numba.num_chunks(indices.size, per_thread=1),
        )
    return PackedPartitions(counts, packed_ids, None if values is None else packed_values, displs)
