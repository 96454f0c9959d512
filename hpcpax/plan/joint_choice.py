"""``--plan auto`` over the whole step: each sparse table's method chosen with the
others in place (pure, no MPI).

:func:`~hpcpax.plan.cost_model.choose` prices one table alone. That misses
how the trainer batches: all tables of one method share one operation per
step (one PS exchange for the ``ps`` tables, one allgather push for the
gathered ones, one allreduce for the densified ones), so an operation's
fixed cost is paid once per step, by whichever tables use it. A table that
joins an operation already in the step costs its marginal time; one that
opens an operation pays the whole fixed cost. With the constants calibrated
on the job (:func:`~hpcpax.tune.calibrate.calibrate`: each operation's fixed
cost, which on small tables is most of the time) choosing per table put a
40 KB table alone on ``allreduce`` next to two gathered ones, and the
trainer's default job ran 1.4-1.7x slower steps than with all three gathered.

:func:`choose_jointly` prices whole steps with
:func:`~hpcpax.plan.step_model.predict_step`: it starts from the best of
the per-table choices and every all-one-method assignment, then moves one
table at a time to the method that makes the predicted step fastest with
the others in place, until no move gains (coordinate descent; a few
sweeps). Dense tensors stay on ``allreduce``; a table whose replicas would
not fit is offered ``ps`` only.
"""

from __future__ import annotations

from ..sync.methods import method_of, names
from .cost_model import ClusterShape, CostParams, VarSpec, _routing

__all__ = ["choose_jointly", "step_seconds", "worth_switching", "SWEEPS"]

#: Most passes over the tables (each pass moves every table to its best method).
SWEEPS = 4
#: Candidate methods of a sparse table, in tie-breaking order.
METHODS = names()


def step_seconds(specs, methods, shape, fabric, params: CostParams, partitions=None,
                 correction=None) -> float:
    """Predicted seconds of the step's synchronization with ``methods`` (``{name:
    method}`` for the sparse tables of ``specs``; dense ones are allreduced), each
    ``ps`` table with ``partitions[name]`` partitions (default: the servers) and local
    aggregation where a node has several workers; ``correction`` applied if given."""
    from .collectives import Links
    from .step_model import predict_step
    from .traffic import Layout

    shape = ClusterShape.from_any(shape)
    layout = Layout.from_shape(shape.num_nodes, shape.workers_per_node, shape.servers_per_node)
    routings, dense = {}, []
    for spec in specs:
        spec = VarSpec.from_any(spec)
        if spec.kind == "dense":
            dense.append(spec.nbytes)
            continue
        method = methods[spec.name]
        parts = (partitions or {}).get(spec.name) or max(1, shape.servers)
        routings[spec.name] = _routing(spec, method, layout,
                                       parts if method_of(method).on_servers else 1,
                                       local_aggregation=shape.workers_per_node > 1)
    prediction = predict_step(layout, Links.from_fabric(fabric), params, routings,
                              dense_bytes=dense, include_control=False)
    return correction.apply(prediction) if correction is not None else prediction.seconds


def choose_jointly(specs, start, shape, fabric, params: CostParams, partitions=None,
                   correction=None, allowed=None) -> dict:
    """Methods for the sparse tables that make the predicted step fastest together.

    Args:
        specs: every variable (:class:`~hpcpax.plan.cost_model.VarSpec` or dicts).
        start: ``{name: method}`` of the sparse tables (e.g. the per-table choices).
        shape, fabric, params, partitions, correction: as :func:`step_seconds`.
        allowed: ``{name: methods}`` a table may take (default: :data:`METHODS`).

    Returns:
        ``{"methods": {name: method}, "step_s": predicted seconds, "start_s": those of
        ``start``, "alternatives": {name: {method: step seconds with only that table
        moved}}}``: deterministic (ties keep the current method, then the earlier
        one in :data:`METHODS`).
    """
    specs = [VarSpec.from_any(s) for s in specs]
    sparse = [s.name for s in specs if s.kind == "sparse"]
    options = {n: [m for m in METHODS if m in (allowed or {}).get(n, METHODS)] for n in sparse}
    for name in sparse:
        if not options[name]:
            raise ValueError(f"no method allowed for {name!r}")

    def price(methods):
        return step_seconds(specs, methods, shape, fabric, params, partitions, correction)

    start = {n: start[n] if start[n] in options[n] else options[n][-1] for n in sparse}
    candidates = [start] + [{n: m if m in options[n] else start[n] for n in sparse}
                            for m in METHODS]
    priced = [(price(c), i, c) for i, c in enumerate(candidates)]
    best_s, _, methods = min(priced, key=lambda item: item[:2])
    methods = dict(methods)
    alternatives = {}
    for _ in range(SWEEPS):
        moved = False
        for name in sparse:
            times = {m: (best_s if m == methods[name] else price({**methods, name: m}))
                     for m in options[name]}
            alternatives[name] = times
            pick = min(options[name], key=lambda m: (times[m], m != methods[name],
                                                     METHODS.index(m)))
            if pick != methods[name]:
                methods[name], best_s, moved = pick, times[pick], True
        if not moved:
            break
    return {"methods": methods, "step_s": best_s, "start_s": priced[0][0],
            "alternatives": alternatives}


def worth_switching(specs, methods, partitions, new_s, shape, fabric, params: CostParams,
                    threshold: float, correction=None) -> bool:
    """Re-planning: whether the new methods' predicted step ``new_s`` beats the current
    ``methods`` (with their ``partitions``) by more than ``threshold`` (a fraction);
    ``correction`` may be :func:`~hpcpax.runlog.learned.load_correction`'s pair."""
    if isinstance(correction, tuple):
        correction = correction[0]
    now_s = step_seconds(specs, methods, shape, fabric, params, partitions=partitions,
                         correction=correction)
    return new_s < now_s * (1.0 - float(threshold))
