"""Sparsity statistics of a sparse variable, measured over trial steps.

:class:`SparsityStats` accumulates, per step, the fraction of rows each
worker touches (``alpha``), the fraction the union of a node's workers
touches (``alpha_node``) and how often a touched row repeats
(``duplicate_ratio`` = occurrences / unique rows). The trainer gathers the
ids and feeds them; this module is plain NumPy and not collective.

Also here: the expected number of distinct rows in ``k`` independent draws
from a distribution (``sum_r 1 - (1 - p_r) ** k``), used to derive ``alpha``
for models described by a token distribution (the simulator presets).
"""

from __future__ import annotations

import numpy as np

__all__ = [
    "SparsityStats",
    "zipf_probabilities",
    "log_uniform_probabilities",
    "expected_unique",
    "draws_for_unique",
    "expected_touched_fraction",
]


def _host(ids) -> np.ndarray:
    if hasattr(ids, "get") and not isinstance(ids, np.ndarray):
        ids = ids.get()  # CuPy array: copy to the host
    return np.asarray(ids).ravel()


class SparsityStats:
    """Running means of per-step sparsity of one sparse variable.

    Args:
        workers_per_node: when :meth:`update` gets a list of every worker's
            ids, consecutive groups of this many form a node; ``None`` means
            the list is one node.
    """

    def __init__(self, workers_per_node: int | None = None):
        if workers_per_node is not None and int(workers_per_node) < 1:
            raise ValueError(f"workers_per_node must be >= 1, not {workers_per_node}")
        self.workers_per_node = None if workers_per_node is None else int(workers_per_node)
        self.rows = None
        self.steps = 0
        self._alpha_sum = 0.0
        self._alpha_node_sum = 0.0
        self._duplicate_sum = 0.0
        self._alpha_max = 0.0

    def update(self, ids, rows: int) -> None:
        """Add one step.

        Args:
            ids: either a **list** of id arrays, one per worker (grouped
                into nodes by ``workers_per_node``), or a **tuple**
                ``(local_ids, node_union_ids)`` seen from one worker, or a
                single array (one worker alone on its node).
            rows: rows of the variable.
        """
        rows = int(rows)
        if rows < 1:
            raise ValueError(f"rows must be >= 1, not {rows}")
        if self.rows is not None and rows != self.rows:
            raise ValueError(f"rows must stay {self.rows}, not {rows}")
        self.rows = rows
        if isinstance(ids, tuple):
            if len(ids) != 2:
                raise ValueError(f"a tuple of ids must be (local_ids, node_union_ids), not {len(ids)} arrays")
            local, union = _host(ids[0]), _host(ids[1])
            workers = [local]
            node_unique = [np.unique(union).size]
        else:
            workers = [_host(w) for w in ids] if isinstance(ids, list) else [_host(ids)]
            if not workers:
                raise ValueError("ids must hold at least one worker's ids")
            group = self.workers_per_node or len(workers)
            if len(workers) % group:
                raise ValueError(f"{len(workers)} workers do not split into nodes of {group}")
            node_unique = [np.unique(np.concatenate(workers[i:i + group])).size
                           for i in range(0, len(workers), group)]
        unique = np.array([np.unique(w).size for w in workers], dtype=np.float64)
        occurrences = np.array([w.size for w in workers], dtype=np.float64)
        alpha = float(unique.mean()) / rows
        self._alpha_sum += alpha
        self._alpha_max = max(self._alpha_max, float(unique.max()) / rows)
        self._alpha_node_sum += float(np.mean(node_unique)) / rows
        self._duplicate_sum += float(occurrences.sum() / unique.sum()) if unique.sum() else 1.0
        self.steps += 1

    def _mean(self, total):
        return total / self.steps if self.steps else None

    @property
    def alpha(self) -> float | None:
        """Mean fraction of rows a worker touched per step, or None before any step."""
        return self._mean(self._alpha_sum)

    @property
    def alpha_node(self) -> float | None:
        """Mean fraction of rows a node touched per step, or None."""
        return self._mean(self._alpha_node_sum)

    @property
    def duplicate_ratio(self) -> float | None:
        """Mean ids per distinct id in a worker's step, or None."""
        return self._mean(self._duplicate_sum)

    def to_dict(self) -> dict:
        """Means over the steps seen (``None`` before the first step)."""
        return {
            "steps": self.steps,
            "rows": self.rows,
            "alpha": self.alpha,
            "alpha_max": self._alpha_max if self.steps else None,
            "alpha_node": self.alpha_node,
            "duplicate_ratio": self.duplicate_ratio,
        }


def zipf_probabilities(rows: int, exponent: float = 1.0) -> np.ndarray:
    """``p_r`` proportional to ``1 / (r + 1) ** exponent`` for ``r < rows``."""
    ranks = np.arange(1, int(rows) + 1, dtype=np.float64)
    weights = ranks ** -float(exponent)
    return weights / weights.sum()


def log_uniform_probabilities(rows: int) -> np.ndarray:
    """TensorFlow's log-uniform candidate sampler: ``log((r+2)/(r+1)) / log(rows+1)``."""
    r = np.arange(int(rows), dtype=np.float64)
    return np.log1p(1.0 / (r + 1.0)) / np.log(rows + 1.0)


def expected_unique(probabilities: np.ndarray, draws: float) -> float:
    """Expected distinct rows in ``draws`` independent draws: ``sum 1 - (1-p)^draws``."""
    p = np.asarray(probabilities, dtype=np.float64)
    return float(-np.expm1(draws * np.log1p(-np.minimum(p, 1.0 - 1e-16))).sum())


def draws_for_unique(probabilities: np.ndarray, unique: float) -> float:
    """Draws needed so that :func:`expected_unique` equals ``unique`` (bisection).

    Models sampling *without* replacement (``unique=True`` in TensorFlow's
    samplers) as drawing with replacement until that many are distinct.
    """
    p = np.asarray(probabilities, dtype=np.float64)
    if not 0 <= unique < np.count_nonzero(p):
        raise ValueError(f"unique must be in [0, {np.count_nonzero(p)}), not {unique}")
    log_miss = np.log1p(-np.minimum(p, 1.0 - 1e-16))

    def distinct(draws):
        return float(-np.expm1(draws * log_miss).sum())

    low, high = 0.0, max(1.0, float(unique))
    while distinct(high) < unique:
        high *= 2.0
    while high - low > 1e-6 * high:
        mid = 0.5 * (low + high)
        if distinct(mid) < unique:
            low = mid
        else:
            high = mid
    return 0.5 * (low + high)


def expected_touched_fraction(terms, workers: int = 1) -> float:
    """Expected fraction of rows touched when ``workers`` each make every draw in ``terms``.

    Args:
        terms: ``[(probabilities, draws), ...]``; all arrays over the same rows.
        workers: independent workers whose touched rows are united.

    Returns:
        ``mean_r 1 - prod_terms (1 - p_r) ** (draws * workers)``.
    """
    log_miss = None
    for probabilities, draws in terms:
        p = np.asarray(probabilities, dtype=np.float64)
        term = float(draws) * int(workers) * np.log1p(-np.minimum(p, 1.0 - 1e-16))
        log_miss = term if log_miss is None else log_miss + term
    if log_miss is None:
        return 0.0
    return float(-np.expm1(log_miss).mean())
