"""The training loop: the one place where steps are run, whatever the consistency.

A run is a sequence of *segments*; a **scheduler** says which step
strategy runs the next one and up to which step, and when the run is over:

- ``bsp`` (:class:`~hpcpax.app.bsp_step.BSPSchedule`): one segment of
  :class:`~hpcpax.app.bsp_step.BSPSteps` over the whole run;
- ``ssp:S|asp|psp`` (:class:`~hpcpax.app.relaxed_run.RelaxedSchedule`):
  relaxed phases (:class:`~hpcpax.app.relaxed_run.RelaxedPhase`) between
  barriers (checkpoint, evaluation, end, preemption);
- ``auto`` (:class:`~hpcpax.app.auto_run.AutoSchedule`): BSP segments and
  ``ssp:S`` phases, chosen per segment from measured stragglers.

The loop, per segment::

    strategy.begin(first, end)                  # collective (enter a phase, ...)
    for each step s (this worker's clock):
        with watchdog.guard(strategy.label(s)):
            if strategy.stop_before(s): break   # end, a relaxed boundary, a stop
            figures = strategy.step(s)          # data, pull, compute, push, dense
            hook.after_step(figures) for every step hook   # trace, balance, auto
            strategy.record(figures)            # metrics, evaluation, checkpoint
        s = strategy.after(s, runner)           # user hooks, the planner
    last = strategy.end(s)                      # collective (barrier, decision)

A step the planner asks of the runner is guarded, hooked and recorded the
same way, then the user's hooks see it (``strategy.user_hooks(s)``): only
the planner is not asked again.

Step hooks (:mod:`hpcpax.app.step_hooks`: the trace, balanced batch
shares, ``auto``'s measurements) see every step's :class:`StepFigures`;
the stragglers' delays are part of a step's compute
(:func:`~hpcpax.app.step_report.compute_step`). The planner never runs a
step itself: a partition search or a hot-rows trial asks the loop's
:class:`StepRunner` for its trial steps.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["StepFigures", "StepRunner", "TrainingLoop"]


@dataclass
class StepFigures:
    """One step of this worker, as the step hooks see it.

    Attributes:
        step: the step (this worker's clock in a relaxed phase).
        began: ``time.perf_counter()`` at its start.
        times: this worker's phase seconds (``data``, ``pull``, ``compute``...).
        local_batch: samples in this worker's shard.
        seconds: the step's wall seconds on this worker.
        loss: the loss (a BSP step's: over every worker; a relaxed step's: this
            worker's).
        kind: ``bsp`` or ``relaxed`` (a step of a relaxed phase).
        extra: what the strategy keeps for its ``record`` (not for hooks).
    """

    step: int
    began: float
    times: dict
    local_batch: int
    seconds: float
    loss: float | None = None
    kind: str = "bsp"
    extra: dict = field(default_factory=dict)


class StepRunner:
    """What the planner is given to ask the loop for steps (BSP segments only).

    :meth:`run` trains one step exactly as the loop does (guard, step hooks,
    metrics, checkpoint, then the user's hooks; not the planner again);
    :attr:`stopped` says the run is stopping.
    """

    def __init__(self, loop, strategy):
        self._loop, self._strategy = loop, strategy

    @property
    def stopped(self) -> bool:
        """True once a stop (a preemption signal) ended the run."""
        return self._loop.stopped

    def run(self, step) -> None:
        """Train ``step``; **collective** over the workers."""
        if self._loop.run_step(self._strategy, step):
            self._strategy.user_hooks(step)


class TrainingLoop:
    """Run a scheduler's segments; see the module doc.

    Args:
        watchdog: the run's :class:`~hpcpax.comm.watchdog.Watchdog`.
        scheduler: ``next_segment(step) -> (strategy, end)`` and
            ``finished(step) -> bool`` (``step``: the next step to run).
        hooks: step hooks, objects with ``after_step(figures)``.
    """

    def __init__(self, watchdog, scheduler, hooks=()):
        self.watchdog, self.scheduler = watchdog, scheduler
        self.hooks = [h for h in hooks if h is not None]
        #: True once a stop (a preemption signal) ended the run.
        self.stopped = False
        #: The last step every worker ran (this worker's, in an asynchronous run).
        self.last = 0

    def run(self, first) -> int:
        """Train from step ``first`` to the scheduler's end; the last step. **Collective**
        over the workers (the servers follow through the command channel)."""
        self.last = step = first - 1
        while not self.stopped and not self.scheduler.finished(step + 1):
            strategy, end = self.scheduler.next_segment(step + 1)
            strategy.begin(step + 1, end)
            runner = StepRunner(self, strategy)
            while True:
                if not self.run_step(strategy, step + 1):
                    break
                step = strategy.after(step + 1, runner)
            step = self.last = strategy.end(step)
        return self.last

    def run_step(self, strategy, step) -> bool:
        """One step of ``strategy`` under the watchdog; False when it stops before it."""
        with self.watchdog.guard(strategy.label(step)):
            if strategy.stop_before(step):
                return False
            figures = strategy.step(step)
            for hook in self.hooks:
                hook.after_step(figures)
            strategy.record(figures)
        return True
