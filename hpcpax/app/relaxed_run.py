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
over them, with a dense period each worker's ``k`` as ``dense_k``), and one
line per change of ``k`` (``{"step", "dense_period": {worker, k_from, k_to,
divergence, refresh_cost_s, step_s, reason}}``), also saved in
``plan.json`` (``runtime``) and checkpoints; ``summary.json`` adds the
consistency, every worker's steps, the servers' staleness records and their
busy/idle/CPU seconds.
"""

from __future__ import annotations

import os
import time

import numpy as np

from ..plan.dense_period import DensePeriod, parse_dense_period
from ..ps.relaxed.consistency import parse_consistency_spec
from ..ps.relaxed import RelaxedParameterServer
from ..ps.relaxed.client import NO_STOP
from ..sync.relaxed import RelaxedSync
from . import checkpoint as ckpt
from .metrics import MetricsWriter, json_safe
from .step_report import PhaseClock, compute_step
from .stragglers import Stragglers

__all__ = ["setup", "plan_under", "relaxed_parts", "RelaxedRun"]


def plan_under(config, spec):
    """The plan to build: ``ps`` for ``auto``/``hybrid`` under a relaxed model."""
    if config["consistency"] == "auto":  # may run ssp segments: every variable on ps
        return "ps" if spec in ("auto", "hybrid") else spec
    default, per_variable = parse_consistency_spec(config["consistency"])
    relaxed = default.relaxed or any(m.relaxed for m in per_variable.values())
    return "ps" if relaxed and spec in ("auto", "hybrid") else spec


def setup(trainer):
    """Stragglers, and the relaxed machinery when the run needs it; **collective**.

    Called by every rank in :meth:`Trainer._build` once the parameter
    server, the sparse synchronizers, the dense variables and the command
    channel exist. Returns a :class:`RelaxedRun`, or None under ``bsp``.
    """
    config, topo = trainer.config, trainer.topology
    trainer.stragglers = Stragglers.for_topology(config, topo)
    default, per_variable = parse_consistency_spec(config["consistency"],
                                                   list(trainer.sync.variables))
    if not (default.relaxed or any(m.relaxed for m in per_variable.values())):
        return None
    return RelaxedRun(trainer, *relaxed_parts(trainer, config["consistency"]))


def relaxed_parts(trainer, consistency):
    """``(RelaxedParameterServer, RelaxedSync)`` under ``consistency``, their commands
    added to the trainer's channel; **collective** (every rank)."""
    config = trainer.config
    relaxed = RelaxedParameterServer(trainer.ps, consistency,
                                     groups=config["consistency_groups"], seed=config["seed"])
    shapes = trainer.model.dense_shapes()
    rsync = RelaxedSync(relaxed, trainer.sync, shapes, config["dtype"], config["optimizer"],
                        config["lr"])
    trainer.commands.handlers.update({
        "relaxed": relaxed.enter_phase,
        "relaxed_load_dense": lambda: rsync.load_dense(trainer.dense, trainer.dense_state),
        "relaxed_fetch_dense": lambda: rsync.fetch_dense(trainer.dense, trainer.dense_state),
        "relaxed_stats": lambda: (relaxed.staleness(), relaxed.server_stats()),
        "stop": lambda preempted=False: (trainer._stop(preempted), relaxed.free()),
    })
    return relaxed, rsync


