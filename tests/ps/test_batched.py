"""Batched PS operations: ``pull_unique_many`` / ``push_many`` against one-by-one calls.

Two parameter servers with the same seed and layout run the same steps, one
variable at a time and batched. The tables must be bit-identical (every owner
sums the same rows in the same order), the rows pulled identical, the bytes
counted per variable identical, and the batched run must use fewer
collective calls per phase.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.errors import MismatchError, SparseIndexError
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.protocol import MAX_BATCH, batches as _batches
from hpcpax.ps.sparse_grad import SparseGrad
from step_data import zipf_grad, zipf_ids

SPECS = [
    SparseVariableSpec("a", rows=120, dim=3, dtype="float64", optimizer="adagrad",
                       optimizer_params={"lr": 0.2}),
    SparseVariableSpec("b", rows=40, dim=5, dtype="float32", optimizer="sgd",
                       optimizer_params={"lr": 0.5}, num_partitions=3),
    SparseVariableSpec("c", rows=300, dim=2, dtype="float32", optimizer="adam",
                       optimizer_params={"lr": 0.05}),
]
STEPS = 4
FIELDS = ("sent_bytes", "recv_bytes", "sent_inter_bytes", "recv_inter_bytes")


def step_ids(spec, worker, step):
    return zipf_ids(spec, worker, step, 1.3, 15)


def step_grad(spec, worker, step):
    return zipf_grad(spec, worker, step, 1.3, 15)


def run(topo, batched, la, mixed_la=False):
    """STEPS of pull + push of every variable; ``(pulled, tables, accounting)``."""
    ps = ParameterServer(topo, local_aggregation=la, seed=3)
    pulled = []
    if topo.is_server:
        ps.serve()
    else:
        ps.register(SPECS)
        if mixed_la:
            ps.set_local_aggregation("b", not la)
        topo.accounting.reset()
        for step in range(STEPS):
            ids = {s.name: step_ids(s, topo.worker_index, step) for s in SPECS}
            grads = {s.name: step_grad(s, topo.worker_index, step) for s in SPECS}
            if batched:
                got = ps.pull_unique_many(ids)
                ps.push_many(grads)
            else:
                got = {s.name: ps.pull_unique(s.name, ids[s.name]) for s in SPECS}
                for s in SPECS:
                    ps.push(s.name, grads[s.name])
            pulled.append(got)
        ps.shutdown()
    tables = {s.name: ps.gather_table(s.name) for s in SPECS}  # every rank, after serve
    accounting = topo.accounting.as_dict()
    topo.accounting.reset()
    return ps, pulled, tables, accounting


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("la,mixed", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("servers,rpn", [(0, None), (1, 2), (0, 2)])
def test_batched_equals_one_by_one(comm, la, mixed, servers, rpn):
    if servers and servers >= min(rpn or comm.Get_size(), comm.Get_size()):
        pytest.skip("layout leaves a node with no worker")
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
    try:
        single = run(topo, False, la, mixed)
        batched = run(topo, True, la, mixed)
        ok = True
        # the rows every pull returned
        for one, many in zip(single[1], batched[1]):
            for name in one:
                ok &= np.array_equal(one[name][0], many[name][0])
                ok &= np.array_equal(one[name][1], many[name][1])
        # the tables after the pushes, bit for bit (owners hold the same rows)
        for spec in SPECS:
            (t1, state1, _), (t2, state2, _) = single[2][spec.name], batched[2][spec.name]
            ok &= np.array_equal(t1, t2)
            ok &= all(np.array_equal(state1[k], state2[k]) for k in state1)
        # the bytes of every variable, per direction and split
        for spec in SPECS:
            a = single[3]["variables"].get(spec.name, {})
            b = batched[3]["variables"].get(spec.name, {})
            ok &= all(a.get(f, 0) == b.get(f, 0) for f in FIELDS)
        # fewer collective calls for the same bytes
        calls_single = sum(p["calls"] for p in single[3]["phases"].values())
        calls_batched = sum(p["calls"] for p in batched[3]["phases"].values())
        if topo.is_worker:
            ok &= calls_batched < calls_single
        assert comm.allreduce(bool(ok), op=MPI.LAND)
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_servers_polling_for_the_next_operation_change_nothing(comm):
    """A server waiting for the workers' next operation by polling with backoff
    (``server_poll_seconds`` > 0, the default on an oversubscribed host) or inside MPI
    (0): the same rows pulled and the same tables, bit for bit."""
    from hpcpax.options import options
    from hpcpax.ps.protocol import server_wait_cap

    topo = hpcpax.init(servers_per_node=1)
    results = []
    try:
        for cap in (0.0, 1e-3):
            options.server_poll_seconds = cap
            assert server_wait_cap(topo) == cap
            results.append(run(topo, True, True))
    finally:
        del options.server_poll_seconds
        topo.free()
    (_, pulled_a, tables_a, _), (_, pulled_b, tables_b, _) = results
    ok = all(np.array_equal(a[n][i], b[n][i]) for a, b in zip(pulled_a, pulled_b)
             for n in a for i in (0, 1))
    for spec in SPECS:
        (t1, state1, _), (t2, state2, _) = tables_a[spec.name], tables_b[spec.name]
        ok &= np.array_equal(t1, t2) and all(np.array_equal(state1[k], state2[k])
                                             for k in state1)
    assert comm.allreduce(bool(ok), op=MPI.LAND)


def test_server_wait_cap_follows_the_one_wait_policy():
    """A server sleeps between polls by default (HPCPAX_WAIT=sleep), on any host and
    whether or not it holds tables; inside MPI (0) under HPCPAX_WAIT=spin; an explicit
    server_poll_seconds wins either way."""
    from types import SimpleNamespace

    from hpcpax.options import options
    from hpcpax.ps.protocol import server_wait_cap

    for oversubscribed in (False, True):
        for idle in (False, True):
            topo = SimpleNamespace(oversubscribed=oversubscribed)
            assert server_wait_cap(topo, idle=idle) == options.poll_seconds > 0
    try:
        options.wait = "spin"
        assert server_wait_cap(SimpleNamespace(oversubscribed=True)) == 0.0
        options.server_poll_seconds = 2e-4
        assert server_wait_cap(SimpleNamespace(oversubscribed=False)) == 2e-4
        del options.wait
        options.server_poll_seconds = 0
        assert server_wait_cap(SimpleNamespace(oversubscribed=True)) == 0.0
    finally:
        del options.server_poll_seconds
        del options.wait


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_batched_pulls_see_the_batched_pushes(comm):
    """BSP through the batched path: the rows move by exactly the optimizer step."""
    topo = hpcpax.init(servers_per_node=0)
    try:
        ps = ParameterServer(topo, seed=5)
        specs = [SparseVariableSpec("x", 30, 2, dtype="float64", optimizer="sgd",
                                    optimizer_params={"lr": 1.0}),
                 SparseVariableSpec("y", 20, 4, dtype="float64", optimizer="sgd",
                                    optimizer_params={"lr": 1.0})]
        ps.register(specs)
        ids = {"x": np.array([0, 7, 7, 29]), "y": np.array([19, 3])}
        before = ps.pull_unique_many(ids)
        grads = {s.name: SparseGrad(ids[s.name], np.ones((len(ids[s.name]), s.dim)), s.rows)
                 for s in specs}
        assert ps.push_many(grads)
        after = ps.pull_unique_many(ids)
        for name in ids:
            unique, counts = np.unique(ids[name], return_counts=True)
            # mean over workers of identical gradients = each worker's sum per row
            want = before[name][1] - counts[:, None]
            assert np.array_equal(after[name][0], unique)
            assert np.allclose(after[name][1], want, rtol=0, atol=1e-12)
        ps.shutdown()
    finally:
        topo.free()


@pytest.fixture
def workers_ps(comm):
    """``(topology, ParameterServer)`` with SPECS registered, every rank a worker."""
    topo = hpcpax.init(servers_per_node=0)
    try:
        ps = ParameterServer(topo)
        ps.register(SPECS)
        yield topo, ps
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_bad_ids_in_one_batched_variable_raise_everywhere_tables_untouched(workers_ps):
    topo, ps = workers_ps
    before = {s.name: ps.read_table(s.name).copy() for s in SPECS}
    grads = {s.name: step_grad(s, topo.worker_index, 0) for s in SPECS}
    if topo.rank == 1:
        grads["c"] = SparseGrad(np.array([1, 300]), np.ones((2, 2), np.float32), 300)
    # every rank names the variable and the bad id (rank 1 its own error,
    # the others the broadcast message)
    with pytest.raises(SparseIndexError, match=r"c: index 300 is out of range for 300 rows"):
        ps.push_many(grads)
    bad_pull = {s.name: step_ids(s, topo.worker_index, 0) for s in SPECS}
    if topo.rank == 0:
        bad_pull["a"] = np.array([-1])
    with pytest.raises(SparseIndexError, match=r"a: index -1 is negative"):
        ps.pull_unique_many(bad_pull)
    for s in SPECS:
        assert np.array_equal(ps.read_table(s.name), before[s.name])


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_workers_batching_different_variables_raise_instead_of_hanging(workers_ps):
    topo, ps = workers_ps
    names = ["a", "b"] if topo.rank == 0 else ["a", "c"]
    with pytest.raises(MismatchError, match=r"pull_many\(a, b\).*pull_many\(a, c\)"):
        ps.pull_unique_many({n: np.array([1]) for n in names})


def test_batches_split_by_index_span():
    class V:
        def __init__(self, index):
            self.index = index

    groups = _batches([V(i) for i in (0, 5, MAX_BATCH - 1, MAX_BATCH, 200)])
    assert [[v.index for v in g] for g in groups] == [[0, 5, MAX_BATCH - 1], [MAX_BATCH], [200]]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("rpn", [None, 1])
def test_replicated_allgather_batch_equals_one_by_one(comm, rpn):
    """``sparse_replicated.push_many``: one Allgatherv for every allgather table,
    the same replicas bit for bit and the same bytes per table as one-by-one."""
    from hpcpax.ops import dedup_sum
    from hpcpax.ops.dedup import dedup_sum_reference
    from hpcpax.comm.sparse_collectives import allgather_sparse_many
    from hpcpax.sync.replicated import ReplicatedTable, push_many

    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=0)
    try:
        methods = {"a": "allgather", "b": "allreduce", "c": "allgather"}
        single = {s.name: ReplicatedTable(topo, s, methods[s.name], seed=2) for s in SPECS}
        batched = {s.name: ReplicatedTable(topo, s, methods[s.name], seed=2) for s in SPECS}
        acct = topo.accounting
        for step in range(STEPS):
            grads = {s.name: step_grad(s, topo.worker_index, step) for s in SPECS}
            acct.reset()
            for s in SPECS:
                single[s.name].push(grads[s.name])
            one = acct.as_dict()
            acct.reset()
            assert push_many(batched, grads)
            many = acct.as_dict()
            for s in SPECS:
                assert np.array_equal(single[s.name].table, batched[s.name].table)
                assert all(np.array_equal(single[s.name].state[k], batched[s.name].state[k])
                           for k in single[s.name].state)
                assert all(one["variables"][s.name][f] == many["variables"][s.name][f]
                           for f in FIELDS)
            assert many["phases"]["allgather"]["calls"] == 1
            assert one["phases"]["allgather"]["calls"] == 2
        # and the batched sums equal a plain NumPy reference: every worker's
        # rows gathered (pickled) in worker order, summed by np.add.at
        grads = {s.name: step_grad(s, topo.worker_index, STEPS) for s in SPECS}
        prepared = [dedup_sum(grads[n].indices, grads[n].values) for n in ("a", "c")]
        got = allgather_sparse_many(topo, ["a", "c"], [p[0] for p in prepared],
                                    [p[1] for p in prepared])
        for (ids, vals), (u, summed) in zip(prepared, got):
            everyone = topo.workers.allgather((ids, vals))
            want = dedup_sum_reference(np.concatenate([i for i, _ in everyone]),
                                       np.concatenate([v for _, v in everyone]))
            assert np.array_equal(u, want[0]) and np.array_equal(summed, want[1])
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_replicated_batch_with_a_bad_gradient_raises_everywhere(comm):
    from hpcpax.sync.replicated import ReplicatedTable

    topo = hpcpax.init(servers_per_node=0)
    try:
        tables = {s.name: ReplicatedTable(topo, s, "allgather") for s in SPECS}
        grads = {s.name: step_grad(s, topo.worker_index, 0) for s in SPECS}
        if topo.rank == 1:
            grads["b"] = SparseGrad(np.array([0]), np.full((1, 5), np.nan, np.float32), 40)
        assert_refused_unchanged(tables, grads, (ValueError, FloatingPointError))
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_alltoallv_many_equals_a_pickled_alltoall_reference(comm):
    """The raw helper: random counts (many zero), mixed widths and dtypes, one or two
    arrays per variable; against ``comm.alltoall`` of each peer's slices (pickle)."""
    from hpcpax.comm.exchange import alltoallv_many, alltoallv_rows, exchange_counts_many

    rng = np.random.default_rng([comm.rank, 11])
    size = comm.Get_size()
    kinds = [(np.float32, (3,)), (np.int64, ()), (np.float64, (2, 2)), (np.float32, (1,))]
    counts = rng.integers(0, 3, (size, len(kinds))) * rng.integers(0, 2, (size, len(kinds)))
    arrays = []
    for k, (dtype, shape) in enumerate(kinds):
        n = int(counts[:, k].sum())
        values = rng.standard_normal((n,) + shape).astype(dtype)
        arrays.append([values] if k % 2 else [rng.integers(0, 99, n), values])
    bounds = np.vstack([np.zeros((1, len(kinds)), np.int64), np.cumsum(counts, axis=0)])
    outgoing = [[[a[bounds[d, k]:bounds[d + 1, k]] for a in arrays[k]] for k in range(len(kinds))]
                for d in range(size)]
    incoming = comm.alltoall(outgoing)  # incoming[s][k]: what source s sent me of variable k
    recv = exchange_counts_many(comm, counts)
    got = alltoallv_many(comm, counts, recv, arrays)
    for k in range(len(kinds)):
        assert recv[:, k].tolist() == [len(incoming[s][k][0]) for s in range(size)]
        one = alltoallv_rows(comm, counts[:, k], recv[:, k], arrays[k])  # the K = 1 path
        for j, (a, b) in enumerate(zip(got[k], one)):
            want = np.concatenate([incoming[s][k][j] for s in range(size)])
            assert a.dtype == want.dtype and a.shape == want.shape and np.array_equal(a, want)
            assert b.dtype == want.dtype and np.array_equal(b, want)


