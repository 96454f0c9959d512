"""``--consistency auto``: the synchronization decided while training runs.

The run is cut into *segments* (``--auto-segment`` steps, doubling while
the mode stays, up to 8x). A segment runs in the mode in force:

- ``bsp`` / ``balanced``: the trainer's own BSP steps
  (:meth:`~hpcpax.app.trainer.Trainer.loop_step`), with even batch shares
  or shares proportional to the workers' speeds
  (:class:`~hpcpax.app.balance.BatchBalancer`);
- ``ssp:S``: one relaxed phase on the
  :class:`~hpcpax.ps.relaxed.RelaxedParameterServer` (as
  ``--consistency ssp:S``), every worker stopping at the segment's last
  step; the dense replicas go to the servers' tables before it and come
  back after it, so the next segment (or a checkpoint) starts from one
  state.

After each segment every worker's per-step figures (own work seconds,
samples, step seconds) are gathered on the first worker, which applies
:class:`~hpcpax.plan.adaptive.AutoPolicy` (its rules and the loss guard are
documented there) and broadcasts the policy's state: every rank runs the
same next segment. A change is printed once, written to ``metrics.jsonl``
(``{"step", "auto": {from, to, reason, measurements}}``), appears on the
``--trace`` timeline and in ``summary.json`` (``auto``), and the policy's
state is kept in checkpoints (BSP-style; one written at a segment's last
step holds the state before that segment's decision, which a resumed run
makes again after its first segment).
A segment's first step (the warm-up of a run, a mode switch, a relaxed
phase's start) is left out of its measurements, and its throughput is the
steady state: each worker's samples over its step seconds, summed over the
workers (the cost of a switch is bounded by the segments' doubling).
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..plan.adaptive import MAX_STALENESS, AutoPolicy
from . import relaxed_run
from .metrics import MetricsWriter, ProgressBar, json_safe

__all__ = ["setup", "AutoRun"]


def setup(trainer):
    """:func:`hpcpax.app.relaxed_run.setup`, or an :class:`AutoRun` under ``auto``;
    **collective** (every rank)."""
    if trainer.config["consistency"] != "auto":
        return relaxed_run.setup(trainer)
    from .stragglers import Stragglers

    config, topo = trainer.config, trainer.topology
    trainer.stragglers = Stragglers(config["straggler"], config["stalls"], topo.rank,
                                    config["seed"])
    relaxed, rsync = relaxed_run.relaxed_parts(trainer, f"ssp:{MAX_STALENESS}")
    trainer.commands.handlers["auto_staleness"] = lambda staleness: _set_staleness(
        relaxed, staleness)
    return AutoRun(trainer, relaxed, rsync)


def _set_staleness(relaxed, staleness):
    from ..ps.consistency import parse_consistency

    relaxed.default = parse_consistency(f"ssp:{int(staleness)}")
    relaxed.per_variable.clear()


class AutoRun:
    """The workers' side of an ``auto`` run (servers serve the trainer's commands)."""

    def __init__(self, trainer, relaxed, rsync):
        self.trainer = trainer
        self.relaxed_run = relaxed_run.RelaxedRun(trainer, relaxed, rsync)
        self.relaxed, self.rsync = relaxed, rsync
        config, topo = trainer.config, trainer.topology
        self.policy = AutoPolicy(topo.num_workers, config["global_batch"],
                                 segment=config["auto_segment"],
                                 max_segment=8 * config["auto_segment"])
        self.figures = []  # this worker's (step, work s, samples, step s) in this segment

    # ------------------------------------------------------------------ run
    def run(self, wall_start) -> dict:
        """Train (workers); **collective** over the workers, the servers following."""
        t = self.trainer
        config = t.config
        with t.watchdog.guard("set-up: dense tables"):
            self.rsync.register_dense()
        start_step = t._resume() if config["resume"] else 1
        t._bar = ProgressBar(config["steps"], start_step - 1,
                             t.is_leader and not config["quiet"])
        metrics = MetricsWriter(os.path.join(t.run_dir, "metrics.jsonl"), t.is_leader,
                                resumed_at=start_step - 1 if config["resume"] else None,
                                job_id=t.job_id)
        t._loop = {"metrics": metrics, "previous": None, "seconds": 0.0, "last": start_step - 1}
        t.log(f"consistency auto: starting at {self.policy.consistency}", important=True)
        step = start_step
        try:
            while step <= config["steps"] and not t.stopped:
                end = self._segment_end(step)
                if self.policy.mode == "ssp":
                    self._relaxed_segment(step, end, metrics)
                else:
                    for s in range(step, end + 1):
                        t.loop_step(s)
                        if t.stopped:
                            break
                        for hook in t.hooks:
                            hook(t, s)
                with t.watchdog.guard(f"auto: decision after step {t._loop['last']}"):
                    self._decide(step, t._loop["last"], metrics)
                step = t._loop["last"] + 1
        finally:
            metrics.close()
        t.summary_extra = json_safe({"consistency": "auto", "auto": self.policy.history,
                                     "auto_final": self.policy.consistency,
                                     **t.summary_extra})
        t.runtime.finish()
        if t.collect:
            t.parameters = t._read_parameters()
        t.commands.run("stop", preempted=t.stopped)
        return t._finish(start_step, t._loop["last"], t._loop["seconds"], wall_start)

    def _segment_end(self, step) -> int:
        """The segment's last step: its length, cut at the end and at checkpoints."""
        config = self.trainer.config
        end = min(config["steps"], step + self.policy.segment - 1)
        if self.policy.mode == "ssp":  # a relaxed phase ends where these are due
            for every in (config["checkpoint_every"], config["eval_every"]):
                if every:
                    end = min(end, (step - 1) // every * every + every)
        return end

    def note(self, step, times, local_batch, seconds) -> None:
        """One step of this worker: its own work (data + compute), samples, seconds."""
        self.figures.append((int(step), times["data"] + times["compute"], int(local_batch),
                             float(seconds)))

    # ------------------------------------------------------------ ssp:S
    def _relaxed_segment(self, first, end, metrics) -> None:
        """Steps ``first..end`` as one ssp phase; **collective** (every rank)."""
        t, rr = self.trainer, self.relaxed_run
        topo = t.topology
        began = time.perf_counter()
        t.commands.run("auto_staleness", staleness=self.policy.staleness)
        t.commands.run("relaxed_load_dense")
        clock = first - 1
        rr.phase += 1
        t.commands.run("relaxed", phase=rr.phase, clocks=[clock] * topo.num_workers,
                       budget=None)
        while True:
            with t.watchdog.guard(f"step {clock + 1}"):
                if self.relaxed.boundary(end, t.preemption.requested):
                    break
                rr._step(clock + 1)
            clock += 1
            record = rr.records[-1]
            self.note(clock, record["time"], record["batch"], record["seconds"])
            for hook in t.hooks:
                hook(t, clock)
        self.relaxed.end()
        with t.watchdog.guard(f"auto: ssp segment end at step {clock}"):
            self._segment_barrier(clock, began, metrics)

    def _segment_barrier(self, clock, began, metrics) -> None:
        """After an ssp phase (every rank): metrics, dense back, evaluation, checkpoint."""
        from mpi4py import MPI

        t = self.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(clock)
        signalled = topo.workers.allreduce(bool(t.preemption.requested), op=MPI.LOR)
        self.relaxed_run._flush(metrics, clocks, final=True)
        t.commands.run("relaxed_fetch_dense")
        last = min(clocks)  # ssp: every worker stops at the same clock
        t._loop["seconds"] += time.perf_counter() - began
        t._loop["last"] = last
        every = config["eval_every"]
        if every and (last % every == 0 or last == config["steps"]):
            metrics.write({"step": last, "eval": t.evaluate(last)})
        every = config["checkpoint_every"]
        if signalled:
            t.stopped = True
            t.log(f"preemption signal: checkpoint after step {last}, then exit", important=True)
            t.save_checkpoint(last)
        elif every and (last % every == 0 or last == config["steps"]):
            t.save_checkpoint(last)

    # --------------------------------------------------------- decisions
    def _decide(self, first, last, metrics) -> None:
        """Gather the segment's figures, decide on the first worker, apply everywhere."""
        t = self.trainer
        topo = t.topology
        mine = [f for f in self.figures if first + 1 <= f[0] <= last]  # not the switch
        self.figures = []
        gathered = topo.workers.gather(mine, root=0)
        decision = None
        if t.is_leader and not t.stopped:
            steps = sorted(set.intersection(*[{f[0] for f in g} for g in gathered]))
            if len(steps) >= 2:
                by_step = [{f[0]: f for f in g} for g in gathered]
                table = np.array([[by_step[w][s][1:] for w in range(len(gathered))]
                                  for s in steps], np.float64)
                losses = t.losses[-(last - first + 1):]
                loss_steps = list(range(last - len(losses) + 1, last + 1))
                # steady state: each worker's samples over its step seconds, summed
                rate = float(sum(table[:, w, 1].sum() / max(table[:, w, 2].sum(), 1e-9)
                                 for w in range(len(gathered))))
                decision = self.policy.decide(last, table[:, :, 0], table[:, :, 1],
                                              table[:, :, 2], losses, loss_steps, rate)
        state = topo.workers.bcast(self.policy.state() if t.is_leader else None, root=0)
        decision = topo.workers.bcast(decision, root=0)
        self.policy.load(state)
        t.balance.shares = list(self.policy.shares)
        if decision is not None:
            metrics.write({"step": last, "auto": decision})
            t.planning.runtime["consistency_auto"] = self.policy.history
            t.write_plan()
            t.runtime.timeline.instant(f"auto: {decision['to']}", decision)
            t.log(f"auto: step {last}: {decision['from']} -> {decision['to']}: "
                  f"{decision['reason']}", important=True)
