"""The relaxed parameter server (ssp, asp, psp) against exact references.

Every test runs on a server rank and at least two workers. The oracles:
SGD with lr 1 on integer gradients makes the final table the exact sum of
every push (in any order), so a lost or repeated push shows; ``ssp:0``
runs the collective path's steps and must give bit-identical rows; the
servers record the clock gap of every answered pull.
"""

import time

import numpy as np
import pytest

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.errors import ConfigError, NonFiniteError, SparseIndexError
from hpcpax.ps.relaxed import RelaxedParameterServer
from hpcpax.ps.relaxed.client import NO_STOP
from hpcpax.ps.sparse_grad import SparseGrad

ROWS, DIM = 64, 3
SUM_SPEC = SparseVariableSpec("emb", rows=ROWS, dim=DIM, initializer="zeros", optimizer="sgd",
                              optimizer_params={"lr": 1.0})


def int_step(worker, step, rows=ROWS, dim=DIM, count=9):
    """Ids and small integer gradients of one worker's step (exact in float32)."""
    rng = np.random.default_rng([worker, step, rows])
    ids = rng.integers(0, rows, count)
    return ids, rng.integers(-3, 4, (count, dim)).astype(np.float32)


def exact_sum(workers, steps, rows=ROWS, dim=DIM):
    """The table after SGD lr 1 on every push of ``steps`` steps of every worker."""
    table = np.zeros((rows, dim), np.float64)
    for w in range(workers):
        for s in range(steps):
            ids, grads = int_step(w, s, rows, dim)
            np.add.at(table, ids, -grads)
    return table


def relaxed_job(topo, consistency, groups="worker", reduce="sum", seed=0):
    ps = ParameterServer(topo, reduce=reduce, local_aggregation=groups == "node", seed=seed)
    return ps, RelaxedParameterServer(ps, consistency, groups=groups, seed=seed)


def jitter(worker, step):
    """A random short sleep (a worker's noise), deterministic per (worker, step)."""
    draw = np.random.default_rng([worker, step, 99]).random()
    if draw < 0.2:
        time.sleep(draw * 0.005)


def sum_steps(relaxed, worker, first, last, name="emb"):
    for step in range(first, last):
        ids, grads = int_step(worker, step)
        relaxed.pull({name: ids})
        jitter(worker, step)
        relaxed.push({name: SparseGrad(ids, grads, ROWS)})


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("consistency", ["ssp:2", "asp", "psp:1,1", "bsp"])
def test_every_push_applied_once_across_checkpoint_resume_and_shutdown(comm, all_ok,
                                                                      consistency):
    """Half the steps, a checkpoint (tables gathered between phases), a fresh server
    resumed from it at the workers' clocks, the rest, and a shutdown right after the
    last pushes: the table is the exact sum of every push."""
    topo = hpcpax.init()
    half, steps = 25, 50
    ps, relaxed = relaxed_job(topo, consistency)
    saved = None
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        relaxed.begin()
        sum_steps(relaxed, topo.worker_index, 0, half)
        relaxed.end()  # the checkpoint barrier: everything applied, nothing in flight
        relaxed.shutdown()
    saved = ps.gather_table("emb")  # collective over every rank: the "checkpoint"
    checkpoint_ok = topo.is_server or np.array_equal(saved[0],
                                                     exact_sum(topo.num_workers, half))
    relaxed.free()
    ps, relaxed = relaxed_job(topo, consistency)  # the resumed job
    if topo.is_server:
        ps.serve()  # the registration, on the collective path
    else:
        ps.register([SUM_SPEC])
        ps.shutdown()
    ps.load_table("emb", *saved)  # every rank at once: owners take their rows
    if topo.is_server:
        relaxed.serve()
        ok = True
    else:
        relaxed.begin(clock=half)
        sum_steps(relaxed, topo.worker_index, half, steps)
        relaxed.end()  # shutdown with the last pushes still in flight
        table = ps.read_table("emb")
        ok = np.array_equal(table, exact_sum(topo.num_workers, steps)) and relaxed.clock == steps
        relaxed.shutdown()
    relaxed.free()
    topo.free()
    assert all_ok(checkpoint_ok and ok)


