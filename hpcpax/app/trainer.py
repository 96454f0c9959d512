"""The training loop on hpcpax's primitives, reusable in-process: :class:`Trainer`.

Roles (see :mod:`hpcpax.comm.topology`): server ranks follow the workers in
:meth:`ParameterServer.serve`; workers run BSP steps::

    batch  = reader.batch(step - 1, G, worker_index, num_workers)   # own shard
    rows   = pull_unique(var, model.sparse_ids(batch))              # per sparse var
    result = model.forward_backward(dense, rows, batch)
    push(var, SparseGrad(...))         # owners apply the sparse optimizer
    DenseAllreduce(mean) of dense grads; dense optimizer on every worker
    one Allreduce of a small vector: loss x batch, phase times, bytes, preempt flag

Each sparse variable is synced as the per-variable *plan* says
(``{name: {"method": "ps"|"allgather"|"dense", "partitions": P}}``, default
all ``ps``); :meth:`Trainer.repartition` changes P live.

Things every rank must do together besides the steps (checkpoint, restore,
stop) are *commands*: workers release the servers from ``serve()`` with
``shutdown()``, the first worker broadcasts the command, every rank runs it,
and servers go back to serving. ``ps.py`` needs nothing new for that.

Steps are numbered from 1; step ``s`` reads global batch ``s - 1``, and a
checkpoint after step ``s`` resumes at ``s + 1`` (data readers are stateless).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from . import checkpoint as ckpt
from .config import TRAINING_KEYS, load_plan_file, model_kwargs, normalize_plan, resolve
from ..backend import Device, select_device, to_host
from ..comm.agreement import check_same, fingerprint
from ..errors import CheckpointError, ConfigError
from .metrics import MetricsWriter, ProgressBar, json_safe
from ..plan.controller import MEASURED_MODES, PlanController
from .preemption import PreemptionHandler
from ..ps.memory import parse_bytes
from ..comm.watchdog import Watchdog

__all__ = ["Trainer", "TIME_PHASES", "BYTE_PHASES"]

#: Wall-time phases of one worker step, in the metrics lines.
TIME_PHASES = ("data", "pull", "compute", "push", "dense", "optimizer")
#: Accounting phases whose bytes the metrics lines report (summed over workers).
BYTE_PHASES = ("pull", "push", "intra_node", "dense", "allgather", "dense_sparse", "control",
               "repartition")
_BYTE_FIELDS = ("sent_bytes", "recv_bytes", "sent_inter_bytes")
#: Evaluation reads fixed global batches from this position on (no held-out split).
EVAL_POSITION = 1_000_003


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

    # ------------------------------------------------------------------ setup
    def _log(self, text, everyone=False, important=False):
        """Print on the first worker (every rank with ``everyone`` and
        ``--verbose-ranks``); ``--quiet`` keeps only ``important`` lines."""
        if self.config["quiet"] and not (important or everyone):
            return
        if self._is_leader or (everyone and self.config["verbose_ranks"]):
            prefix = "" if self._is_leader and not everyone else f"[rank {self.topology.rank}] "
            if self._bar is not None:
                self._bar.write(prefix + text)
            else:
                print(prefix + text, flush=True)

    def _make_run_dir(self):
        topo, config = self.topology, self.config
        path = error = None
        if topo.rank == 0:
            path = config["run_dir"]
            if not path:
                stamp = time.strftime("%Y%m%d-%H%M%S")
                path, n = os.path.join("runs", stamp), 1
                while os.path.exists(path):
                    path, n = os.path.join("runs", f"{stamp}-{n}"), n + 1
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                error = f"cannot create run directory {path}: {exc}"
            path = os.path.abspath(path)
        path, error = topo.comm.bcast((path, error), root=0)
        if error:
            raise ConfigError(error)
        self.run_dir = path
        self.config["run_dir"] = path
        self.job_id = topo.comm.bcast(os.environ.get("SLURM_JOB_ID")
                                      or f"{os.getpid()}-{int(time.time())}", root=0)

    def _resolve_plan(self, names):
        spec = self._plan_override if self._plan_override is not None else self.config["plan"]
        if isinstance(spec, str) and spec in MEASURED_MODES:
            # measured first on the parameter server, decided after plan_steps
            return {name: {"method": "ps", "partitions": None} for name in names}
        if isinstance(spec, str):
            method = "dense" if spec == "allreduce" else spec
            if method in ("ps", "allgather", "dense"):
                return {name: {"method": method, "partitions": None} for name in names}
            plan = load_plan_file(spec)
        else:
            plan = normalize_plan(dict(spec))
        unknown = sorted(set(plan) - set(names))
        if unknown:
            raise ConfigError(f"plan names unknown sparse variable {unknown[0]!r}; the model "
                              f"has {names}")
        return {name: plan.get(name, {"method": "ps", "partitions": None}) for name in names}

    def _open_data(self):
        from ..data import open_dataset

        config, model = self.config, self.model
        if config["model"] == "lm":
            options = {"context": model.context, "shuffle": config["shuffle"],
                       "seed": config["seed"]}
            if config["data"] is None:
                return open_dataset("synthetic", "lm", num_tokens=config["synthetic_samples"],
                                    vocab_size=model.vocab_size, **options)
            reader = open_dataset(config["data"], "lm", **options)
        else:
            options = {"shuffle": config["shuffle"], "seed": config["seed"]}
            if config["data"] is None:
                return open_dataset("synthetic", "ctr", num_samples=config["synthetic_samples"],
                                    n_dense=model.n_dense, n_fields=model.n_fields,
                                    cardinality=list(model.table_rows), **options)
            reader = open_dataset(config["data"], "ctr", **options)
        return reader

    def _build_model(self):
        from ..data import open_dataset
        from ..models import build_model

        config = self.config
        kwargs = model_kwargs(config)
        if config["data"] is not None:
            # Sizes the data file fixes, unless given: vocabulary, feature counts.
            with open_dataset(config["data"], config["model"], **(
                    {"context": kwargs.get("context", 4)} if config["model"] == "lm" else {})) as r:
                if config["model"] == "lm":
                    kwargs.setdefault("vocab_size", int(r.vocab_size))
                else:
                    kwargs.setdefault("n_dense", int(r.n_dense))
                    kwargs.setdefault("n_fields", int(r.n_fields))
        return build_model(config["model"], **kwargs)

    def _sparse_specs(self):
        from ..ps.server import SparseVariableSpec

        config = self.config
        hp = {"lr": config["sparse_lr"]}
        specs = []
        for s in self.model.sparse_specs():
            plan = self.plan[s.name]
            specs.append(SparseVariableSpec(
                s.name, rows=s.rows, dim=s.dim, dtype=config["dtype"],
                initializer="uniform" if s.init_scale > 0 else "zeros",
                init_scale=float(s.init_scale), optimizer=config["sparse_optimizer"],
                optimizer_params=hp, num_partitions=plan["partitions"]
                if plan["method"] == "ps" else None))
        return specs

    # -------------------------------------------------------------- commands
    def _command(self, op, **args):
        """Workers: release the servers and run ``op`` on every rank."""
        self.ps.shutdown()
        command = self.topology.comm.bcast({"op": op, **args}, root=self.topology.worker_ranks[0])
        return self._run_command(command)

    def _serve(self):
        """Servers: serve the workers, run their commands, until ``stop``."""
        topo = self.topology
        while True:
            self.ps.serve()
            command = topo.comm.bcast(None, root=topo.worker_ranks[0])
            if self._run_command(command) == "stop":
                return

    def _run_command(self, command):
        op = command["op"]
        if op == "save":
            return self._save_collective(command["step"], command["meta"])
        if op == "load":
            return self._load_collective(command["path"])
        if op == "switch":
            return self._switch_collective(command["name"], command["method"])
        if op == "stop":
            return "stop"
        raise RuntimeError(f"unknown trainer command {op!r}")

    # ------------------------------------------------------------ checkpoint
    def _save_collective(self, step, meta):
        topo = self.topology
        sparse = []
        for name in self._ps_names():
            gids, table, rows, scalars = self.ps.export_rows(name)
            if self.ps.variables[name].table is not None:
                sparse.append((name, gids, table, rows, scalars))
        dense = None
        if topo.is_worker and topo.worker_index == 0:
            for name, replica in self.replicated.items():
                rows = {k: v for k, v in replica.state.items() if np.ndim(v) == 2}
                scalars = {k: v for k, v in replica.state.items() if k not in rows}
                sparse.append((name, np.arange(replica.spec.rows), replica.table, rows, scalars))
            dense = ({k: to_host(v) for k, v in self.dense.items()},
                     {k: {s: to_host(v) for s, v in slots.items()}
                      for k, slots in self.dense_state.items()})
        start = time.perf_counter()
        path = ckpt.save(topo.comm, self.run_dir, step, dense=dense, sparse=sparse, meta=meta,
                         keep=self.config["keep_checkpoints"], job_id=self.job_id)
        self.checkpoint_seconds += time.perf_counter() - start
        self.last_checkpoint = path
        return path

    def _ps_names(self):
        """Variables the PS holds now (a switched-away one may stay registered)."""
        return [n for n in self.ps.variables if self.plan[n]["method"] == "ps"]

    def save_checkpoint(self, step):
        """Write a checkpoint after ``step`` steps; **collective** over the workers."""
        meta = {"config": self.config, "training_fingerprint": self._training_fingerprint(),
                "topology": self.topology.describe(), "plan": self.plan,
                "data_position": step, "rng": "counter-based (seed, step): nothing to save",
                "job_id": self.job_id}
        path = self._command("save", step=step, meta=json_safe(meta))
        self._log(f"checkpoint written: {path}", important=True)
        return path

    def _training_fingerprint(self):
        return fingerprint({k: self.config[k] for k in TRAINING_KEYS})

    def _load_collective(self, path):
        topo = self.topology
        ckpt.verify(path, topo.comm)
        meta = ckpt.read_meta(path)
        if meta.get("training_fingerprint") != self._training_fingerprint():
            saved = meta.get("config", {})
            differ = [k for k in TRAINING_KEYS if saved.get(k) != self.config[k]]
            raise CheckpointError(
                f"{path} was written by a different training setup: "
                + ", ".join(f"{k}={saved.get(k)!r} there, {self.config[k]!r} now"
                            for k in differ[:4]))
        error = None
        try:
            for name in self._ps_names():
                ckpt.import_ps_variable(self.ps, name, path)
            if topo.is_worker:
                for replica in self.replicated.values():
                    ckpt.import_replicated(replica, path)
                params, state = ckpt.load_dense(path)
                for name in self.dense:
                    if name not in params or params[name].shape != self.dense[name].shape:
                        raise CheckpointError(f"{path}/dense.h5: parameter {name!r} missing or "
                                              f"of another shape")
                    xp = self.device.xp
                    self.dense[name][...] = xp.asarray(params[name])
                    for slot, value in self.dense_state[name].items():
                        value[...] = xp.asarray(state[name][slot]) if slot != "step" \
                            else state[name][slot]
        except CheckpointError as exc:
            error = str(exc)
        errors = [e for e in topo.comm.allgather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        return int(meta["step"])

    # ------------------------------------------------------------------- run
    def run(self) -> dict:
        """Train; **collective**. Returns the summary dict (full on the first worker)."""
        import hpcpax

        config = self.config
        self._bar = None
        self._is_leader = False
        self.topology = hpcpax.init(config["ranks_per_node"], config["servers_per_node"],
                                    comm=self.comm)
        self.watchdog = Watchdog(self.topology.comm, config["timeout"])
        try:
            self.summary = self._run()
            return self.summary
        finally:
            if self._bar is not None:
                self._bar.close()
            self.watchdog.close()
            self.topology.free()

    def _run(self):
        from ..comm.allreduce import DenseAllreduce
        from ..ops.optimizers import make_optimizer
        from ..ps.server import ParameterServer
        from ..sync.replicated import ReplicatedTable

        topo, config = self.topology, self.config
        self._is_leader = topo.is_worker and topo.worker_index == 0
        self.checkpoint_seconds = 0.0
        self.last_checkpoint = None
        wall_start = time.perf_counter()
        # Set-up runs in named guarded phases: a rank stuck in one (a hung
        # file system, a bad GPU) makes the others' watchdogs report it in
        # that phase while they wait in the next collective, instead of
        # every rank waiting forever.
        setup = self.watchdog.guard
        with setup("set-up: device"):
            # Servers are CPU processes; each worker takes GPU (local worker rank % count).
            self.device = (select_device(topo.node_workers.Get_rank(), config["device"])
                           if topo.is_worker else Device("cpu"))
        with setup("set-up: run dir and config"):
            self._make_run_dir()
            check_same(topo.comm, "training config", json_safe(config))
        with setup("set-up: model and plan"):
            self.model = self._build_model()
            names = [s.name for s in self.model.sparse_specs()]
            self.plan = self._resolve_plan(names)
            specs = self._sparse_specs()
            self.specs = {s.name: s for s in specs}
            mode = self.config["plan"] if self._plan_override is None else None
            self.planning = PlanController(self, mode)
            self.planning.measure_fabric()
        with setup("set-up: parameter server"):
            self.ps = ParameterServer(topo, local_aggregation=config["local_aggregation"],
                                      seed=config["seed"])
            self.ps.watchdog = self.watchdog  # each served operation is guarded
            self.ps.memory_budget = parse_bytes(config["server_memory_budget"],
                                                "server_memory_budget")
            self.replicated = {}
            self.dense, self.dense_state = {}, {}
            if topo.rank == 0:
                self._write_json("config.json", {**json_safe(config),
                                                 "model_config": json_safe(self.model.config()),
                                                 "topology": topo.describe()})
                self._write_json("plan.json", self.plan)
        if topo.is_server:
            # Slurm signals every rank; a server only notes it, the workers decide.
            with PreemptionHandler():
                self._serve()
            return self._finish(None, 0, 0, 0.0, False)

        with setup("set-up: sparse tables"):
            self.ps.register([s for s in specs if self.plan[s.name]["method"] == "ps"])
            for spec in specs:
                entry = self.plan[spec.name]
                if entry["method"] != "ps":
                    self.replicated[spec.name] = ReplicatedTable(topo, spec, entry["method"],
                                                                 seed=config["seed"])
                elif entry.get("owners"):
                    self.ps.repartition(spec.name, len(entry["owners"]), entry["owners"])
        with setup("set-up: dense"):
            xp = self.device.xp
            self.dense = {k: xp.asarray(v) for k, v in self.model.init_dense().items()}
            self.optimizer = make_optimizer(config["optimizer"], lr=config["lr"])
            self.dense_state = {name: self.optimizer.init_state(p.shape, p.dtype, xp)
                                for name, p in self.dense.items()}
            self.allreduce = DenseAllreduce(topo, {n: (p.shape, p.dtype)
                                                   for n, p in self.dense.items()},
                                            op="mean", bucket_bytes=config["bucket_bytes"] or None)
        with setup("set-up: data"):
            self.reader = self._open_data()

        start_step = 1
        if config["resume"]:
            with setup("set-up: resume"):  # bounded like a checkpoint save inside a step
                path = ckpt.latest(self.run_dir) if self._is_leader else None
                path = topo.workers.bcast(path, root=0)
                if path is not None:
                    start_step = self._command("load", path=path) + 1
            if path is None:
                self._log(f"resume: no complete checkpoint in {self.run_dir}; starting at step 1")
            else:
                self._log(f"resumed from {path}: continuing at step {start_step}")
        if self._is_leader and not config["quiet"]:
            self._print_config()
        self._bar = ProgressBar(config["steps"], start_step - 1,
                                self._is_leader and not config["quiet"])
        metrics = MetricsWriter(os.path.join(self.run_dir, "metrics.jsonl"), self._is_leader,
                                truncate_after=start_step - 1)
        self.planning.start(start_step, resumed=start_step > 1)
        try:
            with PreemptionHandler() as preemption:
                last, train_seconds, preempted = self._train_loop(start_step, metrics, preemption)
        finally:
            metrics.close()
        if self.collect:
            self.parameters = self._read_parameters()
        self._command("stop")
        self.summary = self._finish(preemption if preempted else None, start_step, last,
                                    train_seconds, preempted, wall_start)
        return self.summary

    def _print_config(self):
        topo = self.topology
        lines = [f"hpcpax.train: {topo.size} ranks ({len(topo.server_ranks)} servers, "
                 f"{topo.num_workers} workers, {topo.num_nodes} nodes), run dir {self.run_dir}"]
        lines.append(f"  model: {self.model!r}")
        shown = {k: v for k, v in self.config.items() if v is not None}
        lines += [f"  {k} = {json.dumps(v)}" for k, v in shown.items()]
        lines.append("  plan: " + ", ".join(f"{n}={e['method']}"
                                            + (f"/{e['partitions']}" if e["partitions"] else "")
                                            for n, e in self.plan.items()))
        print("\n".join(lines), flush=True)

    def _write_json(self, name, value):
        with open(os.path.join(self.run_dir, name), "w", encoding="utf-8") as handle:
            json.dump(json_safe(value), handle, indent=2)

    # ------------------------------------------------------------------ steps
    def _pull_all(self, ids):
        """``{name: (unique ids, rows)}`` of every sparse variable, on this worker's device.

        The PS variables travel together (one exchange per phase); the
        replicated ones go one by one.
        """
        out = {name: self.replicated[name].pull_unique(ids[name])
               for name in self.specs if name in self.replicated}
        on_ps = {name: ids[name] for name in self.specs if name not in self.replicated}
        if on_ps:
            out.update(self.ps.pull_unique_many(on_ps))
        if self.device.kind == "gpu":
            xp = self.device.xp
            out = {name: (xp.asarray(u), xp.asarray(r)) for name, (u, r) in out.items()}
        return {name: out[name] for name in self.specs}

    def _push_all(self, grads):
        """Push ``{name: (indices, values)}``: the PS variables in one batched
        exchange, the replicated ``allgather`` ones in another."""
        from ..ps.sparse_grad import SparseGrad
        from ..sync.replicated import push_many as push_replicated

        on_ps, replicated = {}, {}
        for name in self.specs:
            indices, values = grads[name]
            grad = SparseGrad(indices, values, self.specs[name].rows)
            (replicated if name in self.replicated else on_ps)[name] = grad
        if replicated:
            push_replicated({n: self.replicated[n] for n in replicated}, replicated)
        if on_ps:
            self.ps.push_many(on_ps)

    def _batch(self, position):
        """This worker's shard of global batch ``position``, on its device."""
        topo = self.topology
        batch = self.reader.batch(position, self.config["global_batch"], topo.worker_index,
                                  topo.num_workers)
        if self.device.kind == "gpu":
            batch = {k: self.device.xp.asarray(v) for k, v in batch.items()}
        return batch

    def train_step(self, step):
        """One BSP step on this worker; returns ``(loss, local batch, phase seconds)``.

        **Collective** over the workers (and the servers, through the PS).
        """
        config, topo = self.config, self.topology
        times = dict.fromkeys(TIME_PHASES, 0.0)
        clock = time.perf_counter()

        def lap(phase):
            nonlocal clock
            now = time.perf_counter()
            times[phase] += now - clock
            clock = now

        position = step - 1
        batch = self._batch(position)
        ids = self.model.sparse_ids(batch, position)
        self.planning.observe(ids)
        lap("data")
        rows = self._pull_all(ids)
        lap("pull")
        result = self.model.forward_backward(self.dense, rows, batch, position)
        local_batch = len(next(iter(batch.values())))
        # Mean over the global batch even for uneven shards; exactly 1 for even ones.
        scale = local_batch * topo.num_workers / config["global_batch"]
        lap("compute")
        self._push_all({name: (indices, values * scale if scale != 1 else values)
                        for name, (indices, values) in result.sparse_grads.items()})
        lap("push")
        grads = result.dense_grads
        if scale != 1:
            grads = {name: g * scale for name, g in grads.items()}
        self.allreduce.allreduce(grads)
        lap("dense")
        for name, param in self.dense.items():
            self.optimizer.apply_dense(param, self.dense_state[name], grads[name])
        lap("optimizer")
        return result.loss, local_batch, times

    def _reduce_step(self, loss, local_batch, times, flag):
        """One Allreduce over the workers: loss, batch, flag, times, cumulative bytes."""
        from mpi4py import MPI

        acct = self.topology.accounting
        vector = [loss * local_batch, local_batch, float(flag)]
        vector += [times[p] for p in TIME_PHASES]
        for phase in BYTE_PHASES:
            entry = acct.phase(phase)
            vector += [float(entry[f]) for f in _BYTE_FIELDS]
        vector = np.array(vector, np.float64)
        self.topology.workers.Allreduce(MPI.IN_PLACE, vector, op=MPI.SUM)
        n = self.topology.num_workers
        k = len(TIME_PHASES)
        loss = vector[0] / vector[1]
        mean_times = {p: vector[3 + i] / n for i, p in enumerate(TIME_PHASES)}
        cumulative = vector[3 + k:].reshape(len(BYTE_PHASES), len(_BYTE_FIELDS))
        return loss, vector[2] > 0, mean_times, cumulative

    def _train_loop(self, start_step, metrics, preemption):
        self._loop = {"metrics": metrics, "preemption": preemption, "previous": None,
                      "seconds": 0.0, "last": start_step - 1, "stopped": False}
        step = start_step
        while step <= self.config["steps"] and not self._loop["stopped"]:
            self.loop_step(step)
            step += 1
            if self._loop["stopped"]:
                break
            for hook in self.hooks:
                hook(self, step - 1)
            # the planner may run further steps itself (trial steps of a search)
            step = self.planning.after_step(step - 1) + 1
        loop = self._loop
        return loop["last"], loop["seconds"], loop["stopped"]

    def loop_step(self, step):
        """Train ``step``, write its metrics, checkpoint if due; **collective** (workers).

        Sets ``self._loop["stopped"]`` when a preemption signal was seen
        (after checkpointing). Runs under the watchdog as ``step N``.
        """
        with self.watchdog.guard(f"step {step}"):
            self._loop_step(step)

    def _loop_step(self, step):
        config, loop = self.config, self._loop
        began = time.perf_counter()
        loss, local_batch, times = self.train_step(step)
        loss, stop, times, cumulative = self._reduce_step(loss, local_batch, times,
                                                          loop["preemption"].requested)
        seconds = time.perf_counter() - began
        loop["seconds"] += seconds
        loop["last"] = step
        self.losses.append(loss)
        previous = loop["previous"]
        delta = cumulative if previous is None else cumulative - previous
        loop["previous"] = cumulative
        samples_per_s = config["global_batch"] / seconds
        loop["metrics"].write({
            "step": step, "loss": loss, "samples_per_s": samples_per_s, "seconds": seconds,
            "time": times,
            "bytes": {phase: {f.replace("_bytes", ""): int(delta[i, j])
                              for j, f in enumerate(_BYTE_FIELDS)}
                      for i, phase in enumerate(BYTE_PHASES) if delta[i].any()},
        })
        self._bar.update(1, loss, samples_per_s)
        if config["eval_every"] and (step % config["eval_every"] == 0 or step == config["steps"]):
            loop["metrics"].write({"step": step, "eval": self.evaluate(step)})
        if stop:
            loop["stopped"] = True
            self._log(f"preemption signal: checkpoint after step {step}, then exit",
                      important=True)
            self.save_checkpoint(step)
        elif config["checkpoint_every"] and (step % config["checkpoint_every"] == 0
                                             or step == config["steps"]):
            self.save_checkpoint(step)

    def evaluate(self, step):
        """Mean eval metrics over ``eval_batches`` fixed global batches; **collective**."""
        from mpi4py import MPI

        topo, config = self.topology, self.config
        totals, weight = {}, 0.0
        for k in range(config["eval_batches"]):
            position = EVAL_POSITION + k
            batch = self._batch(position)
            ids = self.model.sparse_ids(batch, position, full=True)
            rows = self._pull_all(ids)
            result = self.model.evaluate(self.dense, rows, batch, position, full=True)
            local_batch = len(next(iter(batch.values())))
            for key, value in result.items():
                totals[key] = totals.get(key, 0.0) + value * local_batch
            weight += local_batch
        keys = sorted(totals)
        vector = np.array([totals[k] for k in keys] + [weight], np.float64)
        topo.workers.Allreduce(MPI.IN_PLACE, vector, op=MPI.SUM)
        out = {k: float(vector[i] / vector[-1]) for i, k in enumerate(keys)}
        self._log(f"eval after step {step}: "
                  + ", ".join(f"{k}={v:.4f}" for k, v in out.items()))
        return out

    def switch_method(self, name, method):
        """Move sparse variable ``name`` to ``method``, exactly; **collective** (workers).

        Every row and its optimizer state moves (PS owners <-> replicas on
        every worker); training continues as if ``method`` had been used all
        along.
        """
        if method not in ("ps", "allgather", "dense"):
            raise ConfigError(f"method must be ps, allgather or dense, not {method!r}")
        self._command("switch", name=name, method=method)
        self.plan[name] = {"method": method,
                           "partitions": (self.ps.variables[name].partitioning.num_parts
                                          if method == "ps" else None)}
        if self._is_leader:
            self._write_json("plan.json", self.plan)

    def _switch_collective(self, name, method):
        """Every rank: the data movement of :meth:`switch_method`."""
        from ..sync.replicated import ReplicatedTable

        topo, spec = self.topology, self.specs[name]
        current = self.plan[name]["method"]
        if current == method:
            return None
        if current == "ps":
            table, rows, scalars = self.ps.gather_table(name)
            if topo.is_worker:
                replica = ReplicatedTable(topo, spec, method, seed=self.config["seed"])
                replica.table[...] = table
                for key, value in rows.items():
                    replica.state[key][...] = value
                replica.state.update({k: np.array(v, copy=True) for k, v in scalars.items()})
                self.replicated[name] = replica
        elif method != "ps":
            if topo.is_worker:
                self.replicated[name].method = method
        else:
            if name not in self.ps.variables:
                self.ps._register_collective([spec] if topo.is_worker else [])
            replica = self.replicated.get(name)
            payload = None
            if topo.is_worker and topo.worker_index == 0:
                rows = {k: v for k, v in replica.state.items() if np.ndim(v) == 2}
                scalars = {k: v for k, v in replica.state.items() if k not in rows}
                payload = (replica.table, rows, scalars)
            table, rows, scalars = topo.comm.bcast(payload, root=topo.worker_ranks[0])
            self.ps.load_table(name, table, rows, scalars)
            self.replicated.pop(name, None)
        self.plan[name] = {"method": method, "partitions": None}
        return None

    def repartition(self, name, partitions, owners=None):
        """Move PS variable ``name`` to ``partitions`` partitions, live; **collective** (workers)."""
        if self.plan[name]["method"] != "ps":
            raise ConfigError(f"{name} is synced by {self.plan[name]['method']!r}, "
                              "not 'ps'; only ps variables have partitions")
        self.ps.repartition(name, int(partitions), owners)
        self.plan[name] = {**self.plan[name], "partitions": int(partitions)}
        if owners is not None:
            self.plan[name]["owners"] = [int(o) for o in owners]
        if self._is_leader:
            self._write_json("plan.json", self.plan)

    def _read_parameters(self):
        sparse = {}
        for name in self.specs:
            if name in self.replicated:
                sparse[name] = self.replicated[name].read_table()
            else:
                sparse[name] = self.ps.read_table(name)
        return {"dense": {k: to_host(v).copy() for k, v in self.dense.items()}, "sparse": sparse}

    # ----------------------------------------------------------------- finish
    def _finish(self, preemption, start_step, last, train_seconds, preempted, wall_start=None):
        topo = self.topology
        totals = topo.accounting.reduce(topo.comm)
        if not self._is_leader:
            self._log(f"done; my bytes sent {topo.accounting.totals()['sent_bytes']:,}",
                      everyone=True)
            return {"rank": topo.rank, "role": topo.role}
        self._bar.close()
        steps_run = max(0, last - start_step + 1)
        wall = time.perf_counter() - wall_start
        summary = {
            "steps": last, "steps_run": steps_run, "start_step": start_step,
            "first_loss": self.losses[0] if self.losses else None,
            "final_loss": self.losses[-1] if self.losses else None,
            "mean_samples_per_s": (steps_run * self.config["global_batch"] / train_seconds
                                   if train_seconds else None),
            "wall_seconds": wall, "train_seconds": train_seconds,
            "checkpoint_seconds": self.checkpoint_seconds,
            "preempted": preempted,
            "signal": preemption.signal_name if preemption else None,
            "last_checkpoint": self.last_checkpoint,
            "topology": topo.describe(),
            "phases": totals["phases"], "total": totals["total"],
        }
        self._write_json("summary.json", summary)
        from ..plan.records import record_run
        record_run(self)  # one record in the run log (never raises)
        if not self.config["quiet"]:
            first, final = summary["first_loss"], summary["final_loss"]
            print(f"hpcpax.train: {steps_run} steps in {wall:.1f} s"
                  + (f", loss {first:.4f} -> {final:.4f}" if first is not None else "")
                  + (f", {summary['mean_samples_per_s']:,.0f} samples/s"
                     if summary["mean_samples_per_s"] else "")
                  + (f" (preempted by {summary['signal']})" if preempted else "")
                  + f"; outputs in {self.run_dir}", flush=True)
        return summary

