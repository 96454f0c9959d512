"""`ModelSync`: the step API for a user's own NumPy or CuPy training loop.

The machinery :mod:`hpcpax.app.trainer` runs on, behind one object and one
call per step phase, for codes that compute their own forward and backward
(NumPy, CuPy, or a framework through :mod:`hpcpax.torch`)::

    sync = hpcpax.ModelSync(tables, dense, plan="auto", initial=...)   # every rank
    if sync.is_server:
        sync.serve()                              # until the workers finish()
    else:
        for step in ...:
            rows = sync.pull({"emb": ids})        # {name: (unique ids, rows)}
            ...forward and backward...
            sync.push({"emb": (ids, grads)})      # the owners run the row optimizer
            sync.allreduce([g1, g2])              # dense gradients, mean, in place
        sync.finish()

- Sparse tables follow the plan: ``auto`` (measure each table's sparsity over
  the first ``plan_steps`` pushes, then move each to the method the cost model
  picks, exactly, with its optimizer state; with a single worker nothing
  moves between workers and nothing is measured: tables stay on the server
  ranks, or, with none, are held by the worker as a replica), ``hybrid``
  (Parallax's rule),
  one method for all (``ps``, ``allgather``, ``allreduce``), or a per-table
  dict / ``plan.json``. :attr:`ModelSync.plan` is the plan in force.
- Dense gradients go through :class:`~hpcpax.sync.dense_buckets.BucketedAllreduce`:
  :meth:`ModelSync.allreduce` at once, or :meth:`ModelSync.ready` per tensor
  as the backward pass produces it and :meth:`ModelSync.wait` (overlap).
- :meth:`ModelSync.save` / :meth:`ModelSync.load` write and read the HDF5
  checkpoints of :mod:`hpcpax.app.checkpoint_files` (rows by global id: resumable
  on another layout or plan).

Server ranks follow the workers in :meth:`ModelSync.serve`; collective things
the servers must join (a method switch, a checkpoint, loading a table) reach
them through a :class:`~hpcpax.engine.commands.CommandChannel`.
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import to_host
from ..errors import CheckpointError, ConfigError
from . import checkpoint_files as ckpt

__all__ = ["ModelSync"]

#: Bytes per broadcast when a table goes from the first worker to its holders.
BCAST_CHUNK = 1 << 28


class ModelSync:
    """Every variable of one model, synchronized step by step.

    Construction is **collective** over every rank of the job (servers too);
    the machinery is an :class:`~hpcpax.engine.engine.Engine` (:attr:`engine`)
    made by :func:`~hpcpax.engine.engine.build_engine`, as the trainer's is.

    Args:
        tables: the sparse tables, a list of
            :class:`~hpcpax.ps.spec.SparseVariableSpec` (same on every rank).
        dense: dense tensors ``{name: (shape, dtype) or array}`` (or a list:
            names ``"0"``, ``"1"``...), in the order their gradients become
            ready (the bucket order).
        plan: ``auto`` (default), ``hybrid``, ``ps``, ``allgather``,
            ``allreduce``, a ``plan.json`` path, or ``{name: {"method", ...}}``.
        initial: ``{name: whole table}`` on the first worker (ignored
            elsewhere): starting values replacing the spec's initializer.
        topology: from :func:`hpcpax.init` (default: made here, and freed
            by :meth:`finish`).
        local_aggregation: aggregate pulls and pushes per node (``ps``).
        seed: key of the layout-independent initializer.
        dense_op: ``mean`` (default) or ``sum`` of dense gradients over workers.
        bucket_bytes: dense bucket size (default: the measured fusion size).
        plan_steps: pushes measured before ``auto``/``hybrid`` decide.
        replan_every: re-measure and re-plan every N pushes (0: never).
        replan_threshold: predicted gain needed to switch when re-planning.
        fabric_seconds: budget of the start-up fabric measurement (auto/hybrid).
        plan_calibrate: ``auto`` times the cost model's constants on this job
            at set-up (a few seconds; the servers serve its operations), as
            the trainer does; False: kernel rates timed on one rank.
        run_dir: where ``plan.json`` is written (None: nowhere).
        quiet: no plan table printed.
        timeout: watchdog seconds (None: ``HPCPAX_TIMEOUT``; 0: off).

    Raises:
        ConfigError, TypeError, ValueError: bad arguments, on every rank.
        MismatchError: ranks gave different tables, dense tensors or plans.
    """

    def __init__(self, tables, dense=None, *, plan="auto", initial=None, topology=None,
                 local_aggregation=True, seed=0, dense_op="mean", bucket_bytes=None,
                 plan_steps=10, replan_every=0, replan_threshold=0.1, fabric_seconds=1.0,
                 plan_calibrate=True, run_dir=None, quiet=False, timeout=None):
        from ..comm.agreement import check_same
        from ..comm.fusion import parse_tensors
        from ..comm.topology import init
        from ..comm.watchdog import Watchdog
        from ..engine import EngineSettings, PlanSettings, build_engine, resolve_plan
        from ..ps.spec import SparseVariableSpec

        specs = list(tables)
        for spec in specs:
            if not isinstance(spec, SparseVariableSpec):
                raise TypeError(f"tables must hold SparseVariableSpec, not {type(spec).__name__}")
            spec.validate()
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise ValueError(f"table names must be unique, not {names}")
        dense_names, shapes, dtypes = parse_tensors(dense if dense is not None else {})
        settings = EngineSettings(
            local_aggregation=local_aggregation, seed=seed, timeout=timeout, dense_op=dense_op,
            bucket_bytes=bucket_bytes, overlap=True,
            plan=PlanSettings(plan_steps=plan_steps, replan_every=int(replan_every),
                              replan_threshold=float(replan_threshold),
                              fabric_seconds=float(fabric_seconds),
                              plan_calibrate=bool(plan_calibrate)))
        request = resolve_plan(plan, names)
        self.topology = topology if topology is not None else init()
        self._own_topology = topology is None
        self.watchdog = None
        try:
            topo = self.topology
            self.run_dir, self.quiet = run_dir, bool(quiet)
            self.is_leader = topo.is_worker and topo.worker_index == 0
            #: Pushes done (the step count the planner sees).
            self.steps = 0
            if request.mode is not None and topo.num_workers == 1:
                request = _one_worker(request, specs, topo, plan)
            check_same(topo.comm, "model sync set-up", {
                "tables": [s.to_dict() for s in specs],
                "plan": repr(sorted(request.requests.items())), "mode": request.mode,
                "dense": [[n, list(s), d.name] for n, s, d in zip(dense_names, shapes, dtypes)]})
            self.watchdog = Watchdog(topo.comm, timeout, role=topo.role)
            self.job_id = topo.comm.bcast(os.environ.get("SLURM_JOB_ID") or str(os.getpid()),
                                           root=0)
            self._pending = None
            with self.watchdog.guard("set-up: model sync"):
                #: The :class:`~hpcpax.engine.engine.Engine` (parameter server, synchronizers,
                #: dense allreduce, planner, commands, watchdog).
                self.engine = build_engine(
                    topo, specs, request, settings,
                    dense={n: (s, d) for n, s, d in zip(dense_names, shapes, dtypes)},
                    watchdog=self.watchdog, run_dir=run_dir, log=self.log,
                    commands={"save": self._save_command, "load": self._load_command,
                              "set_table": self._set_table_command},
                    before_dense=lambda engine: (engine.sync.register_collective(),
                                                 self._load_initial(engine, initial)))
            engine = self.engine
            self.ps, self.sync, self.planning = engine.ps, engine.sync, engine.planning
            self.commands, self.dense_sync = engine.commands, engine.dense_sync
            #: ``{name: tensor shape and dtype}`` of the dense tensors.
            self.dense = engine.dense
            self._step_ids = {}
            self._finished = False
            if topo.is_worker:
                self.planning.start(1)
                self.write_plan()
        except BaseException:
            # every rank fails here together (errors are agreed): undo together
            if self.watchdog is not None:
                self.watchdog.close()
            if self._own_topology:
                self.topology.free()
            raise

    # ------------------------------------------------------------ properties
    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks (they call :meth:`serve`)."""
        return self.topology.is_server

    @property
    def accounting(self):
        """This rank's :class:`~hpcpax.comm.accounting.Accounting` (bytes and seconds)."""
        return self.topology.accounting

    @property
    def plan(self):
        """The :class:`~hpcpax.plan.Plan` in force now (local)."""
        return self.planning.current_plan()

    def methods(self) -> dict:
        """``{table: method}`` now (local)."""
        return self.engine.methods()

    def log(self, text, everyone=False, important=False) -> None:
        """Print on the first worker unless ``quiet`` (the planner's reports)."""
        if self.is_leader and (important or not self.quiet):
            print(text, flush=True)

    def write_plan(self) -> None:
        """Save the plan in force as ``run_dir/plan.json`` (first worker; local)."""
        self.engine.write_plan()

    # ----------------------------------------------------------------- steps
    def pull(self, ids_by_name, record=True) -> dict:
        """Rows for ``{table: ids}``: ``{table: (unique sorted ids, rows)}`` on the ids' device.

        **Collective** over the workers (servers serve): every worker names
        the same tables; ids differ. ``ps`` tables travel in one exchange.
        ``record``: count these ids in the sparsity the planner measures
        (see :meth:`record`).
        """
        with self.watchdog.guard("pull"):
            out = self.sync.pull(ids_by_name)
        if record:
            self.record(ids_by_name)
        return out

    @property
    def measuring(self) -> bool:
        """True while the planner counts the ids of each step (:meth:`record`
        keeps nothing otherwise)."""
        return bool(self.planning.measuring)

    def record(self, ids_by_name) -> None:
        """Count ``{table: ids}`` (duplicates included) in this step's measured sparsity.

        Local; for callers that pull deduplicated ids (``pull(..., record=False)``)
        but know the raw ones. Do not modify the arrays before :meth:`push`.
        """
        if not self.planning.measuring:
            return
        for name, ids in ids_by_name.items():
            self._step_ids.setdefault(name, []).append(ids)

    def push(self, grads) -> None:
        """Push ``{table: (indices, values)}`` (or SparseGrad); ends a step.

        **Collective** over the workers: every worker names the same tables.
        The owners (or every replica) sum the workers' gradients (mean) and
        run the row optimizer. Then the planner sees the step: after
        ``plan_steps`` of them ``auto`` decides and moves tables (every
        rank takes part, through the command channel).
        """
        with self.watchdog.guard("push"):
            self.sync.push(grads)
        self.steps += 1
        recorded, self._step_ids = self._step_ids, {}
        with self.watchdog.guard("plan"):
            if self.planning.measuring:
                self.planning.observe({
                    name: np.concatenate([to_host(u) for u in recorded.get(name, [])]
                                         or [np.zeros(0, np.int64)])
                    for name in self.sync.variables})
            self.planning.after_step(self.steps)

    def ready(self, name, grad) -> None:
        """Dense gradient ``name`` is final: start its bucket when complete (overlap)."""
        self.dense_sync.ready(name, grad)

    def wait(self, fill=None) -> None:
        """Finish the dense reductions :meth:`ready` started; **collective** (workers)."""
        with self.watchdog.guard("dense allreduce"):
            self.dense_sync.wait(fill)

    def allreduce(self, grads):
        """Reduce dense gradients now, in place (mean over workers); **collective** (workers).

        Args:
            grads: a list in registration order, or ``{name: array}``.

        Returns:
            ``grads``.
        """
        if isinstance(grads, (list, tuple)):
            if len(grads) != len(self.dense):
                raise ValueError(f"grads must hold {len(self.dense)} arrays, not {len(grads)}")
            arrays = dict(zip(self.dense, grads))
        elif isinstance(grads, dict):
            arrays = grads
        else:
            raise TypeError(f"grads must be a list or a dict, not {type(grads).__name__}")
        with self.watchdog.guard("dense allreduce"):
            self.dense_sync.allreduce(arrays)
        return grads

    def read_tables(self) -> dict:
        """``{table: whole table}`` on every worker; **collective** (small tables, tests)."""
        return self.sync.read_tables()

    # --------------------------------------------------------- plan (planner)
    def switch_method(self, name, method) -> None:
        """Move table ``name`` to ``method`` exactly; **collective** (workers; servers join)."""
        self.engine.switch_method(name, method)

    def repartition(self, name, partitions, owners=None) -> None:
        """Move ``ps`` table ``name`` to ``partitions`` partitions; **collective** (workers)."""
        self.engine.repartition(name, partitions, owners)

    # ------------------------------------------------- tables and checkpoints
    def set_table(self, name, values) -> None:
        """Replace table ``name``'s rows by ``values`` (first worker's); optimizer state kept.

        **Collective** over the workers (servers join).
        """
        self._pending = values
        try:
            self.commands.run("set_table", name=name)
        finally:
            self._pending = None

    def save(self, run_dir, step, *, dense=None, dense_state=None, meta=None, keep=0) -> str:
        """Write a checkpoint after ``step`` into ``run_dir/checkpoints``; **collective** (workers).

        Tables are written by the ranks holding their rows, by global id, with
        their row-optimizer state; ``dense`` (``{name: array}``) and
        ``dense_state`` (``{name: {slot: array}}``) from the first worker;
        ``meta`` (JSON-able) into ``meta.json``; ``keep`` keeps the newest
        ``keep`` checkpoints (0: all). Returns the checkpoint directory.
        """
        self._pending = ({k: to_host(v) for k, v in (dense or {}).items()},
                         {k: {s: to_host(v) for s, v in slots.items()}
                          for k, slots in (dense_state or {}).items()})
        try:
            return self.commands.run("save", run_dir=os.fspath(run_dir), step=int(step),
                                     meta=meta or {}, keep=int(keep))
        finally:
            self._pending = None

    def load(self, path) -> tuple:
        """Restore the tables from a checkpoint; **collective** (workers; servers join).

        ``path`` is a checkpoint directory or a run directory (its newest).
        Works under another layout or plan (rows by global id). Returns
        ``(step, dense params, dense optimizer state, meta)`` as host arrays.

        Raises:
            CheckpointError: on every rank, naming the damaged file, a
                missing table or rows of another shape.
        """
        return self.commands.run("load", path=self._find_checkpoint(path))

    def _set_table_command(self, name):
        first = self.topology.rank == self.topology.worker_ranks[0]
        self._set_table(self.engine, name, self._pending if first else None)

    def _save_command(self, run_dir, step, meta, keep):
        """Write one checkpoint; **collective** (every rank). Dense from the first worker."""
        topo = self.topology
        meta = {**meta, "plan": self.plan.to_dict(), "topology": topo.describe(),
                "tables": [var.spec.to_dict() for var in self.sync.variables.values()]}
        return ckpt.save(topo.comm, run_dir, step,
                         dense=self._pending if self.is_leader else None,
                         sparse=self.sync.checkpoint_rows(), meta=meta, keep=keep,
                         job_id=self.job_id)

    def _find_checkpoint(self, path) -> str:
        """``path``, or the newest checkpoint of run directory ``path``; **collective**
        (workers)."""
        path = os.fspath(path)
        if os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
            return path
        found = ckpt.latest(path) if self.is_leader else None
        found = self.topology.workers.bcast(found, root=0)
        if found is None:
            raise CheckpointError(f"{path}: no complete checkpoint there")
        return found

    def _load_command(self, path):
        """Restore the tables' rows; **collective** (every rank). ``(step, dense params,
        dense state, meta)`` on workers, None on servers."""
        topo = self.topology
        ckpt.verify(path, topo.comm)
        meta = ckpt.read_meta(path)
        error = None
        try:
            self.sync.restore_rows(lambda name, keep: ckpt.load_matching(
                path, name, keep, layout=ckpt.RowsLayout.of(self.sync[name].spec)))
        except CheckpointError as exc:
            error = str(exc)
        errors = [e for e in topo.comm.allgather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        if not topo.is_worker:
            return None
        params, state = ckpt.load_dense(path)
        return int(meta["step"]), params, state, meta

    # ------------------------------------------------------ whole tables in
    @classmethod
    def _load_initial(cls, engine, initial) -> None:
        """Starting values ``{table: array}`` of the first worker; **collective** (every rank)."""
        topo = engine.topology
        first = topo.worker_ranks[0]
        names = None
        if topo.rank == first:
            initial = dict(initial or {})
            unknown = sorted(set(initial) - set(engine.sync.variables))
            names = ([n for n in engine.sync.variables if n in initial] if not unknown
                     else f"initial values for unknown tables {unknown}")
        names = topo.comm.bcast(names, root=first)
        if isinstance(names, str):
            raise ConfigError(names)
        for name in names:
            cls._set_table(engine, name, initial[name] if topo.rank == first else None)

    @staticmethod
    def _set_table(engine, name, values) -> None:
        """Whole table ``name`` from the first worker into its holders (PS owners or every
        replica); rows only, the optimizer state kept. **Collective** (every rank);
        ``values`` is read on the first worker only."""
        topo, var = engine.topology, engine.sync[name]
        spec = var.spec
        first = topo.worker_ranks[0]
        error = None
        if topo.rank == first:
            values = np.ascontiguousarray(to_host(values))
            if values.shape != (spec.rows, spec.dim) or values.dtype != np.dtype(spec.dtype):
                error = (f"table {name!r} must be {np.dtype(spec.dtype)} of shape "
                         f"{(spec.rows, spec.dim)}, not {values.dtype} {values.shape}")
        error = topo.comm.bcast(error, root=first)
        if error:
            raise ValueError(error)
        table = values if topo.rank == first else np.empty((spec.rows, spec.dim), spec.dtype)
        flat = table.reshape(-1)
        chunk = max(1, BCAST_CHUNK // flat.itemsize)
        for start in range(0, flat.size, chunk):
            topo.comm.Bcast(flat[start:start + chunk], root=first)
        var.load_whole(table)  # the owners' rows, or the replica

    # ---------------------------------------------------------------- finish
    def serve(self) -> None:
        """Servers: serve the workers until they :meth:`finish`, then finish here too."""
        if not self.topology.is_server:
            raise ConfigError(f"rank {self.topology.rank} is a worker; only servers serve")
        self.commands.serve()
        self._close()

    def finish(self) -> None:
        """Workers: release the servers and free what was made; **collective** (every rank)."""
        if self._finished:
            return
        if self.topology.is_worker:
            self.commands.run("stop")
        self._close()

    def _close(self):
        self._finished = True
        self.watchdog.close()
        if self._own_topology:
            self.topology.free()


def _one_worker(request, specs, topology, plan):
    """A measured plan with a single worker: nothing moves between workers, nothing to
    measure. The worker holds whole every table a replica can (it reads it in place, no
    exchange with a server at all: pure cost with one worker), the server ranks hold the
    larger ones. Local."""
    from ..engine import PlanRequest
    from ..ps.memory import fits_whole

    requests = {s.name: {"method": "allgather" if fits_whole(s) or not topology.server_ranks
                         else "ps"} for s in specs}
    picked = sorted({r["method"] for r in requests.values()})
    return PlanRequest(None, requests, f"{plan} (one worker: {'/'.join(picked) or 'none'})")
