"""The BSP step strategy: every worker in lock-step, one exact step at a time.

One step of this worker (:meth:`BSPSteps.step`)::

    batch  = reader.batch(step - 1, G, worker_index, num_workers)   # own shard
    rows   = sync.pull(model.sparse_ids(batch))        # every sparse variable
    result = model.forward_backward(dense, rows, batch)
    start DenseAllreduce(mean) of dense grads          # runs during the push
    sync.push(result.sparse_grads)                     # owners apply the optimizer
    wait for the dense allreduce; dense optimizer on every worker
    one Allreduce of a small vector: loss x batch, phase times, bytes, preempt flag

then :meth:`BSPSteps.record` writes the step's metrics line, evaluates and
checkpoints when due, and stops the run on a preemption signal (after its
checkpoint). :meth:`BSPSteps.after` runs the user's hooks and gives the
planner the step (it may ask for trial steps).

The dense gradients do not depend on the push, so their ``Iallreduce``
runs while it does (the push's polls progress it): the ``push`` phase's
seconds include that, ``dense`` is what is left of it after the push.
"""

from __future__ import annotations

import time

from .loop import StepFigures
from .step_report import TIME_PHASES, PhaseClock, compute_step, reduce_step, step_record

__all__ = ["BSPSteps", "BSPSchedule"]


class BSPSteps:
    """Steps of a BSP segment for one :class:`~hpcpax.app.trainer.Trainer`.

    Args:
        trainer: the run (model, engine, data, checkpoints).

    :attr:`metrics` (the run's :class:`~hpcpax.app.metrics.MetricsWriter`) and
    :attr:`last` are set when the run starts (:meth:`BSPSchedule.prepare`,
    ``auto``'s ``prepare``).
    """

    def __init__(self, trainer):
        self.trainer, self.metrics = trainer, None
        self.end_step = trainer.config["steps"]
        self._previous = None  # cumulative byte counters after the previous step
        #: Wall seconds of the BSP steps run.
        self.seconds = 0.0
        #: The last step run.
        self.last = 0

    # ------------------------------------------------------------- segment
    def label(self, step) -> str:
        """The watchdog's name for ``step``."""
        return f"step {step}"

    def begin(self, first, end) -> None:
        """A segment of steps ``first..end`` begins (local)."""
        self.end_step = end

    def stop_before(self, step) -> bool:
        """True past the segment's end or once the run stopped."""
        return step > self.end_step or self.trainer.loop.stopped

    def after(self, step, runner) -> int:
        """The user's hooks, then the planner (which may ask ``runner`` for steps); the last
        step run. **Collective** over the workers."""
        t = self.trainer
        if t.loop.stopped:
            return step
        self.user_hooks(step)
        return t.engine.planning.after_step(step, runner)

    def user_hooks(self, step) -> None:
        """The user's hooks after ``step`` (also after a step the planner asked for)."""
        t = self.trainer
        for hook in t.hooks:
            hook(t, step)

    def end(self, last) -> int:
        """The segment is over after ``last`` (local); ``last``."""
        return last

    # ---------------------------------------------------------------- step
    def step(self, step) -> StepFigures:
        """Train ``step`` (see the module doc); **collective** over the workers."""
        t = self.trainer
        engine = t.engine
        began, cpu_began = time.perf_counter(), time.process_time()
        clock = PhaseClock(TIME_PHASES)
        lap, times = clock.lap, clock.times
        position = step - 1
        batch = t.batch(position)
        ids = t.model.sparse_ids(batch, position)
        engine.planning.observe(ids)
        lap("data")
        rows = engine.sync.pull(ids)
        lap("pull")
        done = compute_step(t, rows, batch, position, step, clock)
        engine.dense_sync.start(done.dense)  # reduces while the sparse push runs
        engine.sync.push(done.sparse)
        lap("push")
        engine.dense_sync.wait()
        lap("dense")
        for name, param in t.dense.items():
            t.optimizer.apply_dense(param, t.dense_state[name], done.dense[name])
        lap("optimizer")
        loss, stop, mean_times, cumulative, cpu, cpu_phases = reduce_step(
            t.topology, done.loss, done.local_batch, times, t.preemption.requested,
            time.process_time() - cpu_began, clock.cpu)
        seconds = time.perf_counter() - began
        return StepFigures(step, began, times, done.local_batch, seconds, loss,
                           extra={"stop": stop, "mean_times": mean_times,
                                  "cumulative": cumulative, "cpu": cpu,
                                  "cpu_phases": cpu_phases})

    def record(self, figures) -> None:
        """Metrics, evaluation and checkpoint of a step; a stop on a preemption signal.
        **Collective** over the workers (evaluation, checkpoint)."""
        t, config = self.trainer, self.trainer.config
        step, extra = figures.step, figures.extra
        self.seconds += figures.seconds
        self.last = step
        t.losses.append(figures.loss)
        cumulative = extra["cumulative"]
        delta = cumulative if self._previous is None else cumulative - self._previous
        self._previous = cumulative
        record = step_record(step, figures.loss, figures.seconds, config["global_batch"],
                             extra["mean_times"], delta, extra["cpu"],
                             dilation=config["time_dilation"],
                             cpu_phases=extra["cpu_phases"])
        if t.emulated is not None:
            record["emulated"] = True
        self.metrics.write(record)
        t.progress.update(1, figures.loss, record["samples_per_s"])
        if config["eval_every"] and (step % config["eval_every"] == 0 or step == config["steps"]):
            self.metrics.write({"step": step, "eval": t.evaluate(step)})
        if extra["stop"]:
            t.loop.stopped = True
            t.log(f"preemption signal: checkpoint after step {step}, then exit",
                  important=True)
            t.save_checkpoint(step)
        elif config["checkpoint_every"] and (step % config["checkpoint_every"] == 0
                                             or step == config["steps"]):
            t.save_checkpoint(step)


