"""The engine: everything one job synchronizes, made by one factory.

An :class:`Engine` holds, for one topology, the parameter server, the
sparse synchronizers (:class:`~hpcpax.sync.sparse_set.SparseSync`), the
dense allreduce, the planner (:class:`~hpcpax.tune.controller.PlanController`),
the command channel the servers follow, the watchdog and the accounting.
:func:`build_engine` makes one; ``python -m hpcpax.train``
(:class:`~hpcpax.app.trainer.Trainer`), :class:`~hpcpax.app.model_sync.ModelSync`
and :mod:`hpcpax.torch` (through ``ModelSync``) all build theirs with it.

What an engine does not hold: the model's values (dense parameters and
their optimizer state belong to the caller), the data, the step loop
(:mod:`hpcpax.app.loop`) and the run directory's files.

The engine is the planner's host: the controller reads ``topology``,
``settings.plan``, ``run_dir``, ``is_leader``, ``log``, ``sync``, ``dense``,
``ps`` and ``commands`` and calls ``switch_method``, ``repartition`` and
``write_plan``; nothing else.
"""

from __future__ import annotations

import os

import numpy as np

from .commands import CommandChannel
from .plan_requests import PlanRequest, hot_rows_requests
from .settings import EngineSettings

__all__ = ["Engine", "build_engine", "TensorSpec"]


class TensorSpec:
    """Shape and dtype of a dense tensor (what the planner and the allreduce read)."""

    def __init__(self, shape, dtype):
        self.shape, self.dtype = tuple(shape), np.dtype(dtype)

    def __repr__(self):
        return f"TensorSpec({self.shape}, {self.dtype.name})"


class Engine:
    """One job's synchronization machinery on this rank; see the module doc.

    Made by :func:`build_engine` (collective); its attributes are the
    parts, its methods what every caller does with them.

    Attributes:
        topology: the :class:`~hpcpax.comm.topology.Topology`.
        settings: the :class:`~hpcpax.engine.settings.EngineSettings`.
        watchdog: the :class:`~hpcpax.comm.watchdog.Watchdog` guarding steps.
        ps: the :class:`~hpcpax.ps.server.ParameterServer`.
        sync: the :class:`~hpcpax.sync.sparse_set.SparseSync`.
        dense: ``{name: TensorSpec}`` of the dense tensors, in bucket order.
        dense_sync: the dense allreduce (workers; None on servers).
        planning: the :class:`~hpcpax.tune.controller.PlanController`.
        commands: the :class:`~hpcpax.engine.commands.CommandChannel`.
        run_dir: where ``plan.json`` is written (None: nowhere).
        is_leader: True on the first worker.
    """

    def __init__(self, topology, settings, watchdog, *, run_dir=None, log=None):
        self.topology, self.settings, self.watchdog = topology, settings, watchdog
        self.run_dir = run_dir
        self.is_leader = topology.is_worker and topology.worker_index == 0
        self._log = log
        self.ps = self.sync = self.planning = self.commands = self.dense_sync = None
        self.dense = {}

    @property
    def accounting(self):
        """This rank's :class:`~hpcpax.comm.accounting.Accounting` (bytes and seconds)."""
        return self.topology.accounting

    def log(self, text, everyone=False, important=False) -> None:
        """Print through the caller's logger (default: the first worker prints)."""
        if self._log is not None:
            self._log(text, everyone=everyone, important=important)
        elif self.is_leader:
            print(text, flush=True)

    # ------------------------------------------------------------- the plan
    def current_plan(self):
        """The :class:`~hpcpax.plan.Plan` in force now (local)."""
        return self.planning.current_plan()

    def write_plan(self) -> None:
        """Save the plan in force as ``run_dir/plan.json`` (first worker; local)."""
        if self.is_leader and self.run_dir:
            os.makedirs(self.run_dir, exist_ok=True)
            self.current_plan().save(os.path.join(self.run_dir, "plan.json"))

    def switch_method(self, name, method) -> None:
        """Move sparse variable ``name`` to ``method``, exactly; **collective** (workers).

        Every row and its optimizer state moves (PS owners <-> replicas on
        every worker); training continues as if ``method`` had been used all
        along. The servers join through the command channel.
        """
        from ..sync.methods import method_of

        method_of(method)  # refuses an unknown name here, before any rank moves
        self.commands.run("switch", name=name, method=method)
        self.write_plan()

    def repartition(self, name, partitions, owners=None) -> None:
        """Move ``ps`` variable ``name`` to ``partitions`` partitions, live; **collective**
        (workers)."""
        self.sync[name].repartition(int(partitions), owners)
        self.write_plan()

    def methods(self) -> dict:
        """``{variable: method}`` now (local)."""
        return {name: var.method for name, var in self.sync.variables.items()}

    # ---------------------------------------------------------------- close
    def serve(self) -> None:
        """Servers: serve the workers and run their commands until ``stop``."""
        self.commands.serve()

    def close(self) -> None:
        """Stop the watchdog (local; the caller frees the topology it made)."""
        self.watchdog.close()


