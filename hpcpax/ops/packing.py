"""``partition_pack``: order sparse rows by destination partition (or owner).

The packed buffers are ready for ``Alltoallv``: rows bound for destination
``d`` sit at ``[displs[d], displs[d] + counts[d])`` and keep their input
order (a stable counting sort), so the receiver's sums stay deterministic.
A destination is a partition, or, with ``dest_of_part``, whatever the
partitions map to (the rank that owns them, the node delegate that
aggregates them): the parameter server packs every pull request and push
this way, on the device where the rows are. Ids stay global; the caller
converts them with :meth:`Partitioning.local_index` where it needs local rows.
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
    """Rows packed by destination.

    Attributes:
        counts: int64 NumPy array ``[num_dest]``: rows per destination
            (always on the host, since MPI needs the counts there).
        indices: int64 global row ids, packed, on the input's device.
        values: packed ``[n, dim]`` rows on the input's device, or None when
            no values were given.
        displs: int64 NumPy array ``[num_dest]``: exclusive prefix sum of
            ``counts`` (host).
        order: int64 ``[n]`` on the input's device: packed row ``j`` is
            input row ``order[j]`` (``out[order] = packed`` undoes the packing).
    """

    counts: np.ndarray
    indices: object
    values: object
    displs: object
    order: object


def _check(indices, values, partitioning, dest_of_part, num_dest, in_range=False):
    if not isinstance(partitioning, Partitioning):
        raise TypeError(f"partitioning must be a Partitioning, not {type(partitioning).__name__}")
    indices = check_index_array("indices", indices)
    if values is not None:
        values = check_float_matrix("values", values, rows=indices.shape[0])
        check_same_device("values", values, "indices", indices)
    if not in_range:
        check_bounds("indices", indices, partitioning.num_rows)
    if dest_of_part is None:
        return indices, values, None, partitioning.num_parts
    lut = np.asarray(dest_of_part, np.int64)  # host: the same table on every device
    if lut.shape != (partitioning.num_parts,):
        raise ValueError(f"dest_of_part must have {partitioning.num_parts} entries, "
                         f"not {lut.shape}")
    if isinstance(num_dest, bool) or not isinstance(num_dest, (int, np.integer)) or num_dest < 1:
        raise ValueError(f"num_dest must be a positive int with dest_of_part, not {num_dest!r}")
    if lut.size and (lut.min() < 0 or lut.max() >= num_dest):
        raise ValueError(f"dest_of_part must be in [0, {num_dest}), not {lut.min()}..{lut.max()}")
    return indices, values, lut, int(num_dest)


def _displs(counts):
    displs = np.zeros_like(counts)
    np.cumsum(counts[:-1], out=displs[1:])
    return displs


def partition_pack_reference(indices, values, partitioning, dest_of_part=None, num_dest=None):
    """Plain-NumPy twin of :func:`partition_pack` (stable argsort)."""
    indices, values, lut, num_dest = _check(indices, values, partitioning, dest_of_part, num_dest)
    keys = partitioning.partition_of(indices)
    if lut is not None:
        keys = lut[keys]
    order = np.argsort(keys, kind="stable").astype(np.int64)
    counts = np.bincount(keys, minlength=num_dest).astype(np.int64)
    packed_values = None if values is None else values[order]
    return PackedPartitions(counts, indices[order], packed_values, _displs(counts), order)


def partition_pack(indices, values, partitioning, dest_of_part=None, num_dest=None, *,
                   in_range=False):
    """Pack rows by the partition that owns their index, or by its destination.

    Dispatches on the input's device: CuPy runs ``kernels/partition_pack.cu``
    (partition of each row, a stable sort by destination, then a row
    gather), NumPy a parallel stable counting sort in Numba or
    :func:`partition_pack_reference`. All paths return the same arrays. Not
    collective.

    Args:
        indices: 1-D integer array of global row ids in ``[0, num_rows)``.
        values: ``[len(indices), dim]`` float32/float64 rows on the same
            device, or None to pack ids alone (pull requests).
        partitioning: the :class:`~hpcpax.ops.partitioning.Partitioning` of the
            variable.
        dest_of_part: optional host int array ``[num_parts]``: the destination
            of each partition (e.g. its owner rank); rows are then grouped by
            destination, partitions of one destination in input order.
        num_dest: number of destinations (required with ``dest_of_part``).
        in_range: the caller has checked every index is in ``[0, num_rows)``
            (the parameter server has, before anything moves): skip that pass.

    Returns:
        :class:`PackedPartitions`; ``counts``/``displs`` on the host, the
        packed ``indices``/``values`` and ``order`` on the input's device.

    Raises:
        SparseIndexError: an index is negative or ``>= num_rows``.
        TypeError / ValueError: bad dtype, shape, device or destination table.
    """
    indices, values, lut, num_dest = _check(indices, values, partitioning, dest_of_part, num_dest,
                                            in_range)
    if is_device_array(indices):
        from . import _cuda  # noqa: PLC0415

        counts, packed_ids, packed_values, order = _cuda.partition_pack(
            indices, values, partitioning, lut, num_dest)
        return PackedPartitions(counts, packed_ids, packed_values, _displs(counts), order)
    if not _numba.enabled() or indices.size == 0:
        return partition_pack_reference(indices, values, partitioning, lut, num_dest)
    if lut is None:
        lut = np.arange(partitioning.num_parts, dtype=np.int64)
    rows = values if values is not None else np.empty((indices.size, 0), np.float64)
    with _numba.threads_for(max(rows.size, indices.size)):
        counts, displs, packed_ids, packed_values, order = _numba.kernels().partition_pack(
            indices,
            rows,
            partitioning.kind == "range" and partitioning.num_parts > 1,
            partitioning.num_parts,
            partitioning.base,
            partitioning.remainder,
            lut,
            num_dest,
            _numba.num_chunks(indices.size, per_thread=1),
        )
    return PackedPartitions(counts, packed_ids, None if values is None else packed_values,
                            displs, order)
