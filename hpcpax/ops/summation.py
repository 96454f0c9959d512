"""The one summation order of the sparse sums, and its NumPy twin.

``dedup_sum`` and ``scatter_add_rows`` sum the rows that share an id in this
order on every path (NumPy, Numba, CUDA), so their results are bit-equal
across devices, thread counts and launch shapes:

1. The occurrences of an id are taken in input order (the order a stable
   sort of the ids keeps) and cut into chunks of :data:`SUM_CHUNK`:
   occurrences ``[j * SUM_CHUNK, (j + 1) * SUM_CHUNK)`` form chunk ``j``.
2. Each chunk is summed one row at a time in that order, in the values'
   dtype, starting from ``+0.0``; chunk 0 starts instead from the segment's
   initial value (``+0.0`` for ``dedup_sum``, the table row for
   ``scatter_add_rows``).
3. The chunk sums are combined by a fixed binary tree: pairwise over chunk
   index, left to right (``c0 + c1``, ``c2 + c3``, ...), an odd last one
   carried up unchanged, level after level until one is left.

An id with at most ``SUM_CHUNK`` occurrences is one chunk, no tree: the
plain sequential order, bit-equal to ``np.add.at``. Longer segments differ
from ``np.add.at`` by rounding only: both sums of ``L`` terms are within
``gamma_d * sum |x|`` of the exact sum, ``gamma_d = d u / (1 - d u)`` with
``d`` the depth of the order (``L - 1`` sequential; ``SUM_CHUNK - 1 +
ceil(log2(ceil(L / SUM_CHUNK)))`` here, so the bound only gets tighter).

:data:`SUM_CHUNK` is read from ``kernels/hpcpax_common.cuh`` (``HP_SUM_CHUNK``),
the one place it is defined. Not collective; NumPy only.
"""

from __future__ import annotations

import numpy as np

from ._kernel_source import header_constant

__all__ = ["SUM_CHUNK", "SUM_CHUNK_SHIFT", "segment_sums", "tree_depth"]

#: Occurrences per chunk of a segment (a power of two), shared with the kernels.
SUM_CHUNK = header_constant("HP_SUM_CHUNK")
#: ``log2(SUM_CHUNK)``: kernels find an occurrence's chunk with a shift.
SUM_CHUNK_SHIFT = SUM_CHUNK.bit_length() - 1
if SUM_CHUNK < 1 or SUM_CHUNK != 1 << SUM_CHUNK_SHIFT:
    raise ValueError(f"HP_SUM_CHUNK must be a power of two, not {SUM_CHUNK}")


def tree_depth(occurrences: int) -> int:
    """Adds on the longest chain of the order for a segment of ``occurrences`` rows
    (excluding the initial value): the ``d`` of the rounding bound above."""
    if occurrences <= 1:
        return 0
    chunks = -(-occurrences // SUM_CHUNK)
    return min(occurrences, SUM_CHUNK) - 1 + (chunks - 1).bit_length()


def segment_sums(values, inverse, counts, initial=None):
    """Per-segment sums of ``values`` in the order of this module (NumPy twin).

    Args:
        values: ``[n, dim]`` float32/float64 NumPy array.
        inverse: int64 ``[n]``: the segment of each row; a segment's rows are
            its occurrences in input order.
        counts: int64 ``[n_segments]``: rows per segment, each ``>= 1``.
        initial: optional ``[n_segments, dim]`` start of each segment's
            chunk 0 (``+0.0`` when None).

    Returns:
        ``[n_segments, dim]`` sums in ``values.dtype`` (a new array).
    """
    counts = np.asarray(counts, np.int64)
    dim = values.shape[1]
    chunks = (counts + SUM_CHUNK - 1) >> SUM_CHUNK_SHIFT
    if counts.size == 0 or int(chunks.max()) <= 1:  # every segment one chunk: sequential
        partial = np.zeros((counts.size, dim), values.dtype) if initial is None \
            else np.array(initial, values.dtype, copy=True)
        # add.at is unbuffered and goes through the rows in order: sequential sums.
        np.add.at(partial, inverse, values)
        return partial
    base = np.zeros(counts.size, np.int64)
    np.cumsum(chunks[:-1], out=base[1:])
    starts = np.zeros(counts.size, np.int64)
    np.cumsum(counts[:-1], out=starts[1:])
    # rank of each row among its segment's occurrences (a stable sort keeps input order)
    order = np.argsort(inverse, kind="stable")
    rank = np.empty(inverse.size, np.int64)
    rank[order] = np.arange(inverse.size, dtype=np.int64) - starts[inverse[order]]
    partial = np.zeros((int(chunks.sum()), dim), values.dtype)
    if initial is not None:
        partial[base] = initial
    np.add.at(partial, base[inverse] + (rank >> SUM_CHUNK_SHIFT), values)
    _combine_chunks(partial, base, chunks)
    return partial[base]


def _combine_chunks(partial, base, chunks) -> None:
    """The fixed tree over each segment's chunk sums, in place at its chunk 0.

    Level ``s`` (1, 2, 4, ...) adds chunk ``p*2s + s`` into chunk ``p*2s``:
    the pairwise-left-to-right tree with the odd last one carried, as a
    strided in-place reduction (what the CUDA kernel does).
    """
    long = np.flatnonzero(chunks > 1)
    first, width = base[long], chunks[long]
    stride = 1
    while first.size:
        pairs = (width - stride + 2 * stride - 1) // (2 * stride)  # p with p*2s + s < width
        owner = np.repeat(np.arange(first.size), pairs)
        p = np.arange(owner.size) - np.repeat(np.cumsum(pairs) - pairs, pairs)
        left = first[owner] + p * 2 * stride
        partial[left] = partial[left] + partial[left + stride]
        stride *= 2
        keep = width > stride
        first, width = first[keep], width[keep]
