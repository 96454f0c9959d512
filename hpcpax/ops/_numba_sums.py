"""Numba CPU kernels of ``dedup_sum`` and ``scatter_add_rows`` (imported lazily).

They sum in the order of :mod:`hpcpax.ops.summation`, bit-equal to its NumPy
twin: a slot's rows in input order, in chunks of ``1 << shift`` rows, chunk
sums combined by the fixed tree. Threads own ranges of slots (never split a
slot), so results do not depend on the number of threads.

The walk over the input rows reads each row's output row from a streaming
array (``inverse`` rewritten by :func:`chunk_rows`), never from a counter
that the walk itself updates: a walk that also stores integers measured
1.45x slower. A slot of at most one chunk adds
straight into its output row; a longer one into a row per chunk, which
:func:`combine_chunks` then reduces into the slot's row.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ._numba_cache import guard_module


@nb.njit(cache=True, nogil=True)
def balanced_bounds(counts, num_chunks):
    """Split slots into ``num_chunks`` runs of nearly equal summand counts."""
    n_unique = counts.size
    total = 0
    for s in range(n_unique):
        total += counts[s]
    bounds = np.empty(num_chunks + 1, np.int64)
    bounds[0] = 0
    s = 0
    seen = 0
    for t in range(1, num_chunks):
        target = (total * t) // num_chunks
        while s < n_unique and seen < target:
            seen += counts[s]
            s += 1
        bounds[t] = s
    bounds[num_chunks] = n_unique
    return bounds


@nb.njit(cache=True, nogil=True)
def long_segment_cursors(counts, shift, unified):
    """Rows of the chunk sums of the slots longer than one chunk (``1 << shift``).

    Returns ``(cursor, total_chunks)``, ``total_chunks`` the chunk rows all
    long slots need (0: there is none). ``cursor[s] >> shift`` is the row
    the next occurrence of slot s adds into (:func:`chunk_buckets` advances
    it by one per occurrence). ``unified``: one output buffer, slot ``s`` at
    row ``s`` (a short slot's occurrences stay there: at most ``1 << shift``
    of them) and chunk rows from ``counts.size`` on. Else: ``-1`` for a short
    slot, rows of a separate scratch array for a long one.
    """
    chunk = 1 << shift
    cursor = np.empty(counts.size, np.int64)
    total = 0
    base = counts.size if unified else 0
    for s in range(counts.size):
        c = counts[s]
        if c > chunk:
            cursor[s] = (base + total) << shift
            total += (c + chunk - 1) >> shift
        else:
            cursor[s] = s << shift if unified else -1
    return cursor, total


@nb.njit(cache=True, nogil=True)
def _thread_starts(counts, bounds):
    """Start of each thread's run of positions: its slots' counts, summed (no pass over rows)."""
    num_chunks = bounds.size - 1
    starts = np.zeros(num_chunks + 1, np.int64)
    for t in range(num_chunks):
        total = starts[t]
        for s in range(bounds[t], bounds[t + 1]):
            total += counts[s]
        starts[t + 1] = total
    return starts


@nb.njit(cache=True, nogil=True)
def chunk_buckets(inverse, counts, bounds):
    """Positions grouped by the thread owning their slot, increasing in each.

    ``positions[starts[t]:starts[t+1]]`` are the input rows whose slot lies in
    ``[bounds[t], bounds[t+1])``; a stable counting sort with few buckets,
    so its writes stream.
    """
    num_chunks = bounds.size - 1
    n_unique = bounds[num_chunks]
    owner = np.empty(n_unique, np.int32)
    for t in range(num_chunks):
        for s in range(bounds[t], bounds[t + 1]):
            owner[s] = t
    starts = _thread_starts(counts, bounds)
    at = starts[:-1].copy()
    positions = np.empty(inverse.size, np.int64)
    for i in range(inverse.size):
        t = owner[inverse[i]]
        positions[at[t]] = i
        at[t] += 1
    return positions, starts


@nb.njit(cache=True, nogil=True)
def chunk_rows(inverse, counts, bounds, cursor, shift):
    """Positions grouped by thread (:func:`chunk_buckets`), ``inverse`` made output rows.

    With the unified cursors of :func:`long_segment_cursors` (advanced here),
    ``inverse[i]`` becomes, in place and without a branch, the output row of
    input row ``i``: ``cursor[slot] >> shift``, or ``~row`` for the first row
    of a chunk row, which then starts from it (no zeroing pass). Serial, in
    input order: each slot's rows in order, as the chunks need.
    """
    num_chunks = bounds.size - 1
    n_unique = bounds[num_chunks]
    # one random access per row: the owning thread in the top 16 bits, the cursor below
    packed = np.empty(n_unique, np.int64)
    for t in range(num_chunks):
        for s in range(bounds[t], bounds[t + 1]):
            packed[s] = (np.int64(t) << 48) | cursor[s]
    starts = _thread_starts(counts, bounds)
    at = starts[:-1].copy()
    positions = np.empty(inverse.size, np.int64)
    mask = (1 << shift) - 1
    low = (np.int64(1) << 48) - 1
    for i in range(inverse.size):
        s = inverse[i]
        e = packed[s]
        t = e >> 48
        positions[at[t]] = i
        at[t] += 1
        row = (e & low) >> shift
        first = np.int64(row >= n_unique) & np.int64((e & mask) == 0)
        inverse[i] = row ^ -first
        packed[s] = e + 1
    for s in range(n_unique):
        cursor[s] = packed[s] & low
    return positions, starts


@nb.njit(cache=True, nogil=True)
def combine_chunks(scratch, first, width):
    """The fixed tree over chunk rows ``scratch[first:first+width]``, result at
    ``first``: level s = 1, 2, 4, ... adds chunk ``p*2s + s`` into ``p*2s``."""
    dim = scratch.shape[1]
    stride = 1
    while stride < width:
        p = 0
        while p + stride < width:
            for c in range(dim):
                scratch[first + p, c] += scratch[first + p + stride, c]
            p += 2 * stride
        stride *= 2


@nb.njit(cache=True, nogil=True, parallel=True)
def bucket_sum(values, dest, positions, starts, bounds, counts, cursor, total_chunks, shift):
    """Slot s's rows summed in the order (summation.py) from +0, in row s.

    Each thread owns a slot range and walks its rows in increasing position,
    so reads of ``values`` stream. With long slots (``total_chunks > 0``),
    ``dest`` and ``cursor`` come from :func:`chunk_rows`, and the result has
    ``n_unique + total_chunks`` rows, the chunk rows last; else ``dest`` is
    the slot of each row.
    """
    n_unique = bounds[bounds.size - 1]
    dim = values.shape[1]
    mask = (1 << shift) - 1
    out = np.empty((n_unique + total_chunks, dim), values.dtype)
    zero = np.zeros(1, values.dtype)[0]
    for t in prange(bounds.size - 1):
        for s in range(bounds[t], bounds[t + 1]):
            for c in range(dim):
                out[s, c] = 0
        for k in range(starts[t], starts[t + 1]):
            i = positions[k]
            d = dest[i]
            if d >= 0:
                for c in range(dim):
                    out[d, c] += values[i, c]
            else:  # a chunk's first row: +0 + v, the chunk's start
                d = ~d
                for c in range(dim):
                    out[d, c] = values[i, c] + zero
        if total_chunks:
            for s in range(bounds[t], bounds[t + 1]):
                if counts[s] > mask + 1:
                    first = (cursor[s] - counts[s]) >> shift
                    combine_chunks(out, first, (counts[s] + mask) >> shift)
                    for c in range(dim):
                        out[s, c] = out[first, c]
    return out


@nb.njit(cache=True, nogil=True)
def scatter_add_serial(table, ids, values):
    """``table[ids[k]] += values[k]`` in input order: the order while no id
    occurs more than one chunk (see :func:`may_repeat_more_than`)."""
    dim = table.shape[1]
    for k in range(ids.size):
        r = ids[k]
        for c in range(dim):
            table[r, c] += values[k, c]


@nb.njit(cache=True, nogil=True, parallel=True)
def bucket_scatter_add(table, unique, values, inverse, positions, starts, bounds, counts, cursor,
                       total_chunks, shift):
    """``table[unique[s]]`` plus slot s's rows in the order: chunk 0 starts from
    the table row (so a slot of one chunk adds into the row in place), the
    tree's result replaces it. ``cursor``: :func:`long_segment_cursors` with
    ``unified`` off (consumed); ``inverse`` is rewritten."""
    dim = table.shape[1]
    mask = (1 << shift) - 1
    scratch = np.zeros((total_chunks, dim), table.dtype)
    for t in prange(bounds.size - 1):
        for s in range(bounds[t], bounds[t + 1]):
            if total_chunks and cursor[s] >= 0:
                r = unique[s]
                for c in range(dim):
                    scratch[cursor[s] >> shift, c] = table[r, c]
        # each row's destination first, in its own loop: the table row, or ~ a scratch row
        for k in range(starts[t], starts[t + 1]):
            i = positions[k]
            s = inverse[i]
            at = cursor[s] if total_chunks else -1
            if at < 0:
                inverse[i] = unique[s]
            else:
                inverse[i] = ~(at >> shift)
                cursor[s] = at + 1
        for k in range(starts[t], starts[t + 1]):
            i = positions[k]
            d = inverse[i]
            if d >= 0:
                for c in range(dim):
                    table[d, c] += values[i, c]
            else:
                d = ~d
                for c in range(dim):
                    scratch[d, c] += values[i, c]
        if total_chunks:
            for s in range(bounds[t], bounds[t + 1]):
                if cursor[s] >= 0:
                    first = (cursor[s] - counts[s]) >> shift
                    combine_chunks(scratch, first, (counts[s] + mask) >> shift)
                    r = unique[s]
                    for c in range(dim):
                        table[r, c] = scratch[first, c]


@nb.njit(cache=True, nogil=True, inline="always")
def _hash_home(key, mask):
    # Fibonacci hashing: strided ids (one partition of a "mod" layout) spread evenly
    return np.int64((np.uint64(key) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(20)) & mask


@nb.njit(cache=True, nogil=True)
def may_repeat_more_than(ids, limit):
    """False only if no id occurs more than ``limit`` times: a cheap, conservative
    test (counts per bucket of a small hashed table; collisions only add)."""
    if ids.size <= limit:
        return False
    table = np.zeros(4096, np.int32)
    for k in range(ids.size):
        h = _hash_home(ids[k], 4095)
        table[h] += 1
        if table[h] > limit:
            return True
    return False


@nb.njit(cache=True, nogil=True)
def scatter_add_hashed(table, ids, values, shift):
    """Serial :func:`bucket_scatter_add` for a small batch: ids grouped by an
    open-addressing hash table (no sort, no table-sized counting array)."""
    n = ids.size
    size = 1
    while size < 2 * n:
        size *= 2
    mask = size - 1
    keys = np.full(size, -1, np.int64)
    count = np.zeros(size, np.int64)
    slot = np.empty(n, np.int64)
    for k in range(n):
        h = _hash_home(ids[k], mask)
        while keys[h] != -1 and keys[h] != ids[k]:
            h = (h + 1) & mask
        keys[h] = ids[k]
        count[h] += 1
        slot[k] = h
    chunk = 1 << shift
    cursor = np.full(size, -1, np.int64)
    total = 0
    for h in range(size):
        if count[h] > chunk:
            cursor[h] = total << shift
            total += (count[h] + chunk - 1) >> shift
    dim = table.shape[1]
    scratch = np.zeros((total, dim), table.dtype)
    for h in range(size):
        if cursor[h] >= 0:
            for c in range(dim):
                scratch[cursor[h] >> shift, c] = table[keys[h], c]
    for k in range(n):  # destinations first, in an integer loop: the table row or ~ a scratch row
        h = slot[k]
        at = cursor[h]
        if at < 0:
            slot[k] = ids[k]
        else:
            slot[k] = ~(at >> shift)
            cursor[h] = at + 1
    for k in range(n):
        d = slot[k]
        if d >= 0:
            for c in range(dim):
                table[d, c] += values[k, c]
        else:
            d = ~d
            for c in range(dim):
                scratch[d, c] += values[k, c]
    for h in range(size):
        if cursor[h] >= 0:
            first = (cursor[h] - count[h]) >> shift
            combine_chunks(scratch, first, (count[h] + chunk - 1) >> shift)
            for c in range(dim):
                table[keys[h], c] = scratch[first, c]


# ranks compiling at once must not corrupt the shared on-disk cache (see _numba_cache)
guard_module(globals())
