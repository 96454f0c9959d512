"""The cost model's mechanisms against hand-computed cases."""

import numpy as np
import pytest

from hpcpax.plan import collectives as coll
from hpcpax.plan.cost_model import CostParams, VarSpec, predict, predict_detail
from hpcpax.plan.step_model import predict_step
from hpcpax.plan.traffic import (Layout, expected_routing, routing_from_ids, step_bytes)

A, B = 2e-6, 1e9  # latency 2 us, 1 GB/s, same inside and between nodes
LINKS = coll.Links(A, B, A, B)
LINKS_2 = coll.Links(1e-6, 4e9, 5e-6, 1e9)  # fast inside a node, slow between


def test_mpich_allgather_choice():
    assert coll.allgatherv_algorithm(4, 1000) == "recursive_doubling"
    assert coll.allgatherv_algorithm(4, 600_000) == "ring"
    assert coll.allgatherv_algorithm(3, 1000) == "bruck"
    assert coll.allgatherv_algorithm(3, 90_000) == "ring"


def test_ring_allgather_is_p_minus_1_rounds_of_one_block():
    b = 100_000.0
    cost = coll.allgatherv([0, 0, 0], b, LINKS)  # total 300 kB, 3 ranks: ring
    assert cost.algorithm == "ring" and cost.rounds == 2
    assert cost.seconds == pytest.approx(2 * (A + b / B))


def test_recursive_doubling_doubles_the_block_each_round():
    b = 1000.0
    cost = coll.allgatherv([0, 0, 0, 0], b, LINKS)
    assert cost.algorithm == "recursive_doubling" and cost.rounds == 2
    assert cost.seconds == pytest.approx(2 * A + (b + 2 * b) / B)


def test_bruck_on_three_ranks():
    b = 1000.0
    cost = coll.allgatherv([0, 0, 0], b, LINKS)
    assert cost.algorithm == "bruck" and cost.rounds == 2
    assert cost.seconds == pytest.approx(2 * A + 2 * b / B)


def test_allgather_time_per_worker_grows_with_workers():
    """Every worker receives (n-1) blocks: 5/2 the time from 3 to 6 ranks (ring)."""
    b = 1e6
    three = coll.allgatherv([0] * 3, b, coll.Links(0.0, B, 0.0, B))
    six = coll.allgatherv([0] * 6, b, coll.Links(0.0, B, 0.0, B))
    assert six.seconds / three.seconds == pytest.approx(5 / 2)


def test_recursive_doubling_across_nodes_loads_the_shared_nic():
    """2 nodes x 2 ranks: round 1 stays inside the node (b), round 2 sends 2b from
    both ranks of a node through its one NIC (4b at 1 GB/s)."""
    b = 1000.0
    cost = coll.allgatherv([0, 0, 1, 1], b, LINKS_2)
    expected = (1e-6 + b / 4e9) + (5e-6 + 4 * b / 1e9)
    assert cost.seconds == pytest.approx(expected)
    assert cost.bottleneck == "node NIC"
    separate = coll.allgatherv([0, 0, 1, 1], b, coll.Links(1e-6, 4e9, 5e-6, 1e9,
                                                           shared_nic=False))
    assert separate.seconds == pytest.approx((1e-6 + b / 4e9) + (5e-6 + 2 * b / 1e9))


def test_scattered_alltoallv_one_latency_per_nonempty_peer():
    m = np.array([[0, 10, 0], [0, 0, 0], [30, 0, 0]], float)
    cost = coll.alltoallv([0, 0, 0], m, LINKS)
    # rank 0 sends to 1 and receives from 2: 1 message each way, 30 bytes in
    assert cost.seconds == pytest.approx(A + 30 / B)
    copies = coll.alltoallv([0, 0, 0], m, coll.Links(A, B, A, B, duplex=False))
    assert copies.seconds == pytest.approx(A + 40 / B)  # one core copies both ways


