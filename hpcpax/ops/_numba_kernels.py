"""Numba CPU kernels of the sparse ops (imported lazily by ``_numba``).

Every kernel does the same floating-point operations in the same order as
the NumPy reference of its op (sums: the order of ``summation.py``), so
results are bit-equal; parallel loops are split by output row, never by
summand, so results do not depend on the number of threads. No
``fastmath``: it would allow reassociation and FMA.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ._numba_cache import guard_module
from ._numba_sums import (  # noqa: F401  (re-exported: the sums live in their own module)
    balanced_bounds,
    bucket_scatter_add,
    bucket_sum,
    chunk_buckets,
    chunk_rows,
    long_segment_cursors,
    may_repeat_more_than,
    scatter_add_hashed,
    scatter_add_serial,
)

# Counting-table path when the id span is at most this many times the input
# (measured against np.unique's sort, 1k-200k random ids: the table wins up to
# a span of 16x, 0.48 against 0.69 ms at 13k ids; they cross near 24-32x).
DENSE_SPAN_FACTOR = 16
DENSE_SPAN_LIMIT = 1 << 28


@nb.njit(cache=True, nogil=True)
def min_max(ids):
    low = ids[0]
    high = ids[0]
    for i in range(1, ids.size):
        v = ids[i]
        if v < low:
            low = v
        if v > high:
            high = v
    return low, high


@nb.njit(cache=True, nogil=True)
def dense_unique(ids, low, span, slot, seen):
    """Sorted unique ids, inverse and counts via a counting table of ``span``.

    ``slot`` (int32, at least ``span``) and ``seen`` (uint8, at least ``span``
    rounded up to 8) are scratch that must be zero on entry; they are zero
    again on return, so that they can be kept between calls (a fresh table
    of this size cost more in page faults than the counting itself). The
    table is int32 (half the cache footprint); callers keep ``ids.size``
    below 2**31.
    """
    n = ids.size
    for i in range(n):
        k = ids[i] - low
        slot[k] += 1
        seen[k] = 1
    most = min(n, span)
    unique = np.empty(most, np.int64)
    counts = np.empty(most, np.int64)
    # the table is the larger side: skip its empty stretches 8 entries a load
    words = seen.view(np.uint64)
    u = 0
    for w in range((span + 7) >> 3):
        if words[w] != 0:
            for k in range(w << 3, min((w << 3) + 8, span)):
                c = slot[k]
                if c != 0:
                    unique[u] = k + low
                    counts[u] = c
                    slot[k] = u
                    u += 1
    inverse = np.empty(n, np.int64)
    for i in range(n):
        inverse[i] = slot[ids[i] - low]
    for j in range(u):
        k = unique[j] - low
        slot[k] = 0
        seen[k] = 0
    return unique[:u], inverse, counts[:u]


@nb.njit(cache=True, nogil=True, parallel=True)
def gather_rows(table, ids, out):
    dim = table.shape[1]
    for k in prange(ids.size):
        r = ids[k]
        for c in range(dim):
            out[k, c] = table[r, c]


@nb.njit(cache=True, nogil=True)
def part_of(row, kind_is_range, num_parts, base, remainder):
    if not kind_is_range:
        return row % num_parts
    boundary = remainder * (base + 1)
    if row < boundary:
        return row // (base + 1)
    return remainder + (row - boundary) // base


@nb.njit(cache=True, nogil=True, parallel=True)
def partition_pack(ids, values, kind_is_range, num_parts, base, remainder, dest_of_part,
                   num_dest, num_chunks):
    """Stable counting sort of rows by destination (``dest_of_part[partition]``)."""
    n = ids.size
    dim = values.shape[1]
    chunk = (n + num_chunks - 1) // num_chunks
    chunk_counts = np.zeros((num_chunks, num_dest), np.int64)
    for t in prange(num_chunks):
        for i in range(t * chunk, min(n, (t + 1) * chunk)):
            d = dest_of_part[part_of(ids[i], kind_is_range, num_parts, base, remainder)]
            chunk_counts[t, d] += 1
    counts = np.zeros(num_dest, np.int64)
    displs = np.zeros(num_dest, np.int64)
    offsets = np.empty((num_chunks, num_dest), np.int64)
    running = 0
    for d in range(num_dest):
        displs[d] = running
        for t in range(num_chunks):
            offsets[t, d] = running
            running += chunk_counts[t, d]
        counts[d] = running - displs[d]
    packed_ids = np.empty(n, np.int64)
    packed_values = np.empty((n, dim), values.dtype)
    order = np.empty(n, np.int64)
    for t in prange(num_chunks):
        for i in range(t * chunk, min(n, (t + 1) * chunk)):
            d = dest_of_part[part_of(ids[i], kind_is_range, num_parts, base, remainder)]
            j = offsets[t, d]
            offsets[t, d] = j + 1
            packed_ids[j] = ids[i]
            order[j] = i
            for c in range(dim):
                packed_values[j, c] = values[i, c]
    return counts, displs, packed_ids, packed_values, order


# -- row-wise optimizers: same formulas, same order as optimizers.py ---------


@nb.njit(cache=True, nogil=True, parallel=True)
def sgd_rows(param, rows, grads, lr):
    dim = param.shape[1]
    for k in prange(rows.size):
        r = rows[k]
        for c in range(dim):
            param[r, c] = param[r, c] - lr * grads[k, c]


@nb.njit(cache=True, nogil=True, parallel=True)
def momentum_rows(param, accum, rows, grads, lr, momentum, lr_momentum, nesterov):
    dim = param.shape[1]
    for k in prange(rows.size):
        r = rows[k]
        for c in range(dim):
            g = grads[k, c]
            a = momentum * accum[r, c] + g
            accum[r, c] = a
            if nesterov:
                param[r, c] = param[r, c] - (lr * g + lr_momentum * a)
            else:
                param[r, c] = param[r, c] - lr * a


@nb.njit(cache=True, nogil=True, parallel=True)
def adagrad_rows(param, accum, rows, grads, lr, eps):
    dim = param.shape[1]
    for k in prange(rows.size):
        r = rows[k]
        for c in range(dim):
            g = grads[k, c]
            a = accum[r, c] + g * g
            accum[r, c] = a
            param[r, c] = param[r, c] - lr * g / (np.sqrt(a) + eps)


@nb.njit(cache=True, nogil=True, parallel=True)
def adam_rows(param, m, v, rows, grads, lr_t, beta1, one_minus_beta1, beta2, one_minus_beta2, eps):
    dim = param.shape[1]
    for k in prange(rows.size):
        r = rows[k]
        for c in range(dim):
            g = grads[k, c]
            mt = beta1 * m[r, c] + one_minus_beta1 * g
            vt = beta2 * v[r, c] + one_minus_beta2 * (g * g)
            m[r, c] = mt
            v[r, c] = vt
            param[r, c] = param[r, c] - lr_t * mt / (np.sqrt(vt) + eps)


# ranks compiling at once must not corrupt the shared on-disk cache (see _numba_cache)
guard_module(globals())
