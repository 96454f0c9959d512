"""Shared input generators for the ops tests (imported by rootdir-style tests)."""

import numpy as np
from hypothesis import strategies as st

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