def test_incast_at_a_server_nic():
    """4 workers on 4 nodes push 1 MB each to one server on node 0: its NIC takes 3 MB."""
    size = 5
    node_of = [0, 0, 1, 2, 3]  # rank 0 is the server
    m = np.zeros((size, size))
    m[1:, 0] = 1e6
    cost = coll.alltoallv(node_of, m, coll.Links(0.0, 1e12, 0.0, 1e9))
    assert cost.seconds == pytest.approx(3e6 / 1e9)
    assert cost.bottleneck in ("node NIC", "inter link")


def test_partition_parallelism_and_per_partition_cost():
    """One server, a table pushed whole: server seconds = work / min(P, lanes) + P/lanes x c."""
    var = VarSpec("t", "sparse", (4096, 16), alpha=1.0)
    per_byte, overhead = 1e-9, 5e-5
    work = 2 * 4096 * 64 * per_byte  # 2 workers' rows (alpha 1) applied at the server
    for lanes in (1, 4):
        params = CostParams(kernels={"apply": {"call_s": 0.0, "unit_s": per_byte}},
                            server_lanes=lanes, partition_overhead_s=overhead)
        seconds = {}
        for p in (1, 2, 4, 8):
            detail = predict_detail(var, "ps_no_local_aggregation", {"num_nodes": 1,
                                    "workers_per_node": 2, "servers_per_node": 1}, LINKS,
                                    partitions=p, params=params)
            seconds[p] = detail.resources["server CPU"]
        for p, value in seconds.items():
            active = min(p, lanes)
            # the server updates the distinct rows it received (4096 of 8192);
            # the per-partition cost is paid in the pull and in the push
            expected = work / 2 / active + 2 * overhead * np.ceil(p / active)
            assert value == pytest.approx(expected), (lanes, p)
    # hpcpax (one lane, no per-partition cost): partitions change nothing on the server
    params = CostParams(kernels={"apply": {"call_s": 0.0, "unit_s": per_byte}})
    one, many = (predict(var, "ps_no_local_aggregation", {"num_nodes": 1, "workers_per_node": 2,
                                                          "servers_per_node": 1},
                         LINKS, partitions=p, params=params) for p in (1, 16))
    assert one == pytest.approx(many)


def test_per_partition_cost_per_variable_or_per_exchange():
    """Eight tables of 16 partitions on one server: TensorFlow-style, each table's
    partitions pay; hpcpax's batched exchange pays once for its widest table."""
    layout = Layout.from_shape(1, 2, 1)
    overhead = 1e-5

    def server_cpu(partitions, per, ps_batch=None, tables=8):
        routings = {f"t{i}": expected_routing(layout, "ps", 1000, 64, 0.1,
                                              partitions=partitions) for i in range(tables)}
        params = CostParams(partition_overhead_s=overhead, partition_overhead_per=per)
        return predict_step(layout, LINKS, params, routings, ps_batch=ps_batch,
                            include_control=False).resources.get("server CPU", 0.0)

    # no kernel rates: the server's seconds are the per-partition cost alone, pull + push
    assert server_cpu(16, "variable") == pytest.approx(2 * 8 * 16 * overhead)
    assert server_cpu(16, "exchange") == pytest.approx(2 * 16 * overhead)
    assert server_cpu(16, "exchange") - server_cpu(1, "exchange") == pytest.approx(
        2 * 15 * overhead)
    # one variable priced alone among eight: an eighth of its exchange's cost
    assert server_cpu(16, "exchange", ps_batch=8, tables=1) == pytest.approx(2 * 2 * overhead)
    assert server_cpu(16, "variable", ps_batch=8, tables=1) == pytest.approx(2 * 16 * overhead)
    with pytest.raises(ValueError, match="partition_overhead_per"):
        CostParams(partition_overhead_per="table")


