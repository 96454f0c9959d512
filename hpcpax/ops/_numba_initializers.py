"""Numba twin of :func:`hpcpax.ps.initializers.uniform_rows` (imported lazily).

The same integer operations (SplitMix64 over the element's 128-bit counter)
and the same float64 arithmetic in the same order, so the values are
bit-equal to the NumPy path; parallel over rows.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ._numba_cache import guard_module

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_UNIT = 1.0 / (1 << 53)


@nb.njit(cache=True, nogil=True, inline="always")
def _splitmix64(x):
    z = x + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


@nb.njit(cache=True, nogil=True, inline="always")
def _row(key, row, low, span, fits, out, i):
    """Row ``i`` of ``out``: the values of global row ``row``.

    Rows up to ``fits`` have counters below ``2**64`` (the common case).
    """
    dim = out.shape[1]
    udim = np.uint64(dim)
    base = row * udim  # low word of the counter (wraps)
    if row <= fits:
        for j in range(dim):
            bits = _splitmix64(_splitmix64((base + np.uint64(j)) ^ key) + key)
            out[i, j] = low + span * (np.float64(bits >> np.uint64(11)) * _UNIT)
        return
    mask = np.uint64(0xFFFFFFFF)
    top = ((row >> np.uint64(32)) * udim + (((row & mask) * udim) >> np.uint64(32))) \
        >> np.uint64(32)
    for j in range(dim):
        counter = base + np.uint64(j)
        high_word = top + np.uint64(1 if counter < np.uint64(j) else 0)
        k = key if high_word == np.uint64(0) else key ^ _splitmix64(high_word)
        bits = _splitmix64(_splitmix64(counter ^ k) + k)
        out[i, j] = low + span * (np.float64(bits >> np.uint64(11)) * _UNIT)


@nb.njit(cache=True, nogil=True)
def uniform_rows_serial(key, rows, low, high, fits, out):
    """``out[i]`` = U(low, high) values of row ``rows[i]`` under ``key`` (one thread)."""
    span = high - low
    for i in range(rows.size):
        _row(key, rows[i], low, span, fits, out, i)


@nb.njit(cache=True, nogil=True, parallel=True)
def uniform_rows(key, rows, low, high, fits, out):
    """:func:`uniform_rows_serial`, parallel over rows."""
    span = high - low
    for i in prange(rows.size):
        _row(key, rows[i], low, span, fits, out, i)


# ranks compiling at once must not corrupt the shared on-disk cache (see _numba_cache)
guard_module(globals())