BITWISE_SPECS = [
    SparseVariableSpec("a", rows=90, dim=4, optimizer="adagrad", optimizer_params={"lr": 0.3}),
    SparseVariableSpec("b", rows=40, dim=2, dtype="float64", optimizer="adam",
                       optimizer_params={"lr": 0.05}, num_partitions=3),
]


def float_step(spec, worker, step):
    rng = np.random.default_rng([worker, step, spec.rows])
    ids = np.minimum(rng.zipf(1.4, 12) - 1, spec.rows - 1).astype(np.int64)
    return ids, rng.standard_normal((len(ids), spec.dim)).astype(spec.dtype)


def bitwise_run(topo, relaxed_model, groups, steps=12):
    """Pulled rows of every step and the final tables, on the collective path or ssp:0."""
    la = groups == "node"
    ps = ParameterServer(topo, local_aggregation=la, seed=5)
    relaxed = (RelaxedParameterServer(ps, relaxed_model, groups=groups, seed=5)
               if relaxed_model else None)
    pulled, tables = [], None
    if topo.is_server:
        relaxed.serve() if relaxed else ps.serve()
    else:
        ps.register(BITWISE_SPECS)
        if relaxed:
            relaxed.begin()
        for step in range(steps):
            ids = {s.name: float_step(s, topo.worker_index, step)[0] for s in BITWISE_SPECS}
            grads = {s.name: SparseGrad(*float_step(s, topo.worker_index, step), s.rows)
                     for s in BITWISE_SPECS}
            got = relaxed.pull(ids) if relaxed else ps.pull_unique_many(ids)
            pulled.append({n: r.copy() for n, (_, r) in got.items()})
            if relaxed:
                jitter(topo.worker_index, step)
                relaxed.push(grads)
            else:
                ps.push_many(grads)
        if relaxed:
            relaxed.end()
        tables = {s.name: ps.read_table(s.name) for s in BITWISE_SPECS}
        relaxed.shutdown() if relaxed else ps.shutdown()
    if relaxed:
        relaxed.free()
    return pulled, tables


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("groups", ["worker", "node"])
def test_ssp0_gives_exactly_the_parameters_of_bsp(all_ok, groups):
    """Same steps on the collective path and under ssp:0 (adagrad, adam; random
    delays): every pulled row and the final tables are bit-identical. With
    ``groups="node"`` both aggregate inside the node first."""
    topo = hpcpax.init()
    bsp = bitwise_run(topo, None, groups)
    ssp = bitwise_run(topo, "ssp:0", groups)
    ok = True
    if topo.is_worker:
        ok = all(np.array_equal(a[n], b[n]) for a, b in zip(bsp[0], ssp[0]) for n in a)
        ok = ok and all(np.array_equal(bsp[1][n], ssp[1][n]) for n in bsp[1])
        # the test can fail: the rows pulled at step 0 (initial values) have moved since
        first = np.unique(float_step(BITWISE_SPECS[0], topo.worker_index, 0)[0])
        ok = ok and not np.array_equal(bsp[1]["a"][first], bsp[0][0]["a"])
    topo.free()
    assert all_ok(ok)