def test_local_aggregation_fan_in_lands_on_few_delegates():
    """With one partition, one delegate per node receives all its node's rows."""
    layout = Layout.from_shape(1, 4, 1)
    r = expected_routing(layout, "ps", 1000, 64, 0.1, partitions=1, local_aggregation=True)
    received = r.to_delegate.sum(axis=0)
    assert received[1] == pytest.approx(4 * 100) and received[2:].sum() == 0
    r8 = expected_routing(layout, "ps", 1000, 64, 0.1, partitions=8, local_aggregation=True)
    assert r8.to_delegate.sum(axis=0)[1:].max() == pytest.approx(4 * 100 * 2 / 8)


def test_exact_bytes_of_a_tiny_ps_step():
    """2 nodes x (1 server + 2 workers), 2 partitions (one per server), local aggregation."""
    layout = Layout.from_shape(2, 2, 1)  # ranks: S W W | S W W
    ids = [np.array([0, 1, 1]), np.array([1, 2]), np.array([3]), np.array([0, 3, 5])]
    r = routing_from_ids(layout, "ps", 8, 16, ids, partitions=2, local_aggregation=True)
    # node 0 workers 1, 2: delegate of partition p is worker (p % 2) -> ranks 1, 2
    # worker 1: {0, 1} -> 0 to rank 1 (itself), 1 to rank 2; worker 2: {1, 2}: 1 -> 2, 2 -> 1
    assert r.to_delegate[1, 2] == 1 and r.to_delegate[2, 1] == 1
    # delegate 1 holds {0, 2} (partition 0, owner: server rank 0); delegate 2 holds {1}
    owners = np.flatnonzero(r.parts_of_owner)
    assert list(owners) == [0, 3]
    assert r.to_owner[1].sum() == 2 and r.to_owner[2].sum() == 1
    phases = step_bytes(layout, {"t": r})
    # control: two headers, every rank sends 32 bytes to 5 peers each
    assert phases["control"][0].tolist() == [320.0] * 6
    # push, worker rank 2: counts to 5 peers + its delegated ids (1 row) to owner 3
    sent_push = 5 * 8 + r.to_owner[2, 3] * (8 + 16) + r.to_owner[2, 0] * (8 + 16)
    assert phases["push"][0][2] == sent_push


def test_step_model_sums_phases_without_overlap():
    layout = Layout.from_shape(1, 2, 0)
    params = CostParams(kernels={"dense_optimizer": {"call_s": 0.0, "unit_s": 1e-9}})
    pred = predict_step(layout, LINKS, params, {}, dense_bytes=[4000], compute_s=0.01,
                        data_s=0.002, include_control=False)
    dense = coll.allreduce([0, 0], 4000, LINKS).seconds
    assert pred.seconds == pytest.approx(0.012 + dense + 4000e-9)
    assert pred.bottleneck == "compute"


def test_dense_allreduce_hides_behind_the_push_but_its_bytes_do_not():
    """The BSP step starts the dense allreduce before the sparse push and waits after
    it: its latencies and fixed costs hide behind the push, up to the push's length;
    its link seconds stay."""
    layout = Layout.from_shape(1, 2, 0)
    links = coll.Links(1e-3, 1e9, 1e-3, 1e9)  # 1 ms a message: latencies dominate
    ids = [np.array([0, 5]), np.array([1, 6])]
    routing = {"t": routing_from_ids(layout, "ps", 8, 16, ids, partitions=2)}
    dense = coll.allreduce([0, 0], 400_000, links)
    link_s = dense.bandwidth_s + dense.nic_s

    def step(**params):
        return predict_step(layout, links, CostParams(**params), routing,
                            dense_bytes=[400_000], include_control=False)

    alone, over = step(dense_overlaps_push=False), step()
    assert alone.phases["dense"] == pytest.approx(dense.seconds)
    assert alone.phases["push"] > alone.phases["dense"] - link_s > 0
    assert over.phases["dense"] == pytest.approx(link_s)
    assert over.phases["push"] == pytest.approx(alone.phases["push"])
    assert over.resources["overlapped with push"] == pytest.approx(link_s - dense.seconds)
    assert over.seconds == pytest.approx(alone.seconds - (dense.seconds - link_s))
    # a fixed cost longer than the push: only the push's length hides
    slow = {"dense_allreduce": {"call_s": 1.0, "per_variable_s": 0.0}}
    alone, over = step(software=slow, dense_overlaps_push=False), step(software=slow)
    assert alone.phases["dense"] - alone.phases["push"] > link_s
    assert over.phases["dense"] == pytest.approx(alone.phases["dense"] - alone.phases["push"])
    assert over.seconds == pytest.approx(alone.seconds - alone.phases["push"])