class RelaxedRun:
    """The workers' side of a relaxed run (servers serve the trainer's commands)."""

    def __init__(self, trainer, relaxed, rsync):
        self.trainer, self.relaxed, self.rsync = trainer, relaxed, rsync
        self.phase = 0
        self.records = []   # this worker's steps since the last flush
        self.pending = {}   # first worker: step -> every worker's record
        self.samples = 0
        self.period = DensePeriod(*parse_dense_period(trainer.config["dense_period"]))
        #: Local updates between refreshes (a period other than 1, or adaptive).
        self.local = self.period.adaptive or self.period.k > 1
        client = relaxed.client
        self.node = client.node if client is not None else None
        from .timeline import Timeline

        config, topo = trainer.config, trainer.topology
        # under auto, RunTime replaces this timeline with its own (one file for both
        # kinds of segment) and moves the servers' spans onto it before writing
        tracing = config["trace"] if config["consistency"] != "auto" else None
        self.timeline = Timeline(tracing, topo, comm=topo.comm)  # every rank: servers too
        if config["trace"] and relaxed.server is not None:
            relaxed.server.events = []
        trainer.commands.handlers["relaxed_trace"] = self._write_trace

    # ------------------------------------------------------------------ run
    def run(self, wall_start) -> dict:
        """Train (workers); **collective** over the workers, the servers following."""
        t = self.trainer
        topo, config = t.topology, t.config
        with t.watchdog.guard("set-up: dense tables"):
            self.rsync.register_dense()
        clock = self._resume() if config["resume"] else 0
        if not config["resume"] or clock == 0:
            t.commands.run("relaxed_load_dense")
        clocks = topo.workers.allgather(clock)
        start_step = min(clocks) + 1
        if t.is_leader and not config["quiet"]:
            from . import build

            print(build.config_lines(topo, t.run_dir, t.model, config, t.sync.describe())
                  + f"\n  consistency: {self.relaxed.default} ({self.relaxed.default.guarantee})",
                  flush=True)
        from .metrics import ProgressBar

        steps_shown = config["steps"]
        t._bar = ProgressBar(steps_shown, clock, t.is_leader and not config["quiet"])
        metrics = MetricsWriter(os.path.join(t.run_dir, "metrics.jsonl"), t.is_leader,
                                resumed_at=start_step - 1 if config["resume"] else None,
                                job_id=t.job_id,
                                log=lambda text: t.log(text, important=True))
        try:  # the trainer's preemption handler is active since MPI_Init
            clock, seconds, preempted = self._train(clock, metrics, t.preemption)
        finally:
            metrics.close()
        clocks = topo.workers.allgather(clock)
        from ..comm.reductions import total

        samples = total(topo.workers, self.samples)
        changes = topo.workers.allgather(self.period.history)
        if self.local:
            t.planning.runtime["dense_period"] = self._period_record(changes)
            t.write_plan()
        staleness, servers = t.commands.run("relaxed_stats")
        trace = t.commands.run("relaxed_trace") if self.timeline.enabled else None
        if t.collect:
            t.commands.run("relaxed_fetch_dense")
            t.parameters = t._read_parameters()
        t.commands.run("stop", preempted=preempted)
        t.summary_extra = json_safe({
            "consistency": config["consistency"],
            "consistency_groups": config["consistency_groups"],
            "guarantee": self.relaxed.default.guarantee, "worker_steps": clocks,
            "samples": samples, "mean_samples_per_s": samples / seconds if seconds else None,
            "staleness": staleness, "servers": servers, "trace": trace,
            "dense_period": self._period_record(changes) if self.local else None})
        return t._finish(start_step, max(clocks), seconds, wall_start)

    def server_spans(self) -> None:
        """A server rank: the requests its relaxed server handled and the pulls it held
        back, moved onto the timeline (a no-op elsewhere); not collective."""
        server = self.relaxed.server
        if server is None or not server.events:
            return
        for name, start, end, args in server.events:
            self.timeline.span(name, start, end, args, cat="wait" if "wait" in name
                               else "serve")
        server.events = []

    def _write_trace(self):
        """Merge every rank's trace events (servers' requests included); the path on
        the first worker. **Collective** (run it as a command)."""
        self.server_spans()
        path = self.timeline.write()
        if path is not None:
            self.trainer.log(f"trace written: {path}", important=True)
        return path

    def _period_record(self, changes) -> dict:
        """The dense period's setting, every worker's final ``k`` and changes."""
        return {"setting": self.trainer.config["dense_period"],
                "threshold": self.period.threshold, "k_max": self.period.k_max,
                "final_k": self.trainer.topology.workers.allgather(self.period.k),
                "changes": [{"worker": w, **c} for w, cs in enumerate(changes) for c in cs]}

    def _resume(self) -> int:
        """Load the newest checkpoint; this worker's step in it (0 without one)."""
        t = self.trainer
        with t.watchdog.guard("set-up: resume"):
            start = t.checkpoints.resume(t.commands, t.log)  # damaged ones skipped
            path = t.checkpoints.resumed_from
            if path is None:
                return 0
            steps = ckpt.read_meta(path).get("worker_steps") or \
                [start - 1] * t.topology.num_workers
            t.commands.run("relaxed_load_dense")
        periods = ckpt.read_meta(path).get("dense_period")
        if periods and len(periods) == t.topology.num_workers:
            self.period.load(periods[t.topology.worker_index])
        t.log(f"worker steps in {path}: {list(steps)}")
        return int(steps[t.topology.worker_index])

    def _static_stop(self, clock) -> int:
        """Where every worker stops this phase by itself: end, next checkpoint or eval."""
        config = self.trainer.config
        stops = [config["steps"]] if self.relaxed.default.bounded else []
        for every in (config["checkpoint_every"], config["eval_every"]):
            if every:
                stops.append((clock // every + 1) * every)
        return min(stops) if stops else int(NO_STOP)

    def _finished(self, clocks) -> bool:
        steps = self.trainer.config["steps"]
        if self.relaxed.default.bounded:
            return min(clocks) >= steps
        return sum(clocks) >= steps * len(clocks)

    def _train(self, clock, metrics, preemption):
        t = self.trainer
        topo, config = t.topology, t.config
        budget = None if self.relaxed.default.bounded else config["steps"] * topo.num_workers
        seconds, stopped = 0.0, False
        clocks = topo.workers.allgather(clock)
        while not (stopped or self._finished(clocks)):
            began = time.perf_counter()
            self.phase += 1
            with t.watchdog.guard(f"relaxed phase {self.phase}: start at step {clock + 1}"):
                t.commands.run("relaxed", phase=self.phase, clocks=clocks, budget=budget)
            stop = self._static_stop(clock)
            while True:
                with t.watchdog.guard(f"step {clock + 1}"):
                    if self.relaxed.boundary(stop, preemption.requested):
                        break
                    self._step(clock + 1)
                clock += 1
                for hook in t.hooks:  # here not collective: each worker at its own step
                    hook(t, clock)
            self.relaxed.end()
            seconds += time.perf_counter() - began
            with t.watchdog.guard(f"relaxed barrier after step {clock}"):
                clocks, stopped = self._barrier(clock, metrics, preemption)
        return clock, seconds, stopped

    def _barrier(self, clock, metrics, preemption):
        """Between phases (every rank together): metrics, evaluation, checkpoint.

        Returns ``(every worker's step, whether a preemption stops the run)``.
        """
        from ..comm.reductions import any_rank

        t = self.trainer
        topo, config = t.topology, t.config
        clocks = topo.workers.allgather(clock)
        signalled = any_rank(topo.workers, preemption.requested)
        finished = self._finished(clocks)
        self._flush(metrics, clocks, final=finished or signalled)
        common = clocks[0] if len(set(clocks)) == 1 else None
        every = config["eval_every"]
        if every and common is not None and (common % every == 0 or finished):
            t.commands.run("relaxed_fetch_dense")
            metrics.write({"step": common, "eval": t.evaluate(common)})
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
        periods = t.topology.workers.allgather(self.period.state())
        t.commands.run("relaxed_fetch_dense")
        step = min(clocks)
        meta = {"config": t.config,
                "training_fingerprint": t.checkpoints.training_fingerprint(),
                "data_fingerprint": t.checkpoints.data_fingerprint,
                "topology": t.topology.describe(), "plan": t.planning.current_plan().to_dict(),
                "data_position": step, "worker_steps": list(clocks),
                "consistency": t.config["consistency"], "dense_period": periods,
                "rng": "counter-based (seed, step): nothing to save", "job_id": t.job_id}
        path = t.commands.run("save", step=step, meta=json_safe(meta))
        t.log(f"checkpoint written: {path} (worker steps {list(clocks)})", important=True)
        return path

    # ----------------------------------------------------------------- step
    def _step(self, step) -> None:
        """One relaxed step of this worker (``step`` = its clock + 1)."""
        t = self.trainer
        clock = PhaseClock(("data", "pull", "compute", "push", "optimizer"))
        lap, times = clock.lap, clock.times
        position = step - 1
        batch = t._batch(position)
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
        ended = time.perf_counter()
        seconds = ended - clock.began
        self.timeline.step(step, clock.began, times, ended)
        self.period.observe(times["pull"], seconds, refresh)
        self.samples += done.local_batch
        record = {"step": step, "loss": float(done.loss), "batch": done.local_batch,
                  "seconds": seconds, "time": times, "worker": t.topology.worker_index}
        if self.local:
            record["k"] = self.period.k
        if change is not None:
            record["dense_period"] = change
        self.records.append(record)
        t._bar.update(1, record["loss"], done.local_batch * t.topology.num_workers / seconds)

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
            self.timeline.instant(f"dense period k {change['k_to']}", change)
            self.trainer.log(f"dense period: worker {self.trainer.topology.worker_index} "
                             f"step {step}: k {change['k_from']} -> {change['k_to']}: "
                             f"{change['reason']}")
        return change

    def _flush(self, metrics, clocks, final=False) -> None:
        """First worker: one metrics line per step every worker has run (all when final)."""
        t = self.trainer
        gathered = t.topology.workers.gather(self.records, root=0)
        self.records = []
        if not t.is_leader:
            return
        for records in gathered:
            for record in records:
                self.pending.setdefault(record["step"], []).append(record)
        done = max(clocks) if final else min(clocks)
        for step in sorted(s for s in self.pending if s <= done):
            records = self.pending.pop(step)
            batch = sum(r["batch"] for r in records)
            loss = sum(r["loss"] * r["batch"] for r in records) / batch
            t.losses.append(loss)
            line = {
                "step": step, "loss": loss, "workers": len(records),
                "samples_per_s": sum(r["batch"] / r["seconds"] for r in records),
                "seconds": float(np.mean([r["seconds"] for r in records])),
                "time": {k: float(np.mean([r["time"][k] for r in records]))
                         for k in records[0]["time"]}}
            if "k" in records[0]:
                line["dense_k"] = {str(r["worker"]): r["k"] for r in records}
            metrics.write(line)
            for r in records:
                if "dense_period" in r:
                    metrics.write({"step": step, "dense_period": {"worker": r["worker"],
                                                                  **r["dense_period"]}})
