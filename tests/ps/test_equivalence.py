"""BSP equivalence: any layout trains exactly like one process.

The same global batch trained 20 steps on 1..4 ranks, with 0-2 servers per
node, virtual nodes, several partition counts, local aggregation on and off,
and each sparse method (ps, allgather, dense) gives the parameters of the
plain-NumPy single-process run (relative 1e-6).
"""

import itertools
import sys
from pathlib import Path

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad
from hpcpax.sync.replicated import ReplicatedTable

sys.path.insert(0, str(Path(__file__).parent))
import toy  # noqa: E402


def train(topo, store, steps=toy.STEPS):
    """Run the toy model on this worker's shard through ``store``."""
    weight = toy.init_dense()
    w, n = topo.worker_index, topo.num_workers
    losses = []
    for step in range(steps):
        ids, target = toy.batch(step)
        share = slice(w * toy.BATCH // n, (w + 1) * toy.BATCH // n)
        ids, target = ids[share], target[share]
        unique, rows = store.pull_unique("emb", ids) if isinstance(store, ParameterServer) \
            else store.pull_unique(ids)
        loss, grad_w, gid, gval = toy.forward_backward(weight, ids, unique, rows, target)
        grad = SparseGrad(gid, gval, toy.ROWS)
        store.push("emb", grad) if isinstance(store, ParameterServer) else store.push(grad)
        topo.workers.Allreduce(MPI.IN_PLACE, grad_w, op=MPI.SUM)
        weight -= toy.DENSE_LR * grad_w / n
        losses.append(topo.workers.allreduce(loss * len(ids)) / toy.BATCH)
    table = store.read_table("emb") if isinstance(store, ParameterServer) else store.read_table()
    return table, weight, losses


def layouts(size):
    servers = [0, 1] + ([2] if size >= 3 else [])
    rpn = [None] + ([2] if size >= 3 else [])
    for s, r, parts, la in itertools.product(servers, rpn, [None, 3], [True, False]):
        if size == 1 and s:
            continue
        per_node = r or size
        if s and all(min(s, len(range(k, min(k + per_node, size)))) ==
                     len(range(k, min(k + per_node, size))) for k in range(0, size, per_node)):
            continue  # every rank would be a server
        yield s, r, parts, la


def run_layout(servers, rpn, parts, la, method="ps"):
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
    try:
        spec = toy.SPEC if parts is None else type(toy.SPEC)(
            **{**toy.SPEC.to_dict(), "num_partitions": parts})
        if method == "ps":
            store = ParameterServer(topo, local_aggregation=la)
            if topo.is_server:
                store.serve()
                return None
            store.register([spec])
            result = train(topo, store)
            store.shutdown()
            return result
        if topo.is_server:
            return None
        return train(topo, ReplicatedTable(topo, spec, method=method))
    finally:
        topo.free()


@pytest.fixture(scope="module")
def reference():
    return toy.reference_run()


def _close(result, reference):
    table, weight, losses = result
    ref_table, ref_weight, ref_losses = reference
    return (np.allclose(table, ref_table, rtol=1e-6, atol=1e-12)
            and np.allclose(weight, ref_weight, rtol=1e-6, atol=1e-12)
            and np.allclose(losses, ref_losses, rtol=1e-6))


def test_reference_learns(reference):
    losses = reference[2]
    assert losses[-1] < 0.5 * losses[0]


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_ps_equals_single_process(comm, reference):
    failures = []
    for servers, rpn, parts, la in layouts(comm.Get_size()):
        result = run_layout(servers, rpn, parts, la)
        if result is not None and not _close(result, reference):
            failures.append((servers, rpn, parts, la))
    everyone = comm.allgather(failures)
    assert not any(everyone), f"layouts differing from the reference: {everyone}"


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("method", ["allgather", "allreduce"])
def test_replicated_methods_equal_single_process(comm, reference, method):
    ok = True
    for servers in (0, 1) if comm.Get_size() > 1 else (0,):
        result = run_layout(servers, None, None, True, method=method)
        if result is not None:
            ok &= _close(result, reference)
    assert comm.allreduce(ok, op=MPI.LAND)


HOT_SPEC = SparseVariableSpec("hot", rows=8, dim=3, initializer="zeros", optimizer="sgd",
                              optimizer_params={"lr": 1.0})


def hot_batch(rows=3000):
    """Id 0 takes two thirds of the rows (past one summation chunk on every worker)."""
    rng = np.random.default_rng(11)
    ids = np.where(rng.random(rows) < 2 / 3, 0, rng.integers(1, HOT_SPEC.rows, rows))
    grads = (rng.standard_normal((rows, HOT_SPEC.dim)) * 10.0 ** rng.integers(-3, 4, (rows, 1)))
    return ids, grads.astype(np.float32)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_hot_id_past_one_chunk_is_within_the_stated_bound(comm):
    """One SGD push (lr 1, reduce sum) of a batch whose id 0 has ~2000 rows.

    Every layout sums each id's rows in the order of hpcpax.ops.summation on
    each worker (chunks of SUM_CHUNK, a fixed tree), then adds the workers'
    sums one at a time (node aggregation, then the owner): rounding only, so
    each row is within gamma_d * sum|g| of the exact sum, d = tree_depth(L)
    + 2 * ranks (L the id's rows on one worker: at most its whole count).
    1 rank and N ranks then agree to twice that, in float32; the tests of
    this module with toy batches (no id past SUM_CHUNK rows) keep rtol 1e-6.
    """
    from hpcpax.ops.summation import tree_depth

    ids, grads = hot_batch()
    exact, magnitude = np.zeros((HOT_SPEC.rows, HOT_SPEC.dim)), np.zeros((HOT_SPEC.rows, HOT_SPEC.dim))
    np.add.at(exact, ids, grads.astype(np.float64))
    np.add.at(magnitude, ids, np.abs(grads.astype(np.float64)))
    depth = np.array([tree_depth(int(c)) for c in np.bincount(ids, minlength=HOT_SPEC.rows)])
    depth = (depth + 2 * comm.Get_size())[:, None]
    u = np.finfo(np.float32).eps / 2
    bound = depth * u / (1 - depth * u) * magnitude
    failures = []
    for servers, rpn, parts, la in layouts(comm.Get_size()):
        topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
        try:
            spec = HOT_SPEC if parts is None else type(HOT_SPEC)(
                **{**HOT_SPEC.to_dict(), "num_partitions": parts})
            store = ParameterServer(topo, local_aggregation=la, reduce="sum")
            if topo.is_server:
                store.serve()
                continue
            store.register([spec])
            w, n = topo.worker_index, topo.num_workers
            share = slice(w * len(ids) // n, (w + 1) * len(ids) // n)
            store.push("hot", SparseGrad(ids[share], grads[share], HOT_SPEC.rows))
            table = store.read_table("hot")
            store.shutdown()
            if not np.all(np.abs(table.astype(np.float64) + exact) <= bound):
                failures.append((servers, rpn, parts, la))
        finally:
            topo.free()
    everyone = comm.allgather(failures)
    assert not any(everyone), f"layouts past the bound: {everyone}"
