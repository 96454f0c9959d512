import pytest

from hpcpax.errors import ConfigError
from hpcpax.comm.fabric import Fabric, LinkModel
from hpcpax.plan.auto import make_plan, should_switch
from hpcpax.plan.cost_model import CostParams
from hpcpax.plan.plan import Plan

#: Kernel rates of a quiet 2-core test machine (measured once with
#: hpcpax.plan.kernel_rates), fixed so that these tests do not depend on the load.
QUIET = CostParams(kernels={
    "unique": {"call_s": 2e-6, "unit_s": 1.0e-7}, "dedup": {"call_s": 6e-5, "unit_s": 1.7e-10},
    "gather": {"call_s": 1.4e-5, "unit_s": 1.5e-10}, "apply": {"call_s": 2e-5, "unit_s": 2.2e-10},
    "dense_optimizer": {"call_s": 0.0, "unit_s": 1.4e-9}})

FABRIC = Fabric(intra=LinkModel(1e-6, 10e9), inter=LinkModel(2e-6, 12.5e9), allreduce_bucket_bytes=64 << 20)
TOPO = {"num_nodes": 8, "workers_per_node": 6, "servers_per_node": 1}
VARIABLES = [
    {"name": "emb", "kind": "sparse", "shape": (100_000, 128), "dtype": "float32", "alpha": 0.01},
    {"name": "softmax", "kind": "sparse", "shape": (50_000, 64), "dtype": "float32", "alpha": 0.02,
     "alpha_node": 0.05, "note": "extra keys are ignored"},
    {"name": "near_dense", "kind": "sparse", "shape": (1000, 64), "dtype": "float32", "alpha": 0.99},
    {"name": "w", "kind": "dense", "shape": (512, 512), "dtype": "float32"},
]


def _methods(plan):
    return {n: (v.method, v.local_aggregation) for n, v in plan.variables.items()}


def test_hybrid_is_parallax_rule():
    plan = make_plan(VARIABLES, "hybrid", TOPO, FABRIC)
    assert _methods(plan) == {"emb": ("ps", True), "softmax": ("ps", True), "near_dense": ("ps", True),
                              "w": ("allreduce", False)}
    assert plan.variables["emb"].partitions == 8
    assert plan.search["mode"] == "hybrid"
    assert plan.fabric == FABRIC.to_dict()


def test_hybrid_single_worker_per_node_has_no_local_aggregation():
    plan = make_plan(VARIABLES, "hybrid", dict(TOPO, workers_per_node=1), FABRIC)
    assert plan.variables["emb"].local_aggregation is False


def test_ps_and_allreduce_modes():
    plan = make_plan(VARIABLES, "ps", TOPO, FABRIC)
    assert _methods(plan)["emb"] == ("ps", False) and _methods(plan)["w"] == ("allreduce", False)
    plan = make_plan(VARIABLES, "allreduce", TOPO, FABRIC)
    assert {v.method for v in plan.variables.values()} == {"allreduce"}
    assert all(v.partitions == 1 and v.owners == [] for v in plan.variables.values())


def test_auto_uses_cost_model():
    plan = make_plan(VARIABLES, "auto", TOPO, FABRIC, params=QUIET)
    methods = _methods(plan)
    assert methods["emb"] == ("ps", True)
    assert methods["near_dense"][0] == "allreduce"
    assert methods["w"][0] == "allreduce"
    assert all(v.predicted_s is not None and v.reason for v in plan.variables.values())
    assert Plan.from_json(plan.to_json()) == plan


def test_owners_balance_across_all_ps_partitions():
    plan = make_plan(VARIABLES, "hybrid", TOPO, FABRIC, partitions={"emb": 12, "softmax": 4, "near_dense": 2})
    load = [0] * 8
    for v in plan.variables.values():
        if v.method == "ps":
            rows, dim = v.shape[0], v.shape[1]
            for p, owner in enumerate(v.owners):
                base, extra = divmod(rows, v.partitions)
                load[owner] += (base + (p < extra)) * dim * 4
            assert len(v.owners) == v.partitions
    assert max(load) - min(load) <= max(load) * 0.5
    assert plan.variables["emb"].partitions == 12


def test_bad_mode_and_partitions():
    with pytest.raises(ConfigError, match="mode"):
        make_plan(VARIABLES, "magic", TOPO, FABRIC)
    with pytest.raises(ConfigError, match="partitions"):
        make_plan(VARIABLES, "hybrid", TOPO, FABRIC, partitions=0)
    with pytest.raises(ConfigError, match="unique"):
        make_plan(VARIABLES + VARIABLES[:1], "hybrid", TOPO, FABRIC)


def test_should_switch_needs_a_margin():
    times = {"allreduce": 1.0, "allgather": 0.95, "ps": 0.5}
    assert should_switch("allreduce", times, threshold=0.1)
    assert not should_switch("ps", times, threshold=0.1)
    assert not should_switch("allreduce", {"allreduce": 1.0, "ps": 0.95}, threshold=0.1)
    with pytest.raises(ValueError):
        should_switch("allgather", {"ps": 1.0})


def test_auto_charges_ps_tables_their_share_of_a_batched_exchange():
    from hpcpax.plan.cost_model import CostParams, predict

    fields = [{"name": f"f{k}", "kind": "sparse", "shape": (10_000, 16), "dtype": "float32",
               "alpha": 0.01} for k in range(26)]
    plan = make_plan(fields, "hybrid", TOPO, FABRIC, params=CostParams())
    batched = predict(fields[0] | {"shape": (10_000, 16)}, "ps", TOPO, FABRIC, partitions=8,
                      params=CostParams(ps_batch=26))
    alone = make_plan(fields[:1], "hybrid", TOPO, FABRIC,
                      params=CostParams()).variables["f0"].predicted_s
    assert plan.variables["f0"].predicted_s == pytest.approx(batched, rel=1e-12)
    assert plan.variables["f0"].predicted_s < alone
