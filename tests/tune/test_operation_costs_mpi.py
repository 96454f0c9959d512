"""hpcpax's per-operation costs, measured on the job's own ranks (servers serving)."""

import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.tune.operation_costs import measure_operations

OPERATIONS = {"ps_pull", "ps_push", "ps_pull_no_aggregation", "ps_push_no_aggregation",
              "after_ps_push", "after_ps_push_no_aggregation", "after_allgather_push",
              "after_allreduce_push",
              "allgather_push", "allreduce_push", "replica_pull", "dense_allreduce", "control",
              "dense_allreduce_idle", "control_idle", "per_partition"}


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(180)
def test_operations_measured_on_the_job_agree_on_every_rank(comm):
    topo = hpcpax.init(None, 1, comm=comm)  # one server: it serves the PS operations
    try:
        costs = measure_operations(topo, counts=(1, 3), repeats=3)
    finally:
        topo.free()
    ok = set(costs) == OPERATIONS and all(
        entry["call_s"] >= 0.0 and entry["per_variable_s"] >= 0.0 for entry in costs.values())
    # a batched PS pull crosses ranks: it costs more than nothing
    ok = ok and costs["ps_pull"]["call_s"] + costs["ps_pull"]["per_variable_s"] > 0.0
    ok = ok and costs["control"]["per_variable_s"] == 0.0
    ok = ok and costs["control_idle"]["per_variable_s"] == 0.0
    # a replicated push's wait has no per-row form (its rows' work is priced as work)
    ok = ok and costs["after_allgather_push"]["per_row_s"] == 0.0
    same = comm.allgather(costs) == [costs] * comm.Get_size()
    assert comm.allreduce(ok and same, op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_after_work_factor_is_measured_for_serving_and_idle_servers(comm):
    """Both server modes measured, >= 0, the same on every rank. (Under the one wait
    policy's default both modes sleep between polls, so a serving server no longer
    makes the workers take turns on an oversubscribed host, as it did waiting
    inside MPI: no order between the two is asserted.)"""
    from hpcpax.tune.calibrate import measure_after_work, measure_handoff

    topo = hpcpax.init(None, 1, comm=comm)
    try:
        factors = measure_after_work(topo, repeats=20)  # the same on every rank
        handoff = measure_handoff(comm, repeats=10, topology=topo)
    finally:
        topo.free()
    ok = set(factors) == {"serving", "idle"} and all(v >= 0.0 for v in factors.values())
    ok = ok and set(handoff["after_work"]) == {"serving", "idle"}
    same = comm.allgather(factors) == [factors] * comm.Get_size()
    assert comm.allreduce(ok and same, op=MPI.LAND)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(180)
def test_operations_after_a_workers_own_work_are_timed_cold(comm):
    """``cold`` runs on the workers before each timed call (and the warm-up) of the
    operations a step runs after the worker's own work, and before no other: a
    push's next collective must follow the push directly."""
    from hpcpax.tune.operation_costs import COLD_OPERATIONS

    calls = []
    repeats = 2
    topo = hpcpax.init(None, 1, comm=comm)
    try:
        measure_operations(topo, counts=(1, 3), repeats=repeats, cold=calls.append)
        worker = topo.is_worker
    finally:
        topo.free()
    # each operation runs for every k of counts and, where its cost grows with the rows,
    # once with many rows (allreduce_push has no such form)
    variants = {name: 2 if name == "allreduce_push" else 3 for name in COLD_OPERATIONS}
    want = {name: (repeats + 1) * n for name, n in variants.items()} if worker else {}
    got = {name: calls.count(name) for name in set(calls)}
    ok = got == want
    assert comm.allreduce(ok, op=MPI.LAND), (got, want)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(180)
def test_a_budget_cuts_every_part_to_the_repeats_that_fit(comm):
    """With a budget no repeat fits, every part keeps MIN_REPEATS timed repeats (all
    workers alike, the slowest one's pace decides) instead of ``repeats``: a slow link
    cannot stretch start-up; the figures are still complete."""
    from hpcpax.tune.operation_costs import COLD_OPERATIONS, MIN_REPEATS

    calls = []
    topo = hpcpax.init(None, 1, comm=comm)
    try:
        costs = measure_operations(topo, counts=(1, 3), repeats=12, cold=calls.append,
                                   budget_s=1e-9)
        worker = topo.is_worker
    finally:
        topo.free()
    variants = {name: 2 if name == "allreduce_push" else 3 for name in COLD_OPERATIONS}
    want = {name: (MIN_REPEATS + 1) * n for name, n in variants.items()} if worker else {}
    got = {name: calls.count(name) for name in set(calls)}
    ok = got == want and all(v["call_s"] >= 0 for v in costs.values())
    assert comm.allreduce(ok, op=MPI.LAND), (got, want)