def build_engine(topology, specs, plan: PlanRequest, settings: EngineSettings | None = None, *,
                 dense=None, watchdog=None, run_dir=None, log=None, commands=None,
                 before_dense=None) -> Engine:
    """Make the :class:`Engine` of one job; **collective** over ``topology.comm``.

    Args:
        topology: from :func:`hpcpax.init`.
        specs: the sparse variables (:class:`~hpcpax.ps.spec.SparseVariableSpec`),
            the same on every rank.
        plan: the :class:`~hpcpax.engine.plan_requests.PlanRequest`
            (:func:`~hpcpax.engine.plan_requests.resolve_plan` of the user's spec).
        settings: :class:`~hpcpax.engine.settings.EngineSettings` (default: defaults).
        dense: ``{name: (shape, dtype)}`` of the dense tensors in bucket order.
        watchdog: a running watchdog to use (default: one is started here).
        run_dir: where ``plan.json`` goes.
        log: ``log(text, everyone=False, important=False)``.
        commands: extra command handlers ``{op: handler(**args)}``.
        before_dense: ``callable(engine)`` run on every rank after the
            fabric measurement and before the dense allreduce is built (a
            caller's collective set-up, e.g. loading initial tables).

    Order of the collectives (the same on every rank): the parameter
    server, the synchronizers, the planner's fabric measurement,
    ``before_dense``, the dense allreduce (workers).
    """
    from ..comm.watchdog import Watchdog
    from ..ps.server import ParameterServer
    from ..sync.sparse_set import SparseSync
    from ..tune.controller import PlanController

    settings = settings if settings is not None else EngineSettings()
    owned = watchdog is None
    if owned:
        watchdog = Watchdog(topology.comm, settings.timeout, role=topology.role)
    engine = Engine(topology, settings, watchdog, run_dir=run_dir, log=log)
    try:
        engine.ps = ps = ParameterServer(topology, local_aggregation=settings.local_aggregation,
                                         seed=settings.seed)
        ps.watchdog = watchdog  # each served operation is guarded
        ps.memory_budget = settings.server_memory_budget
        engine.sync = SparseSync(topology, ps, specs, plan.requests, seed=settings.seed)
        ps.set_hot_rows(hot_rows_requests(plan.requests, settings.plan.hot_rows))
        engine.dense = {name: TensorSpec(*shape_dtype)
                        for name, shape_dtype in (dense or {}).items()}
        engine.planning = PlanController(engine, plan.mode, label=plan.label)
        engine.planning.measure_fabric()
        engine.commands = CommandChannel(topology, ps, {
            "switch": engine.sync.switch, "hot_rows": ps.set_hot_rows, **(commands or {})},
            watchdog=watchdog)
        if before_dense is not None:
            before_dense(engine)
        if topology.is_worker:
            engine.dense_sync = _dense_sync(topology, engine.dense, settings,
                                            engine.planning.fabric)
    except BaseException:
        if owned:
            watchdog.close()
        raise
    return engine


def _dense_sync(topology, dense, settings, fabric):
    shapes = {name: (t.shape, t.dtype) for name, t in dense.items()}
    if settings.overlap:
        from ..sync.dense_buckets import BucketedAllreduce

        return BucketedAllreduce(topology, shapes, bucket_bytes=settings.bucket_bytes,
                                 op=settings.dense_op, fabric=fabric)
    from ..comm.allreduce import DenseAllreduce

    return DenseAllreduce(topology, shapes, op=settings.dense_op,
                          bucket_bytes=settings.bucket_bytes)
