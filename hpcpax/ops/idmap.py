"""``IdMap``: a compact map from row ids (any non-negative int64) to slots.

What a table that creates rows on first touch needs: for a whole request
at once, which ids already have a slot (:meth:`IdMap.lookup`), then slots
for the new ones (:meth:`IdMap.insert`), and removal of evicted ids
(:meth:`IdMap.remove`). Memory grows with the ids held, never with the id
space, so ids may be hashed 64-bit keys.

Two implementations with the same results: with Numba an open-addressing
hash table (linear probing, at most 70 % full, doubled when fuller; lookups
parallel over ids for large requests); without it (or with
``hpcpax.options.numba`` off) sorted arrays searched with
``np.searchsorted`` (inserts and removals cost a pass over the map). No
per-id Python loop on either path. Host (NumPy) arrays only; not collective.
"""

from __future__ import annotations

import numpy as np

from . import _numba

__all__ = ["IdMap"]

_MIN_BUCKETS = 1024
_MAX_LOAD = 0.7


def _ids(ids, name="ids") -> np.ndarray:
    ids = np.asarray(ids)
    if ids.ndim != 1 or ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be a 1-D integer array, not {ids.ndim}-D {ids.dtype}")
    return np.ascontiguousarray(ids, np.int64)


class IdMap:
    """Non-negative int64 id -> int64 slot, for whole arrays of ids at a time.

    Args:
        numba: use the Numba hash table (default: when
            :func:`hpcpax.ops._numba.enabled`), else sorted arrays.
    """

    def __init__(self, numba=None):
        self._kernels = None
        if numba is None:
            numba = _numba.enabled()
        if numba:
            from . import _numba_idmap  # noqa: PLC0415  (lazy: Numba is slow to import)

            self._kernels = _numba_idmap
        self._count = 0
        # hash table (numba) or sorted ids and their slots (NumPy)
        self._keys = np.full(_MIN_BUCKETS if numba else 0, -1, np.int64)
        self._values = np.full(self._keys.size, -1, np.int64)

    def __len__(self) -> int:
        return self._count

    @property
    def nbytes(self) -> int:
        """Bytes of the map's arrays."""
        return self._keys.nbytes + self._values.nbytes

    def lookup(self, ids):
        """``(slots, missing)``: the slot of each id (-1 where absent) and how many are absent.

        ``ids`` may repeat; the result is aligned with them.
        """
        ids = _ids(ids)
        out = np.empty(ids.size, np.int64)
        if ids.size == 0:
            return out, 0
        if self._kernels is not None:
            if ids.size >= 1 << 15:
                with _numba.threads_for(ids.size * 8):
                    missing = self._kernels.lookup_parallel(self._keys, self._values, ids, out)
            else:
                missing = self._kernels.lookup_serial(self._keys, self._values, ids, out)
            return out, int(missing)
        if self._count == 0:
            out.fill(-1)
            return out, ids.size
        position = np.minimum(np.searchsorted(self._keys, ids), self._count - 1)
        hit = self._keys[position] == ids
        np.copyto(out, np.where(hit, self._values[position], -1))
        return out, int(ids.size - np.count_nonzero(hit))

    def lookup_or_insert(self, ids, first_slot: int):
        """``(slots, new ids)``: each id's slot, the absent ones inserted first.

        Absent ids (``>= 0``; repeats allowed) get slots ``first_slot``,
        ``first_slot + 1``, ... in the order of ``new ids`` (first appearance
        with Numba, ascending without). One pass over the ids with Numba.
        """
        ids = _ids(ids)
        if self._kernels is None or ids.size == 0:
            slots, missing = self.lookup(ids)
            if not missing:
                return slots, np.zeros(0, np.int64)
            absent = slots < 0
            new_ids, inverse = np.unique(ids[absent], return_inverse=True)
            new_slots = np.arange(first_slot, first_slot + new_ids.size, dtype=np.int64)
            self.insert(new_ids, new_slots)
            slots[absent] = new_slots[inverse.reshape(-1)]
            return slots, new_ids
        if int(ids.min()) < 0:
            raise ValueError(f"ids must be >= 0, not {int(ids.min())}")
        self._reserve(self._count + ids.size)
        out = np.empty(ids.size, np.int64)
        new_ids = np.empty(ids.size, np.int64)
        added = int(self._kernels.lookup_or_insert(self._keys, self._values, ids,
                                                   np.int64(first_slot), out, new_ids))
        self._count += added
        return out, new_ids[:added]

    def insert(self, ids, slots) -> None:
        """Map each of ``ids`` (unique, not yet held, ``>= 0``) to ``slots``."""
        ids, slots = _ids(ids), _ids(slots, "slots")
        if ids.size != slots.size:
            raise ValueError(f"slots must have {ids.size} entries, not {slots.size}")
        if ids.size == 0:
            return
        if int(ids.min()) < 0:
            raise ValueError(f"ids must be >= 0, not {int(ids.min())}")
        if self._kernels is not None:
            self._reserve(self._count + ids.size)
            self._count += int(self._kernels.insert(self._keys, self._values, ids, slots))
            return
        order = np.argsort(ids, kind="stable")
        ids, slots = ids[order], slots[order]
        position = np.searchsorted(self._keys, ids)
        self._keys = np.insert(self._keys, position, ids)
        self._values = np.insert(self._values, position, slots)
        self._count = self._keys.size

    def remove(self, ids) -> None:
        """Forget ``ids`` (absent ones are ignored)."""
        ids = _ids(ids)
        if ids.size == 0 or self._count == 0:
            return
        if self._kernels is not None:
            self._count -= int(self._kernels.remove(self._keys, self._values, ids))
            return
        position = np.minimum(np.searchsorted(self._keys, ids), self._count - 1)
        gone = position[self._keys[position] == ids]
        self._keys = np.delete(self._keys, gone)
        self._values = np.delete(self._values, gone)
        self._count = self._keys.size

    def items(self):
        """``(ids, slots)`` of every entry (ids ascending)."""
        if self._kernels is None:
            return self._keys.copy(), self._values.copy()
        full = self._keys != -1
        ids, slots = self._keys[full], self._values[full]
        order = np.argsort(ids)
        return ids[order], slots[order]

    def _reserve(self, count) -> None:
        """Grow the hash table (doubling) until ``count`` entries stay below the load bound."""
        buckets = self._keys.size
        while count > _MAX_LOAD * buckets:
            buckets *= 2
        if buckets == self._keys.size:
            return
        keys = np.full(buckets, -1, np.int64)
        values = np.full(buckets, -1, np.int64)
        self._kernels.rehash(self._keys, self._values, keys, values)
        self._keys, self._values = keys, values
