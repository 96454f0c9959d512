"""Seconds of one training step, phase by phase, as ``hpcpax.train`` runs it.

The trainer's step (:meth:`hpcpax.app.bsp_step.BSPSteps.step`) runs its
phases one after the other: ``data``, ``pull`` (every PS table in one
batched exchange, replicated tables read locally), ``compute`` (forward
and backward), ``push`` (allgather tables in one allgather, densified
tables allreduced, PS tables in one batched exchange), ``dense`` (the
fused ``Iallreduce`` of the dense gradients, started before the push and
waited for after it) and ``optimizer``, then one small ``Allreduce`` of
the step's figures. So the predicted step time is the sum of the phases;
a phase is a sequence of stages, and a stage lasts as long as its slowest
rank (BSP). The dense phase is what is left of the allreduce after the
push (``CostParams.dense_overlaps_push``): its latencies, fixed costs and
waits hide behind the push, up to the push's length, and its link seconds
stay (they queue behind the push's bytes on the same links).

Within a phase, each stage is either local work (kernels; seconds from the
measured rates in :class:`~hpcpax.plan.cost_model.CostParams`) or a
collective priced by :mod:`hpcpax.plan.collectives` for the algorithm MPICH
runs. Server work (gathers, dedup and optimizer on pushed rows) on one owner
runs its partitions ``min(partitions it owns, server_lanes)`` at a time, and
pays ``partition_overhead_s`` per partition per phase: each table's
partitions (``CostParams.partition_overhead_per="variable"``, a framework
running one operation per partition) or, in hpcpax's batched exchange, once
for the most partitions one table has there (``"exchange"``).

hpcpax's fixed cost per operation (``software``) comes from
:class:`~hpcpax.plan.cost_model.CostParams.software`. Measured on a one-rank
world (``software_scope="process"``) it is only the host path, and every
collective's latency is priced here; measured on the job's own ranks
(``"job"``, :func:`hpcpax.tune.calibrate.measure_operations`) it already
holds the latencies of the operation's collectives as this machine runs
them, so those are not charged again (their bytes still are).

The hand-off (``CostParams.handoff``) is what local work costs beyond
itself when ranks that sat polling meanwhile must join the next collective:
``handoff_s`` once per operation of the step (a PS pull or push, an
allgather push, each densified table's ``Allreduce``, the dense allreduce,
the step's figures; not with job-scope operation costs, timed one after
the other as in a step, which hold it), plus ``handoff_per_work`` times the work only for
*server* work (servers work while the workers wait, as in its
measurement). The workers' own stages (data, compute, client kernels) run
on every worker at once; each worker's timer shows its own work at the
rate measured under the same load, but with more busy ranks than cores the
workers take turns, so the first collective after such work waits
``after_work`` times the work accumulated since the previous collective
(``handoff["after_work"]``, :func:`hpcpax.tune.calibrate.measure_after_work`:
``"serving"`` when PS tables are served, whose servers wait inside MPI
taking a core, ``"idle"`` otherwise). Work inside an operation whose cost
was measured (``software``) is not counted: its measurement holds it.
A push also delays the workers' next collective (the step's figures; the
dense allreduce when ``dense_overlaps_push`` is off): a PS push by the
servers' work on it, which runs on their cores after the workers' part
returned, a replicated push by what it leaves behind on an
oversubscribed host; each is measured as that
collective right after the push, less the collective alone (``after_ps_push``,
``after_allgather_push``, ... in ``software``), and the longest of a step's
pushes is charged. The workers' collectives themselves are priced in the
servers' state (``dense_allreduce`` / ``control`` with PS tables served,
their ``_idle`` forms when every table is replicated).

An allgather push moves each worker's block (its distinct rows, or with
``CostParams.allgather_rows="raw"`` one row per lookup, as TensorFlow's
gradients of a gather are) in one fused allgather after one of the
counts (hpcpax's: blocks padded to the largest where
:func:`~hpcpax.comm.sparse_collectives.padded_block_bytes` says so), or
(``allgather_fused=False``, Horovod before allgather fusion) one
``Allgatherv`` per tensor, a table's indices and values apart; a
host-staged allgather (``allgather_staging_Bps``) also copies each
worker's block to the host and every gathered block back, over its node's
shared uplinks (``host staging``). Every worker then sums all the blocks'
rows and updates the union of rows.

Every second is also charged to a *resource* (``compute``, ``client
kernels``, ``server CPU``, ``intra link``, ``inter link``, ``node NIC``,
``host staging``, ``latency``, ``software``, ``scheduling``); the one with
the most is the step's bottleneck. Pure NumPy.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from . import collectives as coll
from ..comm.sparse_collectives import padded_block_bytes
from .traffic import COUNT_BYTES, HEADER_BYTES, INDEX_BYTES, Layout

__all__ = ["StepPrediction", "predict_step", "after_work_factor", "PHASES", "REDUCE_STEP_BYTES"]

PHASES = ("data", "pull", "compute", "push", "dense", "optimizer", "control")
#: resources that are bytes on a link (what an overlapped collective cannot hide)
LINK_RESOURCES = ("intra link", "inter link", "node NIC")
LOCAL_WORK = ("compute", "client kernels", "server CPU", "software")
#: the workers' own work outside the measured operations (see ``after_work``)
WORKER_WORK = ("compute", "client kernels")
#: The trainer's per-step ``Allreduce`` (``hpcpax.app.step_report.reduce_step``): loss,
#: batch, flag, 6 times, 9 phases x 4 byte counters, 4 owner counters.
REDUCE_STEP_BYTES = (3 + 6 + 9 * 4 + 4) * 8


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
    #: the measured per-operation costs hold their collectives' latencies
    latency_included: bool = False
    #: the next collective waits this many times the workers' local work since the last
    #: one (``handoff["after_work"]``; 0 without it)
    after_work: float = 0.0
    #: the workers' local work (seconds) since the last collective
    pending_work: float = 0.0

    def charge(self, phase, resource, seconds):
        """Add ``seconds`` to ``phase`` and to ``resource``."""
        seconds = float(seconds)
        if seconds <= 0:
            return
        self.phases[phase] = self.phases.get(phase, 0.0) + seconds
        self.resources[resource] = self.resources.get(resource, 0.0) + seconds
        if resource in WORKER_WORK:
            self.pending_work += seconds
        if self.handoff and resource in LOCAL_WORK:
            self.hand_off(phase, handoff_seconds(self.handoff, resource, seconds))

    def turns(self, phase) -> None:
        """A collective starts in ``phase``: charge its wait for the workers' turns at
        the local work since the previous one (``after_work * pending_work``, to
        ``scheduling``), then start counting again."""
        seconds, self.pending_work = self.after_work * self.pending_work, 0.0
        if seconds > 0:
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
            self.resources["scheduling"] = self.resources.get("scheduling", 0.0) + seconds

    def hand_off(self, phase, seconds=None):
        """Charge a hand-off to ``scheduling``: ``seconds``, or the per-operation
        ``handoff_s`` (not when the operations' measured costs hold it already)."""
        if seconds is None:
            seconds = 0.0 if self.latency_included else float(
                (self.handoff or {}).get("handoff_s", 0.0))
        if seconds > 0:
            self.phases[phase] = self.phases.get(phase, 0.0) + seconds
            self.resources["scheduling"] = self.resources.get("scheduling", 0.0) + seconds

    def charge_cost(self, phase, cost: coll.Cost, scale: float = 1.0, covered: bool = False):
        """Charge a collective: its latency to ``latency``, the rest to the resources it used.

        ``covered``: the collective belongs to an operation whose measured
        fixed cost already holds its latency (see ``latency_included``).
        """
        self.turns(phase)
        if not (covered and self.latency_included):
            self.charge(phase, "latency", cost.latency_s * scale)
        total = sum(cost.parts.values())
        moved = cost.bandwidth_s + cost.nic_s
        for resource, seconds in cost.parts.items():
            self.charge(phase, resource, moved * seconds / total * scale if total else 0.0)

    def to_dict(self) -> dict:
        """The prediction as a JSON-able dict."""
        return {"seconds": self.seconds, "phases": dict(self.phases),
                "resources": dict(self.resources), "bottleneck": self.bottleneck}


def handoff_seconds(handoff, resource, seconds) -> float:
    """Hand-off seconds that ``seconds`` of local work on ``resource`` add.

    ``handoff_per_work * seconds`` for ``server CPU`` (the one stage where
    some ranks work while the others wait, as
    :func:`~hpcpax.tune.calibrate.measure_handoff` times it), else 0 (the
    per-operation ``handoff_s`` is charged by :meth:`StepPrediction.hand_off`).
    """
    if not handoff or seconds <= 0 or resource != "server CPU":
        return 0.0
    return float(handoff.get("handoff_per_work", 0.0)) * float(seconds)


def after_work_factor(handoff, serving: bool) -> float:
    """``handoff["after_work"]["serving" or "idle"]`` (0 when not measured): how many
    times the workers' local work the next collective waits (servers that serve
    PS tables wait inside MPI, taking a core; idle ones poll)."""
    factors = (handoff or {}).get("after_work") or {}
    return max(float(factors.get("serving" if serving else "idle", 0.0)), 0.0)


def _server_seconds(work, routing_parts, params, overhead_parts=None, share=1.0):
    """Per-rank seconds of server work spread over its partitions' lanes.

    ``routing_parts``: partitions each rank owns over the exchange's tables
    (they share the lanes); ``overhead_parts``: the partitions that pay
    ``partition_overhead_s`` (default ``routing_parts``; with
    ``partition_overhead_per="exchange"`` the most one table has, and a
    variable priced alone pays ``share`` of it).
    """
    parts = np.maximum(routing_parts, 1.0)
    lanes = np.minimum(parts, max(1, int(params.server_lanes)))
    seconds = work / lanes
    owns = routing_parts > 0
    paying = routing_parts if overhead_parts is None else overhead_parts
    seconds = seconds + np.where(owns, np.ceil(paying / lanes) * params.partition_overhead_s
                                 * share, 0.0)
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
    pred.hand_off(phase)
    pred.charge_cost(phase, coll.allgatherv(everyone, HEADER_BYTES, links), share, True)
    aggregated = [r for r in routings if r.to_delegate is not None]
    if aggregated:
        k = len(aggregated)
        pred.charge_cost(phase, _node_collectives(
            layout, links, lambda ranks, nodes: coll.alltoall(nodes, COUNT_BYTES * k, links)),
            share, True)
        out = sum(r.to_delegate * record(r) for r in aggregated)
        pred.charge_cost(phase, _node_collectives(
            layout, links, lambda ranks, nodes: coll.alltoallv(
                nodes, _node_matrix(layout, out, ranks), links)), covered=True)
        # fan-in: the delegate deduplicates what its node's workers sent it
        pred.charge(phase, "client kernels", float(np.max(sum(
            delegate_work(r, r.to_delegate.sum(axis=0)) for r in aggregated))))
    pred.charge_cost(phase, coll.alltoall(everyone, COUNT_BYTES * len(routings), links), share,
                     True)
    pred.charge_cost(phase, coll.alltoallv(everyone, sum(r.to_owner * record(r)
                                                         for r in routings), links),
                     covered=True)
    work = sum(server_work(r) for r in routings)
    parts = sum(r.parts_of_owner for r in routings)
    if params.partition_overhead_per == "exchange":
        # one vectorized pass per table: an exchange pays for its widest table once
        seconds = _server_seconds(work, parts, params,
                                  np.max([r.parts_of_owner for r in routings], axis=0), share)
    else:
        seconds = _server_seconds(work, parts, params)
    pred.charge(phase, "server CPU", float(seconds.max()))
    if back is not None:
        pred.charge_cost(phase, coll.alltoallv(everyone, sum(r.to_owner.T * back(r)
                                                             for r in routings), links),
                         covered=True)
        if aggregated:
            out = sum(r.to_delegate.T * r.row_bytes for r in aggregated)
            pred.charge_cost(phase, _node_collectives(
                layout, links, lambda ranks, nodes: coll.alltoallv(
                    nodes, _node_matrix(layout, out, ranks), links)), covered=True)


def _ps_operation(params, operation, routings):
    """``operation`` or its ``_no_aggregation`` form when no routing aggregates (and it
    was measured)."""
    direct = operation + "_no_aggregation"
    if params.software and direct in params.software and \
            all(r.to_delegate is None for r in routings):
        return direct
    return operation


def _workers_operation(params, operation, serving: bool):
    """``operation`` (a workers' collective) as measured in the servers' state: its
    ``_idle`` form when no table is on the PS (and it was measured)."""
    idle = operation + "_idle"
    if not serving and params.software and idle in params.software:
        return idle
    return operation


def _received_rows(r):
    """Rows each owner serves: everything sent to it, itself included."""
    return r.to_owner.sum(axis=0)


def predict_step(layout: Layout, links, params, routings: dict, dense_bytes=(),
                 compute_s: float = 0.0, data_s: float = 0.0, ps_batch: int | None = None,
                 include_control: bool = True, optimizer_s: float | None = None,
                 compute_on_host: bool = True) -> StepPrediction:
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
        optimizer_s: measured seconds per step of the dense optimizer over the
            model's dense tensors (like ``compute_s``: the model's own work,
            the same under every strategy); None: the ``dense_optimizer``
            kernel rate per tensor, its fixed cost per call included (the
            optimizer runs once per tensor, outside any measured operation).
        compute_on_host: the forward and backward hold a host core (real compute
            on this host's CPUs: the next collective waits ``after_work`` times
            it for the workers' turns); False where they hold none (an
            accelerator's, or ``--emulate-compute``'s wait): ``compute_s`` is
            charged to ``accelerator``, with no turns and no hand-off.
    """
    links = coll.Links.from_fabric(links)
    on_ps = [r for r in routings.values() if r.sync_method.on_servers]
    pred = StepPrediction(handoff=params.handoff, latency_included=bool(
        params.software) and params.software_scope == "job",
        after_work=after_work_factor(params.handoff, serving=bool(on_ps)))
    share = 1.0 / max(1, int(ps_batch)) if ps_batch else 1.0
    workers = list(layout.worker_ranks)
    worker_nodes = [layout.node_of[r] for r in workers]
    pred.charge("data", "compute", data_s)
    gathered = [r for r in routings.values() if r.sync_method.gathers]
    densified = [r for r in routings.values() if r.sync_method.densified]
    # pull: ids deduplicated, then the PS tables in one exchange; replicas read locally
    def rows_of(group):  # the most ids a worker moves over these variables
        return max((sum(float(r.unique[w]) for r in group) for w in workers), default=0.0)

    if on_ps:
        pred.charge("pull", "software", params.overhead(_ps_operation(params, "ps_pull", on_ps),
                                                        len(on_ps), rows_of(on_ps)))
        pred.charge("pull", "client kernels",
                    max(sum(params.kernel("unique", r.raw[w]) for r in on_ps) for w in workers))
        _ps_exchange(pred, "pull", layout, links, params, on_ps, lambda r: INDEX_BYTES,
                     lambda r: params.kernel("gather", _received_rows(r) * r.row_bytes), share,
                     lambda r, rows: params.kernel("unique", rows), back=lambda r: r.row_bytes)
    replicas = gathered + densified
    if replicas:  # each replica read locally: its fixed cost, then its kernels
        pred.charge("pull", "software", params.overhead("replica_pull", len(replicas),
                                                        rows_of(replicas)))
        pred.charge("pull", "client kernels", max(
            sum(params.kernel("unique", r.raw[w]) + params.kernel("gather", r.unique[w]
                                                                  * r.row_bytes)
                for r in replicas) for w in workers))
    # (charged in step order: the first collective after local work waits for the
    # workers' turns at it, see StepPrediction.turns)
    pred.charge("compute", "compute" if compute_on_host else "accelerator", compute_s)
    # push: every gradient deduplicated on its worker first
    if routings:
        pred.charge("push", "client kernels", max(
            sum(params.kernel("dedup", r.raw[w] * r.row_bytes) for r in routings.values())
            for w in workers))
    # each replicated method's measured fixed cost (its collectives' latencies are in
    # it); a calibration that measured only the allgather push charges that for both
    separate = bool(params.software) and "allreduce_push" in params.software
    if separate:
        pred.charge("push", "software", params.overhead("allgather_push", len(gathered),
                                                        rows_of(gathered)))
        pred.charge("push", "software", params.overhead("allreduce_push", len(densified)))
    elif replicas:
        pred.charge("push", "software", params.overhead("allgather_push", len(replicas),
                                                        rows_of(gathered)))
    if gathered:
        # a worker's block: its distinct rows (hpcpax), or one row per lookup (TensorFlow)
        blocks = [(r.raw if params.allgather_rows == "raw" else r.unique)[workers]
                  for r in gathered]
        pred.hand_off("push")
        if params.allgather_fused:
            pred.charge_cost("push", coll.allgatherv(worker_nodes, COUNT_BYTES * len(gathered),
                                                     links), covered=True)
            block = sum(rows * (INDEX_BYTES + r.row_bytes) for rows, r in zip(blocks, gathered))
            padded = padded_block_bytes(np.rint(block)) if block.any() else None
            pred.charge_cost("push", coll.allgatherv(
                worker_nodes, block if padded is None else float(padded), links), covered=True)
        else:  # one Allgatherv per tensor: each table's indices, then its values
            for rows, r in zip(blocks, gathered):
                for width in (INDEX_BYTES, r.row_bytes):
                    pred.charge_cost("push", coll.allgatherv(worker_nodes, rows * width, links),
                                     covered=True)
        if params.allgather_staging_Bps:
            # host-staged: each worker copies its block out and every block back in,
            # over its node's shared uplinks to the host
            block = sum(rows * (INDEX_BYTES + r.row_bytes) for rows, r in zip(blocks, gathered))
            staged = np.bincount(worker_nodes, weights=block + block.sum())
            pred.charge("push", "host staging",
                        float(staged.max()) / float(params.allgather_staging_Bps))
        # every worker sums all workers' rows, then updates the union of rows
        pred.charge("push", "client kernels", sum(
            params.kernel("dedup", rows.sum() * r.row_bytes)
            + params.kernel("apply", r.union * r.row_bytes) for rows, r in zip(blocks, gathered)))
    for r in densified:
        table = r.rows * r.row_bytes
        # densify_allreduce: each worker writes its rows into zeroed (untouched) pages,
        # whose faults the fresh-buffer Allreduce class holds; after the Allreduces it
        # scans the rows mask (a byte per row) and reads and applies the union of rows.
        # No kernel touches the whole table.
        pred.charge("push", "client kernels",
                    max(params.kernel("gather", r.unique[w] * r.row_bytes) for w in workers)
                    + params.kernel("gather", float(r.rows))
                    + params.kernel("gather", r.union * r.row_bytes)
                    + params.kernel("apply", r.union * r.row_bytes))
        # densified into a fresh table (and a fresh mask of rows) just before the call
        pred.hand_off("push")
        pred.charge_cost("push", coll.allreduce(worker_nodes, table, links, fresh=True),
                         covered=separate)
        pred.charge_cost("push", coll.allreduce(worker_nodes, r.rows, links, itemsize=1,
                                                fresh=True), covered=separate)
    if on_ps:
        def apply_work(r):
            rows = _received_rows(r)
            # an owner updates the distinct rows among those it received
            distinct = rows * min(1.0, r.union / max(float(rows.sum()), 1.0))
            return (params.kernel("dedup", rows * r.row_bytes)
                    + params.kernel("apply", distinct * r.row_bytes))

        pred.charge("push", "software", params.overhead(_ps_operation(params, "ps_push", on_ps),
                                                        len(on_ps), rows_of(on_ps)))
        _ps_exchange(pred, "push", layout, links, params, on_ps,
                     lambda r: INDEX_BYTES + r.row_bytes, apply_work, share,
                     lambda r, rows: params.kernel("dedup", rows * r.row_bytes))
    # dense: fused allreduce, one bucket after the other
    total = float(sum(dense_bytes))
    # a push delays the workers' next collective (dense, else the step's figures): the
    # servers' work on a PS push runs on their cores after the workers' part returned;
    # a replicated push's wait is measured too (each as such: after_*_push); pushes of
    # several kinds wait for the longest
    waits = [params.overhead("after_allgather_push", len(gathered)),
             params.overhead("after_allreduce_push", len(densified))]
    if on_ps:
        waits.append(params.overhead(_ps_operation(params, "after_ps_push", on_ps),
                                     len(on_ps), rows_of(on_ps)))
    if len(workers) > 1:
        # with the dense allreduce started before the push, the next collective the
        # workers start after it is the step's figures
        pred.charge("dense" if total > 0 and not params.dense_overlaps_push else "control",
                    "scheduling", max(waits))
    links_before = sum(pred.resources.get(k, 0.0) for k in LINK_RESOURCES)
    pred.charge("dense", "software", params.overhead(
        _workers_operation(params, "dense_allreduce", bool(on_ps)), len(dense_bytes)))
    if total > 0 and len(workers) > 1:
        pred.hand_off("dense")
        full, rest = divmod(total, links.bucket_bytes)
        # the measured operation holds one bucket's latency (the last one's)
        if full:
            pred.charge_cost("dense", coll.allreduce(worker_nodes, links.bucket_bytes, links),
                             full - (0 if rest else 1))
            if not rest:
                pred.charge_cost("dense", coll.allreduce(worker_nodes, links.bucket_bytes, links),
                                 covered=True)
        if rest:
            pred.charge_cost("dense", coll.allreduce(worker_nodes, rest, links), covered=True)
    # a framework that overlaps hides the allreduce behind the backward pass
    hidden = min(max(params.overlap_dense, 0.0) * params.backward_fraction * compute_s,
                 pred.phases["dense"])
    if hidden > 0:
        pred.phases["dense"] -= hidden
        pred.resources["overlapped with backward"] = -hidden
    # started before the push: all but its link seconds hides behind the push
    if params.dense_overlaps_push and pred.phases["dense"] > 0:
        link_s = sum(pred.resources.get(k, 0.0) for k in LINK_RESOURCES) - links_before
        hidden = min(max(pred.phases["dense"] - link_s, 0.0), pred.phases["push"])
        if hidden > 0:
            pred.phases["dense"] -= hidden
            pred.resources["overlapped with push"] = -hidden
    if optimizer_s is not None:
        pred.charge("optimizer", "client kernels", optimizer_s)
    else:
        pred.charge("optimizer", "client kernels",
                    sum(params.kernel("dense_optimizer", b, own_call=True) for b in dense_bytes))
    if include_control and len(workers) > 1:
        pred.hand_off("control")
        pred.charge("control", "software", params.overhead(
            _workers_operation(params, "control", bool(on_ps)), 1))
        pred.charge_cost("control", coll.allreduce(worker_nodes, REDUCE_STEP_BYTES, links,
                                                    itemsize=8), covered=True)
    return pred


def ceil_log2(n: int) -> int:
    """``ceil(log2(n))``, 0 for n <= 1."""
    return int(math.ceil(math.log2(n))) if n > 1 else 0
