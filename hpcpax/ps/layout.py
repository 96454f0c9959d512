"""Where a sparse variable's rows live: partitions, their owners, local rows.

A :class:`VariableLayout` is computed identically on every rank from the
spec, the partition count and the owner map (nothing is communicated): the
partition of each row (:class:`~hpcpax.ops.partitioning.Partitioning`), the
owner rank of each partition (:func:`~hpcpax.ps.placement.assign_owners`
balances bytes unless a plan gives the map). An owner stores its rows
lazily (:class:`~hpcpax.ps.rowstore.LazyRows`): a row's place there is a
slot from an id map, not a function of the layout, so nothing here is
per row and a layout of ``2**63 - 1`` rows costs what one of ten does.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ops.partitioning import Partitioning
from .placement import assign_owners

__all__ = ["VariableLayout", "WholeLayout"]


class VariableLayout:
    """The row layout of one variable under one partitioning; local, no MPI.

    ``owned_global_ids``, ``local_rows`` and ``num_local_rows`` describe
    the owned rows as one dense block (partitions back to back); only
    whole-table loads of small tables use them.

    Args:
        spec: the :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        topology: from :func:`hpcpax.init` (its ``owner_ranks`` and ``rank``).
        num_partitions: P.
        owners: owner index (into ``topology.owner_ranks``) of each
            partition, or None to balance bytes.

    Raises:
        ConfigError: ``owners`` does not name one valid owner per partition.
    """

    #: Rows are stored lazily on owners (not a whole table).
    whole = False

    def __init__(self, spec, topology, num_partitions, owners=None):
        self.spec = spec
        #: This rank (world).
        self.rank = int(topology.rank)
        self.partitioning = Partitioning(spec.partitioning, spec.rows, int(num_partitions))
        num_partitions = self.partitioning.num_parts
        owner_ranks = topology.owner_ranks
        if owners is None:
            owners = assign_owners([self.partitioning.part_rows(p) * spec.row_bytes
                                    for p in range(num_partitions)], len(owner_ranks))
        if len(owners) != num_partitions or not all(0 <= o < len(owner_ranks) for o in owners):
            raise ConfigError(f"{spec.name}: owners must list one of {len(owner_ranks)} owners "
                              f"for each of {num_partitions} partitions, not {owners!r}")
        #: Owner index of each partition.
        self.owners = [int(o) for o in owners]
        #: World rank owning each partition (int64, ``[P]``).
        self.owner_rank_of_part = np.array([owner_ranks[o] for o in self.owners], np.int64)
        #: Partitions this rank owns, ascending.
        self.my_parts = [int(p) for p in np.flatnonzero(self.owner_rank_of_part == topology.rank)]
        # Rows of all my partitions are stored back to back in one table.
        self.offset = np.zeros(num_partitions, np.int64)
        position = 0
        for p in self.my_parts:
            self.offset[p] = position
            position += self.partitioning.part_rows(p)
        #: Rows this rank holds (0 on ranks owning nothing).
        self.num_local_rows = position

    @property
    def num_partitions(self) -> int:
        """P."""
        return self.partitioning.num_parts

    @property
    def is_owner(self) -> bool:
        """Whether this rank holds any partition."""
        return bool(self.my_parts)

    def owned_global_ids(self) -> np.ndarray:
        """Global ids of this rank's rows, in table order (int64)."""
        parts = [self.partitioning.global_index(p, np.arange(self.partitioning.part_rows(p)))
                 for p in self.my_parts]
        return np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)

    def local_rows(self, ids) -> np.ndarray:
        """Row of each global id (owned by this rank) in this owner's table."""
        return self.offset[self.partitioning.partition_of(ids)] + self.partitioning.local_index(ids)

    def dest_of(self, ids) -> np.ndarray:
        """World rank owning each global id."""
        return self.owner_rank_of_part[self.partitioning.partition_of(ids)]

    def delegate_of_part(self, node_workers: int) -> np.ndarray:
        """Node-local worker index that aggregates each partition (``p % node_workers``)."""
        return np.arange(self.num_partitions, dtype=np.int64) % int(node_workers)


class WholeLayout:
    """The layout of a whole table held in one place (a worker's replica).

    Has the parts of :class:`VariableLayout` a
    :class:`~hpcpax.ps.table.TableShard` uses: every row, at its own index.
    """

    #: Every row is built at once, row ``r`` at index ``r``.
    whole = True

    def __init__(self, rows: int):
        self.num_local_rows = int(rows)

    def owned_global_ids(self) -> np.ndarray:
        """Every row id."""
        return np.arange(self.num_local_rows, dtype=np.int64)

    def local_rows(self, ids):
        """A row's place is its id."""
        return ids
