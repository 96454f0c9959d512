"""One run of ``python -m hpcpax.train``, reusable in-process: :class:`Trainer`.

The trainer sets a run up and tears it down; the steps are the loop's
(:mod:`hpcpax.app.loop`). Set-up, in named watchdog phases: the device, the
run directory, the model, the :class:`~hpcpax.engine.engine.Engine`
(parameter server, sparse synchronizers, dense allreduce, planner,
commands; from :func:`~hpcpax.engine.engine.build_engine`, as
``ModelSync``'s), the dense parameters and their optimizer, the data. Then
the consistency's schedule (:class:`~hpcpax.app.bsp_step.BSPSchedule`,
:class:`~hpcpax.app.relaxed_run.RelaxedSchedule` or
:class:`~hpcpax.app.auto_run.AutoSchedule`) prepares (resume, metrics), the
:class:`~hpcpax.app.loop.TrainingLoop` runs its segments with the step hooks
(:mod:`hpcpax.app.step_hooks`), and the schedule finishes (tables, trace,
stop); the summary goes to ``summary.json`` and the run log.

Server ranks follow the workers in
:meth:`~hpcpax.engine.commands.CommandChannel.serve`. Things every rank must
do together besides the steps (checkpoint, restore, switch, stop) go
through the engine's command channel.

Steps are numbered from 1; step ``s`` reads global batch ``s - 1``, and a
checkpoint after step ``s`` resumes at ``s + 1`` (data readers are stateless).
"""

from __future__ import annotations

import dataclasses
import os
import time

from ..backend import to_host
from ..comm.agreement import check_same
from ..comm.polling import within_waits
from ..comm.watchdog import Watchdog
from ..engine import EngineSettings, build_engine, resolve_plan
from ..runlog.records import record_run
from ..options import options
from ..ps.memory import table_report
from . import build, relaxed_run
from .balance import BatchBalancer
from .bsp_step import BSPSchedule, BSPSteps
from .run_checkpoints import RunCheckpoints
from .config import resolve
from .datasets import build_model, check_full_eval_memory, check_synthetic_memory, open_data
from .device_choice import worker_device
from .emulation import EmulatedCompute, dilated_waits, parse_emulate_compute
from .evaluation import evaluate
from .loop import TrainingLoop
from .metrics import MetricsWriter, ProgressBar, json_safe, read_metrics, write_json
from .preemption import PreemptionHandler
from .step_hooks import BalanceHook, TraceHook
from .step_report import BYTE_PHASES, TIME_PHASES, summarize, summary_line
from .stragglers import Stragglers
from .throughput import steady_throughput, unsteady_steps
from .timeline import ServedOps, Timeline

__all__ = ["Trainer", "TIME_PHASES", "BYTE_PHASES"]

