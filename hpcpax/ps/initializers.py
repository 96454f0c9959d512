"""Layout-independent initial values for sparse tables.

Row ``r`` of variable ``v`` is a pure function of ``(seed, v, r)``: a
counter-based generator (SplitMix64 over the element's global counter), never
a stream shared by a partition. So the initial table is identical for any
number of servers, partitions or nodes, which makes BSP training exactly
comparable across layouts, and a row created on first touch, in any order,
gets the value it would have had in a table built whole.

The counter of element ``j`` of row ``r`` is ``r * dim + j`` as a 128-bit
number: its low 64 bits are hashed with the variable's key, and a non-zero
high word (ids of ``2**64 / dim`` and above, e.g. hashed 64-bit ids) is
mixed into that key, so no two elements of a table share a counter. Below
that the values are those of the plain 64-bit counter.
"""

from __future__ import annotations

import zlib

import numpy as np

from ..ops import _numba
from ..options import options

__all__ = ["variable_key", "uniform_rows", "INITIALIZERS", "init_rows"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def variable_key(seed: int, name: str) -> np.uint64:
    """64-bit key of variable ``name`` under ``seed`` (stable across runs)."""
    return np.uint64(((int(seed) & 0xFFFFFFFF) << 32) | zlib.crc32(name.encode()))


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * _M1
        z = (z ^ (z >> np.uint64(27))) * _M2
        return z ^ (z >> np.uint64(31))


def _element_keys(key, rows, dim, low_word):
    """The key of each element: ``key``, mixed with the counter's high word where non-zero."""
    if not rows.size or int(rows.max()) <= ((1 << 64) - dim) // dim:
        return key  # every counter fits in 64 bits
    mask = np.uint64(0xFFFFFFFF)
    with np.errstate(over="ignore"):
        # high word of rows * dim from 32-bit halves (dim < 2**32), plus the carry of + j
        mid = (rows >> np.uint64(32)) * np.uint64(dim) + (((rows & mask) * np.uint64(dim))
                                                           >> np.uint64(32))
        high = (mid >> np.uint64(32))[:, None] + (
            low_word < np.arange(dim, dtype=np.uint64)[None, :]).astype(np.uint64)
        return np.where(high == 0, key, key ^ _splitmix64(high))


def uniform_rows(key: np.uint64, rows, dim: int, low: float, high: float,
                 dtype="float32", out=None) -> np.ndarray:
    """Values U(low, high) of the given global ``rows``, shape ``[len(rows), dim]``.

    Host (NumPy) result, written into ``out`` when given (a C-contiguous
    ``[len(rows), dim]`` array of ``dtype``, e.g. the rows of a table about
    to hold them). The same row always gets the same values. Runs the Numba
    twin (same bits) when :func:`hpcpax.ops._numba.enabled`.
    """
    rows = np.ascontiguousarray(rows, np.uint64)
    if dim >= 1 << 32:
        raise ValueError(f"dim must be < 2**32, not {dim}")
    if rows.size and _numba.enabled():
        from ..ops import _numba_initializers  # noqa: PLC0415  (lazy: imports Numba)

        if out is None or not out.flags.c_contiguous:
            target = np.empty((rows.size, dim), dtype)
        else:
            target = out
        args = (np.uint64(key), rows, float(low), float(high),
                np.uint64(((1 << 64) - dim) // dim), target)
        if target.size < options.numba_serial_below:  # no parallel region to set up
            _numba_initializers.uniform_rows_serial(*args)
        else:
            with _numba.threads_for(target.size):
                _numba_initializers.uniform_rows(*args)
        if out is not None and target is not out:
            out[...] = target
        return target if out is None else out
    with np.errstate(over="ignore"):
        counter = rows[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        keys = _element_keys(np.uint64(key), rows, dim, counter)
        bits = _splitmix64(_splitmix64(counter ^ keys) + keys)
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    values = (low + (high - low) * unit).astype(dtype)
    if out is None:
        return values
    out[...] = values
    return out


def _uniform(key, rows, dim, dtype, scale, out=None):
    return uniform_rows(key, rows, dim, -scale, scale, dtype, out)


def _fill(value, rows, dim, dtype, out):
    if out is None:
        return np.full((len(rows), dim), value, dtype)
    out[...] = value
    return out


def _zeros(key, rows, dim, dtype, scale, out=None):
    return _fill(0, rows, dim, dtype, out)


def _constant(key, rows, dim, dtype, scale, out=None):
    return _fill(scale, rows, dim, dtype, out)


#: name -> function(key, rows, dim, dtype, scale, out=None) -> rows (in ``out`` if given)
INITIALIZERS = {"uniform": _uniform, "zeros": _zeros, "constant": _constant}


def init_rows(initializer: str, seed: int, name: str, rows, dim: int, dtype,
              scale: float) -> np.ndarray:
    """Initial values of global ``rows`` of variable ``name`` (host array)."""
    try:
        fn = INITIALIZERS[initializer]
    except KeyError:
        raise ValueError(f"initializer must be one of {sorted(INITIALIZERS)}, "
                         f"not {initializer!r}") from None
    return fn(variable_key(seed, name), rows, dim, dtype, scale)
