"""``--plan auto`` over the whole step (:mod:`hpcpax.plan.joint_choice`), pure."""

import itertools

import pytest

from hpcpax.plan import make_plan
from hpcpax.plan.cost_model import CostParams, choose
from hpcpax.plan.joint_choice import METHODS, choose_jointly, step_seconds

SHAPE = {"num_nodes": 2, "workers_per_node": 2, "servers_per_node": 1}
# links of a 100 Gb/s-class fabric: the bytes of small tables cost little
FABRIC = {"intra": {"latency_s": 1e-6, "bandwidth_Bps": 5e9},
          "inter": {"latency_s": 2e-6, "bandwidth_Bps": 12.5e9},
          "allreduce_bucket_bytes": 64 << 20}
# each operation's fixed cost per step dominates, as calibrated on a busy host
# (hpcpax.tune.calibrate); one more table in an operation costs little
SOFTWARE = {op: {"call_s": call, "per_variable_s": 2e-5}
            for op, call in (("ps_pull", 9e-4), ("ps_push", 9e-4),
                             ("ps_pull_no_aggregation", 9e-4), ("ps_push_no_aggregation", 9e-4),
                             ("allgather_push", 8e-4), ("allreduce_push", 3e-4),
                             ("replica_pull", 5e-5), ("dense_allreduce", 2e-4),
                             ("control", 1e-4))}
PARAMS = CostParams(software=SOFTWARE, software_scope="job", source="test")


def tables():
    """Two embedding tables and a small bias table, plus one dense tensor."""
    return [{"name": "emb", "kind": "sparse", "shape": [200_000, 32], "alpha": 0.002},
            {"name": "out", "kind": "sparse", "shape": [200_000, 32], "alpha": 0.002},
            {"name": "bias", "kind": "sparse", "shape": [2_000, 1], "alpha": 0.2},
            {"name": "w", "kind": "dense", "shape": [64, 64]}]


def brute_force(specs, allowed=None):
    names = [s["name"] for s in specs if s["kind"] == "sparse"]
    options = [(allowed or {}).get(n, METHODS) for n in names]
    return min((step_seconds(specs, dict(zip(names, combo)), SHAPE, FABRIC, PARAMS), combo)
               for combo in itertools.product(*options))


def test_whole_step_choice_is_the_best_assignment_and_beats_choosing_alone():
    specs = tables()
    alone = {s["name"]: choose(s, SHAPE, FABRIC, params=PARAMS)[0]
             for s in specs if s["kind"] == "sparse"}
    # alone, the bias table avoids the allgather push's fixed cost by opening an
    # allreduce of its own: the step then pays two operations' fixed costs
    assert alone["bias"] != alone["emb"]
    joint = choose_jointly(specs, alone, SHAPE, FABRIC, PARAMS)
    best_s, best = brute_force(specs)
    assert joint["step_s"] == pytest.approx(best_s, rel=1e-12)
    assert tuple(joint["methods"][n] for n in ("emb", "out", "bias")) == best
    assert joint["start_s"] == pytest.approx(step_seconds(specs, alone, SHAPE, FABRIC, PARAMS))
    assert joint["step_s"] < joint["start_s"]
    assert len(set(joint["methods"].values())) == 1  # one operation's fixed cost
    # every single move from the result is slower or equal (what each line reports)
    for name, times in joint["alternatives"].items():
        for method, seconds in times.items():
            moved = step_seconds(specs, {**joint["methods"], name: method}, SHAPE, FABRIC, PARAMS)
            assert seconds == pytest.approx(moved, rel=1e-12)
            assert seconds >= joint["step_s"] * (1 - 1e-12)


def test_tables_held_to_ps_stay_there():
    specs = tables()
    allowed = {"emb": ("ps",)}
    joint = choose_jointly(specs, {"emb": "allgather", "out": "allgather", "bias": "allgather"},
                           SHAPE, FABRIC, PARAMS, allowed=allowed)
    assert joint["methods"]["emb"] == "ps"
    best_s, best = brute_force(specs, allowed)
    assert joint["step_s"] == pytest.approx(best_s, rel=1e-12)
    with pytest.raises(ValueError, match="no method allowed"):
        choose_jointly(specs, {"emb": "ps", "out": "ps", "bias": "ps"}, SHAPE, FABRIC, PARAMS,
                       allowed={"emb": ("pull",)})


def test_make_plan_chooses_the_whole_step_with_per_operation_costs_only():
    specs = tables()
    plan = make_plan(specs, "auto", SHAPE, FABRIC, params=PARAMS)
    whole = plan.search["cost_model"]["whole_step"]
    joint = choose_jointly(specs, {n: choose(s, SHAPE, FABRIC, params=PARAMS)[0] for n, s in
                                   ((s["name"], s) for s in specs) if s["kind"] == "sparse"},
                           SHAPE, FABRIC, PARAMS)
    assert {n: plan.variables[n].method for n in ("emb", "out", "bias")} == joint["methods"]
    assert whole["step_s"] == pytest.approx(joint["step_s"])
    assert "whole step" in plan.variables["bias"].reason
    for name in ("emb", "out", "bias"):
        entry = plan.variables[name]
        assert entry.local_aggregation == (entry.method == "ps")  # 2 workers per node
    # kernel rates only (no per-operation costs): each table priced alone, as before
    rates = CostParams(source="rates")
    plain = make_plan(specs, "auto", SHAPE, FABRIC, params=rates)
    assert "whole_step" not in plain.search["cost_model"]
    assert {n: plain.variables[n].method for n in ("emb", "out", "bias")} == {
        s["name"]: choose(s, SHAPE, FABRIC, params=rates)[0] for s in specs
        if s["kind"] == "sparse"}


def test_replanning_switches_only_for_a_gain_above_the_threshold():
    from hpcpax.plan.joint_choice import worth_switching

    specs = tables()
    current = {"emb": "ps", "out": "ps", "bias": "allreduce"}
    parts = {"emb": 2, "out": 2, "bias": 1}
    now_s = step_seconds(specs, current, SHAPE, FABRIC, PARAMS, partitions=parts)
    assert worth_switching(specs, current, parts, 0.5 * now_s, SHAPE, FABRIC, PARAMS, 0.4)
    assert not worth_switching(specs, current, parts, 0.7 * now_s, SHAPE, FABRIC, PARAMS, 0.4)
    assert not worth_switching(specs, current, parts, now_s, SHAPE, FABRIC, PARAMS, 0.0)
    # a correction given as load_correction's (correction, why) pair is unwrapped
    assert worth_switching(specs, current, parts, 0.5 * now_s, SHAPE, FABRIC, PARAMS, 0.4,
                           correction=(None, "not used"))
