"""Tables as large as the id space on the parameter server, on any layout.

A table of ``2**63 - 1`` rows (hashed ids) trained with ids near ``2**62``
on 1..4 ranks, with and without servers, ``mod`` and ``range`` partitions
and a repartition in the middle, gives the rows of a NumPy reference that
holds only the touched rows. Then: the budget error reaches every rank,
LRU eviction keeps a run going and is counted, checkpoints hold only the
rows touched and resume on another layout, and whole-table operations
refuse such a table.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.app import checkpoint_files as ckpt
from hpcpax.errors import ConfigError
from hpcpax.ops.optimizers import make_optimizer
from hpcpax.plan.auto import make_plan
from hpcpax.ps.initializers import init_rows
from hpcpax.ps.memory import MemoryBudgetError, row_footprint, table_report
from hpcpax.ps.sparse_grad import SparseGrad
from hpcpax.sync.variable import VariableSync

HUGE = 2**63 - 1
DIM, BATCH, STEPS, SEED = 4, 24, 6, 9
# hashed-looking ids: near 2**62, near the top of the id space, and a few small ones
POOL = np.array([2**62 + k * 2**56 for k in range(20)] + [HUGE - 1 - k for k in range(12)]
                + list(range(8)), np.int64)


def spec_of(kind="mod", parts=None, **extra):
    return SparseVariableSpec("hashed", rows=HUGE, dim=DIM, dtype="float64",
                              optimizer="adagrad", optimizer_params={"lr": 0.3},
                              partitioning=kind, num_partitions=parts, **extra)


def global_batch(step):
    rng = np.random.default_rng(100 + step)
    ids = POOL[rng.integers(0, POOL.size, BATCH)]
    return ids, rng.standard_normal((BATCH, DIM))


def reference(workers, steps=STEPS):
    """The pool's rows after ``steps`` (mean over ``workers``), in plain NumPy."""
    table = init_rows("uniform", SEED, "hashed", POOL, DIM, "float64", 0.05)
    optimizer = make_optimizer("adagrad", lr=0.3)
    state = optimizer.init_state(table.shape, table.dtype, np)
    position = {int(i): k for k, i in enumerate(POOL)}
    for step in range(steps):
        ids, grads = global_batch(step)
        local = np.array([position[int(i)] for i in ids])
        summed = np.zeros_like(table)
        np.add.at(summed, local, grads)
        touched = np.unique(local)
        optimizer.apply_rows_reference(table, state, touched, summed[touched] / workers)
    return table


