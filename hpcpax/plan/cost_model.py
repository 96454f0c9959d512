"""The cost model: predicted seconds per step to synchronize a variable.

Mechanisms (each in its own module, all pure arithmetic):

* :mod:`~hpcpax.plan.traffic`: who sends how many rows to whom for each
  method (``ps`` with and without local aggregation, ``allgather``,
  ``allreduce``), exactly from ids or in expectation from the measured row
  density ``alpha``; the bytes it makes match the accounting's to the byte.
* :mod:`~hpcpax.plan.collectives`: seconds of each collective for the
  algorithm MPICH runs (ring / recursive doubling / Bruck allgather, whose
  bytes per worker grow with the number of workers; scattered all-to-all
  with one latency per non-empty peer; node-aware allreduce), with the ranks
  of a node sharing one NIC (incast at a server is its NIC's bytes).
* :mod:`~hpcpax.plan.step_model`: the trainer's step as it runs, phase after
  phase with no overlap; server work parallel over the partitions a server
  owns (``server_lanes``) plus a cost per partition; local aggregation's
  node fan-in (the delegate receives and sums its node's rows); kernel
  seconds from measured rates (:mod:`~hpcpax.plan.kernel_rates`); an
  allgather push as hpcpax runs it (distinct rows, one fused
  ``Allgatherv``) or as another framework did (:class:`CostParams`'s
  ``allgather_rows``, ``allgather_fused``, ``allgather_staging_Bps``:
  TensorFlow's undeduplicated rows, Horovod's one ``Allgatherv`` per tensor
  and its copies through the host).

This module keeps the per-variable interface the planner uses
(:func:`predict`, :func:`predict_all`, :func:`choose`): one variable priced
alone, its share of the batched exchanges' latencies included. Notation:
``n`` workers on ``N`` nodes, ``g = n / N`` per node, ``alpha`` the fraction
of rows one worker touches per step, ``alpha_node`` the fraction a node's
workers touch together (default ``1 - (1 - alpha) ** g``; Zipf access
shares hot rows, so a measured value is smaller and better).
Nothing here is collective.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from ..sync.methods import method_of, methods

__all__ = [
    "VarSpec",
    "predict_detail",
    "ClusterShape",
    "CostParams",
    "PREDICT_METHODS",
    "predict",
    "predict_all",
    "choose",
    "default_alpha_node",
    "predict_key",
]

#: What :func:`predict` prices: every method (the registry's
#: :class:`~hpcpax.sync.methods.SyncMethod`), and each method on the servers
#: with its local aggregation off (``ps_no_local_aggregation``).
_PREDICTED = {**{m.name: (m, True) for m in methods()},
              **{f"{m.name}_no_local_aggregation": (m, False) for m in methods() if m.on_servers}}
PREDICT_METHODS = tuple(_PREDICTED)
INDEX_BYTES = 8


def _dtype_itemsize(dtype) -> int:
    return int(np.dtype(dtype).itemsize)


def default_alpha_node(alpha: float, workers_per_node: int) -> float:
    """Fraction of rows touched by a node's ``g`` workers, assuming independence."""
    return 1.0 - (1.0 - float(alpha)) ** int(workers_per_node)


