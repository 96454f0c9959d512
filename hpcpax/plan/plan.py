"""The plan: per variable, how its gradient moves, saved as JSON.

A :class:`Plan` says, for every variable, the synchronization method
(``allreduce``, ``allgather`` or ``ps``), how many partitions a ``ps``
variable is cut into, which server owns each partition, whether sparse
gradients are aggregated inside a node first, and the wire dtype. It also
keeps the facts it was built from (fabric, measurements, topology, partition
search) so a saved plan explains itself and can be given back to skip the
search.

Nothing here is collective; the trainer compares :meth:`Plan.fingerprint`
across ranks with one small collective before using a plan.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field

import numpy as np

from ..errors import ConfigError
from ..input_checks import check_int, check_tree, parse_json_text, read_text_file, shown
from ..ps.placement import assign_owners
from ..ps.spec import MAX_OWNER, MAX_PARTITIONS
from ..sync import METHODS
from ..sync.methods import method_of

__all__ = ["METHODS", "KINDS", "VariablePlan", "Plan", "assign_owners", "PLAN_FORMAT",
           "check_hot_rows"]


KINDS = ("dense", "sparse")
PLAN_FORMAT = 1


def _plain(value, where: str):
    """``value`` as JSON-native Python (lists, str-keyed dicts, floats, ints).

    Free-form plan fields are normalized this way at construction so that a
    JSON round trip gives back an equal plan.
    """
    if isinstance(value, dict):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise TypeError(f"{where} keys must be str, not {type(key).__name__} ({key!r})")
            out[key] = _plain(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, where) for item in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist(), where)
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if isinstance(value, (int, np.integer)):
        return int(value)
    if isinstance(value, (float, np.floating)):
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{where} must be finite, not {value}")
        return value
    if value is None or isinstance(value, str):
        return value
    raise TypeError(f"{where} must be JSON data, not {type(value).__name__}")


def check_hot_rows(value, where: str = "hot_rows") -> dict:
    """A checked hot-rows entry: ``{"min_nodes", "min_saved_bytes", "reason"}``
    and, where given, ``"route"`` (``"trees"`` or ``"relays"``).

    Accepts such a dict (a saved plan's), ``"off"`` or an int ``m`` (0: off;
    else the fixed rule for groups of ``>= m`` nodes). Not collective.

    Raises:
        ConfigError: anything else; the message starts with ``where``.
    """
    if value == "off" or (isinstance(value, int) and not isinstance(value, bool)):
        nodes = 0 if value == "off" else value
        if nodes < 0:
            raise ConfigError(f"{where} must be 'off', an int >= 0 or an object, not {value!r}")
        return {"min_nodes": 0 if nodes < 2 else nodes, "min_saved_bytes": [],
                "reason": "hot rows: off (given)" if nodes < 2 else
                f"hot rows: given, groups of >= {nodes} nodes"}
    if not isinstance(value, dict):
        raise ConfigError(f"{where} must be 'off', an int >= 0 or an object, "
                          f"not {type(value).__name__}")
    unknown = sorted(set(value) - {"min_nodes", "min_saved_bytes", "reason", "route"})
    if unknown:
        raise ConfigError(f"{where} has unknown keys {unknown}")
    nodes = value.get("min_nodes", 0)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 0:
        raise ConfigError(f"{where}.min_nodes must be an int >= 0, not {nodes!r}")
    table = value.get("min_saved_bytes", [])
    if not isinstance(table, list) or not all(
            b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0)
            for b in table):
        raise ConfigError(f"{where}.min_saved_bytes must be a list of ints >= 0 or null, "
                          f"not {table!r}")
    reason = value.get("reason", "")
    if not isinstance(reason, str):
        raise ConfigError(f"{where}.reason must be a str, not {type(reason).__name__}")
    route = value.get("route", "trees")
    if route not in ("trees", "relays"):
        raise ConfigError(f"{where}.route must be 'trees' or 'relays', not {route!r}")
    return {"min_nodes": int(nodes), "min_saved_bytes": list(table), "reason": reason,
            **({"route": route} if "route" in value else {})}


def _hot_cell(value) -> str:
    if value is None:
        return "-"
    if not value["min_nodes"]:
        return "off"
    return "relays" if value.get("route") == "relays" else f">={value['min_nodes']} nodes"


@dataclass
class VariablePlan:
    """How one variable is synchronized.

    Args:
        name: variable name (unique in the plan).
        kind: ``"dense"`` or ``"sparse"`` (what the model produces).
        shape: full shape of the variable.
        dtype: dtype name of the variable (``"float32"``).
        method: ``"allreduce"``, ``"allgather"`` or ``"ps"``.
        partitions: number of row partitions (>= 1; 1 unless ``ps``).
        owners: server index of each partition; ``len(owners) == partitions``
            for ``ps``, empty otherwise.
        local_aggregation: sparse gradients are summed inside a node before
            leaving it (``ps`` only).
        wire_dtype: dtype on the wire, or ``None`` for ``dtype``.
        predicted_s: predicted communication seconds per step, or ``None``.
        reason: one line saying why this method was chosen.
        hot_rows: ``ps`` only: the hot-rows decision
            (:func:`hpcpax.plan.hot_rows_cost.decide`: ``min_nodes``, 0 off;
            ``min_saved_bytes`` per group size; ``reason``), or ``None``
            (not decided: ``HPCPAX_HOT_ROWS`` applies).

    Raises:
        ConfigError: a field is invalid; the message names the variable and
            the field.
    """

    name: str
    kind: str
    shape: tuple
    dtype: str
    method: str
    partitions: int = 1
    owners: list = field(default_factory=list)
    local_aggregation: bool = False
    wire_dtype: str | None = None
    predicted_s: float | None = None
    reason: str = ""
    hot_rows: dict | None = None

    def __post_init__(self):
        def bad(field_name, message):
            return ConfigError(f"plan variable {self.name!r}: {field_name} {message}")

        if not isinstance(self.name, str) or not self.name:
            raise ConfigError(f"plan variable name must be a non-empty str, not "
                              f"{shown(self.name)}")
        if self.kind not in KINDS:
            raise bad("kind", f"must be one of {KINDS}, not {self.kind!r}")
        self.method = method_of(self.method, f"plan variable {self.name!r}: method").name
        if not isinstance(self.shape, (list, tuple)) or not all(
                isinstance(d, (int, np.integer)) and not isinstance(d, bool)
                for d in self.shape):
            raise bad("shape", f"must be a sequence of ints, not {shown(self.shape)}")
        self.shape = tuple(check_int(int(d), f"plan variable {self.name!r}: shape", 0)
                           for d in self.shape)
        if not isinstance(self.dtype, str):
            raise bad("dtype", f"must be a str, not {type(self.dtype).__name__}")
        if isinstance(self.partitions, bool) or not isinstance(self.partitions, (int, np.integer)):
            raise bad("partitions", f"must be an int, not {type(self.partitions).__name__}")
        self.partitions = check_int(int(self.partitions), f"plan variable {self.name!r}: "
                                    "partitions", 1, MAX_PARTITIONS)
        if not isinstance(self.owners, (list, tuple)) or not all(
                isinstance(o, (int, np.integer)) and not isinstance(o, bool) for o in self.owners):
            raise bad("owners", f"must be a list of ints, not {shown(self.owners)}")
        self.owners = [int(o) for o in self.owners]
        if any(not 0 <= o <= MAX_OWNER for o in self.owners):
            raise bad("owners", f"must hold server indices in [0, {MAX_OWNER}], "
                                f"not {shown(self.owners)}")
        if self.sync_method.on_servers:
            if len(self.owners) != self.partitions:
                raise bad("owners", f"must hold one server per partition ({self.partitions}), not {len(self.owners)}")
        else:
            if self.partitions != 1:
                raise bad("partitions", f"must be 1 for method {self.method!r}, not {self.partitions}")
            if self.owners:
                raise bad("owners", f"must be empty for method {self.method!r}, not {self.owners}")
        self.local_aggregation = bool(self.local_aggregation)
        if self.wire_dtype is not None and not isinstance(self.wire_dtype, str):
            raise bad("wire_dtype", f"must be a str or None, not {type(self.wire_dtype).__name__}")
        if self.predicted_s is not None:
            if isinstance(self.predicted_s, bool) or not isinstance(
                    self.predicted_s, (int, float, np.integer, np.floating)):
                raise bad("predicted_s", f"must be a number or null, not {shown(self.predicted_s)}")
            self.predicted_s = float(self.predicted_s)
            if not math.isfinite(self.predicted_s) or self.predicted_s < 0:
                raise bad("predicted_s", f"must be a finite number >= 0, not {self.predicted_s}")
        if not isinstance(self.reason, str):
            raise bad("reason", f"must be a str, not {type(self.reason).__name__}")
        if self.hot_rows is not None:
            self.hot_rows = check_hot_rows(self.hot_rows,
                                           f"plan variable {self.name!r}: hot_rows")

    @property
    def sync_method(self):
        """The method, as its :class:`~hpcpax.sync.methods.SyncMethod`."""
        return method_of(self.method)

    def to_dict(self) -> dict:
        """JSON-native dict of this variable's plan."""
        return {
            "name": self.name,
            "kind": self.kind,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "method": self.method,
            "partitions": self.partitions,
            "owners": list(self.owners),
            "local_aggregation": self.local_aggregation,
            "wire_dtype": self.wire_dtype,
            "predicted_s": self.predicted_s,
            "reason": self.reason,
            **({} if self.hot_rows is None else {"hot_rows": dict(self.hot_rows)}),
        }

    @classmethod
    def from_dict(cls, data: dict) -> "VariablePlan":
        """Inverse of :meth:`to_dict`; raises :class:`ConfigError` on bad data."""
        if not isinstance(data, dict):
            raise ConfigError(f"plan variable must be a JSON object, not {type(data).__name__}")
        name = data.get("name", "?")
        name = name if isinstance(name, str) else shown(name)
        required = ("name", "kind", "shape", "dtype", "method")
        for key in required:
            if key not in data:
                raise ConfigError(f"plan variable {name!r}: field {key!r} is missing")
        known = set(required) | {"partitions", "owners", "local_aggregation", "wire_dtype",
                                 "predicted_s", "reason", "hot_rows"}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"plan variable {name!r}: unknown fields {unknown}")
        return cls(**data)


