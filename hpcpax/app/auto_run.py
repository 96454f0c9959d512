"""``--consistency auto``: the synchronization decided while training runs.

The run is cut into *segments* (``--auto-segment`` steps, doubling while
the mode stays, up to 8x). A segment runs in the mode in force:

- ``bsp`` / ``balanced``: the trainer's own BSP steps
  (:meth:`~hpcpax.app.trainer.Trainer.loop_step`), with even batch shares
  or shares proportional to the workers' speeds
  (:class:`~hpcpax.app.balance.BatchBalancer`);
- ``ssp:S`` (``ssp:S+balanced`` with uneven shares): steps of one relaxed
  phase on the :class:`~hpcpax.ps.relaxed.RelaxedParameterServer` (as
  ``--consistency ssp:S``). The dense replicas go to the servers' tables
  before the phase and come back after it, so the next BSP segment (or a
  checkpoint) starts from one state.

After a BSP segment every worker's per-step figures (own work seconds,
samples, step seconds) are gathered on the first worker, which applies
:class:`~hpcpax.plan.adaptive.AutoPolicy` (its rules and the loss guard are
documented there) and broadcasts the policy's state: every rank runs the
same next segment. Inside a relaxed phase the segments end *without a
stop* (:mod:`hpcpax.app.auto_channel`): each worker sends its figures (and
losses) at the segment's last step ``b`` and steps on; the first worker
decides when they are all in, and the decision applies from step
``b + S + LEAD`` on every worker (``applies_from``): new shares in place,
while a decision that leaves ``ssp:S`` (to ``bsp``, ``balanced`` or
another ``S``) ends the phase just before that step. A phase also ends at
the run's end and where a checkpoint or evaluation is due; the segment
ending there is decided at once, before the checkpoint.

A change is printed once, written to ``metrics.jsonl`` (``{"step",
"auto": {from, to, reason, measurements, applies_from}}``), appears on the
``--trace`` timeline (which holds the BSP and the relaxed steps alike, the
servers' requests of both, and the costs of the switches: ``auto
decision`` after a BSP segment, ``ssp:S phase start``/``end``) and in
``summary.json`` (``auto``; the seconds each worker waited for a decision
in ``auto_decision_wait_s``), and the
policy's state is kept in checkpoints (one written at a BSP segment's last
step holds the state before that segment's decision, which a resumed run
makes again after its first segment; one written at a relaxed phase's end
holds the state after it).
A segment's first step (the warm-up of a run, a mode switch, a relaxed
phase's start) is left out of its measurements, and its throughput is the
steady state: each worker's samples over its step seconds, summed over the
workers (the cost of a switch is bounded by the segments' doubling).
"""

from __future__ import annotations

import copy
import os
import time

import numpy as np

from ..plan.adaptive import MAX_STALENESS, AutoPolicy
from .auto_channel import LEAD, DecisionChannel
from . import relaxed_run
from .metrics import MetricsWriter, ProgressBar, json_safe

__all__ = ["setup", "AutoRun"]


def setup(trainer):
    """:func:`hpcpax.app.relaxed_run.setup`, or an :class:`AutoRun` under ``auto``;
    **collective** (every rank)."""
    if trainer.config["consistency"] != "auto":
        return relaxed_run.setup(trainer)
    from .stragglers import Stragglers

    from ..errors import ConfigError

    config, topo = trainer.config, trainer.topology
    if not topo.server_ranks:  # the same on every rank: all raise together
        raise ConfigError("consistency 'auto' needs server ranks (servers_per_node >= 1, "
                          "and at least one worker beside them, e.g. mpirun -n 3): its ssp "
                          "segments run on the relaxed parameter server")
    trainer.stragglers = Stragglers.for_topology(config, topo)
    relaxed, rsync = relaxed_run.relaxed_parts(trainer, f"ssp:{MAX_STALENESS}")
    trainer.commands.handlers["auto_staleness"] = lambda staleness: _set_staleness(
        relaxed, staleness)
    return AutoRun(trainer, relaxed, rsync)


