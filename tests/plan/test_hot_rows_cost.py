"""The hot-rows cost model (hpcpax.plan.hot_rows_cost) on hand-computed cases."""

import math

import pytest

from hpcpax.comm.fabric import Fabric, LinkModel
from hpcpax.plan.hot_rows_cost import decide, min_saved_bytes, tree_gain

# no latency: only bytes count (intra 1 GB/s, inter 100 MB/s)
FREE = Fabric(intra=LinkModel(0.0, 1e9), inter=LinkModel(0.0, 1e8), allreduce_bucket_bytes=1 << 20)
# 100 us per inter-node message
SLOW = Fabric(intra=LinkModel(0.0, 1e9), inter=LinkModel(1e-4, 1e8), allreduce_bucket_bytes=1 << 20)


def test_gain_of_eight_nodes_without_latency():
    # G = 1000 x 256 B = 256,000 B = 2.56 ms over an inter-node link; one piece.
    # today: pull 7 copies + push 7 copies = 14 x 2.56 ms = 35.84 ms
    # trees: pull 1 + ceil(log2 8) = 4 hops = 10.24 ms; push chain 8 hops = 20.48 ms
    #        + the codes of 8 members (16 x 8 x 1000 B = 128,000 B = 1.28 ms) = 32.0 ms
    got = tree_gain(8, 1000, 256, FREE, ranks=8, chunk_bytes=0)
    assert got["today_s"] == pytest.approx(0.03584)
    assert got["trees_s"] == pytest.approx(0.032)
    assert got["saved_s"] == pytest.approx(0.00384)
    assert got["pull_saved_s"] == pytest.approx(7 * 2.56e-3 - 4 * 2.56e-3)
    assert got["push_saved_s"] == pytest.approx(7 * 2.56e-3 - 8 * 2.56e-3 - 1.28e-3)
    assert got["pieces"] == 1


def test_threshold_of_eight_nodes_with_latency():
    # fixed: today 2 a; trees: pull 4 hops + ceil(log2 8) a (the reply's count
    # exchange) = 7 a, push 8 hops + 2 a = 10 a: 17 a - 2 a = 15 a = 1.5 ms more
    # per row: (7 - 4 + 7 - 8) x 256 B x 1e-8 s/B - 16 x 8 B x 1e-8 s/B = 3.84 us
    # rows to pay: floor(1.5 ms / 3.84 us) + 1 = 391; saved bytes 7 x 391 x 256
    fixed, per_row = 15 * 1e-4, 2 * 256 * 1e-8 - 128 * 1e-8
    rows = math.floor(fixed / per_row) + 1
    assert rows == 391
    assert min_saved_bytes(8, 256, SLOW, ranks=8, chunk_bytes=0) == 7 * 391 * 256
    assert tree_gain(8, 391, 256, SLOW, ranks=8, chunk_bytes=0)["saved_s"] > 0
    assert tree_gain(8, 390, 256, SLOW, ranks=8, chunk_bytes=0)["saved_s"] < 0


@pytest.mark.parametrize("k", [2, 3, 4, 5, 6])
def test_few_nodes_never_pay_in_one_piece_when_the_owner_is_a_member(k):
    # store and forward: the chain/tree's inter-node hops (k - 1 or 1 + ceil(log2 k),
    # plus k for the push) are at least the 2 (k - 1) copies the owner saves
    assert min_saved_bytes(k, 256, FREE, ranks=2 * k, chunk_bytes=0) is None
    assert tree_gain(k, 10_000, 256, FREE, ranks=2 * k, chunk_bytes=0)["saved_s"] < 0
    assert min_saved_bytes(7, 256, FREE, ranks=14, chunk_bytes=0) is not None


def test_dedicated_owner_pays_from_four_nodes_in_one_piece():
    # owner off the group: today k copies each way; tree 1 + ceil(log2 4) = 3 hops, chain 4
    assert min_saved_bytes(3, 256, FREE, ranks=8, owner_in_group=False, chunk_bytes=0) is None
    got = tree_gain(4, 1000, 256, FREE, ranks=8, owner_in_group=False, chunk_bytes=0)
    assert got["pull_saved_s"] == pytest.approx((4 - 3) * 2.56e-3)
    assert got["push_saved_s"] == pytest.approx(-16 * 4 * 1000 * 1e-8)
    assert min_saved_bytes(4, 256, FREE, ranks=8, owner_in_group=False,
                           chunk_bytes=0) == 3 * 1 * 256


def test_pipelined_chains_of_four_nodes():
    # 64,000-byte pieces: G = 256,000 B in c = 4 of 0.64 ms over an inter-node link
    # pull: one intra-node piece (0.064 ms), then k - 1 + c - 1 = 6 pieces: 3.904 ms
    # push: k + c - 1 = 7 pieces = 4.48 ms, + the codes 16 x 4 x 1000 B = 0.64 ms
    # today 2 x 3 x 2.56 ms = 15.36 ms
    got = tree_gain(4, 1000, 256, FREE, ranks=8, chunk_bytes=64_000)
    assert got["pieces"] == 4
    assert got["today_s"] == pytest.approx(15.36e-3)
    assert got["pull_saved_s"] == pytest.approx(7.68e-3 - 3.904e-3)
    assert got["push_saved_s"] == pytest.approx(7.68e-3 - 5.12e-3)
    # a pair with the owner's node: one copy today, at least one by any chain
    assert min_saved_bytes(2, 256, FREE, ranks=4, chunk_bytes=64_000) is None
    # 3 nodes, 256-byte pieces: 1 row (one piece) loses; 2 rows in 2 pieces save
    # pull 2 - 1.5 copies (- half a row inside the node), push 2 - 2 copies, - the codes:
    # 0.5 x 512 x 1e-8 - 0.5 x 512 x 1e-9 - 16 x 3 x 2 x 1e-8 > 0
    assert tree_gain(3, 1, 256, FREE, ranks=6, chunk_bytes=256)["saved_s"] < 0
    two = tree_gain(3, 2, 256, FREE, ranks=6, chunk_bytes=256)
    assert two["saved_s"] == pytest.approx(0.5 * 512e-8 - 0.5 * 512e-9 - 96e-8)
    assert min_saved_bytes(3, 256, FREE, ranks=6, chunk_bytes=256) == 2 * 2 * 256
    # pipelined (the default 256 KiB pieces), groups from 3 nodes pay; in one piece never on 4
    assert decide(4, 256, SLOW, ranks=8)["min_nodes"] == 3
    assert decide(4, 256, SLOW, ranks=8, chunk_bytes=0)["min_nodes"] == 0


