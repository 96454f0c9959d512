"""Parallax's partition search: sample a few partition counts, fit, take the minimum.

The step time as a function of the number of partitions ``P`` is modelled as

    t(P) = b / P + a (P - 1) + c

``b / P``: work split across partitions (gathers, updates, per-partition
messages that shrink); ``a (P - 1)``: the fixed cost every extra partition
adds (one more message, one more op); ``c``: everything else. The fit is a
linear least-squares problem in ``(a, b, c)``, exact on exact data.

The search (Parallax, section 5): start at ``P0``, double while the
measured time improves; if the very first doubling did not improve, halve
from ``P0`` instead while it improves. Fit the curve on every sample and
take its integer minimum inside the sampled range.

Policy for the answer: if that fitted minimum was itself measured, it is
compared by its measurement; otherwise by its prediction. The chosen count
is whichever is lower of the fitted minimum and the best measured count
(``confirm=True`` spends one more ``measure`` call so that both sides are
measurements). With fewer than three distinct samples no fit is made and
the best measured count wins.

``measure(P)`` is the caller's: the trainer repartitions live and times a
few steps with warm-up excluded. Nothing here is collective, but ``measure``
usually is, so every rank must run the same search with the same timings
(have rank 0 time and broadcast the result).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

__all__ = ["fit_cost_curve", "cost_curve", "search_partitions", "SearchResult"]


def cost_curve(ns, a: float, b: float, c: float):
    """``b / n + a (n - 1) + c`` evaluated at ``ns`` (scalar or array)."""
    ns = np.asarray(ns, dtype=np.float64)
    return b / ns + a * (ns - 1.0) + c


def fit_cost_curve(ns, times) -> tuple:
    """Least-squares ``(a, b, c)`` of ``t(n) = b/n + a(n-1) + c``.

    Args:
        ns: partition counts (>= 1), at least three distinct values.
        times: measured seconds, one per count.

    Raises:
        ValueError: lengths differ, a count is < 1, or fewer than three
            distinct counts are given (the fit would be underdetermined).
    """
    ns = np.asarray(ns, dtype=np.float64).ravel()
    times = np.asarray(times, dtype=np.float64).ravel()
    if ns.shape != times.shape:
        raise ValueError(f"ns and times must have the same length, not {ns.size} and {times.size}")
    if ns.size and ns.min() < 1:
        raise ValueError(f"ns must be >= 1, not {ns.min()}")
    if np.unique(ns).size < 3:
        raise ValueError(f"fit needs at least 3 distinct partition counts, not {np.unique(ns).size}")
    design = np.stack([ns - 1.0, 1.0 / ns, np.ones_like(ns)], axis=1)
    (a, b, c), *_ = np.linalg.lstsq(design, times, rcond=None)
    return float(a), float(b), float(c)


@dataclass
class SearchResult:
    """What the partition search found.

    Attributes:
        chosen: the partition count to use.
        samples: ``{P: measured seconds}`` in the order measured.
        fit: ``(a, b, c)`` of the fitted curve, or ``None`` without a fit.
        search_seconds: wall time the search took (mostly ``measure``).
        fitted_minimum: integer minimum of the fitted curve in the sampled
            range, or ``None``.
        predicted_s: the fitted curve at ``chosen`` (or its measurement when
            no fit), for the plan's record.
    """

    chosen: int
    samples: dict = field(default_factory=dict)
    fit: tuple | None = None
    search_seconds: float = 0.0
    fitted_minimum: int | None = None
    predicted_s: float | None = None

    def to_dict(self) -> dict:
        """JSON-native form (samples as ``[[P, seconds], ...]`` since JSON keys are strings)."""
        return {
            "chosen": int(self.chosen),
            "samples": [[int(p), float(t)] for p, t in self.samples.items()],
            "fit": None if self.fit is None else [float(x) for x in self.fit],
            "search_seconds": float(self.search_seconds),
            "fitted_minimum": None if self.fitted_minimum is None else int(self.fitted_minimum),
            "predicted_s": None if self.predicted_s is None else float(self.predicted_s),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "SearchResult":
        """A result from its ``to_dict`` dict."""
        return cls(
            chosen=int(data["chosen"]),
            samples={int(p): float(t) for p, t in data.get("samples", [])},
            fit=None if data.get("fit") is None else tuple(float(x) for x in data["fit"]),
            search_seconds=float(data.get("search_seconds", 0.0)),
            fitted_minimum=data.get("fitted_minimum"),
            predicted_s=data.get("predicted_s"),
        )


def _check_count(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return int(value)


def search_partitions(measure: Callable[[int], float], p0: int, p_max: int, *, p_min: int = 1,
                      max_measurements: int = 16, confirm: bool = False) -> SearchResult:
    """Parallax's search for the partition count of a ``ps`` variable.

    Args:
        measure: ``measure(P) -> seconds per step`` with ``P`` partitions.
        p0: start point, normally ``max(p_min, number of server ranks)``;
            clamped into ``[p_min, p_max]``.
        p_max: largest count to try (for example the variable's rows).
        p_min: smallest count to try.
        max_measurements: hard cap on ``measure`` calls (>= 1).
        confirm: measure the fitted minimum too when it was not sampled.

    Returns:
        :class:`SearchResult`. ``measure`` is called at most
        ``max_measurements`` times and never twice for one count.
    """
    p_min = _check_count("p_min", p_min, 1)
    p_max = _check_count("p_max", p_max, p_min)
    p0 = min(max(_check_count("p0", p0, 1), p_min), p_max)
    max_measurements = _check_count("max_measurements", max_measurements, 1)
    started = time.perf_counter()
    samples: dict = {}

    def sample(p):
        if p not in samples:
            if len(samples) >= max_measurements:
                return None
            seconds = float(measure(int(p)))
            if not np.isfinite(seconds) or seconds < 0:
                raise ValueError(f"measure({p}) must return finite seconds >= 0, not {seconds}")
            samples[p] = seconds
        return samples[p]

    start_time = sample(p0)
    best, p = start_time, p0
    doubled_ok = False
    while p * 2 <= p_max:
        t = sample(p * 2)
        if t is None or t >= best:
            break
        doubled_ok = True
        best, p = t, p * 2
    if not doubled_ok:
        best, p = start_time, p0
        while p // 2 >= p_min:
            t = sample(p // 2)
            if t is None or t >= best:
                break
            best, p = t, p // 2

    best_measured = min(samples, key=lambda q: (samples[q], q))
    result = SearchResult(chosen=best_measured, samples=dict(samples),
                          predicted_s=samples[best_measured])
    if len(samples) >= 3:
        ns = np.fromiter(samples.keys(), dtype=np.float64)
        fit = fit_cost_curve(ns, list(samples.values()))
        candidates = np.arange(int(ns.min()), int(ns.max()) + 1)
        curve = cost_curve(candidates, *fit)
        fitted = int(candidates[int(np.argmin(curve))])
        result.fit, result.fitted_minimum = fit, fitted
        if confirm:
            sample(fitted)
        fitted_value = samples.get(fitted, float(cost_curve(fitted, *fit)))
        if fitted_value < samples[best_measured]:
            result.chosen, result.predicted_s = fitted, fitted_value
        result.samples = dict(samples)
    result.search_seconds = time.perf_counter() - started
    return result
