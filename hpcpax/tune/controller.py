"""The planner's live automation: measure, plan, switch, search.

:class:`PlanController` is what ``--plan auto|hybrid`` does inside
``python -m hpcpax.train``:

1. at start-up, measure the fabric (alpha-beta links, fusion size; < 2 s);
2. train the first ``plan_steps`` steps with every sparse variable on the
   parameter server while measuring each one's row density (per worker and
   per node, union) and duplicate ratio;
3. build the plan with :func:`hpcpax.plan.make_plan` (cost model for
   ``auto``, Parallax's rule for ``hybrid``) on the first worker, broadcast it,
   check every worker holds the same fingerprint, print its table and save it
   as ``plan.json``;
4. apply it: move variables between methods exactly (every row and its
   optimizer state travels; nothing is recomputed), set partitions, owners
   and local aggregation per variable;
5. optionally run Parallax's partition search on live steps, and re-plan
   every ``replan_every`` steps, switching a method only when the model
   predicts a gain above ``replan_threshold``.

Steps spent measuring or searching are ordinary training steps: they update
the parameters and are written to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import os

import numpy as np

from ..backend import to_host

__all__ = ["PlanController", "MEASURED_MODES"]

#: ``--plan`` values that measure before deciding.
MEASURED_MODES = ("auto", "hybrid")


class PlanController:
    """Measures, plans and re-plans for one :class:`~hpcpax.app.engine.Trainer`.

    Its host is an :class:`~hpcpax.engine.engine.Engine`, used through
    ``topology``, ``settings.plan`` (:class:`~hpcpax.engine.settings.PlanSettings`),
    ``run_dir``, ``is_leader``, ``log``, ``sync`` (the
    :class:`~hpcpax.sync.sparse_set.SparseSync`), ``dense``, ``ps``,
    ``commands``, ``switch_method``, ``repartition`` and ``write_plan``. It
    runs no training step itself: the trial steps of a search are asked of
    the loop through the ``steps`` runner :meth:`after_step` is given.

    Args:
        engine: the engine (its topology, synchronizers and dense specs are set up).
        mode: ``auto``, ``hybrid`` or None (a fixed plan: nothing to do).
        label: how the plan was given, for ``plan.json`` (``ps``, a file...).
    """

    def __init__(self, engine, mode, label=None):
        self.engine = engine
        self.mode = mode if mode in MEASURED_MODES else None
        self.label = mode if self.mode else (label or "fixed")
        self.fabric = None
        #: The fabric the cost model is given (a calibration's dict holds more).
        self.model_fabric = None
        #: The cost model's constants (None: kernel rates timed on the deciding rank).
        self.params = None
        #: The last plan this controller made (None for fixed plans).
        self.plan = None
        self.search = {}
        #: Decisions taken while training, saved in ``plan.json`` (``runtime``).
        self.runtime = {}
        self._stats = None
        self._measure_until = None

    # ------------------------------------------------------------ start-up
    def measure_fabric(self) -> None:
        """Alpha-beta fabric measurement; **collective** over every rank. ``auto`` with
        ``plan_calibrate`` times all the model's constants (:func:`~hpcpax.tune.calibrate.
        calibrate`: what cost_model_check validates); else kernel rates on one rank.
        Nothing is measured when a resumed run will take the measured plan in
        ``plan.json`` and never re-plan (only its fabric is read back)."""
        if self.mode is None:
            return
        from ..comm.fabric import Fabric, measure_fabric

        config = self.engine.settings.plan
        if config.resume and not config.replan_every:
            # a plan start() takes from plan.json: nothing will price a new one
            topo = self.engine.topology
            text = measured_plan_text(self.engine, topo.comm, topo.worker_ranks[0])
            if text is not None:
                fabric = json.loads(text).get("fabric")
                self.fabric = self.model_fabric = Fabric.from_dict(fabric) if fabric else None
                self.engine.log("resume: plan.json holds the measured plan; the fabric and "
                                 "the cost model's constants are not measured again")
                return
        if self.mode == "auto" and config.plan_calibrate:
            from .calibrate import cost_params
            from .calibration_cache import calibrate_or_reuse

            calibration, how = calibrate_or_reuse(self.engine.topology,
                                                  fabric_seconds=config.fabric_seconds,
                                                  budget_s=config.startup_budget_s)
            self.search["calibration"] = how
            self.fabric = Fabric.from_dict(calibration["fabric"])
            self.model_fabric = calibration["fabric"]  # with the measured Allreduce
            self.params = cost_params(calibration)
            # plan.json's search says what start-up was allowed (2 % of a known run)
            self.search["startup_budgets"] = {**calibration["budgets"],
                                              "planned_run_s": config.planned_run_s}
            return
        self.fabric = measure_fabric(self.engine.topology, budget_s=min(
            config.fabric_seconds, config.startup_budget_s or config.fabric_seconds))
        self.model_fabric = self.fabric

    def start(self, first_step: int, resumed: bool = False) -> None:
        """Begin measuring sparsity at ``first_step`` (workers; collective).

        A resumed run takes the plan its run directory already holds, if
        one was made, so it continues exactly as the interrupted run would.
        """
        if self.mode is None:
            return
        if resumed and self._resume_plan():
            return
        self._begin_measuring(first_step)

    def _resume_plan(self) -> bool:
        from ..plan import Plan

        engine = self.engine
        text = measured_plan_text(engine, engine.topology.workers, 0)
        if text is None:
            return False
        self.plan = Plan.from_json(text)
        self.search = {k: v for k, v in self.plan.search.items() if k != "mode"}
        self.apply(self.plan)
        engine.log("resume: plan taken from plan.json (not measured again)")
        return True

    def _begin_measuring(self, first_step):
        from ..plan import SparsityStats

        self._stats = {name: SparsityStats() for name in self.engine.sync}
        self._measure_until = first_step + self.engine.settings.plan.plan_steps - 1

    # ---------------------------------------------------------------- steps
    @property
    def measuring(self) -> bool:
        """True while sparsity is being measured (:meth:`observe` uses its ids)."""
        return self._stats is not None

    def observe(self, ids: dict) -> None:
        """Record one step's ids of every sparse variable (workers; collective
        over each node's workers while measuring)."""
        if self._stats is None:
            return
        node_workers = self.engine.topology.node_workers
        for name, stats in self._stats.items():
            local = to_host(ids[name]).astype(np.int64, copy=False)
            union = np.unique(np.concatenate(node_workers.allgather(np.unique(local))))
            stats.update((local, union), self.engine.sync[name].spec.rows)

    def after_step(self, step: int, steps=None) -> int:
        """Act after ``step``; returns the last step run (a search asks for steps).

        ``steps`` is the loop's step runner (``steps.run(step)`` trains one
        step as the loop does, ``steps.stopped`` says the run is stopping;
        :class:`~hpcpax.app.loop.StepRunner`): the hot-rows trial and the
        partition search ask it for their trial steps. Without one (a user's
        own loop) neither runs. **Collective** over the workers.
        """
        config = self.engine.settings.plan
        if self._stats is not None and step >= self._measure_until:
            replanning = self.plan is not None
            self._decide(replanning)
            self._stats = None
            if config.hot_rows_trial and not replanning and steps is not None:
                step = self._hot_rows_trial(step, steps)
            if config.partition_search and not replanning and steps is not None:
                step = self._search(step, steps)
        if (config.replan_every and self.mode is not None and self.plan is not None
                and self._stats is None and step % config.replan_every == 0
                and step < config.steps):
            self._begin_measuring(step + 1)
        return step

    # ------------------------------------------------------------- decisions
    def _measurements(self):
        """Sparsity means over steps and workers (identical on every worker)."""
        from ..comm.reductions import sum_in_place

        names = sorted(self._stats)
        keys = ("alpha", "alpha_node", "duplicate_ratio")
        vector = np.array([self._stats[n].to_dict()[k] or 0.0 for n in names for k in keys])
        comm = self.engine.topology.workers
        sum_in_place(comm, vector)
        vector /= comm.Get_size()
        steps = self._stats[names[0]].steps if names else 0
        return {n: {**{k: float(vector[i * len(keys) + j]) for j, k in enumerate(keys)},
                    "steps": steps} for i, n in enumerate(names)}

    def _shape(self):
        topo = self.engine.topology
        return {"num_nodes": topo.num_nodes,
                "workers_per_node": max(1, topo.num_workers // topo.num_nodes),
                "servers_per_node": len(topo.server_ranks) // topo.num_nodes}

    def _variables(self, measured):
        from ..ops.optimizers import make_optimizer

        engine = self.engine
        # alpha is touched rows / declared rows: floor it at half a row, not at a
        # fraction that means millions of rows of a 2**63-row table
        out = [{"name": n, "kind": "sparse", "shape": [v.spec.rows, v.spec.dim],
                "dtype": v.spec.dtype, "alpha": max(measured[n]["alpha"], 0.5 / v.spec.rows),
                "alpha_node": max(measured[n]["alpha_node"], 0.5 / v.spec.rows),
                "duplicate_ratio": max(measured[n]["duplicate_ratio"], 1.0),
                "row_slots": len(make_optimizer(v.spec.optimizer,
                                                **v.spec.optimizer_params).row_slots)}
               for n, v in engine.sync.variables.items()]
        out += [{"name": n, "kind": "dense", "shape": list(p.shape), "dtype": str(p.dtype)}
                for n, p in engine.dense.items()]
        return out

    def _decide(self, replanning):
        from ..comm.agreement import check_same
        from ..plan.plan import Plan
        from ..plan.auto import make_plan, should_switch
        from ..plan.cost_model import predict_all
        from ..runlog.learned import load_correction

        engine = self.engine
        topo = engine.topology
        measured = self._measurements()
        text = None
        if engine.is_leader:  # one rank decides everything, keeps included: no
            # rank can take another branch of a collective switch on round-off
            specs = self._variables(measured)
            correction = load_correction()
            plan = make_plan(specs, self.mode, self._shape(), self.model_fabric,
                             params=self.params, measurements=measured, search=self.search,
                             correction=correction, hot_rows=self._hot_rows_setting())
            whole = plan.search.get("cost_model", {}).get("whole_step")
            if replanning and whole is not None:
                self._keep_whole_step(plan, specs, whole["step_s"], correction)
            elif replanning:
                for spec in specs:
                    if spec["kind"] != "sparse":
                        continue
                    times = predict_all(spec, self._shape(), self.model_fabric, params=self.params)
                    if not should_switch(engine.sync[spec["name"]].method, times,
                                         float(engine.settings.plan.replan_threshold)):
                        self._keep(plan.variables[spec["name"]], spec["name"])  # gain too small
            text = plan.to_json()
        plan = Plan.from_json(topo.workers.bcast(text, root=0))
        check_same(topo.workers, "plan", {"fingerprint": plan.fingerprint()})
        self.plan = plan
        self.apply(plan)
        engine.write_plan()
        engine.log(("re-plan" if replanning else f"plan ({self.mode})")
                    + f" after {measured[next(iter(measured))]['steps']} measured steps:\n"
                    + self.current_plan().table())

    def _keep_whole_step(self, plan, specs, new_s, correction) -> None:
        """Re-planning a whole-step plan: every sparse variable stays unless the new
        methods beat the current ones' step by ``replan_threshold``."""
        from ..plan.joint_choice import worth_switching

        sync = self.engine.sync
        sparse = [s["name"] for s in specs if s["kind"] == "sparse"]
        if not worth_switching(specs, {n: sync[n].method for n in sparse},
                               {n: sync[n].partitions for n in sparse}, new_s, self._shape(),
                               self.model_fabric, self.params,
                               float(self.engine.settings.plan.replan_threshold), correction):
            for name in sparse:
                self._keep(plan.variables[name], name)  # gain too small

    def _keep(self, entry, name) -> None:
        """Make ``entry`` describe where ``name`` is now."""
        now = self.engine.sync[name].describe()
        entry.method, entry.partitions = now["method"], now["partitions"]
        entry.owners, entry.local_aggregation = now["owners"], now["local_aggregation"]
        entry.reason = "kept: predicted gain below the re-planning threshold"

    def apply(self, plan) -> None:
        """Put every sparse variable where ``plan`` says; **collective** (workers)."""
        engine = self.engine
        owners_count = len(engine.topology.owner_ranks)
        for name, entry in plan.variables.items():
            if entry.kind != "sparse" or name not in engine.sync.variables:
                continue
            var = engine.sync[name]
            if entry.sync_method is not var.sync_method:
                engine.switch_method(name, entry.method)
            if not entry.sync_method.on_servers:
                continue
            owners = list(entry.owners)
            if len(owners) != entry.partitions or (owners and max(owners) >= owners_count):
                owners = None  # the plan was made for another layout: balance here
            if entry.partitions != var.partitions or (owners is not None and owners != var.owners):
                engine.repartition(name, entry.partitions, owners)
            var.set_local_aggregation(entry.local_aggregation)
        hot = {name: entry.hot_rows for name, entry in plan.variables.items()
               if entry.sync_method.on_servers and entry.hot_rows is not None
               and name in engine.sync.variables
               and engine.ps.hot_rows_of(name) != entry.hot_rows}
        if hot:  # the servers classify too: every rank takes the decision
            engine.commands.run("hot_rows", settings=hot)

    def _hot_rows_setting(self):
        """``make_plan``'s ``hot_rows``: off, relays, the fixed rule of ``HPCPAX_HOT_ROWS``,
        or auto."""
        from ..options import options

        if self.engine.settings.plan.hot_rows in ("off", "relays"):
            return self.engine.settings.plan.hot_rows
        return options.hot_rows if options.hot_rows >= 2 else "auto"

    def current_plan(self):
        """The plan in force now: every variable as it is, with this controller's evidence.

        Local. Sparse variables are described by their synchronizers (the
        truth after switches, searches and repartitions); predictions and
        reasons of the last made plan are kept where the method is unchanged.
        """
        from ..plan.plan import Plan, VariablePlan

        engine = self.engine
        made = self.plan.variables if self.plan is not None else {}
        variables = {}
        for name, var in engine.sync.variables.items():
            now = var.describe()
            prior = made.get(name)
            same = prior is not None and prior.sync_method is var.sync_method
            variables[name] = VariablePlan(
                name=name, kind="sparse", shape=(var.spec.rows, var.spec.dim),
                dtype=str(var.spec.dtype), method=now["method"], partitions=now["partitions"],
                owners=now["owners"], local_aggregation=now["local_aggregation"],
                predicted_s=prior.predicted_s if same else None,
                reason=prior.reason if same else f"plan {self.label}",
                hot_rows=engine.ps.hot_rows_of(name) if var.sync_method.on_servers else None)
        for name, param in engine.dense.items():
            prior = made.get(name)
            variables[name] = VariablePlan(
                name=name, kind="dense", shape=tuple(param.shape), dtype=str(param.dtype),
                method="allreduce", predicted_s=prior.predicted_s if prior else None,
                reason="dense: allreduce")
        search = {"mode": self.label, **self.search}
        if self.plan is not None and "cost_model" in self.plan.search:
            # which constants and whether a learned correction made the plan
            search["cost_model"] = self.plan.search["cost_model"]
        return Plan(variables=variables, fabric=self.fabric.to_dict() if self.fabric else None,
                    measurements=self.plan.measurements if self.plan else {},
                    topology=self._shape(), search=search, runtime=self.runtime)

    # ---------------------------------------------------------------- search
    def _hot_rows_trial(self, step, steps):
        """Keep the plan's hot-row trees only if live steps run faster with them.

        Trees stay on only where a trial confirmed them: the cost model does
        not see a tree's host costs (see :mod:`~hpcpax.tune.hot_rows_trial`),
        so when too few steps are left for even one round (4 steps) the
        trees are turned off, not trusted; a shorter run gets as many rounds
        as fit. ``--hot-rows-trial 0`` trusts the cost model instead.
        """
        from .hot_rows_trial import OFF, ROUND_STEPS, run_hot_rows_trial

        engine, wanted = self.engine, int(self.engine.settings.plan.hot_rows_trial)
        chosen = {name: entry.hot_rows for name, entry in self.plan.variables.items()
                  if entry.sync_method.on_servers and entry.hot_rows
                  and entry.hot_rows["min_nodes"]}
        if not chosen:
            return step
        left = engine.settings.plan.steps - step
        rounds = min(wanted, left // ROUND_STEPS)
        if rounds < 1:
            reason = (f"hot rows off: unverified, {left} steps left and a trial round "
                      f"needs {ROUND_STEPS}")
            engine.commands.run("hot_rows", settings={name: {**OFF, "reason": reason}
                                                      for name in chosen})
            self.search["hot_rows_trial"] = {"variables": sorted(chosen), "model": chosen,
                                             "kept": False, "skipped": reason}
            engine.log(f"hot-rows trial skipped ({', '.join(sorted(chosen))}): {reason}")
            engine.write_plan()
            return step
        trial, next_step = run_hot_rows_trial(engine, steps, chosen, rounds, step + 1)
        self.search["hot_rows_trial"] = {"variables": sorted(chosen), "model": chosen, **trial}
        engine.log(f"hot-rows trial ({', '.join(sorted(chosen))}, {rounds} rounds): trees "
                    + ("kept" if trial["kept"] else "off")
                    + f", median step {np.median(trial['on_s']) * 1e3:.1f} ms with, "
                    f"{np.median(trial['off_s']) * 1e3:.1f} ms without")
        engine.write_plan()
        return next_step - 1

    def _search(self, step, steps):
        """Parallax's partition search for each ps variable, on live steps."""
        from .live_search import search_partitions_live

        engine, config = self.engine, self.engine.settings.plan
        per_trial = 2  # warm-up + timed steps of each candidate
        for name in [n for n, v in engine.sync.variables.items() if v.sync_method.on_servers]:
            budget = config.steps - step
            if budget < 3 * per_trial:
                engine.log(f"partition search of {name} skipped: {budget} steps left")
                continue
            result, next_step = search_partitions_live(
                engine.ps, name, steps.run, first_step=step + 1, steps=1, warmup=1,
                max_measurements=min(8, budget // per_trial))
            step = next_step - 1
            self.search[name] = result.to_dict()
            engine.log(f"partition search of {name}: chose {result.chosen} partitions "
                        f"in {result.search_seconds:.2f} s (samples "
                        + ", ".join(f"{p}: {t * 1e3:.1f} ms" for p, t in
                                    sorted(result.samples.items())) + ")")
            if steps.stopped:
                break
        engine.write_plan()
        return step


def measured_plan_text(engine, comm, root):
    """The text of the run directory's ``plan.json`` when a measured mode (``auto``,
    ``hybrid``) made it, else None (none, unreadable, or written before the measurement
    ended); read by the first worker (rank ``root`` of ``comm``), broadcast over
    ``comm``; **collective** over ``comm``."""
    text = None
    if engine.is_leader:
        try:
            with open(os.path.join(engine.run_dir, "plan.json"), encoding="utf-8") as handle:
                text = handle.read()
            if json.loads(text).get("search", {}).get("mode") not in MEASURED_MODES:
                text = None
        except (OSError, ValueError, AttributeError):
            text = None
    return comm.bcast(text, root=root)
