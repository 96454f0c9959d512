"""Hot rows (trees for pulls, chains for pushes) against today's path.

Two parameter servers with the same seed and layout run the same steps,
one with hot rows off and one with every row two or more sources touch on
a tree (``min_bytes`` 0). Pulled rows and tables (with optimizer state)
must be bit-identical, in float64 and float32: pulls copy rows, and the
push chain sums in the owner's order.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.hot_rows.groups import children_of, chunk_sizes, parent_of
from hpcpax.ps.hot_rows.routing import HotRows, classify
from step_data import pull_push_bytes, zipf_grad, zipf_ids

SPECS = [
    SparseVariableSpec("a", rows=120, dim=3, dtype="float64", optimizer="adagrad",
                       optimizer_params={"lr": 0.2}),
    SparseVariableSpec("b", rows=40, dim=5, dtype="float32", optimizer="sgd",
                       optimizer_params={"lr": 0.5}, num_partitions=3),
    SparseVariableSpec("c", rows=300, dim=2, dtype="float32", optimizer="adam",
                       optimizer_params={"lr": 0.05}),
]
STEPS = 3


def step_ids(spec, worker, step):
    return zipf_ids(spec, worker, step, 1.1, 25)


def step_grad(spec, worker, step):
    return zipf_grad(spec, worker, step, 1.1, 25)


def run(topo, la, hot_rows, batched=True, route="trees"):
    """STEPS of pull + push of every variable; ``(pulled, tables, accounting)``."""
    ps = ParameterServer(topo, local_aggregation=la, seed=3, hot_rows=hot_rows)
    if route == "relays":
        ps.set_hot_rows({s.name: {"min_nodes": hot_rows, "min_saved_bytes": [],
                                  "route": "relays"} for s in SPECS})
    pulled = []
    topo.accounting.reset()
    if topo.is_server:
        ps.serve()
    else:
        ps.register(SPECS)
        for step in range(STEPS):
            ids = {s.name: step_ids(s, topo.worker_index, step) for s in SPECS}
            grads = {s.name: step_grad(s, topo.worker_index, step) for s in SPECS}
            if batched:
                pulled.append(ps.pull_unique_many(ids))
                ps.push_many(grads)
            else:
                pulled.append({s.name: ps.pull_unique(s.name, ids[s.name]) for s in SPECS})
                for s in SPECS:
                    ps.push(s.name, grads[s.name])
        ps.shutdown()
    accounting = topo.accounting.as_dict()
    tables = {s.name: ps.gather_table(s.name) for s in SPECS}
    return pulled, tables, accounting


@pytest.fixture
def every_row_hot():
    hpcpax.options.hot_rows_min_bytes = 0
    hpcpax.options.hot_rows_relay_share = 0
    yield
    del hpcpax.options.hot_rows_min_bytes
    del hpcpax.options.hot_rows_relay_share


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("la", [True, False])
@pytest.mark.parametrize("servers,rpn", [(0, None), (0, 1), (1, 2), (0, 2)])
@pytest.mark.parametrize("chunk_bytes,route", [(0, "trees"), (48, "trees"), (0, "relays")])
def test_hot_rows_equal_todays_path(comm, every_row_hot, la, servers, rpn, chunk_bytes, route):
    if servers and servers >= min(rpn or comm.Get_size(), comm.Get_size()):
        pytest.skip("layout leaves a node with no worker")
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
    try:
        today = run(topo, la, 0)
        hpcpax.options.hot_rows_chunk_bytes = chunk_bytes  # pipelined pieces: still exact
        try:
            trees = run(topo, la, 2, batched=comm.Get_size() != 3, route=route)
        finally:
            del hpcpax.options.hot_rows_chunk_bytes
        ok = True
        for one, two in zip(today[0], trees[0]):
            for name in one:
                ok &= np.array_equal(one[name][0], two[name][0])
                ok &= np.array_equal(one[name][1], two[name][1])
        for spec in SPECS:
            (t1, s1, c1), (t2, s2, c2) = today[1][spec.name], trees[1][spec.name]
            ok &= np.array_equal(t1, t2)
            ok &= all(np.array_equal(s1[k], s2[k]) for k in s1)
        # with several sources per row somewhere, the trees must have been used; relays
        # need two sources off some owner's node
        relayed = comm.allreduce(trees[2]["phases"].get("relay", {}).get("sent_bytes", 0))
        nodes = {int(topo.node_of[w]) for w in topo.worker_ranks}
        sources = len(nodes) if la else topo.num_workers
        if route == "trees":
            ok &= (relayed > 0) == (sources >= 2)
        else:
            off = [sum(int(topo.node_of[w]) != int(topo.node_of[o]) for w in topo.worker_ranks)
                   if not la else len(nodes - {int(topo.node_of[o])})
                   for o in range(comm.Get_size())]
            ok &= (relayed > 0) == (max(off) >= 2)
        assert comm.allreduce(bool(ok), op=MPI.LAND)
    finally:
        topo.free()


def test_classify_groups_rows_by_their_sources():
    # sources 0, 1, 2 send: row 5 from all, row 7 from 0 and 2, row 9 from 1 only
    ids = np.array([5, 7, 5, 9, 5, 7], np.int64)
    counts = np.array([2, 2, 2])
    group, groups = classify(ids, counts, 2, 0, 8)
    assert [m.tolist() for m, _ in groups] == [[0, 2], [0, 1, 2]]
    assert [i.tolist() for _, i in groups] == [[7], [5]]
    assert group.tolist() == [1, 0, 1, -1, 1, 0]
    # min_bytes: (members - 1) x rows x row bytes must reach it
    group, groups = classify(ids, counts, 2, 16, 8)
    assert [m.tolist() for m, _ in groups] == [[0, 1, 2]]
    assert classify(ids, counts, 4, 0, 8)[1] == []
    # a plan's per-k thresholds: groups of 2 never, of 3 from 16 saved bytes
    group, groups = classify(ids, counts, 2, [None, None, None, 16], 8)
    assert [m.tolist() for m, _ in groups] == [[0, 1, 2]]
    assert group.tolist() == [0, -1, 0, -1, 0, -1]
    assert classify(ids, counts, 2, [None, None, None, 17], 8)[1] == []
    assert classify(ids, counts, 2, [None, None, 0], 8)[1][0][0].tolist() == [0, 2]
    # a source that sent an id twice: nothing is grouped
    assert classify(np.array([5, 5, 5, 7]), np.array([2, 1, 1]), 2, 0, 8)[1] == []


def test_classify_beyond_one_word_of_sources():
    # 130 sources (three 63-bit words): row 1 from sources 0, 64 and 129, row 2 from 0-129
    counts = np.zeros(130, np.int64)
    ids = []
    for s in range(130):
        mine = [2] + ([1] if s in (0, 64, 129) else [])
        ids += mine
        counts[s] = len(mine)
    group, groups = classify(np.array(ids, np.int64), counts, 3, 0, 8)
    assert [(m.tolist(), u.tolist()) for m, u in groups] == [([0, 64, 129], [1]),
                                                              (list(range(130)), [2])]
    assert (group >= 0).all()


def test_a_plan_sets_one_variable():
    hot = HotRows(4)
    hot.set("a", {"min_nodes": 7, "min_saved_bytes": [None] * 7 + [100], "reason": "r"})
    assert (hot.min_nodes("a"), hot.thresholds("a")) == (7, [None] * 7 + [100])
    assert hot.entries["a"]["reason"] == "r"
    assert (hot.min_nodes("b"), hot.thresholds("b")) == (4, hot.min_bytes)  # the rest as before
    hot.set("b", {"min_nodes": 0, "min_saved_bytes": []})
    assert hot.min_nodes("b") == 0 and not hot.classify_pull(["b"])
    assert hot.thresholds("b") == hot.min_bytes
    with pytest.raises(ValueError, match="min_nodes must be an int >= 0, not -1"):
        hot.set("a", {"min_nodes": -1})


def test_hot_rows_setting_is_checked():
    assert HotRows({"a": 3}).min_nodes("a") == 3
    assert HotRows(1).min_nodes("a") == 0
    with pytest.raises(ValueError, match="hot_rows must be an int >= 0"):
        HotRows({"a": -1})
    with pytest.raises(TypeError, match="hot_rows must be None, int or dict, not str"):
        HotRows("3")


def expected_bytes(topo, var, uniq, rb, chunk_bytes):
    """{phase: sent bytes of this rank} for one pull and one push (one node per worker),
    and this rank's owner ``egress`` (rows it got from owners) and ``ingress``
    (ids and rows it sent them)."""
    me, size, node_of = topo.rank, topo.size, topo.node_of
    out = {"pull": 0, "push": 0, "relay": 0, "egress": 0, "ingress": 0}
    owner_of = {w: var.layout.dest_of(ids) for w, ids in uniq.items()}
    sources = {}
    for w, ids in uniq.items():
        for x in ids.tolist():
            sources.setdefault(x, []).append(w)
    groups = {}  # (owner, members) -> rows
    for x, members in sources.items():
        if len(members) >= 2:
            owner = int(var.layout.dest_of(np.array([x]))[0])
            groups.setdefault((owner, tuple(sorted(members))), []).append(x)
    hot = {x for rows in groups.values() for x in rows}
    peers = 8 * (size - 1)
    mine = uniq.get(me, np.zeros(0, np.int64))
    mine_owner = owner_of.get(me, np.zeros(0, np.int64))
    to_others = int((mine_owner != me).sum())
    cold_to_others = int(((mine_owner != me) & ~np.isin(mine, list(hot))).sum())
    asked_me = sum(int((owner_of[w] == me).sum()) for w in uniq if w != me)
    cold_asked_me = sum(int(((owner_of[w] == me) & ~np.isin(uniq[w], list(hot))).sum())
                        for w in uniq if w != me)
    if not groups:  # no tree: the classifying pull's reply, then today's push
        out["pull"] += peers + 8 * to_others + 2 * peers + rb * asked_me
        out["push"] += peers + (8 + rb) * to_others
        out["egress"], out["ingress"] = rb * to_others, (8 + rb) * to_others
        return out
    # pull: the requests; the reply (counts of manifests and cold rows, both);
    # the owner's one copy of each group to its tree's first member, the forwards
    out["pull"] += peers + 8 * to_others + 2 * peers + rb * cold_asked_me
    out["egress"] += rb * cold_to_others
    for (owner, members), rows in groups.items():
        n, k = len(rows), len(members)
        pieces = len(chunk_sizes(n, rb, chunk_bytes))
        chain = k <= 3 or pieces > 1
        # a chain starts on the owner's node, a binomial tree off it
        tree = sorted(members, key=lambda m: ((node_of[m] == node_of[owner]) != chain, m))
        if owner == me:
            out["pull"] += 8 * (4 + k + pieces) * sum(m != me for m in tree)  # manifests
            out["pull"] += (8 + rb) * n * (tree[0] != me)
        if me in tree:
            i = tree.index(me)
            children = ([i + 1] if i + 1 < k else []) if chain else [
                i + (1 << j) for j in range(k.bit_length()) if (1 << j) > i and i + (1 << j) < k]
            out["relay"] += (8 + rb) * n * len(children)
            out["egress"] += (8 + rb) * n * (i == 0 and owner != me)
    # push: ids, two codes per id back, cold rows; the chain's partial sums
    out["push"] += peers + 8 * to_others + 16 * asked_me
    out["ingress"] += 8 * to_others
    for x, owner in zip(mine.tolist(), mine_owner.tolist()):
        if x not in hot:
            out["push"] += rb * (owner != me)
            out["ingress"] += rb * (owner != me)
            continue
        members = sorted(sources[x])
        if members.index(me) == len(members) - 1:
            out["push"] += rb * (owner != me)
            out["ingress"] += rb * (owner != me)
        else:
            out["relay"] += rb
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("chunk_bytes", [0, 64])
def test_hot_rows_bytes_equal_the_formula(comm, every_row_hot, chunk_bytes):
    """One node per worker: owner and relay bytes of one pull and one push, exactly,
    with trees and without (no row two workers share on one rank)."""
    topo = hpcpax.init(ranks_per_node=1, servers_per_node=0)
    hpcpax.options.hot_rows_chunk_bytes = chunk_bytes
    try:
        spec = SparseVariableSpec("h", rows=200, dim=4, dtype="float64")
        ps = ParameterServer(topo, seed=1, hot_rows=2)
        ps.register([spec])
        uniq = {w: np.unique(step_ids(spec, i, 0)) for i, w in enumerate(topo.worker_ranks)}
        got = pull_push_bytes(topo, ps, spec, uniq[topo.rank])
        # one node per rank: every owner byte leaves its node
        ok = all(topo.accounting.owner[d + "_inter"] == topo.accounting.owner[d]
                 for d in ("egress", "ingress"))
        want = expected_bytes(topo, ps.variables["h"], uniq, 32, chunk_bytes)
        ps.shutdown()
        ok &= got == want
        if not ok:
            print(topo.rank, got, want)
        assert comm.allreduce(bool(ok), op=MPI.LAND)
    finally:
        del hpcpax.options.hot_rows_chunk_bytes
        topo.free()


def test_a_pull_without_trees_skips_the_next_classifications():
    from hpcpax.ps.hot_rows.routing import PROBE_EVERY

    hot = HotRows({"a": 2, "b": 0})
    assert not hot.classify_pull(["b"])  # off: never classified
    assert hot.classify_pull(["a"])
    hot.pulled(["a"], True)
    assert hot.chain_push(["a"]) and not hot.chain_push(["b"])
    assert hot.classify_pull(["a"])
    hot.pulled(["a"], False)
    assert not hot.chain_push(["a"])
    assert [hot.classify_pull(["a"]) for _ in range(PROBE_EVERY)] == [False] * (
        PROBE_EVERY - 1) + [True]


@pytest.mark.parametrize("k", range(1, 12))
@pytest.mark.parametrize("chain", [True, False])
def test_tree_shapes_reach_every_member_once(k, chain):
    parents = [parent_of(i, chain) for i in range(k)]
    children = {i: children_of(i, k, chain) for i in range(k)}
    assert parents[0] == -1  # the first member hears from the owner
    for i in range(1, k):
        assert i in children[parents[i]] and parents[i] < i
    assert sorted(c for cs in children.values() for c in cs) == list(range(1, k))
    depth = [0] * k
    for i in range(1, k):
        depth[i] = depth[parents[i]] + 1
    # hops from the first member: a chain's length, or a binomial tree's log2
    assert max(depth) == (k - 1 if chain else k.bit_length() - 1)


def test_pieces_follow_the_chunk_bytes():
    from hpcpax.ps.hot_rows.groups import MAX_PIECES, pieces_of

    assert pieces_of(1000, 0) == 1 and pieces_of(1000, 1000) == 1
    assert pieces_of(1001, 1000) == 2 and pieces_of(10 ** 9, 1000) == MAX_PIECES
    assert chunk_sizes(10, 100, 300) == [3, 3, 2, 2]  # 1000 B in 4 pieces, first ones larger
    assert chunk_sizes(3, 100, 1) == [1, 1, 1]  # never more pieces than rows
    assert chunk_sizes(5, 100, 0) == [5]


def test_tags_stay_below_a_small_tag_upper_bound_and_extra_groups_move_as_today():
    from types import SimpleNamespace

    from mpi4py import MPI

    from hpcpax.ps.hot_rows.routing import _owner_pieces
    from hpcpax.ps.hot_rows.trees import TreeTraffic

    class SmallTags:  # a library with the least MPI_TAG_UB the standard allows
        def Get_attr(self, key):
            assert key == MPI.TAG_UB
            return 32767

        def Get_size(self):
            return 1000

    traffic = TreeTraffic(SmallTags(), None, ["a"], "pull")
    assert traffic.pieces_per_owner == 16
    assert traffic.tag(999, traffic.pieces_per_owner - 1) <= 32767
    # 3 sources: row 5 from all, row 7 from 0 and 2; room for one piece: one group
    var = SimpleNamespace(spec=SimpleNamespace(name="a", row_bytes=8))
    ids, counts = np.array([5, 7, 5, 5, 7], np.int64), np.array([2, 1, 2])
    group, chosen = _owner_pieces(var, ids, counts, HotRows(2, min_bytes=0), 0, limit=1)
    assert [(m.tolist(), u.tolist()) for m, u, _, _ in chosen] == [([0, 2], [7])]
    assert group.tolist() == [-1, 0, -1, -1, 0]
