"""The rows an owner holds of one variable, with their optimizer state.

A :class:`TableShard` is the only place that stores a parameter server's
rows: the optimizer's per-row slots beside them, and its scalar slots. It
gathers rows for pulls, applies the optimizer for pushes, and exports and
restores rows *by global id* for checkpoints, method switches and
repartitioning. Nothing here is collective.

Two storages behind one interface:

- an owner's shard of a :class:`~hpcpax.ps.layout.VariableLayout` creates
  rows on first touch (:class:`~hpcpax.ps.rowstore.LazyRows`): start-up
  does no per-row work, memory follows the rows touched, and a row's slot
  comes from an id map, whatever the table's declared size;
- a whole table (a :class:`~hpcpax.ps.layout.WholeLayout`, the replica of
  a replicated method) is built at once, row ``r`` at index ``r``.

Both give every row the value of the layout-independent initializer.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..ops import gather_rows
from .initializers import init_rows
from .memory import MemoryBudgetError
from .rowstore import LazyRows

__all__ = ["TableShard"]


class TableShard:
    """This owner's rows of one variable.

    Args:
        spec: the :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        optimizer: its :class:`~hpcpax.ops.optimizers.SparseOptimizer`.
        layout: the :class:`~hpcpax.ps.layout.VariableLayout` (this rank owns
            some partitions; rows are created on first touch), or a
            :class:`~hpcpax.ps.layout.WholeLayout` (every row, built now).
        seed: key of the layout-independent initializer; None leaves the
            rows uninitialized (they are about to be overwritten).
        memory: this rank's :class:`~hpcpax.ps.memory.RankMemory` (budget of
            a lazily stored shard), or None.
    """

    def __init__(self, spec, optimizer, layout, seed=None, memory=None):
        self.spec, self.optimizer, self.layout = spec, optimizer, layout
        self.seed = seed
        self._lazy = None
        if getattr(layout, "whole", False):
            if seed is None:
                self._table = np.empty((layout.num_local_rows, spec.dim), spec.dtype)
            else:
                self._table = init_rows(spec.initializer, seed, spec.name,
                                        layout.owned_global_ids(), spec.dim, spec.dtype,
                                        spec.init_scale)
            self.state = optimizer.init_state(self._table.shape, self._table.dtype, np)
        else:
            self.state = optimizer.init_state((0, spec.dim), np.dtype(spec.dtype), np)
            self._lazy = LazyRows(spec, optimizer, self.state, seed, memory, owner=self)
            if memory is not None:
                memory.track(spec.name, self)

    # ------------------------------------------------------------------ facts
    @property
    def table(self) -> np.ndarray:
        """The row array (a lazy shard's has spare rows; find rows by :meth:`export`)."""
        return self._table if self._lazy is None else self._lazy.table

    @property
    def lazy(self) -> bool:
        """Whether rows are created on first touch."""
        return self._lazy is not None

    @property
    def nbytes(self) -> int:
        """Bytes held: rows and optimizer state (a lazy shard: its capacity and id map)."""
        if self._lazy is not None:
            return self._lazy.nbytes + sum(np.asarray(self.state[k]).nbytes
                                           for k in self.optimizer.scalar_slots)
        return self.table.nbytes + sum(np.asarray(v).nbytes for v in self.state.values())

    @property
    def rows_held(self) -> int:
        """Rows materialized here."""
        return self._lazy.rows_held if self._lazy is not None else self.table.shape[0]

    def stats(self) -> dict:
        """Counters: rows held, capacity, rows created and evicted, eviction passes, bytes."""
        lazy = self._lazy
        return {"rows_held": self.rows_held,
                "capacity": lazy.capacity if lazy else self.table.shape[0],
                "rows_created": lazy.created if lazy else self.table.shape[0],
                "rows_evicted": lazy.evicted if lazy else 0,
                "evictions": lazy.evictions if lazy else 0,
                "bytes": self.nbytes}

    def _slots(self, ids, initialize=True) -> np.ndarray:
        if self._lazy is None:
            return self.layout.local_rows(ids)
        return self._lazy.slots(ids, initialize)

    # ------------------------------------------------------------ pull / push
    def gather(self, ids) -> np.ndarray:
        """Rows of global ``ids`` (all owned here, repeats allowed), in order.

        A row not held yet is created with its initial value.
        """
        if not len(ids):
            return np.zeros((0, self.spec.dim), self.spec.dtype)
        slots = self._slots(ids)  # first: creating rows may grow the table
        return gather_rows(self.table, slots)

    def apply(self, ids, grads) -> None:
        """Run the optimizer on rows ``ids`` (unique global ids) with ``grads``."""
        slots = self._slots(ids)
        self.optimizer.apply_rows(self.table, self.state, slots, grads)

    def update(self, ids, grads) -> tuple:
        """``(optimizer, table, state, slots, grads)``: :meth:`apply`'s update, for
        :func:`~hpcpax.ops.optimizers.apply_rows_many` to run with others."""
        slots = self._slots(ids)  # first: creating rows may grow the table
        return self.optimizer, self.table, self.state, slots, grads

    # ------------------------------------------------------------------ moves
    def export(self):
        """``(global ids, table, row state, scalar state)``: every row held, by id."""
        rows, scalars = self.optimizer.split_state(self.state)
        if self._lazy is None:
            return self.layout.owned_global_ids(), self.table, rows, scalars
        ids, slots = self._lazy.held()
        if slots.size == self._lazy.top:  # slots 0..top-1: views, no copy
            top = slots.size
            return ids, self.table[:top], {k: v[:top] for k, v in rows.items()}, scalars
        return ids, self.table[slots], {k: v[slots] for k, v in rows.items()}, scalars

    def set_scalars(self, scalars) -> None:
        """Set the optimizer's scalar slots (identical on every holder)."""
        for key, value in scalars.items():
            self.state[key] = np.array(value, copy=True)

    def load_whole(self, table, row_state, scalars) -> None:
        """Copy this owner's rows from whole-table arrays indexed by global id.

        Optimizer row slots that ``row_state`` does not hold keep their
        fresh values (e.g. a table given without its accumulator).
        """
        gids = self.layout.owned_global_ids()
        local = self._slots(gids, initialize=set(row_state) != set(self.optimizer.row_slots))
        self.table[local] = table[gids]
        for key, value in row_state.items():
            self.state[key][local] = value[gids]
        self.set_scalars(scalars)

    def place(self, ids, table, row_state) -> None:
        """Put rows of global ``ids`` (owned here) at their places (after a move)."""
        local = self._slots(ids, initialize=False)
        self.table[local] = table
        for key in self.optimizer.row_slots:
            self.state[key][local] = row_state[key]

    def restore(self, read_rows) -> None:
        """Load the rows of this shard that a checkpoint holds.

        Rows the checkpoint does not hold keep (a lazy shard: get, when
        touched) their initial value: a checkpoint of lazily stored tables
        holds only the rows that were materialized.

        Args:
            read_rows: ``read_rows(keep) -> (global ids, table, row state,
                scalar state)``: every row of the checkpoint whose id
                ``keep(ids)`` (a boolean mask of an id array) selects, e.g.
                :func:`hpcpax.app.checkpoint_files.load_matching`.

        Raises:
            CheckpointError: the checkpoint's rows or optimizer state do not
                fit this variable (both named), hold ids beyond its rows, or
                do not fit the memory budget.
        """
        name, rows = self.spec.name, self.spec.rows

        def keep(ids):
            if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= rows):
                raise CheckpointError(f"variable {name!r}: the checkpoint holds row ids in "
                                      f"[{int(ids.min())}, {int(ids.max())}], the variable "
                                      f"has {rows} rows")
            if self._lazy is None:
                return np.ones(len(ids), bool)
            return self.layout.dest_of(ids) == self.layout.rank

        gids, table, row_state, scalars = read_rows(keep)
        if table.shape[1:] != self.table.shape[1:] or table.dtype != self.table.dtype:
            raise CheckpointError(f"variable {name!r}: checkpoint rows are {table.dtype} "
                                  f"{table.shape[1:]}, the variable is {self.table.dtype} "
                                  f"{self.table.shape[1:]}")
        opt = self.optimizer
        if set(row_state) != set(opt.row_slots) or set(scalars) != set(opt.scalar_slots):
            raise CheckpointError(f"variable {name!r}: checkpoint optimizer state "
                                  f"{sorted(row_state) + sorted(scalars)} does not match "
                                  f"the optimizer's {sorted(opt.state_names)}")
        # exact shapes and dtypes: numpy would broadcast a (64,) or (n, 1) slot into place
        expected = [("ids", gids, (len(table),), gids.dtype)] + \
            [(f"optimizer slot {k!r}", v, table.shape, table.dtype) for k, v in row_state.items()] \
            + [(f"optimizer scalar {k!r}", v, np.shape(self.state[k]),
                np.asarray(self.state[k]).dtype) for k, v in scalars.items()]
        for what, value, shape, dtype in expected:
            if np.shape(value) != shape or np.asarray(value).dtype != dtype:
                raise CheckpointError(f"variable {name!r}: checkpoint {what} is "
                                      f"{np.asarray(value).dtype} {np.shape(value)}, expected "
                                      f"{dtype} {shape}")
        self._reset()
        try:
            self.place(gids, table, row_state)
        except MemoryBudgetError as exc:
            raise CheckpointError(f"restoring {len(gids):,} rows: {exc}") from None
        for key, value in scalars.items():
            self.state[key][...] = value

    def _reset(self) -> None:
        """Every row back to its initial value (a lazy shard: none held)."""
        if self._lazy is not None:
            self._lazy.clear()
        elif self.seed is not None:
            fresh = TableShard(self.spec, self.optimizer, self.layout, self.seed)
            self._table[...] = fresh.table
            for key in self.optimizer.row_slots:
                self.state[key][...] = fresh.state[key]
