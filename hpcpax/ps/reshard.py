"""Moving a variable's rows as a whole: gather, load, repartition.

Every row travels with its optimizer state, by global id, so nothing is
recomputed and training continues as if the new layout (or method) had been
used from the start. Used by :class:`~hpcpax.ps.server.ParameterServer`'s
``gather_table``, ``load_table`` and ``repartition``, which say which calls
are collective.
"""

from __future__ import annotations

import numpy as np

from ..comm.exchange import alltoallv_rows, exchange_counts, group_by_destination

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

    **Collective** over ``comm`` (every rank of the job). Returns
    ``(table, row_state, scalar_state)`` as host arrays.
    """
    spec = var.spec
    pieces = comm.allgather(export_rows(var))
    table = np.empty((spec.rows, spec.dim), spec.dtype)
    row_state, scalars = {}, {}
    for gids, rows, state, scalar in pieces:
        if len(gids) == 0:
            continue
        table[gids] = rows
        for key, value in state.items():
            row_state.setdefault(key, np.empty((spec.rows,) + value.shape[1:],
                                               value.dtype))[gids] = value
        scalars = scalar or scalars
    return table, row_state, {k: np.array(v, copy=True) for k, v in scalars.items()}


def repartition_collective(topology, accounting, var, num_partitions, owners) -> None:
    """Move every row of ``var`` to its owner under a new layout; **collective** (every rank)."""
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
        var.shard.place(got[0], got[1], dict(zip(slots, got[2:])))
        var.shard.set_scalars(scalars)
