"""Topology invariants for 1-4 ranks and virtual-node layouts."""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.errors import ConfigError, TopologyError

WORLD = MPI.COMM_WORLD



def _members(comm):
    """World ranks of a communicator, ascending (collective over it)."""
    return sorted(comm.allgather(WORLD.Get_rank()))


def _expected_nodes(size, ranks_per_node):
    # one physical node in these tests: virtual nodes are runs of consecutive ranks
    return [r // ranks_per_node if ranks_per_node else 0 for r in range(size)]


def _layout_possible(size, ranks_per_node, servers_per_node):
    nodes = _expected_nodes(size, ranks_per_node)
    counts = np.bincount(nodes)
    return (counts > servers_per_node).any()


def _check_invariants(topo, ranks_per_node, servers_per_node):
    size, rank = WORLD.Get_size(), WORLD.Get_rank()
    ok = topo.size == size and topo.rank == rank
    ok &= list(topo.node_of) == _expected_nodes(size, ranks_per_node)
    everyone = WORLD.allgather(topo.node_of.tolist())
    ok &= all(n == everyone[0] for n in everyone)
    ok &= topo.num_nodes == int(topo.node_of.max()) + 1
    # node_comm matches node_of
    on_node = [r for r in range(size) if topo.node_of[r] == topo.node]
    ok &= _members(topo.node_comm) == on_node
    ok &= topo.local_rank == on_node.index(rank) == topo.node_comm.Get_rank()
    ok &= topo.local_size == len(on_node) == topo.node_comm.Get_size()
    # every rank in exactly one role; servers are the first local ranks
    ok &= sorted(topo.server_ranks + topo.worker_ranks) == list(range(size))
    ok &= not set(topo.server_ranks) & set(topo.worker_ranks)
    for r in range(size):
        local = [q for q in range(size) if topo.node_of[q] == topo.node_of[r]].index(r)
        ok &= (r in topo.server_ranks) == (local < servers_per_node)
    ok &= topo.is_server == (rank in topo.server_ranks) and topo.is_worker != topo.is_server
    ok &= topo.role == ("server" if topo.is_server else "worker")
    ok &= topo.owner_ranks == (topo.server_ranks or topo.worker_ranks)
    ok &= topo.num_workers == len(topo.worker_ranks)
    ok &= topo.worker_index == (topo.worker_ranks.index(rank) if topo.is_worker else -1)
    # role communicators
    ok &= (topo.workers is None) == topo.is_server and (topo.servers is None) == topo.is_worker
    role_comm = topo.workers if topo.is_worker else topo.servers
    ok &= _members(role_comm) == (topo.worker_ranks if topo.is_worker else topo.server_ranks)
    if topo.is_worker:
        ok &= _members(topo.node_workers) == topo.workers_on_node(topo.node)
    else:
        ok &= topo.node_workers is None
    leaders = sorted(topo.workers_on_node(n)[0] for n in range(topo.num_nodes)
                     if topo.workers_on_node(n))
    ok &= (topo.node_leaders is not None) == (rank in leaders)
    if topo.node_leaders is not None:
        ok &= _members(topo.node_leaders) == leaders
    ok &= topo.accounting is not None and list(topo.accounting.node_of) == list(topo.node_of)
    ok &= topo.describe()["worker_ranks"] == topo.worker_ranks
    return ok


@pytest.mark.parametrize("servers_per_node", [0, 1])
@pytest.mark.parametrize("ranks_per_node", [None, 1, 2, 3])
def test_layout_invariants(ranks_per_node, servers_per_node, all_ok):
    size = WORLD.Get_size()
    if not _layout_possible(size, ranks_per_node, servers_per_node):
        with pytest.raises(TopologyError):
            hpcpax.init(ranks_per_node=ranks_per_node, servers_per_node=servers_per_node)
        return
    topo = hpcpax.init(ranks_per_node=ranks_per_node, servers_per_node=servers_per_node)
    try:
        assert all_ok(_check_invariants(topo, ranks_per_node, servers_per_node))
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
def test_counts_says_the_layout_in_words(all_ok):
    """The first line of hpcpax.train / hpcpax.torch (singulars where one)."""
    expected = {1: "1 rank (0 servers, 1 worker, 1 node)",
                2: "2 ranks (1 server, 1 worker, 1 node)",
                3: "3 ranks (1 server, 2 workers, 1 node)",
                4: "4 ranks (1 server, 3 workers, 1 node)"}[WORLD.Get_size()]
    topo = hpcpax.init()
    try:
        assert all_ok(topo.counts() == expected)
    finally:
        topo.free()


def test_default_servers_per_node(all_ok):
    size = WORLD.Get_size()
    topo = hpcpax.init()
    try:
        assert all_ok(len(topo.server_ranks) == (1 if size > 1 else 0))
    finally:
        topo.free()


def test_ranks_per_node_from_environment(monkeypatch, all_ok):
    monkeypatch.setenv("HPCPAX_RANKS_PER_NODE", "2")
    topo = hpcpax.init(servers_per_node=0)
    try:
        assert all_ok(list(topo.node_of) == _expected_nodes(WORLD.Get_size(), 2))
    finally:
        topo.free()
    monkeypatch.setenv("HPCPAX_RANKS_PER_NODE", "two")
    with pytest.raises(ConfigError):
        hpcpax.init(servers_per_node=0)


@pytest.mark.parametrize("kwargs", [
    {"ranks_per_node": 0}, {"ranks_per_node": -2}, {"ranks_per_node": "2"},
    {"servers_per_node": -1}, {"servers_per_node": 1.5},
])
def test_bad_values_raise_config_error(kwargs):
    with pytest.raises(ConfigError):
        hpcpax.init(**kwargs)


def test_servers_env_bad(monkeypatch):
    monkeypatch.setenv("HPCPAX_SERVERS_PER_NODE", "x")
    with pytest.raises(ConfigError):
        hpcpax.init()


def test_too_many_servers_raises_everywhere():
    with pytest.raises(TopologyError, match="leaves no worker"):
        hpcpax.init(servers_per_node=WORLD.Get_size())
    # every rank got here: the error did not leave one rank behind in a collective
    assert WORLD.allreduce(1) == WORLD.Get_size()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_oversubscribed_agrees_on_the_host_and_counts_its_cores(comm):
    """Every rank of the host sees the same flag: more ranks than the cores they may use
    together (never with one rank; always with more ranks than the host has cores)."""
    import os

    topo = hpcpax.init()
    try:
        flags = comm.allgather(topo.oversubscribed)
        ok = all(f == flags[0] for f in flags)
        size = comm.Get_size()
        if size == 1:
            ok &= not topo.oversubscribed
        if size > (os.cpu_count() or 1):
            ok &= topo.oversubscribed
        cores = set().union(*comm.allgather(sorted(os.sched_getaffinity(0))))
        ok &= topo.oversubscribed == (size > len(cores))
        assert comm.allreduce(bool(ok), op=MPI.LAND)
    finally:
        topo.free()
