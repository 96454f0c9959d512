"""The training loop on hpcpax's primitives, reusable in-process: :class:`Trainer`.

Roles (see :mod:`hpcpax.comm.topology`): server ranks follow the workers in
:meth:`~hpcpax.ps.server.ParameterServer.serve`; workers run BSP steps::

    batch  = reader.batch(step - 1, G, worker_index, num_workers)   # own shard
    rows   = sync.pull(model.sparse_ids(batch))        # every sparse variable
    result = model.forward_backward(dense, rows, batch)
    sync.push(result.sparse_grads)                     # owners apply the optimizer
    DenseAllreduce(mean) of dense grads; dense optimizer on every worker
    one Allreduce of a small vector: loss x batch, phase times, bytes, preempt flag

Each sparse variable is synced by its :class:`~hpcpax.sync.variable.VariableSync`
(``ps``, ``allgather`` or ``allreduce``, as the plan says); the
:class:`~hpcpax.tune.controller.PlanController` measures, plans and moves
variables live. Things every rank must do together besides the steps
(checkpoint, restore, switch, stop) go through a
:class:`~hpcpax.app.commands.CommandChannel`.

Steps are numbered from 1; step ``s`` reads global batch ``s - 1``, and a
checkpoint after step ``s`` resumes at ``s + 1`` (data readers are stateless).
"""

from __future__ import annotations

import os
import time

