"""Hot rows by relays: the choice of relays, and the bytes of one pull and push.

That relays give today's numbers bit for bit is checked with the trees in
``test_hot_rows.py`` (``route="relays"``).
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.errors import ConfigError
from hpcpax.plan.hot_rows_cost import decide
from hpcpax.plan.plan import check_hot_rows
from hpcpax.ps.hot_rows.relays import choose_relays, members_of, owners_that_relay
from hpcpax.ps.hot_rows.routing import HotRows
from step_data import pull_push_bytes, zipf_ids


def test_choose_relays_picks_off_node_sources_in_turn():
    # ranks 0-5 on nodes 0,0,1,1,2,3; the owner is rank 0
    node_of = np.array([0, 0, 1, 1, 2, 3])
    ids = [np.array(x, np.int64) for x in
           ([7, 9], [7, 8, 9], [7, 8], [8, 9], [7, 9, 5], [])]
    counts = np.array([len(x) for x in ids])
    relay, rows, relays, masks, copies, saved = choose_relays(np.concatenate(ids), counts,
                                                              node_of, 0, min_nodes=2)
    # off-node sources: 7 <- 2, 4; 8 <- 2, 3; 9 <- 3, 4; 5 <- 4 alone (not relayed)
    assert rows.tolist() == [7, 8, 9]
    assert relays.tolist() == [2, 3, 3]  # turns 0, 1, 2 over each row's sorted sources
    want = {7: [0, 1, 2, 4], 8: [1, 2, 3], 9: [0, 1, 3, 4]}
    members = members_of(masks, 6)
    for j, row in enumerate(rows.tolist()):
        assert np.flatnonzero(members[:, j]).tolist() == want[row]
    per_entry = {7: 2, 8: 3, 9: 3, 5: -1}
    assert relay.tolist() == [per_entry[x] for x in np.concatenate(ids).tolist()]
    assert (copies, saved) == (7, 3)  # off-node entries; one copy of 7, 8, 9 each saved


def test_choose_relays_rules():
    node_of = np.arange(4)
    ids = np.array([1, 2, 1, 3, 1, 4], np.int64)  # row 1 from ranks 1, 2, 3
    counts = np.array([0, 2, 2, 2])
    args = (ids, counts, node_of, 0)
    assert choose_relays(*args, min_nodes=2).rows.tolist() == [1]
    assert choose_relays(*args, min_nodes=2)[4:] == (6, 2)
    assert choose_relays(*args, min_nodes=4).rows.tolist() == []  # 3 sources
    assert choose_relays(*args, min_nodes=0).rows.tolist() == []  # off
    twice = np.array([1, 1, 1, 3, 1, 4], np.int64)  # rank 1 sent id 1 twice
    assert (choose_relays(twice, counts, node_of, 0, 2).relay == -1).all()
    # beyond one word of ranks
    many = choose_relays(np.full(130, 5, np.int64), np.ones(130, np.int64), np.arange(130), 0, 2)
    assert many.rows.tolist() == [5] and many.masks.shape == (1, 3)
    assert np.flatnonzero(members_of(many.masks, 130)[:, 0]).tolist() == list(range(130))


def test_owners_relay_only_where_that_lowers_the_busiest_link():
    nodes = np.arange(4)
    one_owner = owners_that_relay([100, 0, 0, 0], [44, 0, 0, 0], nodes, 0.2)
    assert one_owner.tolist() == [True, False, False, False]  # busiest link 100 -> 56
    # every owner equally loaded: the copies only move between the links
    assert not owners_that_relay([100] * 4, [44] * 4, nodes, 0.2).any()
    assert owners_that_relay([100] * 4, [44] * 4, nodes, 0).all()  # 0: every owner
    # 100 -> 85 + 0: less than a fifth off the busiest link, unless a tenth is enough
    assert not owners_that_relay([100, 0, 0, 0], [15, 0, 0, 0], nodes, 0.2).any()
    assert owners_that_relay([100, 0, 0, 0], [15, 0, 0, 0], nodes, 0.1)[0]
    # two owners on node 0: their link carries both; the busier relays, 150 -> 90 (60 / 1)
    two = owners_that_relay([100, 50, 0, 0], [60, 20, 0, 0], np.array([0, 0, 1, 1]), 0.2)
    assert two.tolist() == [True, True, False, False]  # then 90 - 20 = 70 against 80
    hot = owners_that_relay([300, 100, 100, 100], [150, 40, 40, 40], nodes, 0.2)
    assert hot.tolist() == [True, False, False, False]  # 300 -> 150; the next would not help
    assert not owners_that_relay([100, 0], [50, 0], np.array([0, 0]), 0.2).any()  # one node


def test_relays_in_the_plan_and_the_setting():
    entry = decide(4, 256, None, ranks=8, setting="relays")
    assert entry["route"] == "relays" and entry["min_nodes"] == 2
    assert decide(2, 256, None, ranks=4, setting="relays")["min_nodes"] == 0
    assert check_hot_rows(entry) == entry
    assert "route" not in check_hot_rows({"min_nodes": 3})
    with pytest.raises(ConfigError, match="route must be 'trees' or 'relays', not 'star'"):
        check_hot_rows({"min_nodes": 2, "route": "star"})
    hot = HotRows()
    hot.set("a", entry)
    hot.set("b", {"min_nodes": 2, "min_saved_bytes": []})
    assert hot.route(["a"]) == "relays" and hot.route(["b"]) == "trees"
    assert hot.route(["a", "b"]) == "relays"
    hot.set("a", {**entry, "min_nodes": 0})
    assert hot.route(["a", "b"]) == "trees"  # off: its route does not count
    with pytest.raises(ValueError, match="route must be 'trees' or 'relays'"):
        hot.set("c", {"min_nodes": 2, "route": "tree"})


def expected_bytes(topo, var, uniq, rb):
    """{phase: sent bytes of this rank} for one pull and one push by relays, one node per
    rank (every rank a worker and an owner), and its owner ``egress``/``ingress``."""
    me, size = topo.rank, topo.size
    words = (size + 62) // 63
    owner_of = {w: var.layout.dest_of(ids) for w, ids in uniq.items()}
    relay_of = {}  # row -> relay; an owner relays rows >= 2 sources other than itself touch
    for o in range(size):
        sources = {}
        for w, ids in uniq.items():
            for x in ids[owner_of[w] == o].tolist():
                sources.setdefault(x, []).append(w)
        shared = sorted(x for x, s in sources.items() if len([w for w in s if w != o]) >= 2)
        for turn, x in enumerate(shared):
            off = sorted(w for w in sources[x] if w != o)
            relay_of[x] = (off[turn % len(off)], o, sorted(sources[x]))
    mine = uniq[me]
    mine_owner = owner_of[me]
    peers = 8 * (size - 1)
    out = {"pull": 0, "push": 0, "relay": 0, "egress": 0, "ingress": 0}
    to_others = int((mine_owner != me).sum())
    asked = [(w, x) for w in uniq if w != me for x in uniq[w][owner_of[w] == me].tolist()]
    cold_asked = [(w, x) for w, x in asked if x not in relay_of]
    pairs = {(w, relay_of[x][0]) for w, x in asked if x in relay_of}
    relayed_by = {}  # relay -> rows this rank owns and relays there
    for x, (r, o, _) in relay_of.items():
        if o == me:
            relayed_by.setdefault(r, []).append(x)
    # pull: requests; reply counts (manifests, cold rows), manifests, cold rows; to relays
    out["pull"] += peers + 8 * to_others + 2 * peers
    out["pull"] += 8 * 2 * len(pairs) + rb * len(cold_asked)
    out["pull"] += sum((8 * words + 8 + rb) * len(rows) for rows in relayed_by.values())
    for x, owner in zip(mine.tolist(), mine_owner.tolist()):
        if owner == me:
            continue
        if x not in relay_of:
            out["egress"] += rb
            continue
        r, _, sources = relay_of[x]
        if r == me:  # from the owner, then on to the row's other sources
            out["egress"] += 8 + rb
            out["relay"] += (8 + rb) * sum(s != me and s != owner for s in sources)
    # push: ids, 1 + words codes per id back, cold rows; relayed rows to relays, sums on
    out["push"] += peers + 8 * to_others + 8 * (1 + words) * len(asked)
    out["ingress"] += 8 * to_others
    for x, owner in zip(mine.tolist(), mine_owner.tolist()):
        if x not in relay_of:
            out["push"] += rb * (owner != me)
            out["ingress"] += rb * (owner != me)
        elif relay_of[x][0] == me:
            out["push"] += rb
            out["ingress"] += rb
        else:
            out["relay"] += rb
    return out


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(60)
def test_relay_bytes_equal_the_formula(comm):
    """One node per rank: owner, relay and control bytes of one pull and one push."""
    topo = hpcpax.init(ranks_per_node=1, servers_per_node=0)
    hpcpax.options.hot_rows_relay_share = 0
    try:
        spec = SparseVariableSpec("h", rows=200, dim=4, dtype="float64", num_partitions=2)
        ps = ParameterServer(topo, seed=1)
        ps.register([spec])
        ps.set_hot_rows({"h": decide(topo.num_nodes, 32, None, topo.size, setting="relays")})
        uniq = {w: np.unique(zipf_ids(spec, i, 0, 1.1, 25))
                for i, w in enumerate(topo.worker_ranks)}
        got = pull_push_bytes(topo, ps, spec, uniq[topo.rank])
        want = expected_bytes(topo, ps.variables["h"], uniq, 32)
        ps.shutdown()
        relayed = comm.allreduce(got["relay"])  # every rank takes part, whatever it found
        ok = got == want and (comm.Get_size() < 3 or relayed > 0)
        if not ok:
            print(topo.rank, got, want)
        assert comm.allreduce(bool(ok), op=MPI.LAND)
    finally:
        del hpcpax.options.hot_rows_relay_share
        topo.free()
