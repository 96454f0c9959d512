"""The rows an owner holds of one variable, with their optimizer state.

A :class:`TableShard` is the only place that stores a parameter server's
rows: one host table holding every partition the rank owns back to back
(the :class:`~hpcpax.ps.layout.VariableLayout` says where each global id
sits), the optimizer's per-row slots beside it, and its scalar slots. It
gathers rows for pulls, applies the optimizer for pushes, and exports and
restores rows *by global id* for checkpoints, method switches and
repartitioning. Nothing here is collective.
"""

from __future__ import annotations

import numpy as np

from ..errors import CheckpointError
from ..ops import gather_rows
from .initializers import init_rows

__all__ = ["TableShard"]


class TableShard:
    """This owner's rows of one variable.

    Args:
        spec: the :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        optimizer: its :class:`~hpcpax.ops.optimizers.SparseOptimizer`.
        layout: the :class:`~hpcpax.ps.layout.VariableLayout` (this rank owns
            some partitions).
        seed: key of the layout-independent initializer; None leaves the
            rows uninitialized (they are about to be overwritten).
    """

    def __init__(self, spec, optimizer, layout, seed=None):
        self.spec, self.optimizer, self.layout = spec, optimizer, layout
        if seed is None:
            self.table = np.empty((layout.num_local_rows, spec.dim), spec.dtype)
        else:
            self.table = init_rows(spec.initializer, seed, spec.name, layout.owned_global_ids(),
                                   spec.dim, spec.dtype, spec.init_scale)
        self.state = optimizer.init_state(self.table.shape, self.table.dtype, np)

    @property
    def nbytes(self) -> int:
        """Bytes held: rows and optimizer state."""
        return self.table.nbytes + sum(np.asarray(v).nbytes for v in self.state.values())

    def gather(self, ids) -> np.ndarray:
        """Rows of global ``ids`` (all owned here), in order."""
        if not len(ids):
            return np.zeros((0, self.spec.dim), self.spec.dtype)
        return gather_rows(self.table, self.layout.local_rows(ids))

    def apply(self, ids, grads) -> None:
        """Run the optimizer on rows ``ids`` (unique global ids) with ``grads``."""
        self.optimizer.apply_rows(self.table, self.state, self.layout.local_rows(ids), grads)

    def export(self):
        """``(global ids, table, row state, scalar state)``: every row held, by id."""
        rows, scalars = self.optimizer.split_state(self.state)
        return self.layout.owned_global_ids(), self.table, rows, scalars

    def set_scalars(self, scalars) -> None:
        """Set the optimizer's scalar slots (identical on every holder)."""
        for key, value in scalars.items():
            self.state[key] = np.array(value, copy=True)

    def load_whole(self, table, row_state, scalars) -> None:
        """Copy this owner's rows from whole-table arrays indexed by global id."""
        gids = self.layout.owned_global_ids()
        self.table[...] = table[gids]
        for key, value in row_state.items():
            self.state[key][...] = value[gids]
        self.set_scalars(scalars)

    def place(self, ids, table, row_state) -> None:
        """Put rows of global ``ids`` (owned here) at their places (after a move)."""
        local = self.layout.local_rows(ids)
        self.table[local] = table
        for key in self.optimizer.row_slots:
            self.state[key][local] = row_state[key]

    def restore(self, read_rows) -> None:
        """Load every row held here from a checkpoint.

        Args:
            read_rows: ``read_rows(global ids) -> (table, row state, scalar
                state)`` aligned with the ids (e.g.
                :func:`hpcpax.app.checkpoint.load_rows`).

        Raises:
            CheckpointError: the checkpoint's rows or optimizer state do not
                fit this variable (both named).
        """
        gids = self.layout.owned_global_ids()
        table, rows, scalars = read_rows(gids)
        name = self.spec.name
        if table.shape[1:] != self.table.shape[1:] or table.dtype != self.table.dtype:
            raise CheckpointError(f"variable {name!r}: checkpoint rows are {table.dtype} "
                                  f"{table.shape[1:]}, the variable is {self.table.dtype} "
                                  f"{self.table.shape[1:]}")
        opt = self.optimizer
        if set(rows) != set(opt.row_slots) or set(scalars) != set(opt.scalar_slots):
            raise CheckpointError(f"variable {name!r}: checkpoint optimizer state "
                                  f"{sorted(rows) + sorted(scalars)} does not match "
                                  f"the optimizer's {sorted(opt.state_names)}")
        self.place(gids, table, rows)
        for key, value in scalars.items():
            self.state[key][...] = value
