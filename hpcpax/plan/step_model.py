"""Seconds of one training step, phase by phase, as ``hpcpax.train`` runs it.

The trainer's step (:meth:`hpcpax.app.trainer.Trainer.train_step`) runs its
phases one after the other and overlaps nothing: ``data``, ``pull`` (every
PS table in one batched exchange, replicated tables read locally),
``compute`` (forward and backward), ``push`` (allgather tables in one
``Allgatherv``, densified tables allreduced, PS tables in one batched
exchange), ``dense`` (blocking fused ``Allreduce``, bucket by bucket) and
``optimizer``, then one small ``Allreduce`` of the step's figures. So the
predicted step time is the sum of the phases; a phase is a sequence of
stages, and a stage lasts as long as its slowest rank (BSP).

Within a phase, each stage is either local work (kernels; seconds from the
measured rates in :class:`~hpcpax.plan.cost_model.CostParams`) or a
collective priced by :mod:`hpcpax.plan.collectives` for the algorithm MPICH
runs. Server work (gathers, dedup and optimizer on pushed rows) on one owner
runs its partitions ``min(partitions it owns, server_lanes)`` at a time, and
pays ``partition_overhead_s`` per partition per phase.

Every second is also charged to a *resource* (``compute``, ``client
kernels``, ``server CPU``, ``intra link``, ``inter link``, ``node NIC``,
``latency``); the one with the most is the step's bottleneck. Pure NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import collectives as coll
from .traffic import COUNT_BYTES, HEADER_BYTES, INDEX_BYTES, Layout

__all__ = ["StepPrediction", "predict_step", "PHASES", "REDUCE_STEP_BYTES"]

PHASES = ("data", "pull", "compute", "push", "dense", "optimizer", "control")
LOCAL_WORK = ("compute", "client kernels", "server CPU", "software")
#: The trainer's per-step ``Allreduce`` of loss, batch, flag, 6 times, 8 x 3 byte counters.
REDUCE_STEP_BYTES = (3 + 6 + 8 * 3) * 8


@dataclass
class StepPrediction:
    """Predicted seconds per phase, per resource, and the bottleneck."""

    phases: dict = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    resources: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """Predicted step seconds (sum of the phases)."""
        return float(sum(self.phases.values()))

    @property
    def bottleneck(self) -> str:
        """The resource charged the most seconds."""
        return max(self.resources, key=self.resources.get) if self.resources else ""

    handoff: dict | None = None

    def charge(self, phase, resource, seconds):
        """Add ``seconds`` to ``phase`` and to ``resource``."""
        seconds = float(seconds)
        if seconds <= 0:
            return
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.resources[resource] = self.resources.get(resource, 0.0) + seconds
        if self.handoff and resource in LOCAL_WORK:
            # the stage hands over to a collective whose ranks sat polling
            extra = self.handoff["handoff_s"] + self.handoff["handoff_per_work"] * seconds
            self.phases[phase] += extra
            self.resources["scheduling"] = self.resources.get("scheduling", 0.0) + extra

    def charge_cost(self, phase, cost: coll.Cost, scale: float = 1.0):
        """Charge a collective: its latency to ``latency``, the rest to the resources it used."""
        self.charge(phase, "latency", cost.latency_s * scale)
        total = sum(cost.parts.values())
        moved = cost.bandwidth_s + cost.nic_s
        for resource, seconds in cost.parts.items():
            self.charge(phase, resource, moved * seconds / total * scale if total else 0.0)

    def to_dict(self) -> dict:
        """The prediction as a JSON-able dict."""
        return {"seconds": self.seconds, "phases": dict(self.phases),
                "resources": dict(self.resources), "bottleneck": self.bottleneck}


def _server_seconds(work, routing_parts, params):
    """Per-rank seconds of server work spread over its partitions' lanes."""
    parts = np.maximum(routing_parts, 1.0)
    lanes = np.minimum(parts, max(1, int(params.server_lanes)))
    seconds = work / lanes
    owns = routing_parts > 0
    seconds = seconds + np.where(owns, np.ceil(routing_parts / lanes) * params.partition_overhead_s,
                                 0.0)
    return seconds


