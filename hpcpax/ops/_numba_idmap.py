"""Numba kernels of :class:`~hpcpax.ops.idmap.IdMap` (imported lazily).

An open-addressing hash table with linear probing: ``keys`` (int64, ``-1``
marks an empty bucket) and ``values`` side by side, a power-of-two number
of buckets. Deletion shifts the following entries back (no tombstones), so
a lookup never walks further than the longest run of full buckets.
"""

from __future__ import annotations

import numba as nb
import numpy as np
from numba import prange

from ._numba_cache import guard_module

EMPTY = -1


@nb.njit(cache=True, nogil=True, inline="always")
def _home(key, mask):
    # murmur3's finalizer: strided ids (one partition of a "mod" layout) spread evenly
    x = np.uint64(key)
    x ^= x >> np.uint64(33)
    x *= np.uint64(0xFF51AFD7ED558CCD)
    x ^= x >> np.uint64(33)
    return np.int64(x & np.uint64(mask))


@nb.njit(cache=True, nogil=True, inline="always")
def _bucket(keys, key, mask):
    """The bucket holding ``key``, or the empty bucket that ends its probe chain."""
    b = _home(key, mask)
    while keys[b] != key and keys[b] != EMPTY:
        b = (b + 1) & mask
    return b


@nb.njit(cache=True, nogil=True)
def lookup_serial(keys, values, ids, out):
    """``out[i]`` = value of ``ids[i]``, or -1; returns how many were missing."""
    mask = keys.size - 1
    missing = 0
    for i in range(ids.size):
        b = _bucket(keys, ids[i], mask)
        if keys[b] == EMPTY:
            out[i] = -1
            missing += 1
        else:
            out[i] = values[b]
    return missing


@nb.njit(cache=True, nogil=True, parallel=True)
def lookup_parallel(keys, values, ids, out):
    """:func:`lookup_serial`, parallel over ids (read-only on the table)."""
    mask = keys.size - 1
    missing = 0
    for i in prange(ids.size):
        b = _bucket(keys, ids[i], mask)
        if keys[b] == EMPTY:
            out[i] = -1
            missing += 1
        else:
            out[i] = values[b]
    return missing


@nb.njit(cache=True, nogil=True)
def lookup_or_insert(keys, values, ids, first_slot, out, new_ids):
    """``out[i]`` = slot of ``ids[i]``; absent ids get ``first_slot``, ``first_slot + 1``...
    in order of first appearance (listed in ``new_ids``). Returns how many were new.

    The table must have room for every id (the caller reserves it).
    """
    mask = keys.size - 1
    added = 0
    for i in range(ids.size):
        key = ids[i]
        b = _bucket(keys, key, mask)
        if keys[b] == EMPTY:
            keys[b] = key
            values[b] = first_slot + added
            new_ids[added] = key
            added += 1
        out[i] = values[b]
    return added


@nb.njit(cache=True, nogil=True)
def insert(keys, values, ids, slots):
    """Set ``ids[i] -> slots[i]`` (an id already present is overwritten); returns new keys."""
    mask = keys.size - 1
    added = 0
    for i in range(ids.size):
        key = ids[i]
        b = _bucket(keys, key, mask)
        if keys[b] == EMPTY:
            keys[b] = key
            added += 1
        values[b] = slots[i]
    return added


@nb.njit(cache=True, nogil=True)
def remove(keys, values, ids):
    """Delete ``ids`` (absent ones are ignored), shifting later entries back; returns removed."""
    mask = keys.size - 1
    removed = 0
    for i in range(ids.size):
        hole = _bucket(keys, ids[i], mask)
        if keys[hole] == EMPTY:
            continue
        removed += 1
        j = hole
        while True:
            j = (j + 1) & mask
            if keys[j] == EMPTY:
                break
            home = _home(keys[j], mask)
            # the entry at j may fill the hole unless its home lies after the hole
            if ((j - home) & mask) >= ((j - hole) & mask):
                keys[hole] = keys[j]
                values[hole] = values[j]
                hole = j
        keys[hole] = EMPTY
    return removed


@nb.njit(cache=True, nogil=True)
def rehash(old_keys, old_values, keys, values):
    """Insert every entry of the old table into the (larger, empty) new one."""
    mask = keys.size - 1
    for i in range(old_keys.size):
        key = old_keys[i]
        if key == EMPTY:
            continue
        b = _home(key, mask)
        while keys[b] != EMPTY:
            b = (b + 1) & mask
        keys[b] = key
        values[b] = old_values[i]


# ranks compiling at once must not corrupt the shared on-disk cache (see _numba_cache)
guard_module(globals())
