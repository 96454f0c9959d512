"""Evaluation of a training run: metrics over fixed global batches.

Every worker evaluates its shard of ``eval_batches`` fixed global batches
with the current parameters; one ``Allreduce`` combines the shards.
"""

from __future__ import annotations

import numpy as np

__all__ = ["EVAL_POSITION", "evaluate"]

#: Evaluation reads fixed global batches from this position on (no held-out split).
EVAL_POSITION = 1_000_003


def evaluate(model, dense, sync, batch, workers, eval_batches) -> dict:
    """Mean eval metrics over ``eval_batches`` global batches; **collective** (workers).

    Args:
        model: the model (its ``sparse_ids`` and ``evaluate``).
        dense: the dense parameters.
        sync: the :class:`~hpcpax.sync.sparse_set.SparseSync` (rows are pulled
            through it, so servers take part).
        batch: ``batch(position)``: this worker's shard of a global batch.
        workers: the workers' communicator.
        eval_batches: how many global batches.
    """
    from mpi4py import MPI

    totals, weight = {}, 0.0
    for k in range(eval_batches):
        position = EVAL_POSITION + k
        shard = batch(position)
        ids = model.sparse_ids(shard, position, full=True)
        rows = sync.pull(ids)
        result = model.evaluate(dense, rows, shard, position, full=True)
        local_batch = len(next(iter(shard.values())))
        for key, value in result.items():
            totals[key] = totals.get(key, 0.0) + value * local_batch
        weight += local_batch
    keys = sorted(totals)
    vector = np.array([totals[k] for k in keys] + [weight], np.float64)
    workers.Allreduce(MPI.IN_PLACE, vector, op=MPI.SUM)
    return {k: float(vector[i] / vector[-1]) for i, k in enumerate(keys)}
