"""Step hooks: what the training loop tells after every step.

:class:`~hpcpax.app.loop.TrainingLoop` calls ``hook.after_step(figures)``
(:class:`~hpcpax.app.loop.StepFigures`) inside each step's watchdog guard,
before the step's metrics line is written:

- :class:`TraceHook`: the step's phases on the ``--trace`` timeline
  (:class:`~hpcpax.app.timeline.Timeline`), BSP and relaxed steps alike;
- :class:`BalanceHook`: balanced BSP (``--batch-shares``,
  :class:`~hpcpax.app.balance.BatchBalancer`) measures each BSP step and
  rebalances when due (**collective** over the workers), its decisions
  written to the metrics and the timeline;
- ``--consistency auto``'s :class:`~hpcpax.app.auto_run.AutoSchedule`
  measures the BSP steps its decisions are made from.

Stragglers (``--straggler``, ``--stalls``) are not a hook: their delay is
part of a step's compute (:func:`~hpcpax.app.step_report.compute_step`).
"""

from __future__ import annotations

__all__ = ["TraceHook", "BalanceHook"]


class TraceHook:
    """Every step's phases on the run's timeline (a no-op when it is off)."""

    def __init__(self, timeline):
        self.timeline = timeline

    def after_step(self, figures) -> None:
        """Record the step on this worker's track."""
        self.timeline.step(figures.step, figures.began, figures.times,
                           figures.began + figures.seconds)


class BalanceHook:
    """Balanced BSP: each BSP step measured, the shares moved when due.

    Args:
        balance: the run's :class:`~hpcpax.app.balance.BatchBalancer`.
        metrics: the run's :class:`~hpcpax.app.metrics.MetricsWriter`.
        timeline: the run's timeline (decisions as instant events).
        planning: the planner (steps it still measures are warm-up).
    """

    def __init__(self, balance, metrics, timeline, planning):
        self.balance, self.metrics = balance, metrics
        self.timeline, self.planning = timeline, planning

    def after_step(self, figures) -> None:
        """Observe a BSP step; **collective** over the workers."""
        if figures.kind != "bsp":
            return
        decision = self.balance.observe(figures.step, figures.times, figures.local_batch,
                                        self.metrics, step_seconds=figures.seconds,
                                        warming=self.planning.measuring)
        if decision is not None:
            self.timeline.instant(f"batch shares {decision['to']}", decision)
