"""A variable registered on the parameter server: layout everywhere, rows on owners."""

from __future__ import annotations

from ..ops.optimizers import make_optimizer
from .layout import VariableLayout
from .table import TableShard

__all__ = ["PsVariable"]


class PsVariable:
    """One registered sparse variable, on every rank.

    Attributes:
        index: registration order (the wire protocol's variable index).
        spec: its :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        optimizer: the row optimizer the owners run.
        layout: the current :class:`~hpcpax.ps.layout.VariableLayout`.
        shard: this rank's :class:`~hpcpax.ps.table.TableShard`, or None on
            ranks owning no partition.
        local_aggregation: per-variable override (None: the server's setting).
    """

    def __init__(self, index, spec, topology, seed, partitions=None, owners=None, memory=None):
        self.index = index
        self.spec = spec
        #: Key of the initializer (rows are created on first touch, any layout).
        self.seed = seed
        #: This rank's :class:`~hpcpax.ps.memory.RankMemory` (None: no budget).
        self.memory = memory
        self.optimizer = make_optimizer(spec.optimizer, **spec.optimizer_params)
        self.layout = VariableLayout(spec, topology, partitions or spec.num_partitions
                                     or len(topology.owner_ranks), owners)
        self.shard = TableShard(spec, self.optimizer, self.layout, seed, memory) \
            if self.layout.is_owner else None
        self.local_aggregation = None

    def relayout(self, topology, num_partitions, owners=None) -> None:
        """Switch to a new layout with empty shards; held rows are moved in after."""
        self.layout = VariableLayout(self.spec, topology, num_partitions, owners)
        self.shard = TableShard(self.spec, self.optimizer, self.layout, self.seed, self.memory) \
            if self.layout.is_owner else None
        if self.shard is None and self.memory is not None:
            self.memory.forget(self.spec.name)
