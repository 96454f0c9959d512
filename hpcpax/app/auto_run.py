"""``--consistency auto``: the synchronization decided while training runs.

The run is cut into *segments* (``--auto-segment`` steps, doubling while
the mode stays, up to 8x). A segment runs in the mode in force:

- ``bsp`` / ``balanced``: the run's BSP steps
  (:class:`~hpcpax.app.bsp_step.BSPSteps`), with even batch shares
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
in ``auto_decision_wait_s``; the relaxed phases' ``staleness`` records per
``ssp:S``, with the pulls that waited at the bound, and the servers'
counters in ``servers``, as a fixed ``ssp`` run has them), and the
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
import time

import numpy as np

from ..plan.adaptive import MAX_STALENESS, AutoPolicy
from .auto_channel import LEAD, DecisionChannel
from .loop import StepFigures
from .metrics import json_safe
from .relaxed_run import RelaxedSteps, relaxed_parts

__all__ = ["make_auto", "AutoSchedule"]


def make_auto(trainer, bsp):
    """The :class:`AutoSchedule` of an ``auto`` run; **collective** (every rank).

    ``bsp``: the run's :class:`~hpcpax.app.bsp_step.BSPSteps` (its BSP segments).
    """
    from ..errors import ConfigError

    topo = trainer.topology
    if not topo.server_ranks:  # the same on every rank: all raise together
        raise ConfigError("consistency 'auto' needs server ranks (servers_per_node >= 1, "
                          "and at least one worker beside them, e.g. mpirun -n 3): its ssp "
                          "segments run on the relaxed parameter server")
    relaxed, rsync = relaxed_parts(trainer, f"ssp:{MAX_STALENESS}")
    trainer.engine.commands.handlers["auto_staleness"] = lambda staleness: _set_staleness(
        relaxed, staleness)
    return AutoSchedule(trainer, bsp, relaxed, rsync)


def _set_staleness(relaxed, staleness):
    from ..ps.relaxed.consistency import parse_consistency

    relaxed.default = parse_consistency(f"ssp:{int(staleness)}")
    relaxed.per_variable.clear()


class AutoSchedule:
    """The scheduler of an ``auto`` run (workers; servers serve the commands): BSP
    segments (:class:`_BSPSegment`) and ``ssp:S`` phases (:class:`_RelaxedSegment`),
    and a step hook measuring the BSP steps."""

    def __init__(self, trainer, bsp, relaxed, rsync):
        self.trainer, self.bsp = trainer, bsp
        self.relaxed, self.rsync = relaxed, rsync
        self.relaxed_steps = RelaxedSteps(trainer, relaxed, rsync)
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
        self.start_step = 1
        #: Wall seconds of the ssp phases (the BSP steps' are the BSP strategy's).
        self.relaxed_seconds = 0.0
        self._bsp_segment = _BSPSegment(self)
        self._relaxed_segment = _RelaxedSegment(self)

    # ------------------------------------------------------------- set-up
    def prepare(self, metrics_for) -> int:
        """Dense tables, resume, metrics; the first step. **Collective** over the workers."""
        t = self.trainer
        with t.watchdog.guard("set-up: dense tables"):
            self.rsync.register_dense()
        self.start_step = t.resume() if t.config["resume"] else 1
        self.metrics = self.bsp.metrics = metrics_for(self.start_step, self.start_step - 1)
        self.bsp.last = self.start_step - 1
        t.log(f"consistency auto: starting at {self.policy.consistency}", important=True)
        self.channel = DecisionChannel(t.topology.workers)
        return self.start_step

    def checkpoint_state(self) -> dict:
        """The policy's state, for a checkpoint's metadata."""
        return {"auto": self.policy.state()}

    def restore(self, meta) -> None:
        """Continue the policy from a checkpoint's metadata (first worker's);
        **collective** over the workers."""
        topo = self.trainer.topology
        state = topo.workers.bcast(meta.get("auto") if topo.worker_index == 0 else None,
                                   root=0)
        if state:
            self.policy.load(state)
            self.trainer.balance.shares = list(self.policy.shares)

    # ---------------------------------------------------------- scheduler
    def finished(self, step) -> bool:
        """True once ``step`` is past the run's end."""
        return step > self.trainer.config["steps"]

    def next_segment(self, step) -> tuple:
        """The mode in force's segment from ``step``: ``(strategy, its last step)``."""
        end = self._segment_end(step)
        if self.policy.mode == "ssp":
            return self._relaxed_segment, end
        return self._bsp_segment, end

    def after_step(self, figures) -> None:
        """Step hook: a BSP step's figures, measured for the next decision."""
        if figures.kind == "bsp":
            self.note(figures.step, figures.times, figures.local_batch, figures.seconds)

    def finish(self, last) -> tuple:
        """Summary figures, the trace, then stop every rank; ``(first step, last step,
        train seconds)``. **Collective** over the workers."""
        t = self.trainer
        waits = t.topology.workers.gather(self.channel.wait_seconds, root=0)
        self.channel.close()
        # the relaxed phases' staleness records (per ssp:S: pulls, gaps, the pulls that
        # waited at the bound and their seconds) and the servers' counters, as a fixed
        # ssp run reports them
        staleness, servers = t.engine.commands.run("relaxed_stats")
        t.summary_extra.update(json_safe({"consistency": "auto", "auto": self.policy.history,
                                          "auto_final": self.policy.consistency,
                                          "auto_decision_wait_s": waits,
                                          "staleness": staleness, "servers": servers}))
        path = t.end_run()
        if path is not None:
            t.summary_extra["trace"] = path
        return self.start_step, last, self.bsp.seconds + self.relaxed_seconds

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
            decision = None if t.loop.stopped else self._policy_decide(policy, boundary, gathered)
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
        if t.is_leader and not t.loop.stopped:
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
        t.engine.planning.runtime["consistency_auto"] = self.policy.history
        t.write_plan()
        t.timeline.instant(f"auto: {decision['to']}", decision)
        since = (f" (from step {decision['applies_from']})" if "applies_from" in decision
                 else "")
        t.log(f"auto: step {decision['step']}: {decision['from']} -> {decision['to']}"
              f"{since}: {decision['reason']}", important=True)


