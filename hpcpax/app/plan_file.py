"""Per-variable plan tables given by the user: ``--plan FILE`` or a plan dict, checked.

A table is ``{name: {"method", "partitions", "owners", "local_aggregation",
"hot_rows"}}``, or a saved ``plan.json`` (:class:`hpcpax.plan.Plan`'s JSON,
whose dense variables are ignored). Nothing here is collective.
"""

from __future__ import annotations

import json

from ..errors import ConfigError
from ..sync.methods import method_of

__all__ = ["normalize_plan", "load_plan_file"]


def normalize_plan(plan: dict, where: str = "plan") -> dict:
    """Check a per-variable plan table (or a :class:`hpcpax.plan.Plan` JSON dict, whose dense
    variables are ignored): ``{name: {"method", "partitions", "owners", "local_aggregation"}}``
    with None where not given (and a ``ps`` entry's ``hot_rows``, checked at build)."""
    if "variables" in plan and isinstance(plan["variables"], (list, dict)):
        entries = plan["variables"]
        if isinstance(entries, list):
            entries = {entry.get("name"): entry for entry in entries
                       if isinstance(entry, dict) and entry.get("kind", "sparse") == "sparse"}
        plan = entries
    out = {}
    for name, entry in plan.items():
        if not isinstance(entry, dict):
            raise ConfigError(f"{where}[{name!r}] must be a table, not {type(entry).__name__}")
        unknown = set(entry) - {"method", "partitions", "owners", "kind", "name", "shape",
                                "dtype", "local_aggregation", "wire_dtype", "predicted_s",
                                "facts", "reason", "hot_rows"}
        if unknown:
            raise ConfigError(f"{where}[{name!r}]: unknown key {sorted(unknown)[0]!r}")
        method = entry.get("method", "ps")
        on_servers = method_of(method, f"{where}[{name!r}].method").on_servers
        partitions = entry.get("partitions")
        if partitions is not None and (isinstance(partitions, bool)
                                       or not isinstance(partitions, int) or partitions < 1):
            raise ConfigError(f"{where}[{name!r}].partitions must be a positive int, "
                              f"not {partitions!r}")
        owners = entry.get("owners") or None
        if owners is not None:
            if not on_servers:
                owners = None  # a replicated variable has no owners
            elif not isinstance(owners, list) or not all(
                    isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in owners):
                raise ConfigError(f"{where}[{name!r}].owners must be a list of owner indices "
                                  f">= 0, not {owners!r}")
        local = entry.get("local_aggregation")
        if local is not None and not isinstance(local, bool):
            raise ConfigError(f"{where}[{name!r}].local_aggregation must be true or false, "
                              f"not {local!r}")
        out[str(name)] = {"method": method, "partitions": partitions if on_servers else None,
                          "owners": owners, "local_aggregation": local if on_servers else None}
        if entry.get("hot_rows") is not None and on_servers:  # see build.hot_rows_requests
            out[str(name)]["hot_rows"] = entry["hot_rows"]
    return out



def load_plan_file(path) -> dict:
    """A plan JSON file -> normalized per-variable plan dict."""
    try:
        with open(path, encoding="utf-8") as handle:
            data = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"plan file {path}: {exc}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"plan file {path} must hold a JSON object")
    return normalize_plan(data, f"plan file {path}")