def _node_matrix(layout, matrix, node_ranks):
    """``matrix`` restricted to ``node_ranks`` (a node's workers), in their order."""
    idx = np.asarray(node_ranks)
    return matrix[np.ix_(idx, idx)]


def _node_collectives(layout, links, build):
    """The slowest node's cost of a per-node collective ``build(node_ranks, node_of)``."""
    worst = coll.Cost()
    for node in sorted(set(layout.node_of)):
        ranks = layout.node_workers(node)
        if len(ranks) > 1:
            cost = build(ranks, [layout.node_of[r] for r in ranks])
            if cost.seconds > worst.seconds:
                worst = cost
    return worst


def _ps_exchange(pred, phase, layout, links, params, routings, record, server_work, share,
                 delegate_work, back=None):
    """One batched PS operation: header, (intra-node), counts, data (, data back)."""
    everyone = list(layout.node_of)
    pred.charge_cost(phase, coll.allgatherv(everyone, HEADER_BYTES, links), share)
    aggregated = [r for r in routings if r.to_delegate is not None]
    if aggregated:
        k = len(aggregated)
        pred.charge_cost(phase, _node_collectives(
            layout, links, lambda ranks, nodes: coll.alltoall(nodes, COUNT_BYTES * k, links)), share)
        out = sum(r.to_delegate * record(r) for r in aggregated)
        pred.charge_cost(phase, _node_collectives(
            layout, links, lambda ranks, nodes: coll.alltoallv(
                nodes, _node_matrix(layout, out, ranks), links)))
        # fan-in: the delegate deduplicates what its node's workers sent it
        pred.charge(phase, "client kernels", float(np.max(sum(
            delegate_work(r, r.to_delegate.sum(axis=0)) for r in aggregated))))
    pred.charge_cost(phase, coll.alltoall(everyone, COUNT_BYTES * len(routings), links), share)
    pred.charge_cost(phase, coll.alltoallv(everyone, sum(r.to_owner * record(r)
                                                         for r in routings), links))
    work = sum(server_work(r) for r in routings)
    parts = sum(r.parts_of_owner for r in routings)
    pred.charge(phase, "server CPU", float(_server_seconds(work, parts, params).max()))
    if back is not None:
        pred.charge_cost(phase, coll.alltoallv(everyone, sum(r.to_owner.T * back(r)
                                                             for r in routings), links))
        if aggregated:
            out = sum(r.to_delegate.T * r.row_bytes for r in aggregated)
            pred.charge_cost(phase, _node_collectives(
                layout, links, lambda ranks, nodes: coll.alltoallv(
                    nodes, _node_matrix(layout, out, ranks), links)))


def _received_rows(r):
    """Rows each owner serves: everything sent to it, itself included."""
    return r.to_owner.sum(axis=0)


