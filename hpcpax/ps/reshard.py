"""Moving a variable's rows as a whole: gather, load, repartition.

Every held row travels with its optimizer state, by global id, so nothing
is recomputed and training continues as if the new layout (or method) had
been used from the start; rows never touched travel nowhere (their owner
creates them from the initializer when they are). Used by :class:`~hpcpax.ps.server.ParameterServer`'s
``gather_table``, ``load_table`` and ``repartition``, which say which calls
are collective.
"""

from __future__ import annotations

import numpy as np

from ..comm.exchange import alltoallv_rows, exchange_counts, group_by_destination
from .initializers import init_rows
from .memory import MemoryBudgetError, check_whole_table

__all__ = ["export_rows", "gather_table", "repartition_collective"]


def export_rows(var):
    """``(global ids, table, row state, scalar state)`` of this rank's rows of ``var``.

    Local; empty on ranks owning nothing. Scalar state (e.g. Adam's step)
    is identical on every owner.
    """
    if var.shard is None:
        spec = var.spec
        return np.zeros(0, np.int64), np.zeros((0, spec.dim), spec.dtype), {}, {}
    return var.shard.export()


def gather_table(comm, var):
    """The whole table of ``var`` with its optimizer state, on every rank of ``comm``.

    **Collective** over ``comm`` (every rank of the job). Only the rows the
    owners hold travel; the others get their initial values here. Returns
    ``(table, row_state, scalar_state)`` as host arrays.

    Raises:
        ConfigError: on every rank, before anything moves, when the whole
            table exceeds ``HPCPAX_REPLICA_MEMORY``.
    """
    spec = var.spec
    check_whole_table(spec, "gathering the table")
    pieces = comm.allgather(export_rows(var))
    table = init_rows(spec.initializer, var.seed, spec.name, np.arange(spec.rows), spec.dim,
                      spec.dtype, spec.init_scale)
    state = var.optimizer.init_state(table.shape, table.dtype, np)
    row_state = {k: state[k] for k in var.optimizer.row_slots}
    scalars = {}
    for gids, rows, held_state, scalar in pieces:
        scalars = scalar or scalars
        if len(gids) == 0:
            continue
        table[gids] = rows
        for key, value in held_state.items():
            row_state[key][gids] = value
    return table, row_state, {k: np.array(v, copy=True) for k, v in scalars.items()}


def repartition_collective(topology, accounting, var, num_partitions, owners):
    """Move every held row of ``var`` to its owner under a new layout; **collective** (every rank).

    Returns the :class:`~hpcpax.ps.memory.MemoryBudgetError` of an owner
    that cannot hold its new rows (to be raised on every rank together), or
    None.
    """
    spec = var.spec
    gids, table, row_state, scalars = export_rows(var)
    scalars = topology.comm.bcast(scalars, root=int(var.layout.owner_rank_of_part[0]))
    slots = var.optimizer.row_slots
    arrays = [gids, table] + [row_state[k] if k in row_state
                              else np.zeros((0, spec.dim), spec.dtype) for k in slots]
    var.relayout(topology, num_partitions, owners)
    counts, _, *grouped = group_by_destination(var.layout.dest_of(gids), topology.size, *arrays)
    recv = exchange_counts(topology.comm, counts, accounting, "repartition", spec.name)
    got = alltoallv_rows(topology.comm, counts, recv, grouped, accounting, "repartition",
                         spec.name)
    if var.shard is not None:
        var.shard.set_scalars(scalars)
        try:
            var.shard.place(got[0], got[1], dict(zip(slots, got[2:])))
        except MemoryBudgetError as exc:
            return exc
    return None