def assert_refused_unchanged(tables, grads, error, match=None):
    """``push_many(tables, grads)`` raises ``error`` (matching ``match``) and no table
    changes."""
    from hpcpax.sync.replicated import push_many

    before = {n: t.table.copy() for n, t in tables.items()}
    with pytest.raises(error, match=match):
        push_many(tables, grads)
    assert all(np.array_equal(before[n], t.table) for n, t in tables.items())


SAME_WIDTH = [SparseVariableSpec(n, rows=r, dim=4, dtype="float32", optimizer=o,
                                 optimizer_params={"lr": 0.1})
              for n, r, o in (("x", 50, "sgd"), ("y", 7, "adagrad"), ("z", 300, "adam"))]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_replicated_tables_of_one_width_pushed_together_equal_one_by_one(comm):
    """Tables of one width are deduplicated and updated as one group (ids offset
    by table, one range check): the replicas equal pushing each table alone."""
    from hpcpax.sync.replicated import ReplicatedTable, push_many

    topo = hpcpax.init(servers_per_node=0)
    try:
        single = {s.name: ReplicatedTable(topo, s, "allgather", seed=3) for s in SAME_WIDTH}
        batched = {s.name: ReplicatedTable(topo, s, "allgather", seed=3) for s in SAME_WIDTH}
        for step in range(STEPS):
            grads = {s.name: step_grad(s, topo.worker_index, step) for s in SAME_WIDTH}
            for s in SAME_WIDTH:
                single[s.name].push(grads[s.name])
            assert push_many(batched, grads)
            for s in SAME_WIDTH:
                assert np.array_equal(single[s.name].table, batched[s.name].table)
                for k in single[s.name].state:
                    assert np.array_equal(single[s.name].state[k], batched[s.name].state[k])
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad", [7, -1])
def test_replicated_group_with_an_id_out_of_range_names_its_table(comm, bad):
    """An id past table y's 7 rows (or negative) in a group of one width: the
    error names y on every worker, and no table changes."""
    from hpcpax.sync.replicated import ReplicatedTable

    topo = hpcpax.init(servers_per_node=0)
    try:
        tables = {s.name: ReplicatedTable(topo, s, "allgather") for s in SAME_WIDTH}
        grads = {s.name: step_grad(s, topo.worker_index, 0) for s in SAME_WIDTH}
        if topo.worker_index == topo.num_workers - 1:
            grads["y"] = SparseGrad(np.array([0, bad]), np.ones((2, 4), np.float32), 7)
        assert_refused_unchanged(tables, grads, SparseIndexError, f"y: index {bad} is")
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("names", [("y",), ("x", "y", "z")])
def test_replicated_push_bounds_ids_by_the_table_not_the_gradients_num_rows(comm, names):
    """A SparseGrad claiming more rows than table y holds: an id past y's 7 rows is
    refused (the row updates trust the ids), alone or in a group of one width."""
    from hpcpax.sync.replicated import ReplicatedTable

    topo = hpcpax.init(servers_per_node=0)
    try:
        specs = [s for s in SAME_WIDTH if s.name in names]
        tables = {s.name: ReplicatedTable(topo, s, "allgather") for s in specs}
        grads = {s.name: step_grad(s, topo.worker_index, 0) for s in specs}
        grads["y"] = SparseGrad(np.array([0, 7]), np.ones((2, 4), np.float32), 1000)
        assert_refused_unchanged(tables, grads, SparseIndexError,
                                 "y: index 7 is out of range for 7 rows")
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("uneven", [False, True])
def test_an_agreed_gradient_the_same_everywhere_is_applied_without_an_exchange(
        comm, monkeypatch, uneven):
    """Gradients marked ``agreed`` (the workers' mean, read through ``.grad``) that are
    bit for bit the same on every worker are applied as they are, with no exchange;
    one that differs on a worker (``uneven``) is exchanged as an unmarked one is."""
    from hpcpax.sync import replicated
    from hpcpax.sync.replicated import ReplicatedTable, push_many

    exchanged = []
    gather = replicated.allgather_sparse_many
    monkeypatch.setattr(replicated, "allgather_sparse_many",
                        lambda topology, names, *rest: exchanged.append(list(names))
                        or gather(topology, names, *rest))
    topo = hpcpax.init(servers_per_node=0)
    alone = hpcpax.init(comm=MPI.COMM_SELF, servers_per_node=0)
    try:
        marked = {s.name: ReplicatedTable(topo, s, "allgather", seed=3) for s in SAME_WIDTH}
        plain = {s.name: ReplicatedTable(topo, s, "allgather", seed=3) for s in SAME_WIDTH}
        one = {s.name: ReplicatedTable(alone, s, "allgather", seed=3) for s in SAME_WIDTH}
        workers = topo.num_workers
        for step in range(STEPS):
            grads = {s.name: step_grad(s, 0, step) for s in SAME_WIDTH}  # every worker's
            if uneven and workers > 1 and topo.worker_index == workers - 1:
                grads["x"] = step_grad(SAME_WIDTH[0], 1, step)
            exchanged.clear()
            push_many(marked, {n: SparseGrad(g.indices, g.values, g.num_rows, agreed=n != "y")
                               for n, g in grads.items()})
            expect = (["y"] if not uneven else ["x", "y"]) if workers > 1 else []
            assert exchanged == ([expect] if expect else [])
            push_many(plain, grads)
            push_many(one, {n: step_grad(s, 0, step) for n, s in zip(grads, SAME_WIDTH)})
        everyone = comm.allgather({n: t.table for n, t in marked.items()})
        for name in marked:
            assert all(np.array_equal(other[name], marked[name].table) for other in everyone)
            if name == "x" and uneven and workers > 1:  # exchanged: the workers' mean
                assert np.array_equal(marked[name].table, plain[name].table)
            elif name != "y":  # applied as it is: one worker's own update
                assert np.array_equal(marked[name].table, one[name].table)
    finally:
        alone.free()
        topo.free()
