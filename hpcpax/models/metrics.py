"""Evaluation metrics computed on the host in NumPy."""

from __future__ import annotations

import numpy as np

from ..backend import to_host

__all__ = ["roc_auc", "perplexity"]


def perplexity(mean_loss: float) -> float:
    """``exp(mean loss)``: the perplexity of a set whose mean cross entropy is
    ``mean_loss`` (nats). Capped at ``exp(700)`` instead of overflowing.

    Take the mean over the whole set first: a mean of per-part perplexities
    is larger (Jensen) and changes with how the set was split.
    """
    return float(np.exp(min(float(mean_loss), 700.0)))


def roc_auc(labels, scores) -> float:
    """Area under the ROC curve by ranks (Mann-Whitney U), ties counted as half.

    Args:
        labels: ``[n]`` in {0, 1}; NumPy or CuPy (copied to the host).
        scores: ``[n]`` any monotone score (logits or probabilities).

    Returns:
        AUC as a Python float, or NaN when only one class is present.
    """
    labels = to_host(labels).reshape(-1) > 0.5
    scores = to_host(scores).reshape(-1).astype(np.float64)
    if labels.shape != scores.shape:
        raise ValueError(f"labels and scores must have one shape, not {labels.shape} and {scores.shape}")
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    _, inverse, counts = np.unique(scores[order], return_inverse=True, return_counts=True)
    last = np.cumsum(counts)
    # Tied scores share the mean of the 1-based ranks they span.
    mean_rank = last - (counts - 1) / 2.0
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = mean_rank[inverse]
    rank_sum = ranks[labels].sum()
    return float((rank_sum - positives * (positives + 1) / 2.0) / (positives * negatives))
