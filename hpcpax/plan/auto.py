"""Build a :class:`~hpcpax.plan.plan.Plan` from facts, by rule or by cost.

Modes:

* ``hybrid``: Parallax's rule. Sparse variables go to the parameter servers
  (with local aggregation when a node has more than one worker), dense ones
  are allreduced.
* ``ps``: the same as ``hybrid`` (every sparse variable on ``ps``, dense
  stays ``allreduce``), but without local aggregation: each worker pushes
  and pulls on its own.
* ``allreduce``: everything allreduced, sparse gradients densified.
* ``auto``: per variable, the method the cost model predicts fastest
  (:func:`hpcpax.plan.cost_model.choose`).

Partitions of a ``ps`` variable default to ``max(1, servers)``; the owners
of all partitions of all ``ps`` variables are placed together by
:func:`~hpcpax.plan.plan.assign_owners`, so bytes balance across servers.
Nothing here is collective: every rank computes the same plan from the same
inputs.
"""

from __future__ import annotations

import dataclasses

from collections.abc import Mapping

from ..errors import ConfigError
from ..ps.memory import replicable
from ..sync.methods import method_of
from .cost_model import ClusterShape, CostParams, VarSpec, choose, predict, predict_key
from .hot_rows_cost import plan_entry
from .plan import Plan, VariablePlan, assign_owners

__all__ = ["MODES", "make_plan", "should_switch", "partition_bytes"]

MODES = ("auto", "hybrid", "ps", "allreduce")


def partition_bytes(var: VarSpec, partitions: int) -> list:
    """Bytes of each of ``partitions`` nearly equal row blocks of ``var``."""
    base, extra = divmod(var.rows, partitions)
    row_bytes = var.dim * var.itemsize
    return [(base + (1 if p < extra else 0)) * row_bytes for p in range(partitions)]


def _partitions_for(name, partitions, default):
    if partitions is None:
        return default
    if isinstance(partitions, Mapping):
        value = partitions.get(name, default)
    else:
        value = partitions
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"partitions of {name!r} must be an int >= 1, not {value!r}")
    return value


def make_plan(variables, mode: str, topology, fabric, partitions=None,
              params: CostParams | None = None, measurements: dict | None = None,
              search: dict | None = None, correction=None, hot_rows="auto") -> Plan:
    """A plan for ``variables`` under ``mode``.

    Args:
        variables: list of dicts (or :class:`VarSpec`) with ``name``,
            ``kind``, ``shape``, ``dtype``, and for sparse ones ``alpha`` and
            optionally ``alpha_node`` and ``row_slots`` (optimizer slots per
            row: ``auto`` never replicates a table whose whole size with
            them exceeds ``HPCPAX_REPLICA_MEMORY``); extra keys are ignored.
        mode: ``"auto"``, ``"hybrid"``, ``"ps"`` or ``"allreduce"``.
        topology: ``num_nodes``, ``workers_per_node``, ``servers_per_node``
            (dict, :class:`ClusterShape` or object).
        fabric: ``hpcpax.comm.fabric.Fabric`` or its ``to_dict()``.
        partitions: ``None`` (``max(1, servers)``), one int for every ``ps``
            variable, or ``{name: int}`` (for example from the search).
        params: cost model constants (default: kernel rates timed here,
            :meth:`CostParams.measured`).
        measurements, search: evidence copied into the plan.
        correction: a learned :class:`~hpcpax.runlog.learned.Correction` (or
            :func:`~hpcpax.runlog.learned.load_correction`'s ``(correction,
            why)``) applied to ``auto``'s predictions; the plan's
            ``search["cost_model"]`` says whether it was used and why.
        hot_rows: ``"auto"`` (the cost model of
            :mod:`hpcpax.plan.hot_rows_cost` decides per ``ps`` variable),
            ``"off"``, ``"relays"`` (:mod:`hpcpax.ps.hot_rows.relays`), an int (the fixed
            rule), or ``{name: one of these}``.

    Raises:
        ConfigError: unknown mode, duplicate name, or bad partitions.
    """
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {MODES}, not {mode!r}")
    shape = ClusterShape.from_any(topology)
    specs = [VarSpec.from_any(v) for v in variables]
    names = [s.name for s in specs]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ConfigError(f"variable names must be unique, not repeated {duplicates}")
    several_per_node = shape.workers_per_node > 1
    default_partitions = max(1, shape.servers)
    params = params or CostParams.measured()
    correction, why = correction if isinstance(correction, tuple) else (
        correction, "used" if correction is not None else "no learned correction given")
    if mode != "auto" and correction is not None:
        correction, why = None, f"not used: mode {mode} follows a rule"
    if params.ps_batch is None:  # PS tables share their exchanges (push_many)
        sparse = sum(1 for s in specs if s.kind == "sparse")
        params = dataclasses.replace(params, ps_batch=max(1, sparse))

    slots = {v["name"]: int(v.get("row_slots") or 0) for v in variables if isinstance(v, Mapping)}
    decisions = []  # (spec, method, local_aggregation, parts, predicted, reason)
    alone = {}  # auto: each variable's {method: seconds} priced alone
    for spec in specs:
        parts = _partitions_for(spec.name, partitions, default_partitions)
        if mode == "auto":
            method, times, reason = choose(spec, shape, fabric, partitions=parts, params=params,
                                           correction=correction)
            alone[spec.name] = times
            if method_of(method).replicated and spec.kind == "sparse" and not replicable(
                    spec.rows, spec.dim * spec.itemsize, slots.get(spec.name, 0)):
                method, reason = "ps", "whole table above HPCPAX_REPLICA_MEMORY: ps only"
            local = method_of(method).on_servers and several_per_node
            predicted = times[method]
        else:
            if spec.kind == "dense" or mode == "allreduce":
                method, local = "allreduce", False
                reason = "dense: allreduce" if spec.kind == "dense" else "mode allreduce: densified"
            elif mode == "hybrid":
                method, local = "ps", several_per_node
                reason = "sparse: ps" + (" + local aggregation" if local else "") + " (Parallax rule)"
            else:
                method, local, reason = "ps", False, "mode ps: sparse on servers"
            predicted = predict(spec, predict_key(method, local), shape, fabric, partitions=parts,
                                params=params)
        decisions.append((spec, method, local, parts if method_of(method).on_servers else 1,
                          predicted, reason))
    joint = None
    if mode == "auto" and params.software and any(s.kind == "sparse" for s in specs):
        decisions, joint = _whole_step(decisions, alone, specs, shape, fabric, params,
                                       partitions, default_partitions, correction, slots)

    sizes, slices = [], []
    for spec, method, _, parts, _, _ in decisions:
        start = len(sizes)
        if method_of(method).on_servers:
            sizes += partition_bytes(spec, parts)
        slices.append((start, len(sizes)))
    owners = assign_owners(sizes, max(1, shape.servers))

    plan_vars = {}
    for (spec, method, local, parts, predicted, reason), (lo, hi) in zip(decisions, slices):
        plan_vars[spec.name] = VariablePlan(
            name=spec.name, kind=spec.kind, shape=spec.shape, dtype=spec.dtype, method=method,
            partitions=parts, owners=owners[lo:hi], local_aggregation=local, wire_dtype=None,
            predicted_s=predicted, reason=reason,
            hot_rows=plan_entry(spec, method, shape, fabric, hot_rows))
    fabric_dict = fabric if isinstance(fabric, Mapping) or fabric is None else fabric.to_dict()
    measured = dict(measurements or {})
    for spec in specs:
        if spec.kind == "sparse" and spec.name not in measured:
            measured[spec.name] = {"alpha": spec.alpha, "alpha_node": spec.alpha_node}
    search_info = {"mode": mode, "cost_model": {
        "learned_correction": correction is not None, "why": why,
        "params": params.source or "given"}}
    if correction is not None:
        search_info["cost_model"]["correction"] = correction.to_dict()
    if joint is not None:
        search_info["cost_model"]["whole_step"] = {
            "step_s": joint["step_s"], "per_variable_choices_step_s": joint["start_s"]}
    search_info.update(search or {})
    return Plan(variables=plan_vars, fabric=fabric_dict, measurements=measured,
                topology=shape.to_dict(), search=search_info)