def _set_staleness(relaxed, staleness):
    from ..ps.relaxed.consistency import parse_consistency

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
        self.figures = []  # this worker's (step, work s, samples, step s, loss) not yet sent
        self.channel = None  # the DecisionChannel, built when the run starts
        #: A relaxed phase's segment end whose decision is awaited, and the decision
        #: received, ``(step it applies from, policy state, decision or None)``.
        self.waiting = self.scheduled = None
        self.metrics = None

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
                                job_id=t.job_id,
                                log=lambda text: t.log(text, important=True))
        t._loop = {"metrics": metrics, "previous": None, "seconds": 0.0, "last": start_step - 1}
        t.log(f"consistency auto: starting at {self.policy.consistency}", important=True)
        self.metrics = metrics
        self.channel = DecisionChannel(t.topology.workers)
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
                    deciding = time.perf_counter()
                    with t.watchdog.guard(f"auto: decision after step {t._loop['last']}"):
                        self._decide(step, t._loop["last"])
                    t.runtime.timeline.span("auto decision", deciding, time.perf_counter(),
                                            {"step": t._loop["last"]}, cat="auto")
                step = t._loop["last"] + 1
        finally:
            metrics.close()
        waits = t.topology.workers.gather(self.channel.wait_seconds, root=0)
        self.channel.close()
        t.summary_extra = json_safe({"consistency": "auto", "auto": self.policy.history,
                                     "auto_final": self.policy.consistency,
                                     "auto_decision_wait_s": waits, **t.summary_extra})
        t.runtime.finish()
        if t.collect:
            t.parameters = t._read_parameters()
        t.commands.run("stop", preempted=t.stopped)
        return t._finish(start_step, t._loop["last"], t._loop["seconds"], wall_start)

    def _segment_end(self, step) -> int:
        """A BSP segment's last step (its length, cut at the end); a relaxed phase's (the
        end, the next checkpoint or evaluation: its segments end inside it)."""
        config = self.trainer.config
        if self.policy.mode != "ssp":
            return min(config["steps"], step + self.policy.segment - 1)
        end = config["steps"]
        for every in (config["checkpoint_every"], config["eval_every"]):
            if every:
                end = min(end, (step - 1) // every * every + every)
        return end

    def note(self, step, times, local_batch, seconds, loss=None) -> None:
        """One step of this worker: its own work (data + compute), samples, seconds (and
        its loss, in a relaxed phase)."""
        self.figures.append((int(step), times["data"] + times["compute"], int(local_batch),
                             float(seconds), loss))

    # ------------------------------------------------------------ ssp:S
    def _relaxed_segment(self, first, end, metrics) -> None:
        """Steps ``first..`` as one ssp phase up to ``end`` (the run's end, a checkpoint or
        an evaluation) or to a decision that leaves ``ssp:S``; **collective** (every rank).

        The segments inside it end without a stop: their decisions travel through
        the :class:`~hpcpax.app.auto_channel.DecisionChannel` and take effect at
        the same step on every worker (batch shares in place); a decision that
        leaves ``ssp:S`` ends the phase just before its step.
        """
        t, rr = self.trainer, self.relaxed_run
        topo = t.topology
        began = time.perf_counter()
        t.commands.run("auto_staleness", staleness=self.policy.staleness)
        t.commands.run("relaxed_load_dense")
        clock = first - 1
        rr.phase += 1
        t.commands.run("relaxed", phase=rr.phase, clocks=[clock] * topo.num_workers,
                       budget=None)
        self.phase_staleness, self.phase_end = self.policy.staleness, end
        self._start_segment(first, end)
        t.runtime.timeline.span(f"ssp:{self.phase_staleness} phase start", began,
                                time.perf_counter(), {"step": first}, cat="auto")
        stop = end
        while True:
            with t.watchdog.guard(f"step {clock + 1}"):
                stop = min(stop, self._in_phase(clock))
                if self.relaxed.boundary(stop, t.preemption.requested):
                    break
                rr._step(clock + 1)
            clock += 1
            record = rr.records[-1]
            self.note(clock, record["time"], record["batch"], record["seconds"],
                      record["loss"])
            if clock == self.boundary:
                self.channel.send_figures(clock, self._segment_figures(clock))
                self.waiting = clock
            for hook in t.hooks:
                hook(t, clock)
        ending = time.perf_counter()
        self.relaxed.end()
        with t.watchdog.guard(f"auto: decision after step {clock}"):
            self._settle()
        with t.watchdog.guard(f"auto: ssp segment end at step {clock}"):
            self._segment_barrier(clock, began, metrics)
        t.runtime.timeline.span(f"ssp:{self.phase_staleness} phase end", ending,
                                time.perf_counter(), {"step": clock}, cat="auto")

    def _start_segment(self, first, end) -> None:
        """A segment begins at step ``first`` (left out of its figures) inside a phase."""
        self.segment_first = first
        self.boundary = min(end, first + self.policy.segment - 1)

    def _segment_figures(self, boundary) -> list:
        mine = [f for f in self.figures if self.segment_first + 1 <= f[0] <= boundary]
        self.figures = [f for f in self.figures if f[0] > boundary]
        return mine

    def _in_phase(self, clock) -> int:
        """Before step ``clock + 1`` of a phase: move the pending decision on (decide,
        receive, apply when due); the clock the phase must stop at (NO_STOP: none)."""
        from ..ps.relaxed.client import NO_STOP

        if self.waiting is not None:
            due = clock + 1 >= self.waiting + self.phase_staleness + LEAD
            self._exchange(self.waiting, block=due)
        if self.scheduled is None:
            return int(NO_STOP)
        effective, state, decision = self.scheduled
        if state["mode"] != "ssp" or state["staleness"] != self.phase_staleness:
            return effective - 1  # leaves ssp:S: the phase ends, applied after it
        if clock + 1 >= effective:
            self.scheduled = None
            self._apply(state, decision)
            self._start_segment(effective, self.phase_end)
        return int(NO_STOP)

    def _exchange(self, boundary, block) -> None:
        """The decision on ``boundary``: the first worker decides once every worker's
        figures are in, the others receive it; scheduled for its step."""
        t, channel = self.trainer, self.channel
        waiting = self.relaxed.client.answer_control
        if channel.is_leader:
            gathered = channel.collect(boundary, block, waiting)
            if gathered is None:
                return
            policy = copy.deepcopy(self.policy)  # in force only from its step, like elsewhere
            decision = None if t.stopped else self._policy_decide(policy, boundary, gathered)
            effective = boundary + self.phase_staleness + LEAD
            if decision is not None:
                decision["applies_from"] = effective
            payload = (effective, policy.state(), decision)
            channel.send_decision(boundary, payload)
        else:
            payload = channel.receive_decision(boundary, block, waiting)
            if payload is None:
                return
        self.waiting = None
        self.scheduled = payload

    def _settle(self) -> None:
        """After a phase (workers): the pending decision made and applied now."""
        if self.waiting is not None:
            self._exchange(self.waiting, block=True)
        if self.scheduled is not None:
            _, state, decision = self.scheduled
            self.scheduled = None
            self._apply(state, decision)

    def _segment_barrier(self, clock, began, metrics) -> None:
        """After an ssp phase (every rank): metrics, dense back, evaluation, checkpoint."""
        from ..comm.reductions import any_rank

        t = self.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(clock)
        signalled = any_rank(topo.workers, t.preemption.requested)
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
    def _decide(self, first, last) -> None:
        """After a BSP segment: gather its figures, decide on the first worker, apply
        everywhere; **collective** over the workers."""
        t = self.trainer
        topo = t.topology
        mine = [f for f in self.figures if first + 1 <= f[0] <= last]  # not the switch
        self.figures = []
        gathered = topo.workers.gather(mine, root=0)
        decision = None
        if t.is_leader and not t.stopped:
            losses = t.losses[-(last - first + 1):]
            decision = self._policy_decide(self.policy, last, gathered, losses,
                                           list(range(last - len(losses) + 1, last + 1)))
        state = topo.workers.bcast(self.policy.state() if t.is_leader else None, root=0)
        decision = topo.workers.bcast(decision, root=0)
        self._apply(state, decision)

    @staticmethod
    def _policy_decide(policy, last, gathered, losses=None, loss_steps=None):
        """First worker: ``policy.decide`` on every worker's figures (None when fewer
        than two steps are common to all). Without ``losses`` (a relaxed segment) each
        step's loss is the workers' losses averaged over their samples, as the relaxed
        metrics lines do."""
        steps = sorted(set.intersection(*[{f[0] for f in g} for g in gathered]))
        if len(steps) < 2:
            return None
        by_step = [{f[0]: f for f in g} for g in gathered]
        if losses is None:
            rows = [[w[step] for w in by_step] for step in steps]
            losses = [sum(r[4] * r[2] for r in row) / max(sum(r[2] for r in row), 1)
                      for row in rows]
            loss_steps = steps
        table = np.array([[by_step[w][s][1:4] for w in range(len(gathered))]
                          for s in steps], np.float64)
        # steady state: each worker's samples over its step seconds, summed
        rate = float(sum(table[:, w, 1].sum() / max(table[:, w, 2].sum(), 1e-9)
                         for w in range(len(gathered))))
        return policy.decide(last, table[:, :, 0], table[:, :, 1], table[:, :, 2], losses,
                             loss_steps, rate)

    def _apply(self, state, decision) -> None:
        """Every worker: the policy's state after a decision, in force from now on."""
        t = self.trainer
        self.policy.load(state)
        t.balance.shares = list(self.policy.shares)
        if decision is None:
            return
        self.metrics.write({"step": decision["step"], "auto": decision})
        t.planning.runtime["consistency_auto"] = self.policy.history
        t.write_plan()
        t.runtime.timeline.instant(f"auto: {decision['to']}", decision)
        since = (f" (from step {decision['applies_from']})" if "applies_from" in decision
                 else "")
        t.log(f"auto: step {decision['step']}: {decision['from']} -> {decision['to']}"
              f"{since}: {decision['reason']}", important=True)

