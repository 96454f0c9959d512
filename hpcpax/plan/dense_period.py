"""How often dense replicas are refreshed under a relaxed model: ``k`` set on the fly (pure).

Under a relaxed model (``ssp``, ``asp``, ``psp``) the dense variables are
server tables (:mod:`hpcpax.sync.relaxed`): every step each worker pushes its
dense gradient, and refreshes its replica from the server's table, which
holds every worker's updates (the average). With a period ``k`` the replica
is refreshed every ``k`` steps only; in between the worker applies its own
gradients to its replica with a local copy of the dense optimizer. That
saves the dense pull (the largest message of a step) ``k - 1`` times in
``k`` and lets a worker run on its own replica, at the price of the
replicas drifting apart.

:class:`DensePeriod` chooses ``k`` from two measurements:

- the *divergence* at each refresh: ``|w_local - w_server| / |w_server|``,
  the relative norm of the difference between this replica (after its
  local steps) and the server's average it is about to take;
- the *cost* of a refresh: the pull seconds of a refreshing step minus
  those of a step that does not refresh (moving averages), against the
  step's seconds.

Rules, applied after each refresh, first match wins:

1. divergence above ``threshold`` -> ``k = 1`` (replicas drift too far);
2. divergence above ``threshold / 2`` -> ``k`` halved;
3. divergence below ``threshold / 4`` (doubling ``k`` roughly doubles it,
   so it stays below ``threshold / 2``), ``k < k_max``, and a refresh costs
   at least ``min_cost`` of a step (or its cost is not known yet: at
   ``k = 1`` every step refreshes) -> ``k`` doubled;
4. a refresh costs less than ``min_cost / 2`` of a step and ``k > 1`` ->
   ``k`` halved (no reason to drift for nothing);
5. else ``k`` stays.

Every change is returned with the measurements that caused it.

The controller is pure and tested (``tests/plan/test_dense_period.py``);
:class:`~hpcpax.app.relaxed_run.RelaxedSteps` drives it
(``--dense-period``) and :class:`~hpcpax.sync.relaxed.RelaxedSync` does
the refreshes, the local updates and the divergence measurement.
"""

from __future__ import annotations

import math

from ..errors import ConfigError
from ..input_checks import check_int, shown

__all__ = ["DensePeriod", "parse_dense_period", "DEFAULT_K_MAX", "DEFAULT_THRESHOLD",
           "DEFAULT_MIN_COST"]

DEFAULT_K_MAX = 8
#: Largest refresh period K or KMAX (steps; clocks stay int64).
MAX_PERIOD = (1 << 31) - 1
#: Relative divergence above which replicas are refreshed every step.
DEFAULT_THRESHOLD = 0.05
#: Fraction of a step a refresh must cost before ``k`` rises.
DEFAULT_MIN_COST = 0.02
_SMOOTHING = 0.3  # weight of a new sample in the moving averages


def parse_dense_period(spec) -> tuple:
    """``"1"``, ``"4"``, ``"auto"``, ``"auto:16"`` -> ``(k, adaptive, k_max)``.

    Raises:
        ConfigError: anything else.
    """
    text = str(spec).strip().lower()
    head, _, tail = text.partition(":")
    try:
        if head == "auto":
            k_max = check_int(tail, "KMAX", 1, MAX_PERIOD) if tail else DEFAULT_K_MAX
            return 1, True, k_max
        k = check_int(text, "K", 1, MAX_PERIOD)
        return k, False, k
    except ConfigError:
        raise ConfigError(f"dense_period must be K (an int in [1, {MAX_PERIOD}]), auto or "
                          f"auto:KMAX, not {shown(spec)}") from None


def _ema(old, new):
    return new if old is None else (1.0 - _SMOOTHING) * old + _SMOOTHING * new


