import pytest

from hpcpax.comm.fabric import Fabric, LinkModel
from hpcpax.plan.cost_model import (CostParams, VarSpec, choose, default_alpha_node, predict,
                                    predict_all)

#: Kernel rates of a quiet 2-core test machine (measured once with
#: hpcpax.plan.kernel_rates), fixed so that these tests do not depend on the load.
QUIET = CostParams(kernels={
    "unique": {"call_s": 2e-6, "unit_s": 1.0e-7}, "dedup": {"call_s": 6e-5, "unit_s": 1.7e-10},
    "gather": {"call_s": 1.4e-5, "unit_s": 1.5e-10}, "apply": {"call_s": 2e-5, "unit_s": 2.2e-10},
    "dense_optimizer": {"call_s": 0.0, "unit_s": 1.4e-9}})

FABRIC = Fabric(intra=LinkModel(1e-6, 10e9), inter=LinkModel(2e-6, 12.5e9), allreduce_bucket_bytes=64 << 20)
DENSE = VarSpec("w", "dense", (4096, 1024))
SPARSE = VarSpec("emb", "sparse", (100_000, 128), alpha=0.01)
NEARLY_DENSE = VarSpec("emb", "sparse", (100_000, 128), alpha=0.99)


def topo(nodes, per_node=6, servers=1):
    return {"num_nodes": nodes, "workers_per_node": per_node, "servers_per_node": servers}


@pytest.mark.parametrize("nodes", [1, 2, 8])
def test_dense_variable_goes_to_allreduce(nodes):
    method, times, _ = choose(DENSE, topo(nodes), FABRIC, params=QUIET)
    assert method == "allreduce"
    assert "allgather" not in times


@pytest.mark.parametrize("nodes", [8, 16, 32])
def test_sparse_small_alpha_goes_to_ps(nodes):
    method, times, reason = choose(SPARSE, topo(nodes), FABRIC, params=QUIET)
    assert method == "ps"
    assert times["ps"] < times["allgather"] < times["allreduce"]
    assert "alpha=0.01" in reason


def test_ps_advantage_over_allgather_grows_with_nodes():
    ratios = []
    for nodes in (2, 4, 8, 16, 32):
        times = predict_all(SPARSE, topo(nodes), FABRIC, params=QUIET)
        ratios.append(times["allgather"] / times["ps"])
    assert all(b > a for a, b in zip(ratios, ratios[1:])), ratios
    assert ratios[-1] > 3


@pytest.mark.parametrize("nodes", [1, 4, 8])
def test_nearly_dense_sparse_variable_goes_to_allreduce(nodes):
    method, _, _ = choose(NEARLY_DENSE, topo(nodes), FABRIC, params=QUIET)
    assert method == "allreduce"


def test_allreduce_formula_single_node():
    # MPICH's reduce-scatter + allgather (Rabenseifner): 2 (n-1)/n bytes at the
    # link plus 2 log2(n) latencies (the old model's ring had 2 (n-1))
    from hpcpax.plan.cost_model import CostParams

    n, nbytes = 4, DENSE.nbytes
    expected = 2 * (n - 1) / n * nbytes / 10e9 + 2 * 2 * 1e-6
    assert predict(DENSE, "allreduce", topo(1, n), FABRIC, params=CostParams()) == pytest.approx(expected)
    assert predict(DENSE, "allreduce", topo(1, 1), FABRIC, params=CostParams()) == 0.0


def test_allgather_grows_with_workers_and_ps_with_local_aggregation_is_cheaper_off_node():
    from hpcpax.plan.cost_model import CostParams

    # links only: 47 / 11 times the bytes per worker from 12 to 48 workers
    small = predict(SPARSE, "allgather", topo(2), FABRIC, params=CostParams())
    large = predict(SPARSE, "allgather", topo(8), FABRIC, params=CostParams())
    assert large > 3.5 * small
    with_agg = predict(SPARSE, "ps", topo(8), FABRIC, params=CostParams())
    without = predict(SPARSE, "ps_no_local_aggregation", topo(8), FABRIC, params=CostParams())
    assert with_agg < without


def test_fabric_dict_and_object_agree():
    assert predict(SPARSE, "ps", topo(4), FABRIC.to_dict()) == predict(SPARSE, "ps", topo(4), FABRIC)


def test_default_alpha_node_and_measured_override():
    assert default_alpha_node(0.5, 2) == pytest.approx(0.75)
    shared = VarSpec("emb", "sparse", (100_000, 128), alpha=0.01, alpha_node=0.012)
    assert predict(shared, "ps", topo(8), FABRIC) < predict(SPARSE, "ps", topo(8), FABRIC)


def test_more_partitions_than_servers_cost_overhead():
    # a framework paying a fixed cost per partition (Parallax on TensorFlow)
    from hpcpax.plan.cost_model import CostParams

    params = CostParams(partition_overhead_s=20e-6)
    few = predict(SPARSE, "ps", topo(8), FABRIC, partitions=8, params=params)
    many = predict(SPARSE, "ps", topo(8), FABRIC, partitions=512, params=params)
    assert many > few


def test_bad_method_and_dense_allgather():
    with pytest.raises(ValueError, match="method"):
        predict(SPARSE, "broadcast", topo(2), FABRIC)
    with pytest.raises(ValueError, match="sparse"):
        predict(DENSE, "allgather", topo(2), FABRIC)


def test_batched_ps_tables_share_the_message_latencies():
    """t(batch) = bandwidth part + latency part / batch: check that exact shape."""
    from hpcpax.plan.cost_model import CostParams

    small = VarSpec("field", "sparse", (10_000, 16), alpha=0.01)
    t1, t2, t4 = (predict(small, "ps", topo(8), FABRIC, params=CostParams(ps_batch=k))
                  for k in (1, 2, 4))
    assert t4 < t2 < t1
    assert t1 - t4 == pytest.approx(1.5 * (t1 - t2), rel=1e-9)
    assert predict(small, "ps", topo(8), FABRIC, params=CostParams()) == t1  # default: alone
    # allreduce and allgather do not batch
    for method in ("allreduce", "allgather"):
        assert (predict(small, method, topo(8), FABRIC, params=CostParams(ps_batch=4))
                == predict(small, method, topo(8), FABRIC, params=CostParams()))
