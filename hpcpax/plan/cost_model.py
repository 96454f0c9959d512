"""Alpha-beta cost model: seconds per step to synchronize one variable.

Every message costs ``latency + bytes / bandwidth`` on the link it crosses
(``fabric.intra`` inside a node, ``fabric.inter`` between nodes). Phases run
one after another and nothing overlaps compute. Notation: ``n`` workers on
``N`` nodes, ``g = n / N`` workers per node, ``S`` servers, ``P`` partitions,
``row = dim * itemsize + 8`` bytes per sparse row on the wire (values plus an
int64 index), ``alpha`` the fraction of rows one worker touches per step and
``alpha_node`` the fraction the union of a node's workers touches.

* ``allreduce`` (dense, or a sparse variable densified to ``B`` bytes): ring,
  ``2 (n-1)/n * B`` through the slowest link used and ``2 (n-1)`` latencies
  per fusion bucket; with several nodes and several workers per node the
  hierarchical variant (intra reduce-scatter, inter ring over nodes, intra
  allgather) is used when it is faster.
* ``allgather`` (Horovod's sparse path): ring allgather of (indices, values);
  every worker receives ``(n-1) * alpha * rows * row`` bytes, growing with n.
* ``ps``: push, then pull. Each node (local aggregation) or each worker
  (without) sends ``alpha_x * rows * row`` bytes each way, the off-node part
  ``(N-1)/N`` of it through its node's NIC; the busiest server NIC carries
  its share of everything (``ceil(P/S)/P`` per server, ``S/N`` servers per
  NIC). Each phase costs the larger of the client side and the server side,
  plus message latencies (a client sends ``P`` messages, the busiest server
  receives ``senders * ceil(P/S)``), plus ``partition_overhead_s`` per
  partition (packing, one request per partition). Servers gather/apply rows
  at ``server_apply_Bps``. Local aggregation adds the intra-node exchange of
  each worker's rows by destination, at the intra link. PS tables of one
  step travel together (``CostParams.ps_batch`` of them per exchange), so
  each pays its share of the message latencies.

``alpha_node`` defaults to ``1 - (1 - alpha) ** g`` (independent access);
Zipf access shares hot rows, so a measured value is smaller and better.
Nothing here is collective; everything is plain Python floats.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

__all__ = [
    "VarSpec",
    "ClusterShape",
    "CostParams",
    "PREDICT_METHODS",
    "predict",
    "predict_all",
    "choose",
    "default_alpha_node",
]

PREDICT_METHODS = ("allreduce", "allgather", "ps", "ps_no_local_aggregation")
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
    """

    name: str
    kind: str
    shape: tuple
    dtype: str = "float32"
    alpha: float = 1.0
    alpha_node: float | None = None

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
            keys = ("name", "kind", "shape", "dtype", "alpha", "alpha_node")
            fields = {k: spec[k] for k in keys if k in spec}
            if fields.get("alpha") is None:
                fields.pop("alpha", None)  # dense variables carry no alpha
            return cls(**fields)
        raise TypeError(f"variable spec must be a VarSpec or dict, not {type(spec).__name__}")

    @property
    def rows(self) -> int:
        return self.shape[0] if self.shape else 1

    @property
    def dim(self) -> int:
        return math.prod(self.shape[1:]) if len(self.shape) > 1 else 1

    @property
    def itemsize(self) -> int:
        return _dtype_itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.itemsize

    def node_alpha(self, workers_per_node: int) -> float:
        if self.kind == "dense":
            return 1.0
        if self.alpha_node is not None:
            return float(self.alpha_node)
        return default_alpha_node(self.alpha, workers_per_node)

    def worker_alpha(self) -> float:
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
        return self.num_nodes * self.workers_per_node

    @property
    def servers(self) -> int:
        """Ranks holding partitions: the servers, or every worker when there are none."""
        per_node = self.servers_per_node or self.workers_per_node
        return self.num_nodes * per_node

    def to_dict(self) -> dict:
        return {"num_nodes": self.num_nodes, "workers_per_node": self.workers_per_node,
                "servers_per_node": self.servers_per_node}


