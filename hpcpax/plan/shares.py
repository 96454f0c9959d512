"""Balanced BSP: per-worker shares of the global batch from measured speeds (pure, no MPI).

Under BSP every step waits for the slowest worker. When one worker is
persistently slower (a throttled GPU, a busy host), giving each worker a
share of the global batch proportional to its measured speed makes them
finish together. The global batch and the gradient (a mean over its
samples) stay exactly BSP's: only which worker computes which samples
changes (:meth:`hpcpax.data.reading.ShardedReader.batch_range`).

Speeds are measured as *seconds per sample* of a worker's own work (data
and compute: the parts of a step that grow with its share), so they do
not depend on the shares in force. The shares are a deterministic
function of those measurements (:func:`balanced_shares`, ties to the
lower worker index): every rank given the same numbers computes the same
shares.
"""

from __future__ import annotations

import math

import numpy as np

from ..errors import ConfigError
from ..options import counted

__all__ = ["even_shares", "balanced_shares", "fit_work", "share_ranges", "step_work",
           "parse_shares", "relative_gain", "trusted", "MIN_SHARE_FRACTION", "FIT_MIN_POINTS",
           "FIT_MIN_SPREAD", "FIT_MAX_FIXED", "SHARE_TRUST"]

#: No worker gets less than this fraction of an even share (a worker measured
#: very slow once still contributes, and keeps being measured).
MIN_SHARE_FRACTION = 0.1
#: :func:`fit_work` fits a line only to this many evaluations or more ...
FIT_MIN_POINTS = 3
#: ... whose shares spread by this fraction of their mean or more ...
FIT_MIN_SPREAD = 0.2
#: ... and keeps it only when its fixed part is at most this fraction of the mean work
#: (a worker whose work hardly shrinks with its share gains nothing from balancing, and
#: such a line is far more often another worker's contention than a real fixed cost).
FIT_MAX_FIXED = 0.8
#: A correction of shares already uneven moves no share by more than this fraction of
#: it (:func:`trusted`): one noisy evaluation cannot halve a worker's share.
SHARE_TRUST = 0.25


def even_shares(global_batch, workers) -> list:
    """Shares as even as possible (the first ``G % n`` workers get one more)."""
    base, extra = divmod(int(global_batch), int(workers))
    return [base + (1 if w < extra else 0) for w in range(int(workers))]


