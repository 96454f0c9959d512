"""Layout-independent initial values for sparse tables.

Row ``r`` of variable ``v`` is a pure function of ``(seed, v, r)``: a
counter-based generator (SplitMix64 over the element's global counter), never
a stream shared by a partition. So the initial table is identical for any
number of servers, partitions or nodes, which makes BSP training exactly
comparable across layouts.
"""

from __future__ import annotations

import zlib

import numpy as np

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


def uniform_rows(key: np.uint64, rows, dim: int, low: float, high: float,
                 dtype="float32") -> np.ndarray:
    """Values U(low, high) of the given global ``rows``, shape ``[len(rows), dim]``.

    Host (NumPy) result. The same row always gets the same values.
    """
    rows = np.asarray(rows, np.uint64)
    with np.errstate(over="ignore"):
        counter = rows[:, None] * np.uint64(dim) + np.arange(dim, dtype=np.uint64)[None, :]
        bits = _splitmix64(_splitmix64(counter ^ key) + key)
    unit = (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return (low + (high - low) * unit).astype(dtype)


def _uniform(key, rows, dim, dtype, scale):
    return uniform_rows(key, rows, dim, -scale, scale, dtype)


def _zeros(key, rows, dim, dtype, scale):
    return np.zeros((len(rows), dim), dtype)


def _constant(key, rows, dim, dtype, scale):
    return np.full((len(rows), dim), scale, dtype)


#: name -> function(key, rows, dim, dtype, scale) -> rows
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