@dataclass(frozen=True)
class CostParams:
    """Constants of the model that are not link properties.

    Args:
        partition_overhead_s: fixed seconds per partition per phase (packing
            and issuing one request per partition).
        server_apply_Bps: bytes of rows per second a server gathers or
            applies (host memory bound).
        ps_batch: PS variables that share each exchange. hpcpax moves every
            PS table of a phase in one exchange
            (:meth:`~hpcpax.ps.server.ParameterServer.push_many`), so each of them
            pays ``1 / ps_batch`` of the message latencies. ``None`` (the
            default) lets :func:`hpcpax.plan.make_plan` use the number
            of sparse variables of the plan; 1 for a lone variable.
    """

    partition_overhead_s: float = 20e-6
    server_apply_Bps: float = 10e9
    ps_batch: int | None = None

    def to_dict(self) -> dict:
        return {"partition_overhead_s": self.partition_overhead_s,
                "server_apply_Bps": self.server_apply_Bps, "ps_batch": self.ps_batch}


@dataclass(frozen=True)
class _Links:
    intra_latency: float
    intra_bandwidth: float
    inter_latency: float
    inter_bandwidth: float
    bucket_bytes: int


def _links(fabric) -> _Links:
    """Read the link numbers from a ``hpcpax.comm.fabric.Fabric`` or its ``to_dict()``."""
    if isinstance(fabric, Mapping):
        def link(name):
            part = fabric[name]
            return float(part["latency_s"]), float(part["bandwidth_Bps"])

        bucket = fabric.get("allreduce_bucket_bytes", 64 << 20)
        (il, ib), (xl, xb) = link("intra"), link("inter")
    else:
        il, ib = float(fabric.intra.latency_s), float(fabric.intra.bandwidth_Bps)
        xl, xb = float(fabric.inter.latency_s), float(fabric.inter.bandwidth_Bps)
        bucket = getattr(fabric, "allreduce_bucket_bytes", 64 << 20)
    if min(ib, xb) <= 0:
        raise ValueError(f"fabric bandwidths must be > 0, not intra={ib}, inter={xb}")
    return _Links(il, ib, xl, xb, max(1, int(bucket)))


def _ring_allreduce(nbytes, ranks, latency, bandwidth, buckets):
    if ranks <= 1 or nbytes <= 0:
        return 0.0
    return 2.0 * (ranks - 1) / ranks * nbytes / bandwidth + 2.0 * (ranks - 1) * latency * buckets


def _allreduce(nbytes, shape: ClusterShape, links: _Links) -> float:
    n, nodes, g = shape.workers, shape.num_nodes, shape.workers_per_node
    buckets = max(1, math.ceil(nbytes / links.bucket_bytes))
    if nodes == 1:
        return _ring_allreduce(nbytes, n, links.intra_latency, links.intra_bandwidth, buckets)
    flat = _ring_allreduce(nbytes, n, max(links.intra_latency, links.inter_latency),
                           min(links.intra_bandwidth, links.inter_bandwidth), buckets)
    if g == 1:
        return flat
    # hierarchical: the g inter-node rings of nbytes/g each share the node's NIC
    hierarchical = (_ring_allreduce(nbytes, g, links.intra_latency, links.intra_bandwidth, buckets)
                    + _ring_allreduce(nbytes, nodes, links.inter_latency, links.inter_bandwidth, buckets))
    return min(flat, hierarchical)


def _allgather(var: VarSpec, shape: ClusterShape, links: _Links) -> float:
    n = shape.workers
    if n <= 1:
        return 0.0
    per_worker = var.worker_alpha() * var.rows * (var.dim * var.itemsize + INDEX_BYTES)
    if shape.num_nodes == 1:
        latency, bandwidth = links.intra_latency, links.intra_bandwidth
    else:
        latency = max(links.intra_latency, links.inter_latency)
        bandwidth = min(links.intra_bandwidth, links.inter_bandwidth)
    return (n - 1) * per_worker / bandwidth + (n - 1) * latency


