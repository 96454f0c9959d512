"""Embedding modules whose rows live on the parameter servers (or replicas).

:func:`hpcpax.torch.distribute` puts a :class:`DistributedEmbedding` or
:class:`DistributedEmbeddingBag` where the model had an ``nn.Embedding`` or
``nn.EmbeddingBag``. Its forward pulls the rows of the batch's distinct ids
(a **collective** pull: every worker runs the same forward), makes them a
leaf tensor that requires grad, and runs the torch lookup on local indices
into those rows (``sparse=True``). The backward fills the leaf's ``.grad``
with one row per occurrence (a sparse tensor, nothing summed); the
optimizer's step pushes it, and hpcpax's dedup kernel sums the duplicates.
A worker never holds the whole table, only the rows of its batch. The
module's ``weight`` is the original Parameter as a
:class:`~hpcpax.torch.table_weight.TableWeight`: no values, and a ``.grad``
that holds the workers' mean gradient when the script reads it (clipping).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .table_weight import TableWeight

__all__ = ["DistributedEmbedding", "DistributedEmbeddingBag"]


class _TableModule(torch.nn.Module):
    """What both modules share: the table's name, sizes and the runtime."""

    def __init__(self, original, table, runtime):
        super().__init__()
        self.table = table
        self.num_embeddings = original.num_embeddings
        self.embedding_dim = original.embedding_dim
        self.padding_idx = original.padding_idx
        self.max_norm = None
        self.scale_grad_by_freq = False
        self.sparse = True
        object.__setattr__(self, "_runtime", runtime)  # not a submodule
        # the original Parameter, values freed: .grad is the workers' mean gradient
        self.weight = TableWeight.adopt(original.weight, table, runtime)

    def _local(self, input, in_place=True):
        """``(rows leaf, local indices shaped like input, local padding index)``."""
        return self._runtime.lookup(self.table, input, self.padding_idx, in_place)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, table={self.table!r}, "
                f"method={self._runtime.method(self.table)!r}")

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # the whole table, gathered: collective over the workers (servers serve)
        destination[prefix + "weight"] = self._runtime.read_table(self.table)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "weight"
        if key not in state_dict:
            if strict:
                missing_keys.append(key)
            return
        value = state_dict[key]
        if tuple(value.shape) != (self.num_embeddings, self.embedding_dim):
            error_msgs.append(f"size mismatch for {key}: copying a param with shape "
                              f"{tuple(value.shape)}, the table is "
                              f"{(self.num_embeddings, self.embedding_dim)}")
            return
        # rows replaced on their holders: collective over the workers (servers join)
        self._runtime.set_table(self.table, value)


class DistributedEmbedding(_TableModule):
    """``nn.Embedding`` whose rows are pulled per batch; same forward result.

    Args:
        original: the ``nn.Embedding`` it replaces.
        table: the table's name (the module path).
        runtime: the :class:`~hpcpax.torch.runtime.Runtime` that pulls.

    ``forward`` is **collective** over the workers.
    """

    def forward(self, input):
        """Rows of ``input``'s ids, pulled for this batch (gradients pushed after backward)."""
        rows, local, padding = self._local(input)
        # sparse: the row gradient stays one row per occurrence; the push
        # sums duplicates with hpcpax's dedup kernel (2x faster than torch's
        # dense embedding backward)
        return F.embedding(local, rows, padding_idx=padding, sparse=True)


class DistributedEmbeddingBag(_TableModule):
    """``nn.EmbeddingBag`` whose rows are pulled per batch; same forward result.

    ``forward`` is **collective** over the workers.
    """

    def __init__(self, original, table, runtime):
        super().__init__(original, table, runtime)
        self.mode = original.mode
        self.include_last_offset = original.include_last_offset

    def forward(self, input, offsets=None, per_sample_weights=None):
        """``embedding_bag`` over the rows pulled for ``input``'s ids."""
        # torch has no sparse gradient for max bags: dense rows of the pulled ones
        sparse = self.mode != "max"
        rows, local, padding = self._local(input, in_place=sparse)
        return F.embedding_bag(local, rows, offsets, mode=self.mode,
                               per_sample_weights=per_sample_weights,
                               include_last_offset=self.include_last_offset,
                               padding_idx=padding, sparse=sparse)

    def extra_repr(self) -> str:
        """The module's repr arguments, with the bag mode."""
        return super().extra_repr() + f", mode={self.mode!r}"