def balanced_shares(seconds_per_sample, global_batch, minimum=None, fixed=None) -> list:
    """Integer shares summing to ``global_batch`` that make the workers finish together.

    Args:
        seconds_per_sample: each worker's measured work seconds per sample
            (positive numbers; a worker with no valid measurement counts as
            the median of the others).
        global_batch: the samples of one step.
        minimum: the smallest share (default ``MIN_SHARE_FRACTION`` of an
            even share, at least 1).
        fixed: each worker's seconds per step that do not grow with its
            share (default none: work proportional to the share).

    Returns:
        list of ints, one per worker: the real shares that equalize
        ``fixed_w + share_w x seconds_per_sample_w`` (proportional to speed
        without ``fixed``), floored and raised to ``minimum``, then adjusted
        one sample at a time until they sum to ``G``: a missing sample goes
        to the worker that would finish it soonest, a surplus one leaves the
        worker finishing last among those above ``minimum``; ties go to the
        lower worker index, so the result is a deterministic function of
        the arguments.

    Raises:
        ValueError: no worker, or fewer samples than workers.
    """
    times = np.asarray(seconds_per_sample, dtype=np.float64)
    workers = len(times)
    if workers == 0:
        raise ValueError("seconds_per_sample must hold one value per worker, not none")
    global_batch = int(global_batch)
    if global_batch < workers:
        raise ValueError(f"global_batch must be >= the {workers} workers, not {global_batch}")
    valid = np.isfinite(times) & (times > 0)
    if not valid.any():
        return even_shares(global_batch, workers)
    times = np.where(valid, times, np.median(times[valid]))
    base = np.zeros(workers) if fixed is None else np.asarray(fixed, dtype=np.float64)
    base = np.where(np.isfinite(base) & (base > 0), base, 0.0)
    if minimum is None:
        minimum = max(1, int(MIN_SHARE_FRACTION * global_batch / workers))
    minimum = max(1, min(int(minimum), global_batch // workers))
    # equal finish time T: fixed_w + s_w t_w = T with sum(s_w) = G
    finish = (global_batch + (base / times).sum()) / (1.0 / times).sum()
    ideal = np.maximum(0.0, (finish - base) / times)
    shares = [max(minimum, int(x)) for x in np.floor(ideal)]
    times, base = [float(t) for t in times], [float(b) for b in base]
    while sum(shares) < global_batch:
        w = min(range(workers), key=lambda i: (base[i] + (shares[i] + 1) * times[i], i))
        shares[w] += 1
    while sum(shares) > global_batch:
        w = max((i for i in range(workers) if shares[i] > minimum),
                key=lambda i: (base[i] + shares[i] * times[i], -i))
        shares[w] -= 1
    return shares


def fit_work(shares, seconds) -> tuple:
    """``(fixed, per_sample)`` of one worker from its work ``seconds`` at ``shares``
    (one entry per evaluation, oldest first; the last one's share is the share in force).

    A least-squares line ``seconds = fixed + per_sample x share`` only where
    the evaluations determine it: at least ``FIT_MIN_POINTS`` of them, shares
    spread by at least ``FIT_MIN_SPREAD`` of their mean, and a fixed part of
    at most ``FIT_MAX_FIXED`` of the mean work (``fixed`` clamped to ``[0,
    min(seconds)]``, ``per_sample`` then refitted through the clamped
    intercept). Otherwise ``(0, median seconds per sample of the
    evaluations at the share in force)``: a line through two noisy points,
    or through shares that differ little, extrapolates wildly (measured on
    an oversubscribed node, where a worker's speed also moves with the
    others' shares: such a line gave a worker with 0.1 ms per sample 0.9 us
    per sample and a 0.2 s fixed part, and balancing then handed it 1.4x
    its share). Pure.
    """
    s = np.asarray(shares, dtype=np.float64)
    w = np.asarray(seconds, dtype=np.float64)
    if len(s) == 0:
        return 0.0, float("nan")
    latest = s == s[-1]
    proportional = (0.0, float(np.median(w[latest] / max(float(s[-1]), 1.0))))
    if len(s) < FIT_MIN_POINTS or (s.max() - s.min()) < FIT_MIN_SPREAD * s.mean():
        return proportional
    slope = float(((s - s.mean()) * (w - w.mean())).sum() / ((s - s.mean()) ** 2).sum())
    fixed = float(w.mean() - slope * s.mean())
    fixed = min(max(fixed, 0.0), float(w.min()))
    per_sample = float(((w - fixed) * s).sum() / (s * s).sum())
    if not per_sample > 0 or fixed > FIT_MAX_FIXED * float(w.mean()):
        return proportional
    return fixed, per_sample


def share_ranges(shares) -> list:
    """``[(start, stop)]`` of each worker's samples in the global batch."""
    bounds = np.concatenate([[0], np.cumsum(np.asarray(shares, np.int64))])
    return [(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]


def step_work(shares, seconds_per_sample, fixed=None) -> float:
    """The predicted work time of a BSP step: the slowest worker's
    ``fixed + share x seconds per sample``."""
    base = fixed if fixed is not None else [0.0] * len(shares)
    return float(max(b + s * t for s, t, b in zip(shares, seconds_per_sample, base)))


def parse_shares(spec, global_batch, workers) -> list | None:
    """``"4,4,2"`` (or a list) -> shares, checked against the batch and workers.

    Raises:
        ConfigError: not ``workers`` positive ints summing to ``global_batch``.
    """
    if spec is None or spec == "":
        return None
    if isinstance(spec, str):
        try:
            values = [int(p) for p in spec.replace(" ", "").split(",") if p]
        except ValueError:
            raise ConfigError(f"batch_shares must be comma-separated ints, not {spec!r}") from None
    else:
        values = [int(v) for v in spec]
    if len(values) != workers or any(v < 1 for v in values) or sum(values) != global_batch:
        raise ConfigError(f"batch_shares must be one positive int per worker "
                          f"({counted(workers, 'worker')} here) summing to the global "
                          f"batch {global_batch}, not {spec!r} ({len(values)} values summing "
                          f"to {sum(values)})")
    return values


def relative_gain(current, proposed, seconds_per_sample, fixed=None) -> float:
    """Fraction of the step's work time ``proposed`` shares save over ``current``."""
    now = step_work(current, seconds_per_sample, fixed)
    if not math.isfinite(now) or now <= 0:
        return 0.0
    return 1.0 - step_work(proposed, seconds_per_sample, fixed) / now


def trusted(current, proposed, trust) -> list:
    """``proposed`` shares, the move from ``current`` scaled down (the same fraction for
    every worker) so that no share changes by more than ``trust`` x its current value;
    integer shares with ``proposed``'s sum (floored, the samples left over going to the
    largest remainders, ties to the lower worker)."""
    scale = min([1.0] + [trust * c / abs(p - c) for c, p in zip(current, proposed) if p != c])
    target = [c + scale * (p - c) for c, p in zip(current, proposed)]
    shares = [int(math.floor(t)) for t in target]
    order = sorted(range(len(target)), key=lambda w: (shares[w] - target[w], w))
    for w in order[:sum(proposed) - sum(shares)]:
        shares[w] += 1
    return shares
