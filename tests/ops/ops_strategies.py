"""Shared input generators for the ops tests (imported by rootdir-style tests)."""

import numpy as np
from hypothesis import strategies as st

from hpcpax.ops.summation import SUM_CHUNK as C

DISTRIBUTIONS = ["uniform", "zipf", "all_same", "max_index", "one_row", "empty"]


def make_ids(kind, n, num_rows, rng):
    if kind == "empty":
        return np.empty(0, np.int64)
    if kind == "one_row":
        return np.array([rng.integers(num_rows)], np.int64)
    if kind == "all_same":
        return np.full(n, rng.integers(num_rows), np.int64)
    if kind == "max_index":
        ids = rng.integers(0, num_rows, n)
        ids[rng.integers(0, n, max(1, n // 4))] = num_rows - 1
        return ids
    if kind == "zipf":
        return np.minimum(rng.zipf(1.3, n) - 1, num_rows - 1).astype(np.int64)
    return rng.integers(0, num_rows, n).astype(np.int64)


def make_values(n, dim, dtype, rng):
    values = rng.standard_normal((n, dim)).astype(dtype)
    if n:  # signed zeros and exact cancellations are where orders differ
        values[rng.integers(0, n, max(1, n // 8))] = -0.0
        values.flat[rng.integers(0, values.size, max(1, values.size // 16))] *= 1e6
    return values


@st.composite
def sparse_cases(draw, max_n=400, max_rows=300):
    kind = draw(st.sampled_from(DISTRIBUTIONS))
    n = draw(st.integers(1, max_n))
    num_rows = draw(st.integers(1, max_rows))
    dim = draw(st.sampled_from([1, 3, 8, 17]))
    dtype = draw(st.sampled_from([np.float32, np.float64]))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    ids = make_ids(kind, n, num_rows, rng)
    return ids, make_values(ids.size, dim, dtype, rng), num_rows


def bits(a):
    """View a float array as unsigned ints so comparisons are bit-exact (-0.0, NaN)."""
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def slow_segment_sum(rows, initial):
    """The summation order of hpcpax.ops.summation, written out plainly.

    ``rows``: a list of 1-D arrays, one id's rows in input order; ``initial``:
    the start of chunk 0. Chunks of SUM_CHUNK rows added one at a time, then
    chunk sums paired left to right level by level, an odd last one carried.
    """
    chunks = []
    for j in range(0, len(rows), C):
        acc = initial.copy() if j == 0 else np.zeros_like(initial)
        for row in rows[j:j + C]:
            acc = acc + row
        chunks.append(acc)
    while len(chunks) > 1:
        paired = [chunks[i] + chunks[i + 1] for i in range(0, len(chunks) - 1, 2)]
        if len(chunks) % 2:
            paired.append(chunks[-1])
        chunks = paired
    return chunks[0]


def slow_dedup(ids, values):
    """``dedup_sum`` by :func:`slow_segment_sum`, one id at a time."""
    keys = sorted(set(ids.tolist()))
    zero = np.zeros(values.shape[1], values.dtype)
    summed = [slow_segment_sum([values[i] for i in np.flatnonzero(ids == k)], zero) for k in keys]
    return np.array(keys, np.int64), np.array(summed, values.dtype).reshape(len(keys), values.shape[1])


def slow_scatter(table, ids, values):
    """``scatter_add_rows`` by :func:`slow_segment_sum`, in place."""
    for k in sorted(set(ids.tolist())):
        table[k] = slow_segment_sum([values[i] for i in np.flatnonzero(ids == k)], table[k].copy())
    return table
