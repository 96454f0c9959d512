"""Training under a relaxed consistency model (``--consistency ssp:S|asp|psp:B[,S]``).

The workers run relaxed *phases*: between two barriers, each worker steps at
its own pace through the :class:`~hpcpax.ps.relaxed.RelaxedParameterServer`
(pull rows and dense replicas, compute, push), with no collective over the
job. A phase ends, and every rank meets in the trainer's command channel,
when a checkpoint or evaluation is due (every worker stops at the same step
for those), when the run is over, or when a preemption signal reached a
worker (the first server then agrees a stop step with every group:
``asp`` workers stop where they are, ``ssp`` and ``psp`` workers all at the
highest step). At the barrier every push has been applied exactly once and
nothing is in flight, so the checkpoint holds everything, and holds every
worker's step for a resume.

Run length: ``bsp`` and ``ssp`` workers each run ``--steps`` steps;
``asp`` and ``psp`` runs end once the workers together ran ``--steps`` x
workers steps (the same samples; a fast worker takes more of them).

Dense refresh period (``--dense-period K|auto|auto:KMAX``): each worker
refreshes its dense replicas from the servers every ``k`` steps and applies
its own gradients locally in between (:mod:`hpcpax.sync.relaxed`); with
``auto`` its :class:`~hpcpax.plan.dense_period.DensePeriod` sets ``k`` from
the divergence measured at each refresh and the measured cost of a refresh.
In the hierarchical mode a node's workers agree: the node's largest
divergence and its first worker's cost figures decide for all of them.

Metrics: each worker records its steps; the first worker writes one line
per step (loss averaged over the workers that ran it, samples/s summed
over them, with a dense period each worker's ``k`` as ``dense_k``). A
preempted ``asp`` run (its workers stop where they are) writes lines through the slowest worker's
step; its checkpoint keeps the records of the later steps, and the resumed
run (which runs those steps only on the workers that had not) completes
them: each step is one line with every worker's record. And one
line per change of ``k`` (``{"step", "dense_period": {worker, k_from, k_to,
divergence, refresh_cost_s, step_s, reason}}``), also saved in
``plan.json`` (``runtime``) and checkpoints; ``summary.json`` adds the
consistency, every worker's steps, the servers' staleness records and their
busy/idle/CPU seconds.
"""

from __future__ import annotations

import time

import numpy as np

from ..plan.dense_period import DensePeriod, parse_dense_period
from ..ps.relaxed.consistency import parse_consistency_spec
from ..ps.relaxed import RelaxedParameterServer
from ..ps.relaxed.client import NO_STOP
from ..sync.relaxed import RelaxedSync
from . import checkpoint_files as ckpt
from .loop import StepFigures
from .metrics import json_safe
from .step_report import PhaseClock, compute_step

__all__ = ["plan_under", "is_relaxed", "relaxed_parts", "RelaxedSteps", "RelaxedSchedule"]


def plan_under(config, spec):
    """The plan to build: ``ps`` for ``auto``/``hybrid`` under a relaxed model."""
    if config["consistency"] == "auto":  # may run ssp segments: every variable on ps
        return "ps" if spec in ("auto", "hybrid") else spec
    return "ps" if is_relaxed(config["consistency"]) and spec in ("auto", "hybrid") else spec


def is_relaxed(consistency, names=None) -> bool:
    """True when ``--consistency`` (not ``auto``) relaxes any variable's model."""
    default, per_variable = parse_consistency_spec(consistency, names)
    return default.relaxed or any(m.relaxed for m in per_variable.values())


def relaxed_parts(trainer, consistency):
    """``(RelaxedParameterServer, RelaxedSync)`` under ``consistency``, their commands
    added to the engine's channel; **collective** (every rank)."""
    config, engine = trainer.config, trainer.engine
    relaxed = RelaxedParameterServer(engine.ps, consistency,
                                     groups=config["consistency_groups"], seed=config["seed"])
    shapes = trainer.model.dense_shapes()
    rsync = RelaxedSync(relaxed, engine.sync, shapes, config["dtype"], config["optimizer"],
                        config["lr"])
    engine.commands.handlers.update({
        "relaxed": relaxed.enter_phase,
        "relaxed_load_dense": lambda: rsync.load_dense(trainer.dense, trainer.dense_state),
        "relaxed_fetch_dense": lambda: rsync.fetch_dense(trainer.dense, trainer.dense_state),
        "relaxed_stats": lambda: (relaxed.staleness(), relaxed.server_stats()),
        "stop": lambda preempted=False: (trainer.note_stop(preempted), relaxed.free()),
    })
    if config["trace"] and relaxed.server is not None:
        relaxed.server.events = []  # a server's requests, for the trace
    return relaxed, rsync