def _ps(var: VarSpec, shape: ClusterShape, links: _Links, partitions: int,
        local_aggregation: bool, params: CostParams) -> float:
    nodes, g, servers = shape.num_nodes, shape.workers_per_node, shape.servers
    row = var.dim * var.itemsize + (INDEX_BYTES if var.kind == "sparse" else 0)
    aggregate = local_aggregation and g > 1
    senders_per_node = 1 if aggregate else g
    alpha_sender = var.node_alpha(g) if aggregate else var.worker_alpha()
    per_sender = alpha_sender * var.rows * row
    total = per_sender * senders_per_node * nodes

    busiest_server_fraction = math.ceil(partitions / servers) / partitions
    servers_per_nic = servers / nodes
    if nodes == 1:
        latency, nic_bandwidth, off_node = links.intra_latency, links.intra_bandwidth, 1.0
    else:
        latency, nic_bandwidth, off_node = links.inter_latency, links.inter_bandwidth, (nodes - 1) / nodes
    client_nic = per_sender * senders_per_node * off_node / nic_bandwidth
    server_nic = total * min(1.0, busiest_server_fraction * servers_per_nic) * off_node / nic_bandwidth
    client_messages = partitions * senders_per_node
    server_messages = nodes * senders_per_node * math.ceil(partitions / servers)
    share = 1.0 / max(1, int(params.ps_batch or 1))  # latencies shared by the batched tables
    phase = (max(client_nic, server_nic) + max(client_messages, server_messages) * latency * share
             + partitions * params.partition_overhead_s)
    gather_and_apply = 2.0 * total * busiest_server_fraction / params.server_apply_Bps
    seconds = 2.0 * phase + gather_and_apply
    if aggregate:
        per_worker = var.worker_alpha() * var.rows * row
        seconds += 2.0 * ((g - 1) / g * per_worker / links.intra_bandwidth
                          + (g - 1) * links.intra_latency * share)
    return seconds


def predict(var_spec, method: str, topology, fabric, partitions: int | None = None,
            local_aggregation: bool = True, params: CostParams | None = None) -> float:
    """Predicted seconds per step to synchronize one variable with ``method``.

    Args:
        var_spec: :class:`VarSpec` or a dict with its fields.
        method: ``"allreduce"``, ``"allgather"``, ``"ps"`` or
            ``"ps_no_local_aggregation"``.
        topology: :class:`ClusterShape`, dict, or object with ``num_nodes``,
            ``workers_per_node``, ``servers_per_node``.
        fabric: ``hpcpax.comm.fabric.Fabric`` or its ``to_dict()``.
        partitions: partitions for ``ps`` (default: number of servers).
        local_aggregation: for ``ps``, aggregate inside a node first (only
            meaningful with several workers per node).
        params: model constants (:class:`CostParams`).
    """
    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    links = _links(fabric)
    params = params or CostParams()
    if method == "allreduce":
        return _allreduce(var.nbytes, shape, links)
    if method == "allgather":
        if var.kind == "dense":
            raise ValueError(f"method 'allgather' needs a sparse variable, not dense {var.name!r}")
        return _allgather(var, shape, links)
    if method in ("ps", "ps_no_local_aggregation"):
        if partitions is None:
            partitions = shape.servers
        if int(partitions) < 1:
            raise ValueError(f"partitions must be >= 1, not {partitions}")
        if method == "ps_no_local_aggregation":
            local_aggregation = False
        return _ps(var, shape, links, int(partitions), local_aggregation, params)
    raise ValueError(f"method must be one of {PREDICT_METHODS}, not {method!r}")


def predict_all(var_spec, topology, fabric, partitions: int | None = None,
                params: CostParams | None = None) -> dict:
    """``{method: seconds}`` for every method that applies to the variable.

    A dense variable gets ``allreduce`` and ``ps``; a sparse one also
    ``allgather``; ``ps_no_local_aggregation`` appears when a node has
    several workers.
    """
    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    times = {"allreduce": predict(var, "allreduce", shape, fabric, params=params)}
    if var.kind == "sparse":
        times["allgather"] = predict(var, "allgather", shape, fabric, params=params)
    times["ps"] = predict(var, "ps", shape, fabric, partitions=partitions, params=params)
    if shape.workers_per_node > 1:
        times["ps_no_local_aggregation"] = predict(var, "ps_no_local_aggregation", shape, fabric,
                                                   partitions=partitions, params=params)
    return times


def choose(var_spec, topology, fabric, partitions: int | None = None,
           params: CostParams | None = None):
    """The fastest method for one variable under the model.

    Candidates are ``allreduce``, ``allgather`` (sparse only) and ``ps``
    (with local aggregation when a node has several workers, as Parallax
    does). Ties go to the earlier candidate in that order.

    Returns:
        ``(method, times, reason)``: the method name, ``{method: seconds}``
        from :func:`predict_all`, and one line saying why.
    """
    var = VarSpec.from_any(var_spec)
    shape = ClusterShape.from_any(topology)
    times = predict_all(var, shape, fabric, partitions=partitions, params=params)
    candidates = [m for m in ("allreduce", "allgather", "ps") if m in times]
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