def _whole_step(decisions, alone, specs, shape, fabric, params, partitions, default_partitions,
                correction, slots):
    """``auto`` with per-operation costs: the sparse methods chosen together
    (:func:`~hpcpax.plan.joint_choice.choose_jointly`), each variable's line saying
    what its method saves on the whole step. Returns ``(decisions, joint)``."""
    from .joint_choice import METHODS, choose_jointly

    several_per_node = shape.workers_per_node > 1
    parts = {s.name: _partitions_for(s.name, partitions, default_partitions) for s in specs}
    servers_only = tuple(m for m in METHODS if method_of(m).on_servers)
    allowed = {s.name: METHODS if replicable(s.rows, s.dim * s.itemsize, slots.get(s.name, 0))
               else servers_only for s in specs if s.kind == "sparse"}
    start = {d[0].name: d[1] for d in decisions if d[0].kind == "sparse"}
    joint = choose_jointly(specs, start, shape, fabric, params, partitions=parts,
                           correction=correction, allowed=allowed)
    out = []
    for spec, method, local, part, predicted, reason in decisions:
        if spec.kind == "sparse":
            method = joint["methods"][spec.name]
            on_servers = method_of(method).on_servers
            local = on_servers and several_per_node
            part = parts[spec.name] if on_servers else 1
            key = predict_key(method, local)
            predicted = alone[spec.name].get(key, alone[spec.name][method])
            times = joint["alternatives"].get(spec.name, {})
            others = {m: t - joint["step_s"] for m, t in times.items() if m != method}
            reason = (f"whole step {1e3 * joint['step_s']:.3f} ms predicted"
                      + "".join(f"; {m} +{1e3 * d:.3f} ms" for m, d in sorted(
                          others.items(), key=lambda item: item[1]))
                      + (" (replicas would not fit: ps only)" if allowed[spec.name] == servers_only
                         else ""))
        out.append((spec, method, local, part, predicted, reason))
    return out, joint


def should_switch(current_method: str, times: Mapping, threshold: float = 0.1) -> bool:
    """Whether re-planning should move a variable off ``current_method``.

    True when the best predicted method is faster than the current one by
    more than ``threshold`` (a fraction: 0.1 = 10 %); the margin keeps noisy
    measurements from flipping a plan back and forth.
    """
    if current_method not in times:
        raise ValueError(f"current_method {current_method!r} is not in the predicted times {sorted(times)}")
    if threshold < 0:
        raise ValueError(f"threshold must be >= 0, not {threshold}")
    best = min(times.values())
    return best < times[current_method] * (1.0 - threshold)