def staleness_run(topo, consistency, steps):
    """``steps`` pull+push steps per worker with random delays and one long stall
    per 100 steps on the first worker; the servers' merged staleness records."""
    ps, relaxed = relaxed_job(topo, consistency)
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        relaxed.begin()
        for step in range(steps):
            ids, grads = int_step(topo.worker_index, step)
            relaxed.pull({"emb": ids})
            jitter(topo.worker_index, step)
            if topo.worker_index == 0 and step % 100 == 50:
                time.sleep(0.03)  # the others run into the bound
            relaxed.push({"emb": SparseGrad(ids, grads, ROWS)})
        relaxed.end()
        relaxed.shutdown()
    records = relaxed.staleness()
    relaxed.free()
    return records


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(280)
@pytest.mark.parametrize("consistency,bound", [("ssp:2", 2), ("psp:1,1", 1)])
def test_staleness_bound_holds_under_random_delays(all_ok, consistency, bound):
    """For every answered pull the server recorded the puller's clock minus the
    slowest clock (psp: the slowest sampled peer's): over thousands of pulls the
    maximum is the bound, never above it."""
    topo = hpcpax.init()
    steps = 1000
    record = staleness_run(topo, consistency, steps)[consistency]
    ok = (record["pulls"] == steps * topo.num_workers  # one pull per step (one server)
          and sum(record["histogram"].values()) == record["pulls"]
          and record["violations"] == 0)
    if consistency.startswith("ssp"):
        ok = ok and record["max_gap"] == bound  # reached (the stalls), never exceeded
    else:
        ok = ok and record["max_sampled_gap"] <= bound
    topo.free()
    assert all_ok(ok), record


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("consistency", ["asp", "psp:1,0", "ssp:1"])
def test_a_slow_worker_holds_nobody_under_asp_and_psp(all_ok, consistency):
    """The first worker sleeps 50 ms a step, the others 1 ms. Workers step until the
    coordinator stops the run after ``budget`` worker-steps: asp and psp never
    deadlock, asp's fast workers run ahead, ssp:1 stops every worker at the same
    step; every push is applied once."""
    topo = hpcpax.init()
    ps, relaxed = relaxed_job(topo, consistency)
    budget = 40 * topo.num_workers
    ok, clocks = True, None
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        relaxed.begin(budget=budget)
        while not relaxed.boundary(NO_STOP):
            ids, grads = int_step(topo.worker_index, relaxed.clock)
            relaxed.pull({"emb": ids})
            time.sleep(0.05 if topo.worker_index == 0 else 0.001)
            relaxed.push({"emb": SparseGrad(ids, grads, ROWS)})
        relaxed.end()
        clocks = topo.workers.allgather(relaxed.clock)
        table = ps.read_table("emb")
        expected = np.zeros((ROWS, DIM))
        for w, c in enumerate(clocks):
            expected += exact_sum(1, c) if w == 0 else _exact_of(w, c)
        ok = np.array_equal(table, expected) and sum(clocks) >= budget
        if consistency == "ssp:1":
            ok = ok and max(clocks) - min(clocks) == 0  # ssp stops every worker together
        elif consistency == "asp":
            ok = ok and max(clocks) > 2 * min(clocks)  # the fast ones did not wait
        # psp:1,0 waits for the one peer it draws (with 2 workers, always the slow
        # one): it must only never deadlock
        relaxed.shutdown()
    relaxed.free()
    topo.free()
    assert all_ok(ok), (clocks, ok)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(120)
def test_workers_ending_a_phase_at_different_ssp_clocks_lose_nothing(all_ok):
    """ssp:5, the first worker stops a phase 4 steps before the others: the servers
    apply the unfinished clocks' sums at the phase end, and the rest of those clocks
    when the first worker catches up in the next phase; the table is the exact sum."""
    topo = hpcpax.init()
    ps, relaxed = relaxed_job(topo, "ssp:5")
    ok = True
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        first = 10 if topo.worker_index == 0 else 14
        relaxed.begin()
        sum_steps(relaxed, topo.worker_index, 0, first)
        relaxed.end()
        middle = ps.read_table("emb")
        expected = sum(_exact_of(w, 10 if w == 0 else 14) for w in range(topo.num_workers))
        ok = np.array_equal(middle, expected)
        relaxed.begin()
        sum_steps(relaxed, topo.worker_index, first, 14)  # the first worker catches up
        relaxed.end()
        ok = ok and np.array_equal(ps.read_table("emb"), exact_sum(topo.num_workers, 14))
        relaxed.shutdown()
    relaxed.free()
    topo.free()
    assert all_ok(ok)


