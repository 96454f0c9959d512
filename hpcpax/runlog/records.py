"""The run-log record of one training run, and the one call that saves it.

:func:`record_run` is what the trainer calls at the end of a run (on its
first worker): it reads the run's facts from the trainer and its
``metrics.jsonl`` and appends them to the run log. Whatever goes wrong
here is a warning, never an error: the training has already succeeded.
Not collective.
"""

from __future__ import annotations

import json
import os

import numpy as np

from .log import RunLog, _warn, run_log_path

__all__ = ["record_run", "run_record", "measured_phases", "layout_summary"]

#: Steps left out at the start of a run's timing (warm-up, JIT compilation).
WARMUP_STEPS = 2


def layout_summary(describe: dict) -> dict:
    """Counts from a topology's ``describe()``: nodes, workers, servers, per node."""
    nodes = int(describe["num_nodes"])
    workers, servers = len(describe["worker_ranks"]), len(describe["server_ranks"])
    return {**describe, "workers": workers, "servers": servers,
            "workers_per_node": max(1, workers // nodes), "servers_per_node": servers // nodes}


def measured_phases(metrics_path: str, first_step: int = 1) -> dict:
    """Median seconds per step and per phase over ``metrics.jsonl`` from ``first_step``."""
    rows = []
    with open(metrics_path, encoding="utf-8") as handle:
        for line in handle:
            row = json.loads(line)
            if "loss" in row and row["step"] >= first_step:
                rows.append(row)
    if not rows:
        return {}
    phases = {p: float(np.median([r["time"].get(p, 0.0) for r in rows])) for p in rows[0]["time"]}
    return {"step_s": float(np.median([r["seconds"] for r in rows])), "phases": phases,
            "steps": len(rows)}


def _variables(engine, measurements):
    out = []
    for name, var in engine.sync.variables.items():
        spec = var.spec
        facts = measurements.get(name, {})
        out.append({"name": name, "kind": "sparse", "shape": [spec.rows, spec.dim],
                    "dtype": spec.dtype, "alpha": facts.get("alpha"),
                    "alpha_node": facts.get("alpha_node"),
                    "duplicate_ratio": facts.get("duplicate_ratio")})
    out += [{"name": n, "kind": "dense", "shape": list(p.shape), "dtype": str(p.dtype)}
            for n, p in engine.dense.items()]
    return out


def _strategy(engine):
    out = {}
    for name, var in engine.sync.variables.items():
        now = var.describe()
        out[name] = {"method": now["method"], "partitions": now["partitions"],
                     "local_aggregation": now["local_aggregation"] if var.sync_method.on_servers
                     else None}
    return out


def _predict(record):
    """The analytic model's step for a record with a fabric and measured densities."""
    from ..plan.collectives import Links
    from ..plan.cost_model import CostParams
    from ..plan.step_model import predict_step
    from ..plan.traffic import Layout, expected_routing

    sparse = [v for v in record["model"]["variables"] if v["kind"] == "sparse"]
    if record.get("fabric") is None or any(v.get("alpha") is None for v in sparse):
        return None
    layout = Layout.from_topology(record["layout"])
    routings = {}
    for var in sparse:
        strategy = record["strategy"][var["name"]]
        method = strategy["method"]
        rows, dim = var["shape"]
        itemsize = np.dtype(var["dtype"]).itemsize
        routings[var["name"]] = expected_routing(
            layout, method, rows, dim * itemsize, var["alpha"], var.get("alpha_node"),
            var.get("duplicate_ratio") or 1.0, partitions=strategy.get("partitions") or max(
                1, len(layout.owner_ranks)), local_aggregation=bool(strategy["local_aggregation"]))
    dense = [int(np.prod(v["shape"])) * np.dtype(v["dtype"]).itemsize
             for v in record["model"]["variables"] if v["kind"] == "dense"]
    phases = record["measured"].get("phases", {})
    prediction = predict_step(layout, Links.from_fabric(record["fabric"]), CostParams.measured(),
                              routings, dense, compute_s=phases.get("compute", 0.0),
                              data_s=phases.get("data", 0.0),
                              optimizer_s=phases.get("optimizer"),
                              compute_on_host=not record.get("emulated_compute"))
    return prediction.to_dict()


def run_record(engine, config) -> dict:
    """The record of a finished run of ``engine`` (an :class:`~hpcpax.engine.engine.Engine`)
    under ``python -m hpcpax.train``'s resolved flags ``config`` (first worker; reads
    ``metrics.jsonl``)."""
    planning = getattr(engine, "planning", None)
    plan = getattr(planning, "plan", None)
    measurements = dict(plan.measurements) if plan is not None else {}
    fabric = getattr(planning, "fabric", None)
    first = 1 + WARMUP_STEPS + (config["plan_steps"] if plan is not None else 0)
    metrics = os.path.join(engine.run_dir, "metrics.jsonl")
    record = {
        "model": {"name": config["model"], "variables": _variables(engine, measurements)},
        "layout": layout_summary(engine.topology.describe()),
        "fabric": fabric.to_dict() if fabric is not None else None,
        "strategy": _strategy(engine),
        "plan_mode": config["plan"] if isinstance(config["plan"], str) else "given",
        "global_batch": config["global_batch"],
        "measured": measured_phases(metrics, first) if os.path.exists(metrics) else {},
    }
    record["predicted"] = _predict(record) if record["measured"] else None
    return record


def record_run(engine, config, source: str = "train") -> int | None:
    """Append the finished run of ``engine`` under flags ``config`` to the run log; the
    record id or None.

    Not collective (call it on one rank). Never raises: a problem is a
    one-line :class:`~hpcpax.runlog.log.RunLogWarning`.
    """
    if run_log_path() is None:
        return None
    try:
        record = run_record(engine, config)
    except Exception as exc:  # noqa: BLE001  (a finished run must not fail here)
        _warn(f"run log: no record of this run ({type(exc).__name__}: {exc})")
        return None
    return RunLog().append(record, source)