def train(topo, ps, steps, repartition_at=None):
    w, n = topo.worker_index, topo.num_workers
    for step in range(steps):
        if step == repartition_at:
            ps.repartition("hashed", 5)
        ids, grads = global_batch(step)
        share = slice(w * BATCH // n, (w + 1) * BATCH // n)
        ps.pull_unique("hashed", ids[share])
        ps.push("hashed", SparseGrad(ids[share], grads[share], HUGE))
    return ps.pull("hashed", POOL)


def serving(topo, ps):
    """Servers follow the workers until shutdown; True on servers."""
    if topo.is_server:
        ps.serve()
        return True
    return False


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(180)
def test_ids_near_2_62_train_like_numpy_on_every_layout(comm, all_ok):
    failures = []
    size = comm.Get_size()
    for servers, kind, parts in [(0, "mod", None), (1, "mod", 3), (1, "range", None),
                                 (0, "range", 3)]:
        if servers and size == 1:
            continue
        topo = hpcpax.init(servers_per_node=servers)
        try:
            ps = ParameterServer(topo, seed=SEED)
            if serving(topo, ps):
                continue
            ps.register([spec_of(kind, parts)])
            rows = train(topo, ps, STEPS, repartition_at=3)
            expected = reference(topo.num_workers)
            ps.shutdown()
            if not np.allclose(rows, expected, rtol=1e-12, atol=1e-15):
                failures.append((servers, kind, parts))
        finally:
            topo.free()
    assert all_ok(not failures), failures


def run_with_budget(eviction, budget_rows, steps):
    """Steps touching 400 new ids each through owners holding ``budget_rows`` rows."""
    topo = hpcpax.init(servers_per_node=1 if MPI.COMM_WORLD.Get_size() > 1 else 0)
    spec = SparseVariableSpec("items", rows=10**12, dim=8, optimizer="adagrad",
                              optimizer_params={"lr": 0.1}, eviction=eviction)
    ps = ParameterServer(topo, seed=SEED)
    ps.memory_budget = budget_rows * row_footprint(spec, make_optimizer("adagrad", lr=0.1),
                                                   lru=eviction == "lru")
    errors, firsts, again = [], None, None
    try:
        if topo.is_server:
            while True:  # a refused operation leaves serve(); follow on to the shutdown
                try:
                    ps.serve()
                    break
                except MemoryBudgetError as exc:
                    errors.append(str(exc))
        else:
            ps.register([spec])
            hot = np.arange(50, dtype=np.int64) * 10**9
            for step in range(steps):
                fresh = 10**11 + np.arange(400) * topo.num_workers + topo.worker_index \
                    + step * 10**6
                ids = np.concatenate([hot, fresh])
                try:
                    rows = ps.pull("items", ids)
                    ps.push("items", SparseGrad(ids, np.ones_like(rows), spec.rows))
                except MemoryBudgetError as exc:
                    errors.append(str(exc))
                    break
                if step == 0:
                    firsts = ps.pull("items", fresh[:5])
            if not errors:  # step 0's new rows, long evicted under lru
                again = ps.pull("items", 10**11 + np.arange(5) * topo.num_workers
                                + topo.worker_index)
            ps.shutdown()
        report = table_report(topo.comm, ps)
        return topo, errors, report, (firsts, again)
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_budget_error_is_raised_on_every_rank(comm, all_ok):
    topo, errors, report, _ = run_with_budget("none", 2000, steps=30)
    message = errors[0] if errors else ""
    ok = (len(errors) == 1 and "'items'" in message and "owner rank" in message
          and "memory budget" in message and "rows held" in message)
    assert all_ok(ok), errors
    held = report["items"]["rows_held"]
    assert all_ok(0 < held <= 2048 * len(topo.owner_ranks)), report


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_lru_eviction_keeps_the_run_going_and_is_counted(comm, all_ok):
    topo, errors, report, (firsts, again) = run_with_budget("lru", 3000, steps=30)
    items = report["items"]
    workers = comm.Get_size() - (1 if comm.Get_size() > 1 else 0)
    touched = 50 + 400 * workers * 30
    ok = (not errors and items["rows_created"] >= touched and items["rows_evicted"] > 0
          and items["evictions"] > 0 and items["rows_held"] <= 3000  # one owner rank
          and items["rows_created"] - items["rows_evicted"] == items["rows_held"])
    if not topo.is_server:  # evicted rows come back from the initializer
        ids = 10**11 + np.arange(5) * topo.num_workers + topo.worker_index
        initial = init_rows("uniform", SEED, "items", ids, 8, "float32", 0.05)
        ok = ok and np.array_equal(again, initial) and not np.array_equal(firsts, initial)
    assert all_ok(ok), (errors, report)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_checkpoint_holds_touched_rows_and_resumes_on_another_layout(comm, all_ok, tmp_path):
    path = comm.bcast(str(tmp_path), root=0)
    topo = hpcpax.init(servers_per_node=1 if comm.Get_size() > 1 else 0)
    before, first_worker = None, topo.worker_ranks[0]
    try:
        ps = ParameterServer(topo, seed=SEED)
        if not serving(topo, ps):
            ps.register([spec_of("mod", 3)])
            before = train(topo, ps, STEPS)
            ps.shutdown()
        shard = ps.variables["hashed"].shard
        sparse = [("hashed", *shard.export())] if shard is not None else []
        dense = ({}, {}) if topo.rank == 0 else None
        saved = ckpt.save(comm, path, STEPS, dense=dense, sparse=sparse)
    finally:
        topo.free()
    ids = ckpt.load_matching(saved, "hashed", lambda ids: np.ones(len(ids), bool))[0]
    touched = np.unique(np.concatenate([global_batch(s)[0] for s in range(STEPS)]))
    ok = np.array_equal(np.sort(ids), touched)  # the touched rows, nothing else
    topo = hpcpax.init(servers_per_node=0)
    try:
        ps = ParameterServer(topo, seed=SEED)
        ps.register([spec_of("range", 5)])
        shard = ps.variables["hashed"].shard
        if shard is not None:
            shard.restore(lambda keep: ckpt.load_matching(saved, "hashed", keep))
        after = ps.pull("hashed", POOL)
        ps.shutdown()
    finally:
        topo.free()
    expected = comm.bcast(before, root=first_worker)
    assert all_ok(ok and np.array_equal(after, expected))


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_whole_table_operations_refuse_a_huge_table_on_every_rank(comm, all_ok):
    topo = hpcpax.init(servers_per_node=0)
    try:
        ps = ParameterServer(topo, seed=SEED)
        spec = SparseVariableSpec("big", rows=10**9, dim=16)
        ps.register([spec])
        refused = []
        for call in (lambda: ps.gather_table("big"), lambda: ps.read_table("big"),
                     lambda: VariableSync(topo, spec, ps, "allgather")):
            try:
                call()
                refused.append("")
            except ConfigError as exc:
                refused.append(str(exc))
        ps.shutdown()
    finally:
        topo.free()
    ok = all("big" in m and "HPCPAX_REPLICA_MEMORY" in m and "1,000,000,000 rows" in m
             for m in refused)
    assert all_ok(ok), refused


def test_planner_never_replicates_a_table_above_the_replica_bound():
    from hpcpax.plan.cost_model import CostParams

    fabric = {"intra": {"latency_s": 1e-6, "bandwidth_Bps": 5e9},
              "inter": {"latency_s": 2e-6, "bandwidth_Bps": 12.5e9}}
    shape = {"num_nodes": 1, "workers_per_node": 4, "servers_per_node": 0}

    def method(rows, slots):
        var = {"name": "emb", "kind": "sparse", "shape": [rows, 64], "dtype": "float32",
               "alpha": 200 / rows, "alpha_node": 600 / rows, "row_slots": slots}
        # fixed kernel rates: the choice must not follow this machine's load
        return make_plan([var], "auto", shape, fabric,
                         params=CostParams(source="fixed for the test")).variables["emb"]

    small = method(1000, 1)  # tiny and touched whole: a replica is cheapest
    assert small.method in ("allgather", "allreduce"), small
    for rows in (10**9, HUGE):
        huge = method(rows, 1)
        assert huge.method == "ps" and "HPCPAX_REPLICA_MEMORY" in huge.reason