class DensePeriod:
    """The refresh period ``k`` of one group's dense replicas.

    Args:
        k: the starting period.
        adaptive: change ``k`` by the rules above (False: ``k`` fixed).
        k_max: the largest period.
        threshold: the divergence above which ``k`` drops to 1.
        min_cost: fraction of a step a refresh must cost for ``k`` to rise.

    Local and pure: feed it measurements, it returns decisions.
    """

    def __init__(self, k=1, adaptive=False, k_max=DEFAULT_K_MAX, threshold=DEFAULT_THRESHOLD,
                 min_cost=DEFAULT_MIN_COST):
        if not 1 <= int(k) <= int(k_max):
            raise ConfigError(f"dense period k must be in [1, {k_max}], not {k}")
        if not threshold > 0:
            raise ConfigError(f"divergence threshold must be > 0, not {threshold}")
        self.k, self.adaptive, self.k_max = int(k), bool(adaptive), int(k_max)
        self.threshold, self.min_cost = float(threshold), float(min_cost)
        self.pull_refresh = self.pull_plain = self.step_seconds = None
        self.last_refresh = None  # the step of the last refresh
        self.last_divergence = None
        #: Every change: ``{step, k_from, k_to, divergence, refresh_cost_s, step_s, reason}``.
        self.history = []

    # ------------------------------------------------------------- schedule
    def due(self, step) -> bool:
        """Whether ``step`` refreshes the replica (``k`` steps after the last refresh)."""
        return self.last_refresh is None or step - self.last_refresh >= self.k

    @property
    def refresh_cost(self) -> float | None:
        """Seconds a refresh adds to a step's pull (None until both kinds were seen)."""
        if self.pull_refresh is None or self.pull_plain is None:
            return None
        return max(0.0, self.pull_refresh - self.pull_plain)

    def observe(self, pull_seconds, step_seconds, refreshed) -> None:
        """One step's pull and step seconds, and whether it refreshed."""
        if refreshed:
            self.pull_refresh = _ema(self.pull_refresh, float(pull_seconds))
        else:
            self.pull_plain = _ema(self.pull_plain, float(pull_seconds))
        self.step_seconds = _ema(self.step_seconds, float(step_seconds))

    # -------------------------------------------------------------- decide
    def refreshed(self, step, divergence=None) -> dict | None:
        """A refresh happened at ``step``; the change ``divergence`` causes, or None.

        ``divergence`` is None when the replica made no local step since
        the last refresh (nothing to measure).
        """
        self.last_refresh = int(step)
        if divergence is None:
            return None
        self.last_divergence = float(divergence)
        if not self.adaptive or not math.isfinite(divergence):
            return None
        k, reason = self._rule(float(divergence))
        if k == self.k:
            return None
        change = {"step": int(step), "k_from": self.k, "k_to": k,
                  "divergence": float(divergence), "refresh_cost_s": self.refresh_cost,
                  "step_s": self.step_seconds, "reason": reason}
        self.k = k
        self.history.append(change)
        return change

    def _rule(self, d):
        cost, step = self.refresh_cost, self.step_seconds
        share = None if cost is None or not step else cost / step
        if d > self.threshold:
            return 1, f"divergence {d:.3g} > threshold {self.threshold:g}"
        if d > self.threshold / 2 and self.k > 1:
            return max(1, self.k // 2), f"divergence {d:.3g} > threshold / 2"
        if d < self.threshold / 4 and self.k < self.k_max and (share is None
                                                               or share >= self.min_cost):
            why = ("refresh cost not measured yet" if share is None
                   else f"a refresh costs {100 * share:.1f} % of a step")
            return min(self.k_max, 2 * self.k), f"divergence {d:.3g} < threshold / 4; {why}"
        if share is not None and share < self.min_cost / 2 and self.k > 1:
            return max(1, self.k // 2), (f"a refresh costs only {100 * share:.1f} % of a "
                                         "step")
        return self.k, None

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict:
        """JSON-able state (for checkpoints)."""
        return {"k": self.k, "adaptive": self.adaptive, "k_max": self.k_max,
                "threshold": self.threshold, "min_cost": self.min_cost,
                "pull_refresh": self.pull_refresh, "pull_plain": self.pull_plain,
                "step_seconds": self.step_seconds, "last_divergence": self.last_divergence,
                "history": list(self.history)}

    def load(self, state) -> None:
        """Continue from :meth:`state` (the schedule restarts: the next step refreshes)."""
        self.k = int(state["k"])
        for key in ("pull_refresh", "pull_plain", "step_seconds", "last_divergence"):
            setattr(self, key, state.get(key))
        self.history = list(state.get("history", []))
        self.last_refresh = None
