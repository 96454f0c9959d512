"""Byte counters of push and pull equal the formula for the layout.

Every rank rebuilds every worker's ids from seeds, replays the routing in
plain Python (delegate of partition p on a node = node worker p % workers;
owner from the variable's layout) and compares the bytes it expects to send
and receive, per phase and split intra/inter node, with the counters.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad

ROWS, DIM = 300, 5
ROW = DIM * 4  # float32 values
ID = 8  # int64 ids


def worker_ids(worker):
    rng = np.random.default_rng(worker)
    return np.minimum(rng.zipf(1.2, 40) - 1, ROWS - 1).astype(np.int64)


def expected(topo, var, la):
    """{phase: [sent, recv, sent_inter, recv_inter]} for one pull + one push."""
    me = topo.rank
    out = {p: np.zeros(4, np.int64) for p in ("pull", "push", "intra_node")}
    part_of = var.layout.partitioning.partition_of
    owner_of = var.layout.dest_of

    def add(phase, src, dst, nbytes):
        if src == dst or nbytes == 0:
            return
        inter = topo.node_of[src] != topo.node_of[dst]
        if src == me:
            out[phase][0] += nbytes
            out[phase][2] += nbytes * inter
        if dst == me:
            out[phase][1] += nbytes
            out[phase][3] += nbytes * inter

    def counts_msgs(phase, ranks):  # the Alltoall of counts: 8 bytes to each peer
        for a in ranks:
            for b in ranks:
                add(phase, a, b, 8)

    uniq = {w: np.unique(worker_ids(i)) for i, w in enumerate(topo.worker_ranks)}
    senders = {}  # rank -> ids it sends to owners
    for node in range(topo.num_nodes):
        members = topo.workers_on_node(node)
        if la and len(members) > 1:
            for phase_round in ("pull", "push"):
                counts_msgs("intra_node", members)
            for w in members:
                for d_index, d in enumerate(members):
                    mine = uniq[w][part_of(uniq[w]) % len(members) == d_index]
                    add("intra_node", w, d, len(mine) * ID)            # pull requests
                    add("intra_node", d, w, len(mine) * ROW)           # rows fanned out
                    add("intra_node", w, d, len(mine) * (ID + ROW))    # push gradients
            node_union = np.unique(np.concatenate([uniq[w] for w in members]))
            for d_index, d in enumerate(members):
                senders[d] = node_union[part_of(node_union) % len(members) == d_index]
        else:
            for w in members:
                senders[w] = uniq[w]
    counts_msgs("pull", range(topo.size))
    counts_msgs("pull", [])  # the reply reuses the counts
    counts_msgs("push", range(topo.size))
    for src, ids in senders.items():
        owners = owner_of(ids)
        for dst in np.unique(owners):
            n = int((owners == dst).sum())
            add("pull", src, int(dst), n * ID)
            add("pull", int(dst), src, n * ROW)
            add("push", src, int(dst), n * (ID + ROW))
    return out


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("la", [True, False])
@pytest.mark.parametrize("servers,rpn,parts", [(0, 2, 5), (1, 2, 3), (0, None, 4), (1, None, 2)])
def test_push_pull_bytes_equal_formula(comm, la, servers, rpn, parts):
    if servers >= (rpn or comm.Get_size()) or servers >= comm.Get_size():
        pytest.skip("layout leaves a node with no worker")
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
    spec = SparseVariableSpec("emb", ROWS, DIM, num_partitions=parts)
    ps = ParameterServer(topo, local_aggregation=la)
    try:
        if topo.is_server:
            ps.serve()
        else:
            ps.register([spec])
            topo.accounting.reset()
            ids = worker_ids(topo.worker_index)
            ps.pull_unique("emb", ids)
            ps.push("emb", SparseGrad(ids, np.ones((len(ids), DIM), np.float32), ROWS))
            ps.shutdown()
        want = expected(topo, ps.variables["emb"], la)
        ok = True
        for phase, (sent, recv, s_inter, r_inter) in want.items():
            got = topo.accounting.phase(phase)
            ok &= (got["sent_bytes"], got["recv_bytes"], got["sent_inter_bytes"],
                   got["recv_inter_bytes"]) == (sent, recv, s_inter, r_inter)
        assert comm.allreduce(ok, op=MPI.LAND)
    finally:
        topo.free()