from ..backend import to_host
from ..comm.agreement import check_same
from ..comm.watchdog import Watchdog
from ..options import parse_bytes
from ..tune.controller import PlanController
from ..runlog.records import record_run
from ..ps.memory import table_report
from . import auto_run, build, relaxed_run
from .checkpointing import RunCheckpoints
from .commands import CommandChannel
from .config import resolve
from .datasets import build_model, check_full_eval_memory, check_synthetic_memory, open_data
from .device_choice import worker_device
from .evaluation import evaluate
from .metrics import MetricsWriter, ProgressBar, json_safe, read_metrics, write_json
from .preemption import PreemptionHandler
from .runtime import RunTime
from .throughput import steady_throughput, unsteady_steps
from .step_report import (BYTE_PHASES, TIME_PHASES, PhaseClock, compute_step, reduce_step,
                          step_record, summarize, summary_line)

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
        self.stopped = False
        #: True when the run stopped on a preemption signal (after checkpointing).
        self.preempted = False
        self._bar = None
        self.summary_extra = {}  # fields added to summary.json (a relaxed run's figures)

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
        if self.is_leader:
            self.planning.current_plan().save(os.path.join(self.run_dir, "plan.json"))

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
            with PreemptionHandler() as self.preemption:
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
            self.commands.serve()  # a server notes signals; the workers decide
            return self._finish(0, 0, 0.0, wall_start)
        if note:
            self.log(note, important=True)
        with setup("set-up: sparse tables"):
            self.sync.register()
            self.write_plan()
        with setup("set-up: checkpoints and data"):
            for line in self.commands.run("check_disk"):
                self.log(line, important=True)
            self.reader, self.eval_set = open_data(self.model, config)
        if self.relaxed is not None:  # --consistency ssp|asp|psp|auto: relaxed_run, auto_run
            return self.relaxed.run(wall_start)
        start_step = self._resume() if config["resume"] else 1
        if self.is_leader and not config["quiet"]:
            print(build.config_lines(topo, self.run_dir, self.model, config,
                                     self.sync.describe()), flush=True)
        self._bar = ProgressBar(config["steps"], start_step - 1,
                                self.is_leader and not config["quiet"])
        metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"), self.is_leader,
                                resumed_at=start_step - 1 if config["resume"] else None,
                                job_id=self.job_id,
                                log=lambda text: self.log(text, important=True))
        self.planning.start(start_step, resumed=start_step > 1)
        try:
            last, train_seconds = self._train_loop(start_step, metrics)
            # rows held, created and evicted per ps table (every rank's shards)
            self.tables = self.commands.run("tables")
        finally:
            metrics.close()
        self.runtime.finish()  # the --trace file
        if self.collect:
            self.parameters = self._read_parameters()
        self.commands.run("stop", preempted=self.stopped)
        return self._finish(start_step, last, train_seconds, wall_start)

    def _build(self) -> None:
        """Model, plan, parameter server, synchronizers, dense state; **collective**."""
        from ..ps.server import ParameterServer
        from ..sync.sparse_set import SparseSync

        topo, config = self.topology, self.config
        self.model = build_model(config)
        here = sum(1 for rank in topo.worker_ranks if topo.node_of[rank] == topo.node)
        check_synthetic_memory(self.model, config, here)  # before tables, plan and data
        check_full_eval_memory(self.model, config)
        specs = build.sparse_specs(self.model, config)
        spec = config["plan"] if self._plan_override is None else self._plan_override
        spec = relaxed_run.plan_under(config, spec)
        mode, requests = build.plan_requests(spec, [s.name for s in specs])
        self.ps = ParameterServer(topo, local_aggregation=config["local_aggregation"],
                                  seed=config["seed"])
        self.ps.watchdog = self.watchdog  # each served operation is guarded
        self.ps.memory_budget = parse_bytes(config["server_memory_budget"],
                                            "server_memory_budget")
        self.sync = SparseSync(topo, self.ps, specs, requests, seed=config["seed"])
        self.ps.set_hot_rows(build.hot_rows_requests(requests, config["hot_rows"]))
        self.dense, self.optimizer, self.dense_state, self.allreduce = build.dense_variables(
            topo, self.model, config, self.device.xp)
        self.planning = PlanController(self, mode, label=spec if isinstance(spec, str)
                                       else "table")
        self.planning.measure_fabric()
        self.commands = CommandChannel(topo, self.ps, {
            **self.checkpoints.handlers(self.sync, self.dense, self.dense_state,
                                        self.optimizer, self.device.xp),
            "switch": self.sync.switch, "stop": self._stop, "hot_rows": self.ps.set_hot_rows,
            "tables": lambda: table_report(topo.comm, self.ps)})
        self.relaxed = auto_run.setup(self)  # stragglers; relaxed server / auto if asked
        self.runtime = RunTime(self)  # balanced BSP (--batch-shares), timeline (--trace)
        if topo.rank == 0:
            write_json(os.path.join(self.run_dir, "config.json"),
                       {**config, "model_config": self.model.config(),
                        "topology": topo.describe()})

    # ------------------------------------------------------------ checkpoint
    def save_checkpoint(self, step) -> str:
        """Write a checkpoint after ``step`` steps; **collective** over the workers."""
        meta = {"config": self.config,
                "training_fingerprint": self.checkpoints.training_fingerprint(),
                "data_fingerprint": self.checkpoints.data_fingerprint,
                "topology": self.topology.describe(),
                "plan": self.planning.current_plan().to_dict(),
                **self.runtime.checkpoint_meta(),  # batch shares, auto
                "data_position": step, "rng": "counter-based (seed, step): nothing to save",
                "job_id": self.job_id}
        path = self.commands.run("save", step=step, meta=json_safe(meta))
        self.log(f"checkpoint written: {path}", important=True)
        return path

    def _stop(self, preempted=False):
        self.preempted = bool(preempted)

    def _resume(self) -> int:
        """Load the newest intact checkpoint (damaged ones skipped); the step to start at."""
        with self.watchdog.guard("set-up: resume"):  # bounded like a save inside a step
            return self.runtime.resume(self.checkpoints.resume(self.commands, self.log))

    # ------------------------------------------------------------------ steps
    def _batch(self, position):
        """This worker's shard of global batch ``position``, on its device."""
        batch = self.balance.batch(self.reader, position)  # even or balanced shares
        if self.device.kind == "gpu":
            batch = {k: self.device.xp.asarray(v) for k, v in batch.items()}
        return batch

    def train_step(self, step):
        """One BSP step on this worker; returns ``(loss, local batch, phase seconds)``.

        **Collective** over the workers (and the servers, through the PS).
        """
        clock = PhaseClock(TIME_PHASES)
        lap, times = clock.lap, clock.times
        position = step - 1
        batch = self._batch(position)
        ids = self.model.sparse_ids(batch, position)
        self.planning.observe(ids)
        lap("data")
        rows = self.sync.pull(ids)
        lap("pull")
        done = compute_step(self, rows, batch, position, step, clock)
        self.sync.push(done.sparse)
        lap("push")
        self.allreduce.allreduce(done.dense)
        lap("dense")
        for name, param in self.dense.items():
            self.optimizer.apply_dense(param, self.dense_state[name], done.dense[name])
        lap("optimizer")
        return done.loss, done.local_batch, times

    def _train_loop(self, start_step, metrics):
        self._loop = {"metrics": metrics, "previous": None, "seconds": 0.0,
                      "last": start_step - 1}
        step = start_step
        while step <= self.config["steps"] and not self.stopped:
            self.loop_step(step)
            step += 1
            if self.stopped:
                break
            for hook in self.hooks:
                hook(self, step - 1)
            # the planner may run further steps itself (trial steps of a search)
            step = self.planning.after_step(step - 1) + 1
        return self._loop["last"], self._loop["seconds"]

    def loop_step(self, step) -> None:
        """Train ``step``, write its metrics, checkpoint if due; **collective** (workers).

        Sets :attr:`stopped` when a preemption signal was seen (after
        checkpointing). Runs under the watchdog as ``step N``.
        """
        with self.watchdog.guard(f"step {step}"):
            self._loop_step(step)

    def _loop_step(self, step):
        config, loop = self.config, self._loop
        began, cpu_began = time.perf_counter(), time.process_time()
        loss, local_batch, mine = self.train_step(step)
        loss, stop, times, cumulative, cpu = reduce_step(
            self.topology, loss, local_batch, mine, self.preemption.requested,
            time.process_time() - cpu_began)
        seconds = time.perf_counter() - began
        self.runtime.after_step(step, began, mine, local_batch, loop["metrics"])
        loop["seconds"] += seconds
        loop["last"] = step
        self.losses.append(loss)
        delta = cumulative if loop["previous"] is None else cumulative - loop["previous"]
        loop["previous"] = cumulative
        record = step_record(step, loss, seconds, config["global_batch"], times, delta, cpu)
        loop["metrics"].write(record)
        self._bar.update(1, loss, record["samples_per_s"])
        if config["eval_every"] and (step % config["eval_every"] == 0 or step == config["steps"]):
            loop["metrics"].write({"step": step, "eval": self.evaluate(step)})
        if stop:
            self.stopped = True
            self.log(f"preemption signal: checkpoint after step {step}, then exit",
                     important=True)
            self.save_checkpoint(step)
        elif config["checkpoint_every"] and (step % config["checkpoint_every"] == 0
                                             or step == config["steps"]):
            self.save_checkpoint(step)

    def evaluate(self, step) -> dict:
        """Eval metrics on the eval set, from global sums (see :mod:`.evaluation`); **collective**."""
        return evaluate(self.model, self.dense, self.sync.pull, self.eval_set, self.topology,
                        self.config, device=self.device, step=step, log=self.log)

    # ------------------------------------------------------------------- plan
    def switch_method(self, name, method) -> None:
        """Move sparse variable ``name`` to ``method``, exactly; **collective** (workers).

        Every row and its optimizer state moves (PS owners <-> replicas on
        every worker); training continues as if ``method`` had been used all
        along.
        """
        from ..sync.methods import method_of

        method_of(method)  # refuses an unknown name here, before any rank moves
        self.commands.run("switch", name=name, method=method)
        self.write_plan()

    def repartition(self, name, partitions, owners=None) -> None:
        """Move PS variable ``name`` to ``partitions`` partitions, live; **collective** (workers)."""
        self.sync[name].repartition(int(partitions), owners)
        self.write_plan()

    def _read_parameters(self) -> dict:
        return {"dense": {k: to_host(v).copy() for k, v in self.dense.items()},
                "sparse": self.sync.read_tables()}

    # ----------------------------------------------------------------- finish
    def _finish(self, start_step, last, train_seconds, wall_start):
        topo = self.topology
        steady = None
        if self.is_leader:  # steady-state throughput from the steps this run logged
            steady = steady_throughput(
                [r for r in read_metrics(os.path.join(self.run_dir, "metrics.jsonl"))
                 if "loss" in r and start_step <= r["step"] <= last],
                self.config["global_batch"], unsteady_steps(self.config, start_step,
                                                            self.planning))
        summary = summarize(topo, self.losses, start_step=start_step, last=last,
                            steady=steady, train_seconds=train_seconds,
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
        summary["tables"] = getattr(self, "tables", {})
        write_json(os.path.join(self.run_dir, "summary.json"), summary)
        record_run(self)  # one record in the run log (never raises)
        if not self.config["quiet"]:
            print(summary_line(summary, self.run_dir), flush=True)
        return summary