@dataclass(frozen=True)
class VarSpec:
    """What the cost model needs to know about one variable.

    Args:
        name: variable name.
        kind: ``"dense"`` or ``"sparse"``.
        shape: full shape; a sparse variable's rows are ``shape[0]``.
        dtype: dtype name.
        alpha: fraction of rows one worker touches per step (1 for dense).
        alpha_node: fraction touched by a node's workers together, or
            ``None`` to derive it with :func:`default_alpha_node`.
        duplicate_ratio: ids per distinct id in a worker's batch (>= 1).
    """

    name: str
    kind: str
    shape: tuple
    dtype: str = "float32"
    alpha: float = 1.0
    alpha_node: float | None = None
    duplicate_ratio: float = 1.0

    def __post_init__(self):
        if self.kind not in ("dense", "sparse"):
            raise ValueError(f"kind of {self.name!r} must be 'dense' or 'sparse', not {self.kind!r}")
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        for label, value in (("alpha", self.alpha), ("alpha_node", self.alpha_node)):
            if value is not None and not 0.0 <= float(value) <= 1.0:
                raise ValueError(f"{label} of {self.name!r} must be in [0, 1], not {value}")

    @classmethod
    def from_any(cls, spec) -> "VarSpec":
        """A :class:`VarSpec` from itself or a dict with the same keys (extra keys ignored)."""
        if isinstance(spec, cls):
            return spec
        if isinstance(spec, Mapping):
            keys = ("name", "kind", "shape", "dtype", "alpha", "alpha_node", "duplicate_ratio")
            fields = {k: spec[k] for k in keys if k in spec}
            if fields.get("duplicate_ratio") is None:
                fields.pop("duplicate_ratio", None)
            if fields.get("alpha") is None:
                fields.pop("alpha", None)  # dense variables carry no alpha
            return cls(**fields)
        raise TypeError(f"variable spec must be a VarSpec or dict, not {type(spec).__name__}")

    @property
    def rows(self) -> int:
        """Rows (first dimension; 1 for a scalar)."""
        return self.shape[0] if self.shape else 1

    @property
    def dim(self) -> int:
        """Elements per row."""
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return _dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the whole variable."""
        return math.prod(self.shape) * self.itemsize

    def node_alpha(self, workers_per_node: int) -> float:
        """Fraction of rows a node touches per step (measured, or from ``alpha``)."""
        if self.kind == "dense":
            return 1.0
        if self.alpha_node is not None:
            return float(self.alpha_node)
        return default_alpha_node(self.alpha, workers_per_node)

    def worker_alpha(self) -> float:
        """Fraction of rows a worker touches per step (1 for dense)."""
        return 1.0 if self.kind == "dense" else float(self.alpha)


@dataclass(frozen=True)
class ClusterShape:
    """Topology summary as plain numbers.

    ``servers_per_node == 0`` means the workers host the partitions.
    """

    num_nodes: int
    workers_per_node: int
    servers_per_node: int = 0

    def __post_init__(self):
        for label in ("num_nodes", "workers_per_node"):
            if int(getattr(self, label)) < 1:
                raise ValueError(f"{label} must be >= 1, not {getattr(self, label)}")
        if int(self.servers_per_node) < 0:
            raise ValueError(f"servers_per_node must be >= 0, not {self.servers_per_node}")

    @classmethod
    def from_any(cls, topology) -> "ClusterShape":
        """From itself, a dict, or any object with the three attributes."""
        if isinstance(topology, cls):
            return topology
        get = topology.get if isinstance(topology, Mapping) else lambda k, d=None: getattr(topology, k, d)
        return cls(int(get("num_nodes")), int(get("workers_per_node")), int(get("servers_per_node", 0) or 0))

    @property
    def workers(self) -> int:
        """Worker ranks in all."""
        return self.num_nodes * self.workers_per_node

    @property
    def servers(self) -> int:
        """Ranks holding partitions: the servers, or every worker when there are none."""
        per_node = self.servers_per_node or self.workers_per_node
        return self.num_nodes * per_node

    def to_dict(self) -> dict:
        """The shape as a JSON-able dict."""
        return {"num_nodes": self.num_nodes, "workers_per_node": self.workers_per_node,
                "servers_per_node": self.servers_per_node}


@dataclass(frozen=True)
class CostParams:
    """Constants of the model that are not link properties.

    Kernel rates are ``(call_s, unit_s)`` pairs: a fixed cost per call plus
    a cost per unit (ids for ``unique``, bytes for the others), as
    :func:`hpcpax.plan.kernel_rates.measure_kernel_rates` measures them.
    ``None`` leaves a kernel out (costs nothing). :meth:`measured` times
    them on this machine.

    Args:
        partition_overhead_s: fixed seconds per partition a server owns, per
            phase (a framework that runs one operation per partition, like
            TensorFlow under Parallax, pays it; hpcpax runs one kernel per
            variable but still pays some host work per partition, measured
            by :func:`hpcpax.tune.operation_costs.measure_operations`,
            ``per_partition``; 0 by default).
        partition_overhead_per: who pays ``partition_overhead_s``: every
            variable's partitions (``"variable"``, the default: one operation
            per partition and variable, as under TensorFlow) or each batched
            exchange once, for the most partitions one of its tables has on
            that server (``"exchange"``: hpcpax, which packs and serves every
            table of an exchange in one vectorized pass per table; 3 ranks on
            2 cores, 16 partitions against 1: +0.15-0.62 ms per pull of one
            table and +0.03-0.34 ms of eight, not eight times as much).
        server_apply_Bps: bytes of rows per second a server applies (and
            gathers, unless ``server_gather_Bps``) when no ``apply``
            /``gather`` rate is given: a preset's host-memory figure.
        server_gather_Bps: bytes per second of a server's gathers.
        server_lanes: partitions one server processes at the same time
            (cores working on separate partitions; hpcpax: 1).
        kernels: ``{kernel: {"call_s", "unit_s"}}`` measured rates.
        ps_batch: PS variables that share each exchange. hpcpax moves every
            PS table of a phase in one exchange, so each of them pays
            ``1 / ps_batch`` of the headers' and counts' latencies. ``None``
            (the default) lets :func:`hpcpax.plan.make_plan` use the number
            of sparse variables of the plan; 1 for a lone variable.
        overlap_dense: fraction of the backward pass the dense allreduce may
            hide behind (0 for hpcpax's trainer, whose allreduce starts after
            the backward pass).
        backward_fraction: share of the compute time that is the backward
            pass (used with ``overlap_dense``).
        dense_overlaps_push: the dense allreduce starts before the sparse push
            and is waited for after it (hpcpax's BSP step; TensorFlow's graph
            runs them concurrently too): its latencies and fixed costs hide
            behind the push, its bytes still queue on the links.
        handoff: ``{"handoff_s", "handoff_per_work"[, "after_work"]}``: each
            stage of local work of ``w`` seconds also costs ``handoff_s +
            handoff_per_work * w`` before the next collective can run, and
            ``after_work`` (``{"serving": f, "idle": f}``) makes the first
            collective after the workers' own work wait ``f`` times that work
            (they take turns on an oversubscribed host; see
            :mod:`hpcpax.plan.step_model`). Measured by
            :func:`hpcpax.tune.calibrate.measure_handoff`; 0 when None.
        software: ``{operation: {"call_s", "per_variable_s"[, "per_row_s"]}}``:
            hpcpax's host overhead per batched operation (``ps_pull``,
            ``ps_push``, ``allgather_push``, ``allreduce_push``,
            ``replica_pull``, ``dense_allreduce``, ...; ``per_row_s`` per id
            of the worker, where measured; ``dense_allreduce_idle`` and
            ``control_idle``: the workers' collectives with no table on the PS;
            ``after_ps_push[_no_aggregation]``, ``after_allgather_push``,
            ``after_allreduce_push``: the wait a push leaves in the workers'
            next collective, per pushed table (and row, for the PS)), from
            :func:`hpcpax.tune.calibrate.measure_software`. It includes the
            kernels' fixed cost per call, so with it :meth:`kernel` counts
            only their per-unit cost.
        software_scope: where ``software`` was measured: ``"process"`` (a
            one-rank world, :func:`~hpcpax.tune.calibrate.measure_software`:
            the host path only) or ``"job"`` (the job's own ranks,
            :func:`~hpcpax.tune.calibrate.measure_operations`: the host path
            and the latencies of the operation's collectives, which the step
            model then does not charge again).
        allgather_rows: what a worker's block of an allgather push holds:
            ``"unique"`` (hpcpax deduplicates and sums its rows first, one
            row per distinct id) or ``"raw"`` (one row per lookup, as
            TensorFlow's gradient of a gather, an ``IndexedSlices`` whose
            ``values``/``indices`` Horovod allgathers as they are; the
            receivers then sum ``workers x raw`` rows).
        allgather_fused: all allgather tables of a push travel in one
            allgather (after one of the counts), as hpcpax's do (equal
            blocks padded to the largest where
            :func:`~hpcpax.comm.sparse_collectives.padded_block_bytes` says
            so, else ``Allgatherv``); False:
            one ``Allgatherv`` per tensor, a table's indices and values
            apart (Horovod fused allreduce only until allgather fusion,
            horovod/horovod PR #732, merged January 2019; its coordinator
            exchanged the sizes in its negotiation, so no counts collective).
        allgather_staging_Bps: None: the allgather runs on the buffers the
            gradients live in (hpcpax on the host, or CUDA-aware MPI). A
            rate: the allgather runs on host copies (Horovod built without
            ``HOROVOD_GPU_ALLGATHER`` copies a GPU tensor to the host, runs
            its CPU ``MPI_Allgatherv``, and copies the result back: horovod
            PR #1480), so each worker moves its own block device-to-host and
            the gathered blocks of every worker host-to-device, and a
            node's workers share this many bytes per second for it (their
            PCIe uplinks to the host; a preset says what it assumed).
        source: where the numbers come from (printed with predictions).
    """

    partition_overhead_s: float = 0.0
    partition_overhead_per: str = "variable"
    server_apply_Bps: float | None = None
    server_gather_Bps: float | None = None
    server_lanes: int = 1
    kernels: dict | None = None
    ps_batch: int | None = None
    overlap_dense: float = 0.0
    backward_fraction: float = 2.0 / 3.0
    dense_overlaps_push: bool = True
    handoff: dict | None = None
    software: dict | None = None
    software_scope: str = "process"
    allgather_rows: str = "unique"
    allgather_fused: bool = True
    allgather_staging_Bps: float | None = None
    source: str = ""

    def __post_init__(self):
        if self.software_scope not in ("process", "job"):
            raise ValueError(f"software_scope must be 'process' or 'job', "
                             f"not {self.software_scope!r}")
        if self.allgather_rows not in ("unique", "raw"):
            raise ValueError(f"allgather_rows must be 'unique' or 'raw', "
                             f"not {self.allgather_rows!r}")
        if self.allgather_staging_Bps is not None and not float(self.allgather_staging_Bps) > 0:
            raise ValueError(f"allgather_staging_Bps must be > 0 or None, "
                             f"not {self.allgather_staging_Bps!r}")
        if self.partition_overhead_per not in ("variable", "exchange"):
            raise ValueError(f"partition_overhead_per must be 'variable' or 'exchange', "
                             f"not {self.partition_overhead_per!r}")

    @classmethod
    def measured(cls, dim: int = 64, dtype: str = "float32", **overrides) -> "CostParams":
        """Kernel rates timed now on this machine (cached per process); not collective."""
        from .kernel_rates import measure_kernel_rates

        return cls(kernels=measure_kernel_rates(dim, dtype), source="kernels timed here",
                   **overrides)

    def _rate(self, name, fallback_Bps=None):
        if self.kernels and name in self.kernels:
            entry = self.kernels[name]
            return float(entry["call_s"]), float(entry["unit_s"])
        if fallback_Bps:
            return 0.0, 1.0 / float(fallback_Bps)
        return 0.0, 0.0

    def overhead(self, operation: str, variables: int, rows: float = 0.0) -> float:
        """hpcpax's host seconds for one ``operation`` carrying ``variables`` variables
        and ``rows`` ids of this worker (``per_row_s``, where it was measured)."""
        if not self.software or operation not in self.software or variables <= 0:
            return 0.0
        entry = self.software[operation]
        return (float(entry["call_s"]) + float(entry["per_variable_s"]) * variables
                + float(entry.get("per_row_s", 0.0)) * float(rows))

    def kernel(self, name: str, units, own_call: bool = False):
        """Seconds of kernel ``name`` on ``units`` (scalar or array; 0 units cost 0); with
        ``software`` its call cost is in the measured operation's, unless ``own_call``
        (called outside any operation: the dense optimizer, once per tensor)."""
        fallback = {"apply": self.server_apply_Bps,
                    "gather": self.server_gather_Bps or self.server_apply_Bps,
                    "dedup": self.server_apply_Bps}.get(name)
        call, per = self._rate(name, fallback)
        if self.software and not own_call:
            call = 0.0  # inside the measured per-operation overhead
        units = np.asarray(units, np.float64)
        out = np.where(units > 0, call + units * per, 0.0)
        return float(out) if out.ndim == 0 else out

    def to_dict(self) -> dict:
        """The parameters as a JSON-able dict (saved in the plan)."""
        return {"partition_overhead_s": self.partition_overhead_s,
                "partition_overhead_per": self.partition_overhead_per,
                "server_apply_Bps": self.server_apply_Bps,
                "server_gather_Bps": self.server_gather_Bps, "server_lanes": self.server_lanes,
                "kernels": self.kernels, "ps_batch": self.ps_batch,
                "overlap_dense": self.overlap_dense, "backward_fraction": self.backward_fraction,
                "dense_overlaps_push": self.dense_overlaps_push,
                "handoff": self.handoff, "software": self.software,
                "software_scope": self.software_scope, "allgather_rows": self.allgather_rows,
                "allgather_fused": self.allgather_fused,
                "allgather_staging_Bps": self.allgather_staging_Bps, "source": self.source}


def _routing(var: VarSpec, method: str, layout, partitions: int, local_aggregation: bool):
    from .traffic import expected_routing

    row_bytes = var.dim * var.itemsize
    kind = _predicted(method)[0].name
    g = layout.workers_per_node()
    return expected_routing(layout, kind, var.rows, row_bytes, var.worker_alpha(),
                            alpha_node=var.node_alpha(g) if var.kind == "sparse" else 1.0,
                            duplicate_ratio=var.duplicate_ratio if var.kind == "sparse" else 1.0,
                            partitions=partitions, local_aggregation=local_aggregation)


def predict_detail(var_spec, method: str, topology, fabric, partitions: int | None = None,
                   local_aggregation: bool = True, params: CostParams | None = None):
    """:func:`predict` with its breakdown: a :class:`~hpcpax.plan.step_model.StepPrediction`."""
    from .collectives import Links
    from .step_model import predict_step
    from .traffic import Layout

    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    links = Links.from_fabric(fabric)
    params = params or CostParams.measured()
    layout = Layout.from_shape(shape.num_nodes, shape.workers_per_node, shape.servers_per_node)
    sync, local_allowed = _predicted(method)
    if sync.densified and var.kind == "dense":  # a dense tensor's plain allreduce
        return predict_step(layout, links, params, {}, dense_bytes=[var.nbytes],
                            include_control=False)
    if not sync.dense_ok and var.kind == "dense":
        raise ValueError(f"method {sync.name!r} needs a sparse variable, not dense {var.name!r}")
    if sync.on_servers:
        if partitions is None:
            partitions = shape.servers
        if int(partitions) < 1:
            raise ValueError(f"partitions must be >= 1, not {partitions}")
        local_aggregation = local_aggregation and local_allowed
    routing = _routing(var, method, layout, int(partitions or 1), local_aggregation)
    return predict_step(layout, links, params, {var.name: routing}, include_control=False,
                        ps_batch=params.ps_batch or 1)


def _predicted(method):
    """``(SyncMethod, local aggregation allowed)`` of a :data:`PREDICT_METHODS` name."""
    try:
        return _PREDICTED[method]
    except (KeyError, TypeError):
        raise ValueError(f"method must be one of {PREDICT_METHODS}, not {method!r}") from None


def predict_key(method, local_aggregation: bool) -> str:
    """The :data:`PREDICT_METHODS` name of ``method`` run with or without local aggregation."""
    sync = method_of(method)
    if sync.on_servers and not local_aggregation:
        return f"{sync.name}_no_local_aggregation"
    return sync.name


def predict(var_spec, method: str, topology, fabric, partitions: int | None = None,
            local_aggregation: bool = True, params: CostParams | None = None) -> float:
    """Predicted seconds per step to synchronize one variable with ``method``.

    Args:
        var_spec: :class:`VarSpec` or a dict with its fields.
        method: ``"allreduce"``, ``"allgather"``, ``"ps"`` or
            ``"ps_no_local_aggregation"``.
        topology: :class:`ClusterShape`, dict, or object with ``num_nodes``,
            ``workers_per_node``, ``servers_per_node``.
        fabric: ``hpcpax.comm.fabric.Fabric``, its ``to_dict()`` or
            :class:`~hpcpax.plan.collectives.Links`.
        partitions: partitions for ``ps`` (default: number of servers).
        local_aggregation: for ``ps``, aggregate inside a node first (only
            meaningful with several workers per node).
        params: model constants (:class:`CostParams`; default: kernel rates
            timed on this machine, :meth:`CostParams.measured`).
    """
    return predict_detail(var_spec, method, topology, fabric, partitions, local_aggregation,
                          params).seconds


def predict_all(var_spec, topology, fabric, partitions: int | None = None,
                params: CostParams | None = None) -> dict:
    """``{method: seconds}`` for every method that applies to the variable.

    A dense variable gets ``allreduce`` and ``ps``; a sparse one also
    ``allgather``; ``ps_no_local_aggregation`` appears when a node has
    several workers.
    """
    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    times = {m.name: predict(var, m.name, shape, fabric,
                             partitions=partitions if m.on_servers else None, params=params)
             for m in methods() if m.dense_ok or var.kind == "sparse"}
    if shape.workers_per_node > 1:
        for m in methods():
            if m.on_servers:
                key = predict_key(m, False)
                times[key] = predict(var, key, shape, fabric, partitions=partitions,
                                     params=params)
    return times


def choose(var_spec, topology, fabric, partitions: int | None = None,
           params: CostParams | None = None, correction=None):
    """The fastest method for one variable under the model.

    Candidates are ``allreduce``, and for a sparse variable ``allgather``
    and ``ps`` (with local aggregation when a node has several workers, as
    Parallax does); a dense variable stays on ``allreduce``. Ties go to the earlier candidate in that order. ``correction``
    (a :class:`~hpcpax.runlog.learned.Correction`) rescales each prediction
    by mechanism when given.

    Returns:
        ``(method, times, reason)``: the method name, ``{method: seconds}``
        from :func:`predict_all` (corrected when a correction is given), and
        one line saying why.
    """
    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    if correction is None:
        times = predict_all(var, shape, fabric, partitions=partitions, params=params)
    else:
        times = {m.name: correction.apply(predict_detail(var, m.name, shape, fabric, partitions,
                                                         params=params))
                 for m in methods() if var.kind == "sparse" or m.densified}
    # hpcpax keeps dense variables replicated (its servers hold sparse tables)
    candidates = [m.name for m in methods() if m.name in times
                  and (var.kind == "sparse" or m.densified)]
    method = min(candidates, key=lambda m: (times[m], candidates.index(m)))
    others = [m for m in candidates if m != method]
    if not others:
        reason = "only method"
    else:
        runner_up = min(others, key=lambda m: times[m])
        ratio = times[runner_up] / times[method] if times[method] > 0 else math.inf
        ratio_text = "inf" if math.isinf(ratio) else f"{ratio:.2f}x"
        reason = f"{ratio_text} faster than {runner_up}"
    if var.kind == "sparse":
        reason += f" (alpha={var.worker_alpha():.3g}, node={var.node_alpha(shape.workers_per_node):.3g})"
    return method, times, reason