class Trainer:
    """One training run: set-up, steps, checkpoints, outputs.

    Args:
        config: setting overrides ``{key: value}`` (flag names with
            underscores; see :data:`hpcpax.app.config.FLAGS`), or the dict
            :func:`hpcpax.app.config.parse_args` returns.
        comm: communicator to run on (default ``MPI.COMM_WORLD``); pass
            ``MPI.COMM_SELF`` for a one-process run inside a bigger job.
        plan: per-variable plan ``{name: {"method", "partitions"[, "owners"]}}``
            overriding ``config["plan"]``; variables it omits use ``ps``.
        hooks: callables ``hook(trainer, step)`` run on workers after every
            step (all workers call them; they may call :meth:`repartition`).
        collect: keep the final parameters in :attr:`parameters` (workers;
            reads whole tables, for tests and small models).

    :meth:`run` is **collective** over ``comm``.
    """

    def __init__(self, config=None, *, comm=None, plan=None, hooks=(), collect=False):
        self.config = resolve(config)
        self.comm = comm
        self._plan_override = plan
        self.hooks = list(hooks)
        self.collect = collect
        self.parameters = None
        self.summary = None
        self.losses = []
        self.is_leader = False
        #: True when the run stopped on a preemption signal (after checkpointing).
        self.preempted = False
        self._bar = None
        self.summary_extra = {}  # fields added to summary.json (a relaxed run's figures)
        self.tables = {}
        #: Start-up seconds: ``engine`` (its build, the plan's measurements included) and
        #: ``total`` (from the start of :meth:`run` to the first step), in summary.json.
        self.startup = {}
        #: The :class:`~hpcpax.engine.engine.Engine` (set up by :meth:`run`).
        self.engine = None
        #: The :class:`~hpcpax.app.loop.TrainingLoop` (workers, once training starts).
        self.loop = None

    # ---------------------------------------------------------------- output
    def log(self, text, everyone=False, important=False) -> None:
        """Print on the first worker (every rank with ``everyone`` and
        ``--verbose-ranks``); ``--quiet`` keeps only ``important`` lines."""
        if self.config["quiet"] and not (important or everyone):
            return
        if self.is_leader or (everyone and self.config["verbose_ranks"]):
            prefix = "" if self.is_leader and not everyone else f"[rank {self.topology.rank}] "
            if self._bar is not None:
                self._bar.write(prefix + text)
            else:
                print(prefix + text, flush=True)

    def write_plan(self) -> None:
        """Save the plan in force as ``plan.json`` (first worker; local)."""
        self.engine.write_plan()

    @property
    def stopped(self) -> bool:
        """True once a preemption signal stopped the loop (after its checkpoint)."""
        return self.loop is not None and self.loop.stopped

    # ------------------------------------------------------------------- run
    def run(self) -> dict:
        """Train; **collective**. Returns the summary dict (full on the first worker).

        :attr:`preempted` then says whether the run stopped early on a
        preemption signal (after its checkpoint).
        """
        from ..comm.startup import check_arrival
        from ..comm.topology import init
        from ..comm.topology import world_comm

        config = self.config
        check_arrival(self.comm, config["timeout"])  # a rank stuck in imports is named
        # flags as given (run dir made absolute), before init or the watchdog use them
        given = {**config, "run_dir": config["run_dir"] and os.path.abspath(config["run_dir"])}
        check_same(self.comm if self.comm is not None else world_comm(), "training config",
                   json_safe(given))
        self.topology = init(config["ranks_per_node"], config["servers_per_node"],
                             comm=self.comm)
        self.watchdog = Watchdog(self.topology.comm, config["timeout"],
                                 role=self.topology.role)
        try:
            # installed once MPI is up (MPI_Init replaces signal handlers), for the whole run:
            # a signal during set-up is honoured at the first step boundary
            with PreemptionHandler() as self.preemption, \
                    dilated_waits(config["time_dilation"]):
                self.summary = self._run()
            return self.summary
        finally:
            if self._bar is not None:
                self._bar.close()
            self.watchdog.close()
            self.topology.free()

    def _run(self):
        topo, config = self.topology, self.config
        self.is_leader = topo.is_worker and topo.worker_index == 0
        wall_start, self._cpu_start = time.perf_counter(), time.process_time()
        # Set-up runs in named guarded phases: a rank stuck in one (a hung
        # file system, a bad GPU) makes the others' watchdogs report it in
        # that phase while they wait in the next collective.
        setup = self.watchdog.guard
        with setup("set-up: device"):
            # Servers are CPU processes; each worker takes GPU (local worker rank % count),
            # with --device auto only where a trial step measured faster there
            self.device = worker_device(self)
        with setup("set-up: run dir and config"):
            self.run_dir, self.job_id, note = build.prepare_run_dir(topo, config)
            config["run_dir"] = self.run_dir
            check_same(topo.comm, "training config", json_safe(config))
            self.checkpoints = RunCheckpoints(topo, self.run_dir, config, self.job_id)
        with setup("set-up: model and plan"):
            self._build()
        if topo.is_server:
            self.engine.serve()  # a server notes signals; the workers decide
            return self._finish(0, 0, 0.0, wall_start)
        if note:
            self.log(note, important=True)
        with setup("set-up: sparse tables"):
            self.engine.sync.register()
            self.write_plan()
        with setup("set-up: checkpoints and data"):
            for line in self.engine.commands.run("check_disk"):
                self.log(line, important=True)
            self.reader, self.eval_set = open_data(self.model, config)
        first = self.schedule.prepare(self._metrics_for)
        metrics = self.metrics
        hooks = [TraceHook(self.timeline),
                 BalanceHook(self.balance, metrics, self.timeline, self.engine.planning)]
        if config["consistency"] == "auto":
            hooks.append(self.schedule)  # auto measures the BSP steps it decides from
        self.loop = TrainingLoop(self.watchdog, self.schedule, hooks)
        self.startup["total"] = time.perf_counter() - wall_start
        try:
            last = self.loop.run(first)
            start_step, last, train_seconds = self.schedule.finish(last)
        finally:
            metrics.close()
        return self._finish(start_step, last, train_seconds, wall_start)

    def _build(self) -> None:
        """Model, engine, dense state, schedule, timeline; **collective**."""
        topo, config = self.topology, self.config
        self.model = build_model(config)
        here = sum(1 for rank in topo.worker_ranks if topo.node_of[rank] == topo.node)
        check_synthetic_memory(self.model, config, here)  # before tables, plan and data
        check_full_eval_memory(self.model, config)
        specs = build.sparse_specs(self.model, config)
        spec = config["plan"] if self._plan_override is None else self._plan_override
        request = resolve_plan(relaxed_run.plan_under(config, spec), [s.name for s in specs])
        self.dense, self.optimizer, self.dense_state = build.dense_variables(
            topo, self.model, config, self.device.xp)
        modeled = parse_emulate_compute(config["emulate_compute"], config["time_dilation"])
        settings = EngineSettings.from_config(config)
        if modeled is not None:  # a run of known length: start-up keeps to a share of it
            step_s = modeled.seconds(config["global_batch"] / max(1, topo.num_workers))
            settings = dataclasses.replace(settings, plan=dataclasses.replace(
                settings.plan, planned_run_s=config["steps"] * step_s))
        began = time.perf_counter()
        self.engine = engine = build_engine(
            topo, specs, request, settings,
            dense=build.dense_shapes(self.model), watchdog=self.watchdog,
            run_dir=self.run_dir, log=self.log)
        # the parameter server, the tables' layout, the plan's start-up measurements
        self.startup["engine"] = time.perf_counter() - began
        engine.commands.handlers.update({
            **self.checkpoints.handlers(engine.sync, self.dense, self.dense_state,
                                        self.optimizer, self.device.xp),
            "stop": self.note_stop, "trace": self._write_trace,
            "tables": lambda: table_report(topo.comm, engine.ps)})
        #: The emulated accelerator (``--emulate-compute``), or None.
        self.emulated = None
        if modeled is not None:
            self.emulated = EmulatedCompute(modeled, self.model.dense_shapes(), self.model.dtype,
                                            self.device.xp)
        #: What runs a step's forward and backward: the model, or the emulated accelerator.
        self.compute = self.emulated if self.emulated is not None else self.model
        self.stragglers = Stragglers.for_topology(config, topo)
        self.balance = BatchBalancer(config["batch_shares"], config["rebalance_every"], topo,
                                     config["global_batch"], self.log)
        self.schedule, self._relaxed_steps = self._make_schedule()
        # every rank: servers get a track of the operations they serve (the start-up
        # barrier of the trace is collective over every rank)
        self.timeline = Timeline(config["trace"], topo, comm=topo.comm)
        if self.timeline.enabled and topo.is_server and config["consistency"] in ("bsp", "auto"):
            engine.ps.watchdog = ServedOps(engine.ps.watchdog, self.timeline)
        if topo.rank == 0:
            write_json(os.path.join(self.run_dir, "config.json"),
                       {**config, "model_config": self.model.config(),
                        "topology": topo.describe()})

    def _make_schedule(self):
        """The consistency's schedule and its relaxed steps (None under bsp); **collective**."""
        from .auto_run import make_auto

        config = self.config
        self.bsp = BSPSteps(self)
        if config["consistency"] == "auto":
            auto = make_auto(self, self.bsp)
            return auto, auto.relaxed_steps
        if relaxed_run.is_relaxed(config["consistency"], list(self.engine.sync.variables)):
            relaxed, rsync = relaxed_run.relaxed_parts(self, config["consistency"])
            schedule = relaxed_run.RelaxedSchedule(self, relaxed, rsync)
            return schedule, schedule.steps
        return BSPSchedule(self, self.bsp), None

    # ------------------------------------------------------------ checkpoint
    def checkpoint_meta(self, step) -> dict:
        """What every checkpoint's ``meta.json`` holds after ``step`` (local)."""
        return {"config": self.config,
                "training_fingerprint": self.checkpoints.training_fingerprint(),
                "data_fingerprint": self.checkpoints.data_fingerprint,
                "topology": self.topology.describe(),
                "plan": self.engine.current_plan().to_dict(),
                "data_position": step, "rng": "counter-based (seed, step): nothing to save",
                "job_id": self.job_id}

    def save_checkpoint(self, step) -> str:
        """Write a checkpoint after ``step`` steps; **collective** over the workers."""
        meta = {**self.checkpoint_meta(step), "batch_shares": self.balance.state(),
                **self.schedule.checkpoint_state()}
        path = self.engine.commands.run("save", step=step, meta=json_safe(meta))
        self.log(f"checkpoint written: {path}", important=True)
        return path

    def note_stop(self, preempted=False):
        """The ``stop`` command: the run ends (on a preemption signal when ``preempted``)."""
        self.preempted = bool(preempted)

    def resume(self) -> int:
        """Load the newest intact checkpoint (damaged ones skipped) and the balancer's and
        the schedule's state in it; the step to start at. **Collective** over the workers."""
        from .checkpoint_files import read_meta

        with self.watchdog.guard("set-up: resume"):  # bounded like a save inside a step
            step = self.checkpoints.resume(self.engine.commands, self.log)
            path = self.checkpoints.resumed_from
            if path is not None:
                self.balance.resume(path)
                self.schedule.restore(read_meta(path) if self.topology.worker_index == 0
                                      else {})
            return step

    # ------------------------------------------------------------------ steps
    def batch(self, position):
        """This worker's shard of global batch ``position``, on its device."""
        batch = self.balance.batch(self.reader, position)  # even or balanced shares
        if self.device.kind == "gpu":
            batch = {k: self.device.xp.asarray(v) for k, v in batch.items()}
        return batch

    def evaluate(self, step) -> dict:
        """Eval metrics on the eval set, from global sums (see :mod:`.evaluation`); **collective**."""
        return evaluate(self.model, self.dense, self.engine.sync.pull, self.eval_set,
                        self.topology, self.config, device=self.device, step=step, log=self.log)

    def _metrics_for(self, start_step, done):
        """The progress bar (at ``done`` steps) and the metrics writer of a run starting at
        ``start_step`` (first worker writes)."""
        config = self.config
        self._bar = ProgressBar(config["steps"], done, self.is_leader and not config["quiet"])
        self.metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"), self.is_leader,
                             resumed_at=start_step - 1 if config["resume"] else None,
                             job_id=self.job_id, log=lambda text: self.log(text, important=True))
        return self.metrics

    @property
    def progress(self):
        """The run's :class:`~hpcpax.app.metrics.ProgressBar`."""
        return self._bar

    # ------------------------------------------------------------------- plan
    def switch_method(self, name, method) -> None:
        """Move sparse variable ``name`` to ``method``, exactly; **collective** (workers).

        See :meth:`hpcpax.engine.engine.Engine.switch_method`.
        """
        self.engine.switch_method(name, method)

    def repartition(self, name, partitions, owners=None) -> None:
        """Move PS variable ``name`` to ``partitions`` partitions, live; **collective** (workers)."""
        self.engine.repartition(name, partitions, owners)

    def read_parameters(self) -> dict:
        """``{"dense": ..., "sparse": ...}``: every parameter, on every worker; **collective**."""
        return {"dense": {k: to_host(v).copy() for k, v in self.dense.items()},
                "sparse": self.engine.sync.read_tables()}

    def end_run(self, before_collect=None):
        """A schedule's last act: the trace, the parameters (``collect``; after
        ``before_collect()``), then the ``stop`` command that releases the servers. The
        trace's path (None without one). **Collective** over the workers."""
        path = self.write_trace()
        if self.collect:
            if before_collect is not None:
                before_collect()
            self.parameters = self.read_parameters()
        self.engine.commands.run("stop", preempted=self.loop.stopped)
        return path

    # ------------------------------------------------------------------ trace
    def write_trace(self):
        """Merge and write the ``--trace`` file; its path on the first worker (None when
        tracing is off). **Collective** over the workers (servers join as a command)."""
        if not self.timeline.enabled:
            return None
        path = self.engine.commands.run("trace")
        if path is not None:
            self.log(f"trace written: {path}", important=True)
        return path

    def _write_trace(self):
        if self._relaxed_steps is not None:  # a server's requests of the relaxed phases
            self._relaxed_steps.server_spans()
        return self.timeline.write()  # every rank: the first worker writes the file

    # ----------------------------------------------------------------- finish
    def _finish(self, start_step, last, train_seconds, wall_start):
        topo = self.topology
        steady = None
        if self.is_leader:  # steady-state throughput from the steps this run logged
            steady = steady_throughput(
                [r for r in read_metrics(os.path.join(self.run_dir, "metrics.jsonl"))
                 if "loss" in r and start_step <= r["step"] <= last],
                self.config["global_batch"], unsteady_steps(self.config, start_step,
                                                            self.engine.planning))
        summary = summarize(topo, self.losses, start_step=start_step, last=last,
                            steady=steady,
                            train_seconds=train_seconds / self.config["time_dilation"],
                            wall=time.perf_counter() - wall_start,
                            checkpoints=self.checkpoints, preempted=self.preempted,
                            signal=self.preemption.signal_name if self.preempted else None,
                            cpu_seconds=time.process_time() - self._cpu_start)
        if not self.is_leader:
            self.log(f"done; my bytes sent {topo.accounting.totals()['sent_bytes']:,}",
                     everyone=True)
            return {"rank": topo.rank, "role": topo.role}
        self._bar.close()
        summary.update(self.summary_extra)
        summary["tables"] = self.tables
        summary["startup_seconds"] = {k: round(v, 4) for k, v in self.startup.items()}
        summary["time_dilation"] = self.config["time_dilation"]
        summary["wait"] = {"policy": options.wait, "poll_seconds": options.poll_seconds,
                           "within": within_waits()}
        summary["emulated_compute"] = (self.emulated.compute.to_dict()
                                       if self.emulated is not None else None)
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        if not self.config["quiet"]:
            print(summary_line(summary, self.run_dir), flush=True)
        # after the summary line: the log's bounded wait for a lock never costs the run its end
        record_run(self.engine, self.config)  # one record in the run log (never raises)
        return summary