def test_dense_optimizer_pays_its_call_per_tensor_or_the_measured_seconds():
    """The optimizer runs once per dense tensor outside any measured operation: its
    fixed cost per call counts even when ``software`` (which holds the other kernels'
    calls) is measured; a measured ``optimizer_s`` replaces the kernel estimate."""
    layout = Layout.from_shape(1, 1, 0)
    kernels = {"dense_optimizer": {"call_s": 1e-5, "unit_s": 1e-9}}
    software = {"dense_allreduce": {"call_s": 0.0, "per_variable_s": 0.0}}
    tensors = [4000, 400, 40]
    for params in (CostParams(kernels=kernels),
                   CostParams(kernels=kernels, software=software, software_scope="job")):
        pred = predict_step(layout, LINKS, params, {}, dense_bytes=tensors,
                            include_control=False)
        assert pred.phases["optimizer"] == pytest.approx(3 * 1e-5 + 4440e-9)
    # inside a measured operation a kernel's call is not charged again
    assert CostParams(kernels=kernels, software=software).kernel("dense_optimizer", 100) \
        == pytest.approx(100e-9)
    pred = predict_step(layout, LINKS, CostParams(kernels=kernels), {}, dense_bytes=tensors,
                        include_control=False, optimizer_s=2e-4)
    assert pred.phases["optimizer"] == pytest.approx(2e-4)


def test_allgather_push_prices_padded_blocks_where_the_exchange_pads_them():
    """hpcpax's allgather pads every worker's block to the largest when that adds at most
    ``PAD_LIMIT`` of the bytes (one ``Iallgather`` of equal blocks): the step model then
    prices equal blocks of the largest size; past the limit, the blocks as they are."""
    from hpcpax.comm.sparse_collectives import PAD_LIMIT
    from hpcpax.plan.traffic import COUNT_BYTES, INDEX_BYTES

    layout = Layout.from_shape(2, 2, 0)  # 4 workers on 2 nodes
    links = coll.Links(1e-6, 4e9, 5e-6, 1e8)
    row_bytes = 64
    block = INDEX_BYTES + row_bytes

    def push_s(sizes):
        ids = [np.arange(n) for n in sizes]
        routing = {"t": routing_from_ids(layout, "allgather", 10_000, row_bytes, ids)}
        pred = predict_step(layout, links, CostParams(), routing, include_control=False)
        return pred.phases["push"]

    nodes = [0, 0, 1, 1]
    counts = coll.allgatherv(nodes, COUNT_BYTES, links).seconds
    # small blocks: MPICH's recursive doubling, whose rounds carry the sums of blocks
    near = [100, 64, 100, 64]  # padding adds 72 rows to 328: under the limit
    assert 4 * 100 <= (1 + PAD_LIMIT) * sum(near)
    padded = coll.allgatherv(nodes, 100.0 * block, links)
    as_is = coll.allgatherv(nodes, np.array(near, float) * block, links)
    assert padded.algorithm == as_is.algorithm == "recursive_doubling"
    assert padded.seconds > as_is.seconds
    padded = padded.seconds
    assert push_s(near) == pytest.approx(counts + padded)
    far = [100, 10, 10, 10]  # padding would more than double the bytes
    assert 4 * 100 > (1 + PAD_LIMIT) * sum(far)
    assert push_s(far) == pytest.approx(
        counts + coll.allgatherv(nodes, np.array(far, float) * block, links).seconds)