@dataclass
class Plan:
    """A whole plan: one :class:`VariablePlan` per variable plus its evidence.

    Args:
        variables: ``{name: VariablePlan}``.
        fabric: ``Fabric.to_dict()`` of the measured fabric, or ``None``.
        measurements: free JSON data (sparsity statistics per variable, ...).
        topology: ``num_nodes``, ``workers_per_node``, ``servers_per_node``.
        search: free JSON data (partition search results, mode, ...).
        runtime: free JSON data: decisions taken while training (the dense
            refresh period's changes under a relaxed model, ``--consistency
            auto``'s mode changes), with the measurements behind them.

    The free-form dicts are normalized to JSON-native values at construction
    (tuples become lists; non-str keys raise ``TypeError``), so
    ``Plan.from_json(plan.to_json()) == plan`` holds exactly.
    """

    variables: dict
    fabric: dict | None = None
    measurements: dict = field(default_factory=dict)
    topology: dict = field(default_factory=dict)
    search: dict = field(default_factory=dict)
    runtime: dict = field(default_factory=dict)

    def __post_init__(self):
        if not isinstance(self.variables, dict):
            raise TypeError(f"variables must be a dict, not {type(self.variables).__name__}")
        for name, var in self.variables.items():
            if not isinstance(var, VariablePlan):
                raise TypeError(f"variables[{name!r}] must be a VariablePlan, not {type(var).__name__}")
            if var.name != name:
                raise ConfigError(f"plan variable {name!r}: name field says {var.name!r}")
        if self.fabric is not None:
            self.fabric = _plain(self.fabric, "plan.fabric")
        self.measurements = _plain(self.measurements, "plan.measurements")
        self.topology = _plain(self.topology, "plan.topology")
        self.search = _plain(self.search, "plan.search")
        self.runtime = _plain(self.runtime, "plan.runtime")

    # -- JSON -----------------------------------------------------------
    def to_dict(self) -> dict:
        """The plan as ``plan.json``'s JSON object."""
        return {
            "format": PLAN_FORMAT,
            "variables": [var.to_dict() for var in self.variables.values()],
            "fabric": self.fabric,
            "measurements": self.measurements,
            "topology": self.topology,
            "search": self.search,
            "runtime": self.runtime,
        }

    def to_json(self, indent: int | None = 2) -> str:
        """The plan as JSON text (variables in insertion order)."""
        return json.dumps(self.to_dict(), indent=indent, allow_nan=False)

    @classmethod
    def from_dict(cls, data: dict) -> "Plan":
        """A plan from ``plan.json``'s object; ConfigError naming what is wrong."""
        if not isinstance(data, dict):
            raise ConfigError(f"plan must be a JSON object, not {type(data).__name__}")
        check_tree(data, "plan")
        fmt = data.get("format", PLAN_FORMAT)
        if fmt != PLAN_FORMAT:
            raise ConfigError(f"plan format must be {PLAN_FORMAT}, not {shown(fmt)}")
        entries = data.get("variables")
        if not isinstance(entries, list):
            raise ConfigError(f"plan field 'variables' must be a list, not {type(entries).__name__}")
        variables = {}
        for entry in entries:
            var = VariablePlan.from_dict(entry)
            if var.name in variables:
                raise ConfigError(f"plan variable {var.name!r}: appears twice")
            variables[var.name] = var
        try:
            return cls(
                variables=variables,
                fabric=data.get("fabric"),
                measurements=data.get("measurements", {}),
                topology=data.get("topology", {}),
                search=data.get("search", {}),
                runtime=data.get("runtime", {}),
            )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, ConfigError):
                raise
            raise ConfigError(f"plan: {exc}") from None

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        """Parse and validate a plan; raises :class:`ConfigError` on bad input.

        The text goes through :func:`hpcpax.input_checks.parse_json_text`
        (bounded nesting, finite numbers, ints within int64).
        """
        return cls.from_dict(parse_json_text(text, "plan"))

    def save(self, path) -> None:
        """Write the plan as JSON atomically (temporary file, then rename), mode 0666 & ~umask."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        tmp = os.path.join(directory, f".plan-{os.getpid()}-{id(self)}.json.tmp")
        # os.open applies the umask (mkstemp's 0600 would hide the plan from the group)
        handle = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            with os.fdopen(handle, "w", encoding="utf-8") as stream:
                stream.write(self.to_json())
                stream.write("\n")
                stream.flush()
                os.fsync(stream.fileno())
            os.replace(tmp, path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise

    @classmethod
    def load(cls, path) -> "Plan":
        """Read and validate a plan file; errors name the file and the field."""
        path = os.fspath(path)
        text = read_text_file(path, "plan")
        try:
            return cls.from_json(text)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc}") from None

    # -- views ----------------------------------------------------------
    def fingerprint(self) -> str:
        """16 hex digits hashing the decisions only (not predictions or evidence).

        Two ranks agree on how to move every variable exactly when their
        fingerprints match; re-measuring the same decisions keeps it stable.
        """
        decisions = [
            [v.name, v.kind, list(v.shape), v.dtype, v.method, v.partitions,
             list(v.owners), v.local_aggregation, v.wire_dtype]
            + ([] if v.hot_rows is None else [v.hot_rows["min_nodes"],
                                               v.hot_rows["min_saved_bytes"]]
               + ([v.hot_rows["route"]] if "route" in v.hot_rows else []))
            for v in self.variables.values()
        ]
        text = json.dumps(decisions, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]

    def total_predicted_s(self) -> float | None:
        """Sum of the variables' predicted seconds, or ``None`` if any is unknown."""
        values = [v.predicted_s for v in self.variables.values()]
        if not values or any(v is None for v in values):
            return None
        return float(sum(values))

    def table(self) -> str:
        """Aligned text table of the plan, for rank 0 to print."""
        header = ["variable", "kind", "shape", "method", "parts", "local agg",
                  "wire dtype", "hot rows", "pred ms/step", "reason"]
        rows = []
        for v in self.variables.values():
            rows.append([
                v.name, v.kind, "x".join(str(d) for d in v.shape) or "()", v.method,
                str(v.partitions), "yes" if v.local_aggregation else "no",
                v.wire_dtype or v.dtype, _hot_cell(v.hot_rows),
                "-" if v.predicted_s is None else f"{v.predicted_s * 1e3:.3f}",
                v.reason,
            ])
        total = self.total_predicted_s()
        if total is not None:
            rows.append(["total", "", "", "", "", "", "", "", f"{total * 1e3:.3f}", ""])
        widths = [max(len(r[i]) for r in [header] + rows) for i in range(len(header))]
        numeric = {4, 8}

        def line(cells):
            parts = [c.rjust(w) if i in numeric else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths))]
            return "  ".join(parts).rstrip()

        out = [line(header), "  ".join("-" * w for w in widths)]
        out += [line(r) for r in rows]
        topo = self.topology
        if topo:
            out.append("topology: " + ", ".join(f"{k}={topo[k]}" for k in sorted(topo)))
        out.append(f"fingerprint: {self.fingerprint()}")
        return "\n".join(out)