def _is_record(record) -> bool:
    """Whether ``record`` has the fields and types of a step record :meth:`RelaxedSteps.flush`
    writes a line from (one read back from a checkpoint)."""
    def number(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    return (isinstance(record, dict) and isinstance(record.get("step"), int)
            and isinstance(record.get("worker"), int) and isinstance(record.get("batch"), int)
            and record["batch"] > 0 and number(record.get("loss"))
            and number(record.get("seconds")) and record["seconds"] > 0
            and isinstance(record.get("time"), dict)
            and all(number(v) for v in record["time"].values()))


class RelaxedSteps:
    """A worker's steps on the relaxed parameter server, shared by ``--consistency
    ssp|asp|psp`` (:class:`RelaxedSchedule`) and ``auto``'s ssp segments.

    Holds the dense refresh period, this worker's step records until the next
    barrier flushes them, and the samples trained.
    """

    def __init__(self, trainer, relaxed, rsync):
        self.trainer, self.relaxed, self.rsync = trainer, relaxed, rsync
        self.phase = 0
        self.records = []   # this worker's steps since the last flush
        self.pending = {}   # first worker: step -> every worker's record
        #: First worker: the records of steps some worker has not run yet, as of the
        #: last flush (a checkpoint keeps them: the resumed run completes those lines).
        self.unsettled = []
        self.samples = 0
        self.period = DensePeriod(*parse_dense_period(trainer.config["dense_period"]))
        #: Local updates between refreshes (a period other than 1, or adaptive).
        self.local = self.period.adaptive or self.period.k > 1
        client = relaxed.client
        self.node = client.node if client is not None else None

    def enter_phase(self, clocks, budget) -> None:
        """Every rank enters the next phase; **collective** (a command)."""
        self.phase += 1
        self.trainer.engine.commands.run("relaxed", phase=self.phase, clocks=clocks,
                                         budget=budget)

    def step(self, step) -> StepFigures:
        """One relaxed step of this worker (``step`` = its clock + 1); local, but for
        the hierarchical mode's refresh agreement within a node."""
        t = self.trainer
        clock = PhaseClock(("data", "pull", "compute", "push", "optimizer"))
        lap, times = clock.lap, clock.times
        position = step - 1
        batch = t.batch(position)
        ids = t.model.sparse_ids(batch, position)
        lap("data")
        refresh = self.period.due(step)
        measured = self.rsync.local_steps > 0
        rows = self.rsync.pull(ids, t.dense, refresh=refresh)
        lap("pull")
        change = self._refreshed(step, measured) if refresh else None
        done = compute_step(t, rows, batch, position, step, clock)
        self.rsync.push(done.sparse, done.dense)
        lap("push")
        if self.local:
            self.rsync.local_update(t.dense, done.dense_local, t.optimizer)
            lap("optimizer")
        seconds = time.perf_counter() - clock.began
        self.period.observe(times["pull"], seconds, refresh)
        record = {"step": step, "loss": float(done.loss), "batch": done.local_batch,
                  "seconds": seconds, "time": times, "worker": t.topology.worker_index}
        if self.local:
            record["k"] = self.period.k
        if change is not None:
            record["dense_period"] = change
        return StepFigures(step, clock.began, times, done.local_batch, seconds,
                           float(done.loss), kind="relaxed", extra={"record": record})

    def record(self, figures) -> None:
        """Keep the step's record for the next barrier's metrics (local)."""
        t = self.trainer
        self.samples += figures.local_batch
        self.records.append(figures.extra["record"])
        t.progress.update(1, figures.loss,
                          figures.local_batch * t.topology.num_workers / figures.seconds)

    def _refreshed(self, step, measured):
        """Feed the refresh's divergence to the period controller; the change, or None.

        In the hierarchical mode **collective** over the node's workers (they
        refresh at the same steps): the node's largest divergence and its
        first worker's cost figures decide, so the node keeps one ``k``.
        """
        divergence = self.rsync.divergence if measured else None
        if self.node is not None and self.period.adaptive:
            from ..comm.reductions import largest

            got = largest(self.node, -1.0 if divergence is None else divergence)
            divergence = None if got < 0 else got
            p = self.period
            p.pull_refresh, p.pull_plain, p.step_seconds = self.node.bcast(
                (p.pull_refresh, p.pull_plain, p.step_seconds), root=0)
        change = self.period.refreshed(step, divergence)
        if change is not None:
            self.trainer.timeline.instant(f"dense period k {change['k_to']}", change)
            self.trainer.log(f"dense period: worker {self.trainer.topology.worker_index} "
                             f"step {step}: k {change['k_from']} -> {change['k_to']}: "
                             f"{change['reason']}")
        return change

    def flush(self, metrics, clocks, final=False) -> None:
        """First worker: one metrics line per step every worker has run (all when final);
        **collective** over the workers.

        The records of steps beyond the slowest worker's (``min(clocks)``) are kept in
        :attr:`unsettled` too, for a checkpoint: a run resumed from it reruns those steps
        only on the workers that had not run them, and :meth:`restore` hands their
        records back, so each step is one line with every worker's record.
        """
        t = self.trainer
        gathered = t.topology.workers.gather(self.records, root=0)
        self.records = []
        if not t.is_leader:
            return
        for records in gathered:
            for record in records:
                self.pending.setdefault(record["step"], []).append(record)
        self.unsettled = [r for step in sorted(self.pending) if step > min(clocks)
                          for r in self.pending[step]]
        done = max(clocks) if final else min(clocks)
        for step in sorted(s for s in self.pending if s <= done):
            records = self.pending.pop(step)
            batch = sum(r["batch"] for r in records)
            loss = sum(r["loss"] * r["batch"] for r in records) / batch
            t.losses.append(loss)
            d = t.config["time_dilation"]  # times reported undilated
            line = {
                "step": step, "loss": loss, "workers": len(records),
                "samples_per_s": sum(r["batch"] / r["seconds"] for r in records) * d,
                "seconds": float(np.mean([r["seconds"] for r in records])) / d,
                "time": {k: float(np.mean([r["time"][k] for r in records])) / d
                         for k in records[0]["time"]}}
            if t.emulated is not None:
                line["emulated"] = True
            if "k" in records[0]:
                line["dense_k"] = {str(r["worker"]): r["k"] for r in records}
            metrics.write(line)
            for r in records:
                if "dense_period" in r:
                    metrics.write({"step": step, "dense_period": {"worker": r["worker"],
                                                                  **r["dense_period"]}})

    def restore(self, records, worker_steps) -> int:
        """First worker, on resume: the checkpoint's :attr:`unsettled` records back into
        the pending lines; the number restored (local).

        Only records of a step past the slowest worker's and at or before their own
        worker's step are taken (a damaged or foreign list restores nothing else).
        """
        if not isinstance(records, list):
            return 0
        slowest = min(worker_steps)
        taken = 0
        for record in records:
            if not isinstance(record, dict):
                continue
            step, worker = record.get("step"), record.get("worker")
            if not (_is_record(record) and 0 <= worker < len(worker_steps)
                    and slowest < step <= worker_steps[worker]):
                continue
            self.pending.setdefault(step, []).append(record)
            taken += 1
        return taken

    def server_spans(self) -> None:
        """A server rank: the requests its relaxed server handled and the pulls it held
        back, moved onto the run's timeline (a no-op elsewhere); not collective."""
        server = self.relaxed.server
        if server is None or not server.events:
            return
        for name, start, end, args in server.events:
            self.trainer.timeline.span(name, start, end, args, cat="wait" if "wait" in name
                                       else "serve")
        server.events = []


class RelaxedSchedule:
    """``--consistency ssp|asp|psp``: relaxed phases between barriers, and the run's
    set-up and summary around them (workers; the servers serve the commands).

    The scheduler of :class:`~hpcpax.app.loop.TrainingLoop` and the strategy of
    each of its segments (one relaxed phase).
    """

    def __init__(self, trainer, relaxed, rsync):
        self.trainer, self.relaxed, self.rsync = trainer, relaxed, rsync
        self.steps = RelaxedSteps(trainer, relaxed, rsync)
        self.metrics = None
        self.clocks = None
        self.seconds = 0.0
        self.start_step = 1
        self._began = None

    # ------------------------------------------------------------- set-up
    def prepare(self, metrics_for) -> int:
        """Dense tables, resume, metrics; this worker's first step. **Collective**."""
        t = self.trainer
        topo, config = t.topology, t.config
        with t.watchdog.guard("set-up: dense tables"):
            self.rsync.register_dense()
        clock = self._resume() if config["resume"] else 0
        if not config["resume"] or clock == 0:
            t.engine.commands.run("relaxed_load_dense")
        self.clocks = topo.workers.allgather(clock)
        self.start_step = min(self.clocks) + 1
        if t.is_leader and not config["quiet"]:
            from . import build

            print(build.config_lines(topo, t.run_dir, t.model, config, t.engine.sync.describe())
                  + f"\n  consistency: {self.relaxed.default} ({self.relaxed.default.guarantee})",
                  flush=True)
        self.metrics = metrics_for(self.start_step, clock)
        return clock + 1

    def _resume(self) -> int:
        """Load the newest checkpoint; this worker's step in it (0 without one)."""
        t = self.trainer
        with t.watchdog.guard("set-up: resume"):
            start = t.checkpoints.resume(t.engine.commands, t.log)  # damaged ones skipped
            path = t.checkpoints.resumed_from
            if path is None:
                return 0
            steps = ckpt.read_meta(path).get("worker_steps") or \
                [start - 1] * t.topology.num_workers
            t.engine.commands.run("relaxed_load_dense")
        meta = ckpt.read_meta(path)
        periods = meta.get("dense_period")
        if periods and len(periods) == t.topology.num_workers:
            self.steps.period.load(periods[t.topology.worker_index])
        t.log(f"worker steps in {path}: {list(steps)}")
        if t.is_leader:  # the steps the slower workers still run: their lines to complete
            self.steps.restore(meta.get("unsettled_records"), [int(s) for s in steps])
        return int(steps[t.topology.worker_index])

    # ---------------------------------------------------------- scheduler
    def finished(self, step) -> bool:
        """True once the workers together ran the run (``bsp``/``ssp``: every worker
        ``--steps``; ``asp``/``psp``: ``--steps`` x workers steps in all)."""
        steps = self.trainer.config["steps"]
        if self.relaxed.default.bounded:
            return min(self.clocks) >= steps
        return sum(self.clocks) >= steps * len(self.clocks)

    def next_segment(self, step) -> tuple:
        """``(self, where every worker stops by itself)``: the end, the next checkpoint
        or evaluation."""
        config = self.trainer.config
        clock = step - 1
        stops = [config["steps"]] if self.relaxed.default.bounded else []
        for every in (config["checkpoint_every"], config["eval_every"]):
            if every:
                stops.append((clock // every + 1) * every)
        return self, (min(stops) if stops else int(NO_STOP))

    # ----------------------------------------------------------- strategy
    def label(self, step) -> str:
        """The watchdog's name for ``step``."""
        return f"step {step}"

    def begin(self, first, end) -> None:
        """Every rank enters the phase; **collective**."""
        t = self.trainer
        self._began, self.stop = time.perf_counter(), end
        budget = (None if self.relaxed.default.bounded
                  else t.config["steps"] * t.topology.num_workers)
        with t.watchdog.guard(f"relaxed phase {self.steps.phase + 1}: start at step {first}"):
            self.steps.enter_phase(self.clocks, budget)

    def stop_before(self, step) -> bool:
        """True where this worker's phase ends (a stop step agreed, or its own)."""
        return self.relaxed.boundary(self.stop, self.trainer.preemption.requested)

    def step(self, step) -> StepFigures:
        """One relaxed step (:meth:`RelaxedSteps.step`)."""
        return self.steps.step(step)

    def record(self, figures) -> None:
        """Keep the step's record (:meth:`RelaxedSteps.record`)."""
        self.steps.record(figures)

    def after(self, step, runner) -> int:
        """The user's hooks (not collective here: each worker at its own step)."""
        self.user_hooks(step)
        return step

    def user_hooks(self, step) -> None:
        """The user's hooks after ``step``."""
        t = self.trainer
        for hook in t.hooks:
            hook(t, step)

    def end(self, clock) -> int:
        """The phase's barrier (every rank): metrics, evaluation, checkpoint; ``clock``."""
        t = self.trainer
        self.relaxed.end()
        self.seconds += time.perf_counter() - self._began
        with t.watchdog.guard(f"relaxed barrier after step {clock}"):
            self.clocks, stopped = self._barrier(clock)
        if stopped:
            t.loop.stopped = True
        return clock

    def _barrier(self, clock):
        """Between phases (every rank together): metrics, evaluation, checkpoint.

        Returns ``(every worker's step, whether a preemption stops the run)``.
        """
        from ..comm.reductions import any_rank

        t = self.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(clock)
        signalled = any_rank(topo.workers, t.preemption.requested)
        self.clocks = clocks
        finished = self.finished(clock + 1)
        # preempted: lines only through the slowest worker's step; the rest are unsettled
        # records the checkpoint keeps, completed by the resumed run (each step logged once)
        self.steps.flush(self.metrics, clocks, final=finished)
        common = clocks[0] if len(set(clocks)) == 1 else None
        every = config["eval_every"]
        if every and common is not None and (common % every == 0 or finished):
            t.engine.commands.run("relaxed_fetch_dense")
            self.metrics.write({"step": common, "eval": t.evaluate(common)})
        if signalled:
            t.log(f"preemption signal: checkpoint at steps {clocks}, then exit", important=True)
            self._save(clocks)
            return clocks, True
        every = config["checkpoint_every"]
        if every and (finished or (common is not None and common % every == 0)):
            self._save(clocks)
        return clocks, False

    def _save(self, clocks) -> str:
        t = self.trainer
        periods = t.topology.workers.allgather(self.steps.period.state())
        t.engine.commands.run("relaxed_fetch_dense")
        step = min(clocks)
        meta = {**t.checkpoint_meta(step), "worker_steps": list(clocks),
                "consistency": t.config["consistency"], "dense_period": periods,
                "unsettled_records": self.steps.unsettled if t.is_leader else []}
        path = t.engine.commands.run("save", step=step, meta=json_safe(meta))
        t.log(f"checkpoint written: {path} (worker steps {list(clocks)})", important=True)
        return path

    # ------------------------------------------------------------- finish
    def finish(self, last) -> tuple:
        """Figures, stats and the trace, then stop every rank; ``(first step, last step,
        train seconds)`` for the summary. **Collective** over the workers."""
        t = self.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(last)
        from ..comm.reductions import total

        samples = total(topo.workers, self.steps.samples)
        changes = topo.workers.allgather(self.steps.period.history)
        if self.steps.local:
            t.engine.planning.runtime["dense_period"] = self._period_record(changes)
            t.write_plan()
        staleness, servers = t.engine.commands.run("relaxed_stats")
        trace = t.end_run(lambda: t.engine.commands.run("relaxed_fetch_dense"))
        seconds = self.seconds
        t.summary_extra.update(json_safe({
            "consistency": config["consistency"],
            "consistency_groups": config["consistency_groups"],
            "guarantee": self.relaxed.default.guarantee, "worker_steps": clocks,
            "samples": samples,
            "mean_samples_per_s": (samples / seconds * config["time_dilation"]
                                   if seconds else None),
            "staleness": staleness, "servers": servers, "trace": trace,
            "dense_period": self._period_record(changes) if self.steps.local else None}))
        return self.start_step, max(clocks), seconds

    def _period_record(self, changes) -> dict:
        """The dense period's setting, every worker's final ``k`` and changes."""
        period = self.steps.period
        return {"setting": self.trainer.config["dense_period"],
                "threshold": period.threshold, "k_max": period.k_max,
                "final_k": self.trainer.topology.workers.allgather(period.k),
                "changes": [{"worker": w, **c} for w, cs in enumerate(changes) for c in cs]}