def predict_step(layout: Layout, links, params, routings: dict, dense_bytes=(),
                 compute_s: float = 0.0, data_s: float = 0.0, ps_batch: int | None = None,
                 include_control: bool = True) -> StepPrediction:
    """Predicted :class:`StepPrediction` of one training step.

    Args:
        layout: the ranks (:class:`~hpcpax.plan.traffic.Layout`).
        links: :class:`~hpcpax.plan.collectives.Links` (or a fabric).
        params: :class:`~hpcpax.plan.cost_model.CostParams` (kernel rates).
        routings: ``{sparse variable: Routing}`` of the step.
        dense_bytes: bytes of each dense tensor (fused into buckets).
        compute_s, data_s: measured forward+backward and data seconds per step.
        ps_batch: when pricing one variable alone, the number of PS tables
            that share its headers and count exchanges (their latencies are
            divided among them); None when ``routings`` is the whole step.
        include_control: add the trainer's per-step figures ``Allreduce``.
    """
    links = coll.Links.from_fabric(links)
    pred = StepPrediction(handoff=params.handoff)
    share = 1.0 / max(1, int(ps_batch)) if ps_batch else 1.0
    workers = list(layout.worker_ranks)
    worker_nodes = [layout.node_of[r] for r in workers]
    pred.charge("data", "compute", data_s)
    pred.charge("compute", "compute", compute_s)

    on_ps = [r for r in routings.values() if r.method == "ps"]
    gathered = [r for r in routings.values() if r.method == "allgather"]
    densified = [r for r in routings.values() if r.method == "allreduce"]
    # pull: ids deduplicated, then the PS tables in one exchange; replicas read locally
    if on_ps:
        pred.charge("pull", "software", params.overhead("ps_pull", len(on_ps)))
        pred.charge("pull", "client kernels",
                    max(sum(params.kernel("unique", r.raw[w]) for r in on_ps) for w in workers))
        _ps_exchange(pred, "pull", layout, links, params, on_ps, lambda r: INDEX_BYTES,
                     lambda r: params.kernel("gather", _received_rows(r) * r.row_bytes), share,
                     lambda r, rows: params.kernel("unique", rows), back=lambda r: r.row_bytes)
    replicas = gathered + densified
    if replicas:
        pred.charge("pull", "client kernels", max(
            sum(params.kernel("unique", r.raw[w]) + params.kernel("gather", r.unique[w]
                                                                  * r.row_bytes)
                for r in replicas) for w in workers))
    # push: every gradient deduplicated on its worker first
    if routings:
        pred.charge("push", "client kernels", max(
            sum(params.kernel("dedup", r.raw[w] * r.row_bytes) for r in routings.values())
            for w in workers))
    if replicas:
        pred.charge("push", "software", params.overhead("allgather_push", len(replicas)))
    if gathered:
        record = [r.unique[workers] * (INDEX_BYTES + r.row_bytes) for r in gathered]
        pred.charge_cost("push", coll.allgatherv(worker_nodes, COUNT_BYTES * len(gathered), links))
        pred.charge_cost("push", coll.allgatherv(worker_nodes, sum(record), links))
        # every worker sums all workers' rows, then updates the union of rows
        pred.charge("push", "client kernels", sum(
            params.kernel("dedup", r.unique[workers].sum() * r.row_bytes)
            + params.kernel("apply", r.union * r.row_bytes) for r in gathered))
    for r in densified:
        table = r.rows * r.row_bytes
        pred.charge("push", "client kernels", params.kernel("gather", table)
                    + params.kernel("apply", r.union * r.row_bytes))
        pred.charge_cost("push", coll.allreduce(worker_nodes, table, links))
        pred.charge_cost("push", coll.allreduce(worker_nodes, r.rows, links, itemsize=1))
    if on_ps:
        def apply_work(r):
            rows = _received_rows(r)
            # an owner updates the distinct rows among those it received
            distinct = rows * min(1.0, r.union / max(float(rows.sum()), 1.0))
            return (params.kernel("dedup", rows * r.row_bytes)
                    + params.kernel("apply", distinct * r.row_bytes))

        pred.charge("push", "software", params.overhead("ps_push", len(on_ps)))
        _ps_exchange(pred, "push", layout, links, params, on_ps,
                     lambda r: INDEX_BYTES + r.row_bytes, apply_work, share,
                     lambda r, rows: params.kernel("dedup", rows * r.row_bytes))
    # dense: blocking fused allreduce, one bucket after the other
    total = float(sum(dense_bytes))
    pred.charge("dense", "software", params.overhead("dense_allreduce", len(dense_bytes)))
    if total > 0 and len(workers) > 1:
        full, rest = divmod(total, links.bucket_bytes)
        if full:
            pred.charge_cost("dense", coll.allreduce(worker_nodes, links.bucket_bytes, links),
                             full)
        if rest:
            pred.charge_cost("dense", coll.allreduce(worker_nodes, rest, links))
    # a framework that overlaps hides the allreduce behind the backward pass
    hidden = min(max(params.overlap_dense, 0.0) * params.backward_fraction * compute_s,
                 pred.phases["dense"])
    if hidden > 0:
        pred.phases["dense"] -= hidden
        pred.resources["overlapped with backward"] = -hidden
    pred.charge("optimizer", "client kernels",
                sum(params.kernel("dense_optimizer", b) for b in dense_bytes))
    if include_control and len(workers) > 1:
        pred.charge_cost("control", coll.allreduce(worker_nodes, REDUCE_STEP_BYTES, links,
                                                    itemsize=8))
    return pred


def ceil_log2(n: int) -> int:
    """``ceil(log2(n))``, 0 for n <= 1."""
    return int(math.ceil(math.log2(n))) if n > 1 else 0