class BSPSchedule:
    """``--consistency bsp``: one :class:`BSPSteps` segment from the first step to
    ``--steps``, and the run's set-up and end around it (workers)."""

    def __init__(self, trainer, steps):
        self.trainer, self.steps = trainer, steps
        self.start_step = 1

    def prepare(self, metrics_for) -> int:
        """Resume, the start-up lines, metrics, the planner; the first step.
        **Collective** over the workers."""
        from . import build

        t, config = self.trainer, self.trainer.config
        self.start_step = t.resume() if config["resume"] else 1
        if t.is_leader and not config["quiet"]:
            print(build.config_lines(t.topology, t.run_dir, t.model, config,
                                     t.engine.sync.describe()), flush=True)
        self.steps.metrics = metrics_for(self.start_step, self.start_step - 1)
        self.steps.last = self.start_step - 1
        t.engine.planning.start(self.start_step, resumed=self.start_step > 1)
        return self.start_step

    def checkpoint_state(self) -> dict:
        """Nothing beyond the trainer's own checkpoint metadata."""
        return {}

    def restore(self, meta) -> None:
        """Nothing to restore beyond the trainer's own state."""

    def finished(self, step) -> bool:
        """True once ``step`` is past the run's end."""
        return step > self.trainer.config["steps"]

    def next_segment(self, step) -> tuple:
        """``(strategy, last step)``: the BSP steps to the run's end."""
        return self.steps, self.trainer.config["steps"]

    def finish(self, last) -> tuple:
        """Table figures, the trace, then stop every rank; ``(first step, last step,
        train seconds)``. **Collective** over the workers."""
        t = self.trainer
        t.tables = t.engine.commands.run("tables")  # rows held, created, evicted per table
        path = t.end_run()
        if path is not None:
            t.summary_extra["trace"] = path
        return self.start_step, self.steps.last, self.steps.seconds
