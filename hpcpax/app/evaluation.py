"""Evaluation whose metrics do not depend on the number of workers.

Each worker evaluates its shard of a fixed list of global batches (the
:class:`EvalSet`). Metrics are then computed from the *whole* set, never
averaged over shards: the per-example losses and (for rank metrics such as
AUC) the scores and labels of every worker are gathered to the first
worker, which sums the losses exactly (``math.fsum``), takes
``perplexity = exp(mean loss)`` and the AUC of all scores, and broadcasts
the result. The same parameters give the same numbers (to the rounding of
the per-example forward pass) on 1, 2 or 100 workers, in any layout.

The eval set is, by preference, held out (``--eval-data FILE`` or
``--eval-fraction F``: a tail of the data file never trained on) and read
in a fixed shuffled order from position 0, so a short evaluation is a
random sample of it. Without one, evaluation reads fixed global batches of
the training data far from the start (``EVAL_POSITION``), as before.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["EVAL_POSITION", "EvalSet", "evaluate"]

#: Without a held-out set, evaluation reads training batches from this position on.
EVAL_POSITION = 1_000_003


@dataclass
class EvalSet:
    """The global batches an evaluation reads: ``reader.batch(first_position + k, ...)``
    for ``k < batches``.

    Attributes:
        reader: a data reader (see :func:`hpcpax.data.open_dataset`).
        first_position: the global batch position of the first batch.
        batches: how many global batches.
        held_out: True when training never reads these samples.
    """

    reader: object
    first_position: int
    batches: int
    held_out: bool

    def describe(self, global_batch: int) -> str:
        """E.g. ``"4096 held-out samples of corpus.h5 (tokens 900:1000)"``."""
        kind = "held-out" if self.held_out else "training"
        return f"{self.batches * global_batch} {kind} samples of {self.reader.name}"


def _to_device(batch, device):
    if device is not None and device.kind == "gpu":
        return {key: device.xp.asarray(value) for key, value in batch.items()}
    return batch


def evaluate(model, dense, pull, eval_set, topology, config, *, device=None, step=None,
             log=None) -> dict:
    """Metrics of ``model`` with parameters ``dense`` (and the sparse rows ``pull``
    returns) on ``eval_set``. **Collective** over ``topology.workers`` (and the
    parameter servers, through ``pull``).

    Args:
        model: a :class:`hpcpax.models.Model`.
        dense: the dense parameters, on the worker's device.
        pull: ``pull({table: ids}) -> {table: (unique ids, rows)}``, collective
            over the workers (the trainer's pull of every sparse variable).
        eval_set: the :class:`EvalSet`.
        topology: anything with ``workers`` (communicator), ``worker_index``
            and ``num_workers``.
        config: the run config (``global_batch`` is read).
        device: the worker's :class:`hpcpax.backend.Device`; batches go to a GPU.
        step: the training step, for the log line.
        log: optional ``log(text)`` for one line on the first worker.

    Returns:
        On every worker the same dict: the model's metrics (``loss`` and
        ``perplexity`` for lm, ``loss`` and ``auc`` for ctr) and ``samples``.
    """
    from ..errors import ConfigError

    global_batch = config["global_batch"]
    if eval_set.batches < 1:
        raise ConfigError(f"the evaluation set {eval_set.reader.name} holds "
                          f"{eval_set.reader.num_samples} samples, fewer than one global "
                          f"batch of {global_batch}")
    losses, scores, labels = [], [], []
    for k in range(eval_set.batches):
        position = eval_set.first_position + k
        batch = eval_set.reader.batch(position, global_batch, topology.worker_index,
                                      topology.num_workers)
        batch = _to_device(batch, device)
        rows = pull(model.sparse_ids(batch, position, full=True))
        out = model.eval_outputs(dense, rows, batch, position, full=True)
        losses.append(out.losses)
        if out.scores is not None:
            scores.append(out.scores)
            labels.append(out.labels)
    local = (np.concatenate(losses), np.concatenate(scores) if scores else None,
             np.concatenate(labels) if labels else None)
    workers = topology.workers
    parts = workers.gather(local, root=0)
    metrics = None
    if workers.Get_rank() == 0:
        all_losses = np.concatenate([part[0] for part in parts])
        all_scores = all_labels = None
        if parts[0][1] is not None:
            all_scores = np.concatenate([part[1] for part in parts])
            all_labels = np.concatenate([part[2] for part in parts])
        # fsum: the exactly rounded sum, whatever order the workers' parts come in
        metrics = model.eval_metrics(math.fsum(all_losses.tolist()), len(all_losses),
                                     all_scores, all_labels)
        metrics["samples"] = int(len(all_losses))
    metrics = workers.bcast(metrics, root=0)
    if log is not None:
        shown = ", ".join(f"{k}={v:.4f}" for k, v in metrics.items() if k != "samples")
        log(f"eval after step {step} on {eval_set.describe(global_batch)}: {shown}")
    return metrics