class _BSPSegment:
    """A BSP segment of an ``auto`` run: the run's BSP steps, then a decision."""

    def __init__(self, auto):
        self.auto, self.bsp = auto, auto.bsp
        self.first = None

    def label(self, step) -> str:
        """The watchdog's name for ``step``."""
        return self.bsp.label(step)

    def begin(self, first, end) -> None:
        """Steps ``first..end`` (local)."""
        self.first = first
        self.bsp.begin(first, end)

    def stop_before(self, step) -> bool:
        """True past the segment's end or once the run stopped."""
        return self.bsp.stop_before(step)

    def step(self, step) -> StepFigures:
        """One BSP step."""
        return self.bsp.step(step)

    def record(self, figures) -> None:
        """Its metrics, evaluation, checkpoint."""
        self.bsp.record(figures)

    def after(self, step, runner) -> int:
        """The user's hooks (no planner: ``auto`` runs a fixed plan)."""
        if not self.auto.trainer.loop.stopped:
            self.user_hooks(step)
        return step

    def user_hooks(self, step) -> None:
        """The user's hooks after ``step``."""
        t = self.auto.trainer
        for hook in t.hooks:
            hook(t, step)

    def end(self, last) -> int:
        """Gather the segment's figures and decide; **collective** over the workers."""
        t = self.auto.trainer
        last = self.bsp.last
        deciding = time.perf_counter()
        with t.watchdog.guard(f"auto: decision after step {last}"):
            self.auto._decide(self.first, last)
        t.timeline.span("auto decision", deciding, time.perf_counter(), {"step": last},
                        cat="auto")
        return last