def test_decide():
    off = decide(4, 256, FREE, ranks=8, chunk_bytes=0)
    assert off["min_nodes"] == 0 and off["min_saved_bytes"] == []
    assert "hot rows off" in off["reason"]
    on = decide(8, 256, SLOW, ranks=16, chunk_bytes=0)
    assert on["min_nodes"] == 7
    assert on["min_saved_bytes"][:7] == [None] * 7
    assert on["min_saved_bytes"][7] == min_saved_bytes(7, 256, SLOW, ranks=16, chunk_bytes=0)
    assert on["min_saved_bytes"][8] == min_saved_bytes(8, 256, SLOW, ranks=16, chunk_bytes=0)
    assert decide(8, 256, SLOW.to_dict(), ranks=16, chunk_bytes=0) == on  # the plan's dict too
    assert decide(8, 256, SLOW, ranks=16, setting="off")["min_nodes"] == 0
    assert decide(8, 256, SLOW, ranks=16, setting=3) == {
        "min_nodes": 3, "min_saved_bytes": [],
        "reason": "hot rows: fixed rule, groups of >= 3 nodes"}
    assert decide(1, 256, SLOW, ranks=2)["min_nodes"] == 0
    assert decide(8, 256, None, ranks=16)["min_nodes"] == 0


def test_bad_input():
    with pytest.raises(ValueError, match="k must be >= 2, not 1"):
        tree_gain(1, 10, 256, FREE, ranks=4)
    with pytest.raises(TypeError, match="rows must be int, not float"):
        tree_gain(3, 1.5, 256, FREE, ranks=4)
    with pytest.raises(ValueError, match="hot_rows must be 'auto', 'off', 'relays' or an int"):
        decide(4, 256, FREE, ranks=8, setting="sometimes")


def test_the_plan_records_and_shows_the_decision():
    from hpcpax.errors import ConfigError
    from hpcpax.plan import Plan, make_plan

    variables = [{"name": "emb", "kind": "sparse", "shape": [100_000, 64], "dtype": "float32",
                  "alpha": 0.01},
                 {"name": "w", "kind": "dense", "shape": [64, 64], "dtype": "float32"}]
    shape8 = {"num_nodes": 8, "workers_per_node": 1, "servers_per_node": 1}
    plan = make_plan(variables, "hybrid", shape8, SLOW)
    assert plan.variables["emb"].hot_rows == decide(8, 256, SLOW, ranks=16)
    assert plan.variables["emb"].hot_rows["min_nodes"] == 3  # pipelined pieces
    assert plan.variables["w"].hot_rows is None
    assert ">=3 nodes" in plan.table().splitlines()[2]
    assert Plan.from_json(plan.to_json()) == plan
    off = make_plan(variables, "hybrid", shape8, SLOW, hot_rows={"emb": "off"})
    assert off.variables["emb"].hot_rows["min_nodes"] == 0
    assert " off " in off.table().splitlines()[2]
    assert off.fingerprint() != plan.fingerprint()  # a decision, not a prediction
    two = make_plan(variables, "hybrid", {**shape8, "num_nodes": 2}, SLOW)
    assert two.variables["emb"].hot_rows["min_nodes"] == 0
    with pytest.raises(ConfigError, match="hot_rows.min_nodes must be an int >= 0"):
        Plan.from_dict({**plan.to_dict(), "variables": [
            {**plan.variables["emb"].to_dict(), "hot_rows": {"min_nodes": -2}}]})


def test_a_plan_file_sets_hot_rows_per_variable():
    from hpcpax.engine.plan_requests import hot_rows_requests
    from hpcpax.app.config import normalize_plan
    from hpcpax.errors import ConfigError

    plan = normalize_plan({"a": {"method": "ps", "hot_rows": 0}, "b": {"hot_rows": "off"},
                           "c": {"hot_rows": 3}, "d": {"method": "allgather", "hot_rows": 3},
                           "e": {}})
    got = hot_rows_requests(plan, "auto")
    assert sorted(got) == ["a", "b", "c"]
    assert got["a"]["min_nodes"] == got["b"]["min_nodes"] == 0 and got["c"]["min_nodes"] == 3
    assert {n: e["min_nodes"] for n, e in hot_rows_requests(plan, "off").items()} == {
        "a": 0, "b": 0, "c": 0, "e": 0}
    with pytest.raises(ConfigError, match=r"plan\['a'\].hot_rows must be 'off', an int >= 0"):
        hot_rows_requests(normalize_plan({"a": {"hot_rows": "sometimes"}}), "auto")