def _exact_of(worker, steps):
    table = np.zeros((ROWS, DIM))
    for s in range(steps):
        ids, grads = int_step(worker, s)
        np.add.at(table, ids, -grads)
    return table


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(120)
def test_bad_input_raises_on_the_offending_worker_and_leaves_the_table(all_ok):
    """The first worker asks for an id out of range and pushes a NaN: each raises a
    clear error there, nothing is sent, and the table is the exact sum of the
    valid pushes; the other workers never notice."""
    topo = hpcpax.init()
    ps, relaxed = relaxed_job(topo, "ssp:1")
    steps, ok = 12, True
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        relaxed.begin()
        for step in range(steps):
            ids, grads = int_step(topo.worker_index, step)
            if topo.worker_index == 0 and step == 5:
                with pytest.raises(SparseIndexError, match="out of range for 64 rows"):
                    relaxed.pull({"emb": np.array([3, ROWS])})
                bad = grads.copy()
                bad[0, 0] = np.nan
                with pytest.raises(NonFiniteError, match="NaN or Inf"):
                    relaxed.push({"emb": SparseGrad(ids, bad, ROWS)})
                ok = ok and relaxed.clock == step  # the clock did not move
            relaxed.pull({"emb": ids})
            relaxed.push({"emb": SparseGrad(ids, grads, ROWS)})
        relaxed.end()
        ok = ok and np.array_equal(ps.read_table("emb"), exact_sum(topo.num_workers, steps))
        relaxed.shutdown()
    relaxed.free()
    topo.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(120)
def test_per_variable_models_on_one_server(all_ok):
    """``asp; emb=ssp:1``: each variable answered and applied under its own model."""
    topo = hpcpax.init()
    ps, relaxed = relaxed_job(topo, "asp; emb=ssp:1")
    other = SparseVariableSpec("other", rows=ROWS, dim=DIM, initializer="zeros",
                               optimizer="sgd", optimizer_params={"lr": 1.0})
    steps, ok = 20, True
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC, other])
        relaxed.begin()
        for step in range(steps):
            ids, grads = int_step(topo.worker_index, step)
            relaxed.pull({"emb": ids, "other": ids})
            jitter(topo.worker_index, step)
            relaxed.push({"emb": SparseGrad(ids, grads, ROWS),
                          "other": SparseGrad(ids, 2 * grads, ROWS)})
        relaxed.end()
        expected = exact_sum(topo.num_workers, steps)
        ok = (np.array_equal(ps.read_table("emb"), expected)
              and np.array_equal(ps.read_table("other"), 2 * expected))
        relaxed.shutdown()
    records = relaxed.staleness()
    ok = ok and set(records) == {"ssp:1", "asp"} and records["ssp:1"]["max_gap"] <= 1
    relaxed.free()
    topo.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_an_idle_server_sleeps(all_ok):
    """Workers in a phase but sending nothing for 2 s: the server polls with backoff,
    so its CPU time is a small fraction of the wall time (spinning would be ~100 %)."""
    topo = hpcpax.init()
    ps, relaxed = relaxed_job(topo, "asp")
    if topo.is_server:
        relaxed.serve()
    else:
        ps.register([SUM_SPEC])
        relaxed.begin()
        time.sleep(2.0)
        relaxed.end()
        relaxed.shutdown()
    stats = relaxed.server_stats()
    relaxed.free()
    topo.free()
    ok = all(s["cpu_seconds"] < 0.25 * s["phase_seconds"] for s in stats)
    assert all_ok(ok), stats


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_relaxed_models_need_server_ranks(all_ok):
    """With no server rank the workers host the rows: refused on every rank, by name."""
    topo = hpcpax.init(servers_per_node=0)
    ps = ParameterServer(topo)
    with pytest.raises(ConfigError, match="needs server ranks"):
        RelaxedParameterServer(ps, "ssp:1")
    topo.free()
    assert all_ok(True)
