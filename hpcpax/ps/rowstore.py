"""Rows created on first touch: the storage of a :class:`~hpcpax.ps.table.TableShard`.

A parameter server's table may be declared as large as the id space (hashed
64-bit ids: ``rows = 2**63 - 1``) and still start at once and hold memory
for the rows touched only:

- an :class:`~hpcpax.ops.idmap.IdMap` maps each held global id to a *slot*,
  its row in the shard's arrays (the "local row" of a lazily stored table);
- a row is created the first time a request names it, with the value the
  layout-independent initializer gives it (:mod:`hpcpax.ps.initializers`)
  and fresh optimizer slots, so training is bit-identical to a table built
  whole;
- the arrays (values, optimizer row slots, the id of each slot) grow by at
  least half their size at a time, in chunks of :data:`CHUNK_ROWS` rows,
  and only as far as the rank's budget (:class:`~hpcpax.ps.memory.RankMemory`)
  allows;
- when the budget is reached, a variable with ``eviction="lru"`` frees its
  least recently used rows (at least 1/16 of its capacity at a time, never
  one the current request names). **Evicted rows are dropped**: touched
  again, a row is re-created from the initializer, as if it had never been
  trained (the policy of production recommenders that expire stale ids);
  checkpoints hold the rows held at the time. Without eviction the request
  fails with the variable and the numbers named.

Every operation works on whole id arrays (Numba or NumPy, no per-row Python
loop). Not collective.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ops import _numba
from ..ops.idmap import IdMap
from ..options import counted, format_bytes
from .initializers import INITIALIZERS, variable_key
from .memory import MemoryBudgetError, row_footprint

__all__ = ["LazyRows", "CHUNK_ROWS", "EVICTION_POLICIES"]

#: Granularity of growth (rows).
CHUNK_ROWS = 1024
#: New elements below which rows are initialized by the bound serial kernel.
_SERIAL_INIT = 1 << 16
#: ``SparseVariableSpec.eviction`` values.
EVICTION_POLICIES = ("none", "lru")


def _round_up(n, chunk=CHUNK_ROWS):
    return -(-int(n) // chunk) * chunk


class LazyRows:
    """The held rows of one variable on one owner, created on first touch.

    Args:
        spec: the :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        optimizer: its row optimizer (declares the row slots).
        state: the shard's optimizer state dict; its row slots are replaced
            here as the arrays grow (scalar slots are left alone).
        seed: key of the initializer (None: rows may only be placed, e.g.
            while a table is being moved in; creating one raises).
        memory: this rank's :class:`~hpcpax.ps.memory.RankMemory`, or None
            for no budget.
        owner: the shard (what ``memory`` tracks).
    """

    def __init__(self, spec, optimizer, state, seed, memory=None, owner=None):
        self.spec, self.optimizer, self.state, self.seed = spec, optimizer, state, seed
        self.memory, self.owner = memory, owner
        self.lru = getattr(spec, "eviction", "none") == "lru"
        self.map = IdMap()
        self.table = np.empty((0, spec.dim), spec.dtype)
        #: Global id held in each slot (-1: free).
        self.slot_ids = np.empty(0, np.int64)
        self.last_use = np.empty(0, np.int64) if self.lru else None
        self.clock = 0
        self.top = 0  # slots ever handed out; those above are fresh
        self.free = np.empty(0, np.int64)  # freed (evicted) slots, reused first
        self.footprint = row_footprint(spec, optimizer, self.lru)
        # the initializer's key and a new row's optimizer slots, computed once
        self._initializer = INITIALIZERS[spec.initializer]
        self._key = variable_key(seed, spec.name) if seed is not None else None
        fresh = optimizer.init_state((1, spec.dim), np.dtype(spec.dtype), np)
        self._fresh_slots = {k: fresh[k][0] for k in optimizer.row_slots}
        self._write_uniform = self._uniform_kernel()
        #: Rows created (on first touch or moved in; re-creations after eviction included).
        self.created = 0
        #: Rows evicted, and eviction passes.
        self.evicted = 0
        self.evictions = 0

    # ----------------------------------------------------------------- facts
    @property
    def capacity(self) -> int:
        """Rows the arrays can hold without growing."""
        return self.table.shape[0]

    @property
    def rows_held(self) -> int:
        """Rows held now."""
        return len(self.map)

    @property
    def nbytes(self) -> int:
        """Bytes of the arrays (capacity, not just rows held) and the id map."""
        slots = sum(self.state[k].nbytes for k in self.optimizer.row_slots)
        extra = self.last_use.nbytes if self.lru else 0
        return (self.table.nbytes + slots + self.slot_ids.nbytes + extra + self.map.nbytes
                + self.free.nbytes)

    def held(self):
        """``(global ids, slots)`` of every held row, in slot order."""
        if self.free.size == 0:
            return self.slot_ids[:self.top], np.arange(self.top, dtype=np.int64)
        slots = np.flatnonzero(self.slot_ids[:self.top] >= 0).astype(np.int64)
        return self.slot_ids[slots], slots

    # ---------------------------------------------------------------- access
    def slots(self, ids, initialize=True) -> np.ndarray:
        """Slot of each global id (duplicates allowed), creating the missing rows.

        Args:
            ids: int64 global ids of rows this owner holds.
            initialize: give new rows their initial values and fresh
                optimizer slots (False: the caller overwrites them).

        Raises:
            MemoryBudgetError: the rows do not fit the rank's budget (and
                the variable does not evict), naming the variable and the
                numbers; nothing is changed then.
        """
        ids = np.asarray(ids, np.int64)
        if self.free.size == 0 and self.capacity - self.top >= ids.size:
            # room for every id to be new: one pass finds and creates
            slots, new_ids = self.map.lookup_or_insert(ids, self.top)
            if self.lru:
                self.clock += 1
                self.last_use[slots] = self.clock
            if new_ids.size:
                fresh = slice(self.top, self.top + new_ids.size)
                self.top += new_ids.size
                self.slot_ids[fresh] = new_ids
                if initialize:
                    self._initialize(new_ids, fresh)
                self.created += new_ids.size
            return slots
        slots, missing = self.map.lookup(ids)
        if self.lru:
            self.clock += 1
            if missing < slots.size:  # stamp held rows first: eviction spares them
                self.last_use[slots[slots >= 0] if missing else slots] = self.clock
        if missing:
            absent = slots < 0
            new_ids, inverse = np.unique(ids[absent], return_inverse=True)
            new_slots = self._allocate(new_ids.size)
            self.map.insert(new_ids, new_slots)
            self.slot_ids[new_slots] = new_ids
            if initialize:
                self._initialize(new_ids, new_slots)
            if self.lru:
                self.last_use[new_slots] = self.clock
            slots[absent] = new_slots[inverse.reshape(-1)]
            self.created += new_ids.size
        return slots

    def clear(self) -> None:
        """Drop every row (keeps the allocation)."""
        self.map = IdMap()
        self.slot_ids[:] = -1
        self.top = 0
        self.free = np.empty(0, np.int64)

    def _initialize(self, ids, slots) -> None:
        spec = self.spec
        if self.seed is None:
            raise ConfigError(f"{spec.name}: rows {ids[:3].tolist()} are not held here and "
                              "this shard has no initializer seed")
        if isinstance(slots, slice) and self._write_uniform is not None \
                and ids.size * spec.dim < _SERIAL_INIT:  # the common case, in place
            self._write_uniform(ids.view(np.uint64), self.table[slots])
        elif isinstance(slots, slice):  # fresh slots: written in place
            self._initializer(self._key, ids, spec.dim, spec.dtype, spec.init_scale,
                              out=self.table[slots])
        else:
            self.table[slots] = self._initializer(self._key, ids, spec.dim, spec.dtype,
                                                  spec.init_scale)
        for key, row in self._fresh_slots.items():
            self.state[key][slots] = row

    def _uniform_kernel(self):
        """The Numba uniform initializer bound to this variable (None: other paths)."""
        spec = self.spec
        if spec.initializer != "uniform" or self._key is None or not _numba.enabled():
            return None
        from ..ops import _numba_initializers  # noqa: PLC0415  (lazy: imports Numba)

        kernel = _numba_initializers.uniform_rows_serial
        args = (np.uint64(self._key), -float(spec.init_scale), float(spec.init_scale),
                np.uint64(((1 << 64) - spec.dim) // spec.dim))
        return lambda rows, out: kernel(args[0], rows, args[1], args[2], args[3], out)

    # ---------------------------------------------------------------- growth
    def _allocate(self, count) -> np.ndarray:
        """``count`` slots for new rows: freed ones first, then fresh ones."""
        short = count - self.free.size - (self.capacity - self.top)
        if short > 0:
            self._make_room(short, count)
        reused = min(count, self.free.size)
        slots = np.arange(self.top, self.top + count - reused, dtype=np.int64)
        if reused:
            slots = np.concatenate([self.free[self.free.size - reused:], slots])
        self.free = self.free[:self.free.size - reused]
        self.top += count - reused
        return slots

    def _allowed_capacity(self):
        """Most rows the arrays may have within the budget (None: no limit)."""
        room = self.memory.room(self.owner) if self.memory is not None else None
        if room is None:
            return None
        return max(0, int(room) // self.footprint)

    def _make_room(self, short, count) -> None:
        """Grow by at least ``short`` rows, or evict, or raise (before changing anything)."""
        capacity = self.capacity
        wanted = _round_up(max(capacity + short, capacity + capacity // 2, CHUNK_ROWS))
        allowed = self._allowed_capacity()
        if allowed is None or wanted <= allowed:
            self._grow(wanted)
            return
        if capacity + short <= allowed:
            self._grow(allowed)
            return
        evictable = self._evictable() if self.lru else np.empty(0, np.int64)
        reachable = self.free.size + max(allowed, capacity) - self.top + evictable.size
        if not self.lru or count > reachable:
            self._refuse(count, allowed)
        if allowed > capacity:
            self._grow(allowed)
        still = count - self.free.size - (self.capacity - self.top)
        self._evict(evictable, min(evictable.size, max(still, self.capacity // 16)))

    def _grow(self, capacity) -> None:
        """Reallocate the arrays to ``capacity`` rows, keeping the held ones."""
        keep = self.top

        def grown(array, fill=None):
            out = (np.empty if fill is None else np.full)(
                (capacity,) + array.shape[1:], *(() if fill is None else (fill,)),
                dtype=array.dtype)
            out[:keep] = array[:keep]
            return out

        self.table = grown(self.table)
        for key in self.optimizer.row_slots:
            self.state[key] = grown(self.state[key])
        self.slot_ids = grown(self.slot_ids, -1)
        if self.lru:
            self.last_use = grown(self.last_use, 0)

    # -------------------------------------------------------------- eviction
    def _evictable(self) -> np.ndarray:
        """Held slots not named by the current request (oldest use unknown yet)."""
        used = np.flatnonzero(self.slot_ids[:self.top] >= 0)
        return used[self.last_use[used] < self.clock].astype(np.int64)

    def _evict(self, candidates, count) -> None:
        """Drop the ``count`` least recently used of ``candidates``."""
        if count <= 0:
            return
        if count < candidates.size:
            pick = np.argpartition(self.last_use[candidates], count - 1)[:count]
            victims = candidates[pick]
        else:
            victims = candidates
        self.map.remove(self.slot_ids[victims])
        self.slot_ids[victims] = -1
        self.free = np.concatenate([self.free, np.sort(victims)[::-1]])
        self.evicted += int(victims.size)
        self.evictions += 1

    def _refuse(self, count, allowed) -> None:
        spec, memory = self.spec, self.memory
        slots = len(self.optimizer.row_slots)
        need = (self.rows_held + count) * self.footprint
        others = memory.held(exclude=self.owner) if memory is not None else 0
        raise MemoryBudgetError(
            f"sparse variable {spec.name!r} does not fit its owner's memory budget: "
            f"{self.rows_held:,} rows held + {count:,} new would take about "
            f"{format_bytes(need)} ({self.footprint} bytes per row of {spec.dim} "
            f"{np.dtype(spec.dtype)} with {counted(slots, 'optimizer slot')}), "
            f"room for {allowed:,} rows: budget {format_bytes(memory.limit)} minus "
            f"{format_bytes(others)} held by other tables ({memory.describe(self.owner)}); "
            f"raise --server-memory-budget / HPCPAX_SERVER_MEMORY, add server ranks, or set "
            f"eviction='lru' on the variable")
