"""What the user asked each sparse variable to use: ``--plan``, a plan dict or ``plan.json``.

- :func:`resolve_plan`: a ``--plan`` value (``auto``, ``hybrid``, a method
  name, a file, a dict) -> :class:`PlanRequest` (the measured mode, if
  any, and one request per variable), the only place a plan spec becomes
  per-variable methods;
- :func:`normalize_plan` / :func:`load_plan_file`: a per-variable table
  ``{name: {"method", "partitions", "owners", "local_aggregation",
  "hot_rows"}}``, or a saved ``plan.json`` (:class:`hpcpax.plan.Plan`'s
  JSON, whose dense variables are ignored), checked;
- :func:`hot_rows_requests`: the hot-row entries such a table gives.

Nothing here is collective; every rank resolves the same spec.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from ..errors import ConfigError
from ..input_checks import (check_int, check_name, check_tree, load_json_file, shown,
                            shown_path)
from ..ps.spec import MAX_OWNER, MAX_PARTITIONS
from ..sync.methods import method_of, names as method_names

__all__ = ["PLAN_MODES", "PlanRequest", "resolve_plan", "normalize_plan", "load_plan_file",
           "hot_rows_requests"]

#: ``--plan`` values that measure the run before deciding.
PLAN_MODES = ("auto", "hybrid")
#: Most variables a plan table may name.
MAX_PLAN_VARIABLES = 1 << 16


@dataclass
class PlanRequest:
    """A plan as asked for, before anything is measured.

    Attributes:
        mode: ``auto``/``hybrid`` (every variable starts on the parameter
            server and is measured, then moved) or None (fixed).
        requests: ``{name: {"method", "partitions", "owners",
            "local_aggregation"[, "hot_rows"]}}`` per sparse variable.
        label: how the plan was given, for ``plan.json`` (``ps``, ``table``...).
    """

    mode: str | None
    requests: dict = field(default_factory=dict)
    label: str = "fixed"


def resolve_plan(spec, names) -> PlanRequest:
    """The :class:`PlanRequest` for a ``--plan`` value or a plan dict over variables ``names``.

    Raises:
        ConfigError: an unknown method or mode, a bad table, or a table naming
            a variable the model does not have.
    """
    label = spec if isinstance(spec, str) else "table"
    if isinstance(spec, str) and spec in PLAN_MODES:
        return PlanRequest(spec, {name: {"method": "ps"} for name in names}, label)
    if isinstance(spec, str) and spec in method_names():
        return PlanRequest(None, {name: {"method": spec} for name in names}, label)
    plan = load_plan_file(spec) if isinstance(spec, str) else normalize_plan(dict(spec))
    unknown = sorted(set(plan) - set(names))
    if unknown:
        raise ConfigError(f"plan names unknown sparse variable {unknown[0]!r}; the model "
                          f"has {names}")
    return PlanRequest(None, {name: plan.get(name, {"method": "ps"}) for name in names}, label)


def hot_rows_requests(requests, setting) -> dict:
    """``{name: hot-rows entry}`` a plan table gives, every ``ps`` variable off for ``off``.

    Local. Raises :class:`ConfigError` for a bad entry (the same on every rank).
    """
    from ..plan.plan import check_hot_rows

    off = {"min_nodes": 0, "min_saved_bytes": [], "reason": "hot rows: off (--hot-rows off)"}
    return {name: off if setting == "off" else check_hot_rows(r["hot_rows"],
                                                              f"plan[{name!r}].hot_rows")
            for name, r in requests.items()
            if method_of(r.get("method") or "ps").on_servers
            and (setting == "off" or r.get("hot_rows") is not None)}


def normalize_plan(plan: dict, where: str = "plan") -> dict:
    """Check a per-variable plan table (or a :class:`hpcpax.plan.Plan` JSON dict, whose dense
    variables are ignored): ``{name: {"method", "partitions", "owners", "local_aggregation"}}``
    with None where not given (and a ``ps`` entry's ``hot_rows``, checked at build).

    Every value goes through :mod:`hpcpax.input_checks`: names are non-empty strs,
    partitions at most :data:`~hpcpax.ps.spec.MAX_PARTITIONS`, owners as many.

    Raises:
        ConfigError: naming ``where``, the variable and the field.
    """
    if not isinstance(plan, dict):
        raise ConfigError(f"{where} must be a table, not {type(plan).__name__}")
    check_tree(plan, where)
    if "variables" in plan and isinstance(plan["variables"], (list, dict)):
        entries = plan["variables"]
        if isinstance(entries, list):
            listed = {}
            for index, entry in enumerate(entries):
                if not isinstance(entry, dict):
                    raise ConfigError(f"{where}: variables[{index}] must be a table, not "
                                      f"{type(entry).__name__}")
                if entry.get("kind", "sparse") == "sparse":
                    name = check_name(entry.get("name"), f"{where}: variables[{index}].name")
                    listed[name] = entry
            entries = listed
        plan = entries
    if len(plan) > MAX_PLAN_VARIABLES:
        raise ConfigError(f"{where} must name at most {MAX_PLAN_VARIABLES} variables, "
                          f"not {len(plan)}")
    out = {}
    for name, entry in plan.items():
        check_name(name, f"{where}: variable name")
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}[{name!r}] must be a table, not {type(entry).__name__}")
        unknown = set(entry) - {"method", "partitions", "owners", "kind", "name", "shape",
                                "dtype", "local_aggregation", "wire_dtype", "predicted_s",
                                "facts", "reason", "hot_rows"}
        if unknown:
            raise ConfigError(f"{where}[{name!r}]: unknown key {shown(sorted(unknown)[0])}")
        method = entry.get("method", "ps")
        if not isinstance(method, str):
            raise ConfigError(f"{where}[{name!r}].method must be a method name, not "
                              f"{type(method).__name__} ({shown(method)})")
        on_servers = method_of(method, f"{where}[{name!r}].method").on_servers
        partitions = entry.get("partitions")
        if partitions is not None:
            if isinstance(partitions, bool) or not isinstance(partitions, int):
                raise ConfigError(f"{where}[{name!r}].partitions must be a positive int, "
                                  f"not {shown(partitions)}")
            check_int(partitions, f"{where}[{name!r}].partitions", 1, MAX_PARTITIONS)
        owners = entry.get("owners") or None
        if owners is not None:
            if not on_servers:
                owners = None  # a replicated variable has no owners
            elif not isinstance(owners, list) or len(owners) > MAX_PARTITIONS or not all(
                    isinstance(o, int) and not isinstance(o, bool) and 0 <= o <= MAX_OWNER
                    for o in owners):
                raise ConfigError(f"{where}[{name!r}].owners must be a list of at most "
                                  f"{MAX_PARTITIONS} owner indices in [0, {MAX_OWNER}], "
                                  f"not {shown(owners)}")
        local = entry.get("local_aggregation")
        if local is not None and not isinstance(local, bool):
            raise ConfigError(f"{where}[{name!r}].local_aggregation must be true or false, "
                              f"not {shown(local)}")
        out[name] = {"method": method, "partitions": partitions if on_servers else None,
                     "owners": owners, "local_aggregation": local if on_servers else None}
        if entry.get("hot_rows") is not None and on_servers:  # see hot_rows_requests
            from ..plan.plan import check_hot_rows

            out[name]["hot_rows"] = check_hot_rows(entry["hot_rows"],
                                                   f"{where}[{name!r}].hot_rows")
    return out


def load_plan_file(path) -> dict:
    """A plan JSON file -> normalized per-variable plan dict.

    Read by :func:`hpcpax.input_checks.load_json_file` (bounded size, strict
    UTF-8, bounded nesting, finite numbers), then :func:`normalize_plan`.
    """
    data = load_json_file(path, "plan file")
    where = f"plan file {shown_path(path)}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where} must hold a JSON object, not {type(data).__name__}")
    return normalize_plan(data, where)