class _RelaxedSegment:
    """An ``ssp:S`` phase of an ``auto`` run, from a step up to the run's end, a
    checkpoint or an evaluation, or to a decision that leaves ``ssp:S``.

    The segments inside it end without a stop: their decisions travel through
    the :class:`~hpcpax.app.auto_channel.DecisionChannel` and take effect at
    the same step on every worker (batch shares in place); a decision that
    leaves ``ssp:S`` ends the phase just before its step.
    """

    def __init__(self, auto):
        self.auto = auto
        self.steps = auto.relaxed_steps
        self.stop = self.began = None

    def label(self, step) -> str:
        """The watchdog's name for ``step``."""
        return f"step {step}"

    def begin(self, first, end) -> None:
        """Every rank enters the phase; **collective**."""
        auto, t = self.auto, self.auto.trainer
        self.began = time.perf_counter()
        t.engine.commands.run("auto_staleness", staleness=auto.policy.staleness)
        t.engine.commands.run("relaxed_load_dense")
        self.steps.enter_phase([first - 1] * t.topology.num_workers, None)
        auto.phase_staleness, auto.phase_end = auto.policy.staleness, end
        auto._start_segment(first, end)
        t.timeline.span(f"ssp:{auto.phase_staleness} phase start", self.began,
                        time.perf_counter(), {"step": first}, cat="auto")
        self.stop = end

    def stop_before(self, step) -> bool:
        """Move the pending decision on; True where the phase ends."""
        auto = self.auto
        self.stop = min(self.stop, auto._in_phase(step - 1))
        return auto.relaxed.boundary(self.stop, auto.trainer.preemption.requested)

    def step(self, step) -> StepFigures:
        """One relaxed step."""
        return self.steps.step(step)

    def record(self, figures) -> None:
        """Keep its record for the phase's metrics."""
        self.steps.record(figures)

    def after(self, clock, runner) -> int:
        """Measure the step, send the segment's figures at its end, the user's hooks."""
        auto = self.auto
        record = self.steps.records[-1]
        auto.note(clock, record["time"], record["batch"], record["seconds"], record["loss"])
        if clock == auto.boundary:
            auto.channel.send_figures(clock, auto._segment_figures(clock))
            auto.waiting = clock
        self.user_hooks(clock)
        return clock

    def user_hooks(self, step) -> None:
        """The user's hooks after ``step``."""
        t = self.auto.trainer
        for hook in t.hooks:
            hook(t, step)

    def end(self, clock) -> int:
        """The phase ends: the pending decision, then the barrier; the last step."""
        auto, t = self.auto, self.auto.trainer
        ending = time.perf_counter()
        auto.relaxed.end()
        with t.watchdog.guard(f"auto: decision after step {clock}"):
            auto._settle()
        with t.watchdog.guard(f"auto: ssp segment end at step {clock}"):
            last = self._barrier(clock)
        t.timeline.span(f"ssp:{auto.phase_staleness} phase end", ending,
                        time.perf_counter(), {"step": clock}, cat="auto")
        return last

    def _barrier(self, clock) -> int:
        """After an ssp phase (every rank): metrics, dense back, evaluation, checkpoint."""
        from ..comm.reductions import any_rank

        auto, t = self.auto, self.auto.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(clock)
        signalled = any_rank(topo.workers, t.preemption.requested)
        self.steps.flush(auto.metrics, clocks, final=True)
        t.engine.commands.run("relaxed_fetch_dense")
        last = min(clocks)  # ssp: every worker stops at the same clock
        auto.relaxed_seconds += time.perf_counter() - self.began
        auto.bsp.last = last
        every = config["eval_every"]
        if every and (last % every == 0 or last == config["steps"]):
            auto.metrics.write({"step": last, "eval": t.evaluate(last)})
        every = config["checkpoint_every"]
        if signalled:
            t.loop.stopped = True
            t.log(f"preemption signal: checkpoint after step {last}, then exit", important=True)
            t.save_checkpoint(last)
        elif every and (last % every == 0 or last == config["steps"]):
            t.save_checkpoint(last)
        return last
