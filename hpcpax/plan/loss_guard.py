"""The loss guard of ``--consistency auto`` (pure): does a relaxed segment still train?

:func:`guard` compares a relaxed segment's loss with the segment before it
and with the trajectory the last BSP segment promised
(:func:`expected_fall`); :class:`~hpcpax.plan.adaptive.AutoPolicy` sends a
segment that diverges or stalls back to BSP.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["loss_figures", "expected_fall", "guard", "GUARD_RISE", "GUARD_RATE"]

GUARD_RISE = 0.02        # a relaxed segment's mean loss this much above the last: divergence
GUARD_RATE = 0.25        # ... or progress below this fraction of BSP's: a stall


def loss_figures(steps, losses) -> dict | None:
    """``{mean, slope (per step), noise (std error of the mean), mid (step), n}`` of a
    segment."""
    steps = np.asarray(steps, np.float64)
    losses = np.asarray(losses, np.float64)
    keep = np.isfinite(losses)
    steps, losses = steps[keep], losses[keep]
    if len(losses) == 0:
        return None
    mean, mid = float(losses.mean()), float(steps.mean())
    if len(losses) < 3:
        return {"mean": mean, "slope": 0.0, "noise": abs(mean), "mid": mid, "n": len(losses)}
    slope, intercept = np.polyfit(steps - mid, losses, 1)
    residual = losses - (intercept + slope * (steps - mid))
    noise = float(residual.std(ddof=2) / math.sqrt(len(losses)))
    return {"mean": mean, "slope": float(slope), "noise": noise, "mid": mid, "n": len(losses)}


def expected_fall(bsp, start, end) -> float:
    """The loss change (negative: a fall) BSP's trajectory promises from step ``start``
    to ``end``, from the BSP segment ``bsp`` (:func:`loss_figures`).

    SGD's excess loss falls roughly as ``1 / t`` (the convex rate), so its slope
    falls as ``1 / t^2``: ``bsp.slope x (bsp.mid + 1)^2 x (1 / (start + 1) - 1 /
    (end + 1))`` (steps counted from 0), and no more than the slope carried
    over ``bsp.n`` steps. A rate taken at a run's steep first steps and
    carried on unchanged promised 5-10 times the fall BSP itself achieved
    later (measured on ``benchmarks/stragglers.py``'s model), and sent
    relaxed segments that trained well back to BSP.
    """
    slope, at = bsp["slope"], bsp["mid"] + 1.0
    start, end = max(float(start), bsp["mid"]) + 1.0, max(float(end), bsp["mid"]) + 1.0
    flattening = slope * at * at * (1.0 / start - 1.0 / end)
    linear = slope * min(end - start, bsp.get("n", 1))
    return max(flattening, linear) if slope < 0 else min(flattening, linear)


def guard(bsp, previous, current) -> str | None:
    """Why a relaxed segment must go back to BSP (None: it may go on).

    Args:
        bsp: :func:`loss_figures` of the last BSP segment (its slope is the
            reference rate).
        previous: those of the segment before ``current`` (any mode).
        current: those of the relaxed segment.

    The rule: with ``noise`` the combined standard error of the two means,
    the loss *diverges* when ``current.mean > previous.mean + max(GUARD_RISE x
    previous.mean, 3 x noise)``; it *stalls* when BSP's trajectory promised a
    measurable fall between the two segments (``expected =``
    :func:`expected_fall` ``(bsp, previous.mid, current.mid) < -3 x noise``:
    BSP's rate, flattening as ``1 / t^2``) and the fall achieved is below
    ``GUARD_RATE x |expected| - 2 x noise``.
    """
    if not (bsp and previous and current):
        return None
    noise = math.hypot(previous["noise"], current["noise"])
    rise = current["mean"] - previous["mean"]
    if rise > max(GUARD_RISE * abs(previous["mean"]), 3 * noise):
        return (f"loss diverges: {previous['mean']:.4f} -> {current['mean']:.4f} "
                f"(+{100 * rise / abs(previous['mean']):.1f} %)")
    expected = expected_fall(bsp, previous["mid"], current["mid"])
    if expected < -3 * noise and -rise < GUARD_RATE * -expected - 2 * noise:
        return (f"loss stalls: fell {-rise:.4f} where BSP's trajectory (rate "
                f"{bsp['slope']:.2e}/step at step {bsp['mid']:.0f}) gives {-expected:.4f}")
    return None
