"""The measured-constant mechanisms of the step model, against hand-computed cases:
hand-off (scheduling), per-operation costs measured on the job's ranks, the
``Allreduce`` fit, the calibration's thread limits and the learned correction's
cross-validation."""

import numpy as np
import pytest

from hpcpax.plan import collectives as coll
from hpcpax.tune.calibrate import fit_relative
from hpcpax.plan.cost_model import CostParams
from hpcpax.runlog.learned import FEATURES, fit_correction, load_correction
from hpcpax.runlog.log import RunLog
from hpcpax.plan.step_model import handoff_seconds, predict_step
from hpcpax.plan.traffic import Layout, routing_from_ids

A = 1e-3  # 1 ms per message, links so fast that bytes cost nothing
FAST = coll.Links(A, 1e18, A, 1e18)
#: the dense allreduce priced after the push, not overlapped with it
ALONE = {"dense_overlaps_push": False}
SOFTWARE = {"ps_pull": {"call_s": 1e-3, "per_variable_s": 2e-4},
            "ps_push": {"call_s": 3e-3, "per_variable_s": 4e-4},
            "ps_pull_no_aggregation": {"call_s": 5e-4, "per_variable_s": 1e-4},
            "ps_push_no_aggregation": {"call_s": 6e-4, "per_variable_s": 1e-4},
            "allgather_push": {"call_s": 7e-4, "per_variable_s": 1e-4},
            "dense_allreduce": {"call_s": 2e-4, "per_variable_s": 1e-5},
            "control": {"call_s": 3e-4, "per_variable_s": 0.0}}


def _ps_routing(layout, aggregate=False):
    # 2 workers, each touching rows of both partitions
    ids = [np.array([0, 5]), np.array([1, 6])]
    return routing_from_ids(layout, "ps", 8, 16, ids, partitions=2, local_aggregation=aggregate)


def test_handoff_scales_server_work_only():
    handoff = {"handoff_s": 1e-4, "handoff_per_work": 0.5}
    assert handoff_seconds(handoff, "compute", 0.01) == 0.0
    assert handoff_seconds(handoff, "client kernels", 0.01) == 0.0
    assert handoff_seconds(handoff, "server CPU", 0.01) == pytest.approx(0.005)
    assert handoff_seconds(handoff, "server CPU", 0.0) == 0.0
    assert handoff_seconds(None, "server CPU", 0.01) == 0.0
    # compute and data were timed with every worker busy: not scaled; one hand-off per
    # operation: here the dense allreduce and the step's figures
    layout = Layout.from_shape(1, 2, 0)
    pred = predict_step(layout, FAST, CostParams(handoff=handoff), {}, dense_bytes=[64],
                        compute_s=0.01, data_s=0.002, include_control=True)
    assert pred.phases["compute"] == pytest.approx(0.01)
    assert pred.phases["data"] == pytest.approx(0.002)
    assert pred.resources["scheduling"] == pytest.approx(2e-4)
    # a PS variable adds its pull and its push
    ps = predict_step(layout, FAST, CostParams(handoff=handoff), {"t": _ps_routing(layout)},
                      dense_bytes=[64], include_control=True)
    assert ps.resources["scheduling"] == pytest.approx(4e-4)


def test_handoff_per_work_lands_on_the_servers_apply():
    layout = Layout.from_shape(1, 2, 1)
    routing = _ps_routing(layout)
    kernels = {"apply": {"call_s": 0.0, "unit_s": 1e-6}, "dedup": {"call_s": 0.0, "unit_s": 1e-6},
               "gather": {"call_s": 0.0, "unit_s": 1e-6}}
    flat = predict_step(layout, FAST, CostParams(kernels=kernels, handoff={
        "handoff_s": 0.0, "handoff_per_work": 0.0}), {"t": routing}, include_control=False)
    scaled = predict_step(layout, FAST, CostParams(kernels=kernels, handoff={
        "handoff_s": 0.0, "handoff_per_work": 0.5}), {"t": routing}, include_control=False)
    assert flat.resources["server CPU"] > 0
    assert scaled.resources["scheduling"] == pytest.approx(0.5 * flat.resources["server CPU"])
    assert scaled.seconds - flat.seconds == pytest.approx(0.5 * flat.resources["server CPU"])


def test_compute_off_host_takes_no_turns():
    """An accelerator's (or ``--emulate-compute``'s) forward and backward hold no host
    core: charged to ``accelerator``, the push waits for no turns at it, only at the
    gradients' dedup; the step differs from the on-host one by exactly those turns."""
    layout = Layout.from_shape(1, 2, 1)
    unit = {"call_s": 0.0, "unit_s": 1e-6}
    kernels = {k: dict(unit) for k in ("unique", "dedup", "gather", "apply", "dense_optimizer")}
    params = CostParams(kernels=kernels, software=SOFTWARE, software_scope="job",
                        handoff={"handoff_s": 0.0, "handoff_per_work": 0.0,
                                 "after_work": {"serving": 2.0, "idle": 0.5}})
    ps = {"t": _ps_routing(layout)}
    on, off = (predict_step(layout, FAST, params, ps, dense_bytes=[400], compute_s=0.004,
                            data_s=0.001, compute_on_host=host) for host in (True, False))
    assert off.phases["compute"] == on.phases["compute"] == pytest.approx(0.004)
    assert off.resources["accelerator"] == pytest.approx(0.004)
    assert on.resources["compute"] - off.resources["compute"] == pytest.approx(0.004)
    assert on.phases["push"] - off.phases["push"] == pytest.approx(2.0 * 0.004)
    assert on.seconds - off.seconds == pytest.approx(2.0 * 0.004)


def test_after_work_waits_for_the_workers_turns():
    """The first collective after the workers' own work waits ``after_work`` times the
    work since the previous collective: the pull for data and the ids' dedup, the push
    for compute and the gradients' dedup, the step's figures for the optimizer; the
    ``serving`` factor when PS tables are served, ``idle`` otherwise."""
    layout = Layout.from_shape(1, 2, 1)
    unit = {"call_s": 0.0, "unit_s": 1e-6}
    kernels = {k: dict(unit) for k in ("unique", "dedup", "gather", "apply", "dense_optimizer")}
    factors = {"serving": 2.0, "idle": 0.5}

    def step(routings, after_work):
        params = CostParams(kernels=kernels, software=SOFTWARE, software_scope="job",
                            handoff={"handoff_s": 0.0, "handoff_per_work": 0.0,
                                     "after_work": after_work})
        return predict_step(layout, FAST, params, routings, dense_bytes=[400],
                            compute_s=0.004, data_s=0.001, include_control=True)

    ps = {"t": _ps_routing(layout)}
    flat, turns = step(ps, {"serving": 0.0, "idle": 0.0}), step(ps, factors)
    # kernels: unique of 2 raw ids per worker; dedup of 2 rows x 16 bytes; the optimizer
    # over 400 bytes (1 us per unit)
    unique, dedup, optimizer = 2e-6, 32e-6, 400e-6
    assert flat.resources.get("scheduling", 0.0) == 0.0
    assert turns.phases["pull"] - flat.phases["pull"] == pytest.approx(2.0 * (0.001 + unique))
    assert turns.phases["push"] - flat.phases["push"] == pytest.approx(2.0 * (0.004 + dedup))
    assert turns.phases["control"] - flat.phases["control"] == pytest.approx(2.0 * optimizer)
    assert turns.phases["dense"] == pytest.approx(flat.phases["dense"])  # after the push
    assert turns.resources["scheduling"] == pytest.approx(
        2.0 * (0.001 + unique + 0.004 + dedup + optimizer))
    # every table replicated: the servers idle, the idle factor; the local read, the
    # compute and the dedup all come before the allgather push's first collective
    gathered = {"t": routing_from_ids(layout, "allgather", 8, 16,
                                      [np.array([0, 5]), np.array([1, 6])])}
    flat, turns = step(gathered, {"serving": 0.0, "idle": 0.0}), step(gathered, factors)
    before_push = 0.001 + 0.004 + (unique + 32e-6) + dedup  # read: unique + gather
    assert turns.phases["pull"] == pytest.approx(flat.phases["pull"])
    assert turns.phases["push"] - flat.phases["push"] == pytest.approx(0.5 * before_push)
    # without the measurement (presets, older calibrations) nothing changes
    assert step(ps, None).seconds == pytest.approx(step(ps, {"serving": 0.0,
                                                             "idle": 0.0}).seconds)


def test_operations_measured_on_the_job_hold_their_collectives_latencies():
    """1 node, 2 workers owning the 2 partitions, no aggregation: a pull is a header
    Allgatherv (1 round), a counts Alltoall, the ids Alltoallv and the rows back
    (1 peer each): 4 latencies, charged with process-scope costs, not with job-scope ones
    (the dense allreduce priced alone, not overlapped with the push)."""
    layout = Layout.from_shape(1, 2, 0)
    routing = _ps_routing(layout)
    process = predict_step(layout, FAST, CostParams(software=SOFTWARE, **ALONE), {"t": routing},
                           dense_bytes=[64, 64], include_control=True)
    job = predict_step(layout, FAST, CostParams(software=SOFTWARE, software_scope="job", **ALONE),
                       {"t": routing}, dense_bytes=[64, 64], include_control=True)
    pull = 5e-4 + 1e-4  # ps_pull_no_aggregation, one variable
    push = 6e-4 + 1e-4
    assert job.phases["pull"] == pytest.approx(pull)
    assert process.phases["pull"] == pytest.approx(pull + 4 * A)
    # push: header, counts, rows (no answer)
    assert job.phases["push"] == pytest.approx(push)
    assert process.phases["push"] == pytest.approx(push + 3 * A)
    # dense: one bucket of two tensors; MPICH's Allreduce of 32 floats on 2 ranks is
    # reduce-scatter + allgather, 2 rounds (the control vector too)
    assert job.phases["dense"] == pytest.approx(2e-4 + 2 * 1e-5)
    assert process.phases["dense"] == pytest.approx(2e-4 + 2 * 1e-5 + 2 * A)
    assert job.phases["control"] == pytest.approx(3e-4)
    assert process.phases["control"] == pytest.approx(3e-4 + 2 * A)
    assert "latency" not in job.resources


def test_aggregating_exchange_uses_the_aggregating_operation_cost():
    layout = Layout.from_shape(1, 2, 1)
    params = CostParams(software=SOFTWARE, software_scope="job", **ALONE)
    aggregated = predict_step(layout, FAST, params, {"t": _ps_routing(layout, True)},
                              include_control=False)
    direct = predict_step(layout, FAST, params, {"t": _ps_routing(layout, False)},
                          include_control=False)
    assert aggregated.phases["pull"] == pytest.approx(1e-3 + 2e-4)
    assert direct.phases["pull"] == pytest.approx(5e-4 + 1e-4)
    # without a measured no-aggregation cost both use the aggregating one
    only = {k: v for k, v in SOFTWARE.items() if "no_aggregation" not in k}
    fallback = predict_step(layout, FAST, CostParams(software=only, software_scope="job", **ALONE),
                            {"t": _ps_routing(layout, False)}, include_control=False)
    assert fallback.phases["pull"] == pytest.approx(1e-3 + 2e-4)


def test_workers_collectives_priced_in_the_servers_state_and_after_a_push():
    """dense and control: the ``_idle`` measurement when every table is replicated,
    the serving one with a PS table; after a PS push the next workers' collective
    (dense, else control) waits ``after_ps_push`` for the pushed tables (the dense
    allreduce priced after the push, not overlapped with it)."""
    layout = Layout.from_shape(1, 2, 1)
    software = {**SOFTWARE,
                "dense_allreduce_idle": {"call_s": 2e-5, "per_variable_s": 1e-6},
                "control_idle": {"call_s": 3e-5, "per_variable_s": 0.0},
                "after_ps_push": {"call_s": 5e-4, "per_variable_s": 2e-4, "per_row_s": 1e-5},
                "after_ps_push_no_aggregation": {"call_s": 7e-4, "per_variable_s": 0.0}}
    params = CostParams(software=software, software_scope="job", **ALONE)
    gathered = {"t": routing_from_ids(layout, "allgather", 8, 16,
                                      [np.array([0, 5]), np.array([1, 6])])}
    idle = predict_step(layout, FAST, params, gathered, dense_bytes=[64, 64])
    assert idle.phases["dense"] == pytest.approx(2e-5 + 2 * 1e-6)
    assert idle.phases["control"] == pytest.approx(3e-5)
    aggregated = {"t": _ps_routing(layout, True)}
    served = predict_step(layout, FAST, params, aggregated, dense_bytes=[64, 64])
    rows = 2  # each worker's ids of the table
    assert served.phases["dense"] == pytest.approx(2e-4 + 2 * 1e-5 + 5e-4 + 2e-4 + rows * 1e-5)
    assert served.phases["control"] == pytest.approx(3e-4)
    # the dense allreduce started before the push: the wait lands on the step's figures
    over = predict_step(layout, FAST, CostParams(software=software, software_scope="job"),
                        aggregated, dense_bytes=[64, 64])
    assert over.phases["control"] == pytest.approx(3e-4 + 5e-4 + 2e-4 + rows * 1e-5)
    # no dense tensors: the wait lands on the control Allreduce; no aggregation: its form
    direct = predict_step(layout, FAST, params, {"t": _ps_routing(layout, False)})
    assert direct.phases["dense"] == 0.0
    assert direct.phases["control"] == pytest.approx(3e-4 + 7e-4)
    # a replicated push's wait lands on the next collective too; with a PS push as
    # well the longer of the two
    waits = {**software, "after_allgather_push": {"call_s": 4e-4, "per_variable_s": 1e-4},
             "after_allreduce_push": {"call_s": 9e-4, "per_variable_s": 0.0}}
    params = CostParams(software=waits, software_scope="job", **ALONE)
    replicated = predict_step(layout, FAST, params, gathered, dense_bytes=[64, 64])
    assert replicated.phases["dense"] == pytest.approx(2e-5 + 2 * 1e-6 + 4e-4 + 1e-4)
    both = predict_step(layout, FAST, params, {"g": gathered["t"], **aggregated},
                        dense_bytes=[64, 64])
    assert both.phases["dense"] == pytest.approx(2e-4 + 2 * 1e-5 + 5e-4 + 2e-4 + rows * 1e-5)
    # a calibration without these measurements prices as before
    old = predict_step(layout, FAST, CostParams(software=SOFTWARE, software_scope="job", **ALONE),
                       gathered, dense_bytes=[64, 64])
    assert old.phases["dense"] == pytest.approx(2e-4 + 2 * 1e-5)


def test_bad_software_scope_is_refused():
    with pytest.raises(ValueError, match="software_scope must be 'process' or 'job', not 'x'"):
        CostParams(software_scope="x")


def test_relative_fit_keeps_the_latency_of_small_sizes():
    sizes = np.array([256, 64 << 10, 1 << 20, 8 << 20], np.float64)
    latency, bandwidth = 20e-6, 2e9
    exact = latency + sizes / bandwidth
    assert fit_relative(sizes, exact) == pytest.approx((latency, bandwidth), rel=1e-9)
    noisy = exact.copy()
    noisy[-1] *= 1.05  # 5 % noise on the largest size (0.2 ms, ten times the latency)
    got_latency, got_bandwidth = fit_relative(sizes, noisy)
    assert got_latency == pytest.approx(latency, rel=0.1)
    assert got_bandwidth == pytest.approx(bandwidth, rel=0.1)
    # a negative intercept refits through the origin
    assert fit_relative([100, 200], [2e-6, 5e-6])[0] == 0.0


def test_one_rank_software_measurement_keeps_the_ranks_thread_limits():
    numba = pytest.importorskip("numba")
    from hpcpax.comm.threads import usable_cores
    from hpcpax.ops import _numba
    from hpcpax.tune.calibrate import measure_software

    if usable_cores() < 2 or numba.config.NUMBA_NUM_THREADS < 2:
        pytest.skip("needs 2 cores: a one-rank world would give this rank 2 threads")
    saved = _numba._DEFAULT_THREADS
    try:
        _numba._DEFAULT_THREADS = 1  # as hpcpax.init sets it with 2 ranks on 2 cores
        measure_software(counts=(1, 2), repeats=2)
        assert _numba._DEFAULT_THREADS == 1
    finally:
        _numba._DEFAULT_THREADS = saved


def _record(group, resources, measured):
    return {"model": {"name": group}, "layout": {"workers": 2},
            "measured": {"step_s": measured},
            "predicted": {"seconds": sum(resources.values()), "resources": resources}}


def _records(weight_of_group, rng, per_group=12):
    out = []
    for group, weight in weight_of_group.items():
        for _ in range(per_group):
            resources = {"software": rng.uniform(1e-3, 5e-3), "compute": rng.uniform(1e-3, 5e-3)}
            measured = resources["compute"] + weight * resources["software"]
            out.append(_record(group, resources, measured))
    return out


def test_correction_that_does_not_transfer_is_not_used(tmp_path):
    """Group a's software costs 3x the prediction, group b's 1/3: a weight learned on one
    group makes the other worse, so cross-validation keeps the analytic model."""
    records = _records({"a": 3.0, "b": 1.0 / 3.0}, np.random.default_rng(0))
    correction = fit_correction(records)
    assert correction.validation["groups"] == 2 and correction.helps is False
    assert correction.validation["learned_error"] >= correction.validation["analytic_error"]
    assert correction.weights == dict.fromkeys(FEATURES, 1.0)
    assert correction.apply(records[0]["predicted"]) == pytest.approx(
        records[0]["predicted"]["seconds"])
    path = str(tmp_path / "runs.sqlite")
    for record in records:
        RunLog(path).append(record)
    used, why = load_correction(path)
    assert used is None and why.startswith("not used: cross-validation over 2 groups")


def test_correction_that_transfers_is_used():
    records = _records({"a": 2.0, "b": 2.0, "c": 2.0}, np.random.default_rng(1))
    correction = fit_correction(records)
    assert correction.helps is True and correction.validation["groups"] == 3
    assert correction.validation["learned_error"] < correction.validation["analytic_error"]
    assert correction.weights["software"] == pytest.approx(2.0, rel=0.05)


def test_densified_tables_use_the_fresh_buffer_allreduce():
    """A densified table is allreduced from a buffer allocated just before: its measured
    class prices the table and the rows mask; a reused-buffer class prices the dense
    buckets."""
    fabric = {"intra": {"latency_s": 1e-6, "bandwidth_Bps": 1e9},
              "inter": {"latency_s": 1e-6, "bandwidth_Bps": 1e9},
              "allreduce": {"latency_s": 1e-5, "bandwidth_Bps": 4e9},
              "allreduce_fresh": {"latency_s": 2e-5, "bandwidth_Bps": 1e9}}
    links = coll.Links.from_fabric(fabric)
    assert links.allreduce == (1e-5, 4e9) and links.allreduce_fresh == (2e-5, 1e9)
    assert coll.allreduce([0, 0], 4e6, links).seconds == pytest.approx(1e-5 + 1e-3)
    assert coll.allreduce([0, 0], 4e6, links, fresh=True).seconds == pytest.approx(2e-5 + 4e-3)
    layout = Layout.from_shape(1, 2, 0)
    ids = [np.array([0, 5]), np.array([1, 6])]
    routing = routing_from_ids(layout, "allreduce", 1000, 16, ids)
    pred = predict_step(layout, links, CostParams(), {"t": routing}, include_control=False)
    table, mask = 1000 * 16, 1000
    assert pred.phases["push"] == pytest.approx(2 * 2e-5 + (table + mask) / 1e9)
    # without a fresh class, the reused one
    plain = coll.Links.from_fabric({k: v for k, v in fabric.items() if k != "allreduce_fresh"})
    pred = predict_step(layout, plain, CostParams(), {"t": routing}, include_control=False)
    assert pred.phases["push"] == pytest.approx(2 * 1e-5 + (table + mask) / 4e9)


def test_densified_push_kernels_touch_rows_not_the_table():
    """``densify_allreduce`` writes each worker's rows into zeroed pages, scans the mask
    (a byte per row), reads and applies the union: the kernels are priced on those
    bytes, never on the whole table (a 100,000-row table cost 3 ms too much in the check)."""
    layout = Layout.from_shape(1, 2, 0)
    ids = [np.array([0, 5, 9]), np.array([1, 5])]  # unique 3 and 2, union 4
    rows, row_bytes = 100_000, 128
    routing = routing_from_ids(layout, "allreduce", rows, row_bytes, ids)
    kernels = {"unique": {"call_s": 0.0, "unit_s": 0.0}, "dedup": {"call_s": 0.0, "unit_s": 0.0},
               "gather": {"call_s": 1e-6, "unit_s": 1e-9},
               "apply": {"call_s": 2e-6, "unit_s": 3e-9}}
    pred = predict_step(layout, FAST, CostParams(kernels=kernels), {"t": routing},
                        include_control=False)
    pull = 1e-6 + 3 * row_bytes * 1e-9  # the pull's local read of the most rows
    push = ((1e-6 + 3 * row_bytes * 1e-9) + (1e-6 + rows * 1e-9)
            + (1e-6 + 4 * row_bytes * 1e-9) + (2e-6 + 4 * row_bytes * 3e-9))
    assert pred.resources["client kernels"] == pytest.approx(pull + push)
    assert pred.resources["client kernels"] < rows * row_bytes * 1e-9 / 10


def test_evict_caches_writes_a_scratch_buffer_larger_than_a_private_cache():
    """The default eviction writes 4 x the core's private cache, every byte each call."""
    from hpcpax.tune import caches

    private = caches.private_cache_bytes()
    assert private >= 1 << 15
    caches.evict_caches()  # (earlier tests in this process may have written it too)
    scratch = caches._EVICT[4 * private]
    before = scratch.copy()
    caches.evict_caches()
    caches.evict_caches()
    assert scratch.nbytes == 4 * private and bool(np.all(scratch == before + 2.0))


def test_job_scope_operations_hold_the_per_operation_handoff():
    """Operations timed one after the other hold their hand-offs: only the server work's
    per-work share is added then."""
    layout = Layout.from_shape(1, 2, 0)
    handoff = {"handoff_s": 1e-4, "handoff_per_work": 0.5}
    job = predict_step(layout, FAST, CostParams(handoff=handoff, software=SOFTWARE,
                                                software_scope="job"),
                       {"t": _ps_routing(layout)}, dense_bytes=[64], include_control=True)
    assert "scheduling" not in job.resources


def test_replicated_tables_pay_their_local_read_once_per_table():
    """An allgather table's pull is a local read: its measured fixed cost per call and
    per table (``replica_pull``), charged once per table; free kernels leave nothing else."""
    layout = Layout.from_shape(1, 2, 0)
    ids = [np.array([0, 5]), np.array([1, 6])]
    routings = {name: routing_from_ids(layout, "allgather", 8, 16, ids) for name in "ab"}
    free = {k: {"call_s": 0.0, "unit_s": 0.0} for k in ("unique", "gather", "dedup", "apply")}
    with_read = {**SOFTWARE, "replica_pull": {"call_s": 2e-4, "per_variable_s": 5e-5}}
    pred = predict_step(layout, FAST, CostParams(software=with_read, software_scope="job",
                                                 kernels=free), routings,
                        include_control=False)
    assert pred.phases["pull"] == pytest.approx(2e-4 + 2 * 5e-5)
    # an older calibration without the operation charges no fixed cost for it
    older = predict_step(layout, FAST, CostParams(software=SOFTWARE, software_scope="job",
                                                  kernels=free), routings,
                         include_control=False)
    assert older.phases.get("pull", 0.0) == pytest.approx(0.0)


def test_densified_and_allgathered_tables_pay_their_own_push_cost():
    """With ``allreduce_push`` measured, a densified table pays it (its Allreduces'
    latencies inside, as the job measured it) and an allgathered one ``allgather_push``;
    an older calibration charges ``allgather_push`` and the latencies for both."""
    layout = Layout.from_shape(1, 2, 0)
    ids = [np.array([0, 5]), np.array([1, 6])]
    free = {k: {"call_s": 0.0, "unit_s": 0.0} for k in ("unique", "gather", "dedup", "apply")}
    both = {**SOFTWARE, "allreduce_push": {"call_s": 4e-4, "per_variable_s": 3e-4}}

    def push(method, software):
        routing = routing_from_ids(layout, method, 8, 16, ids)
        return predict_step(layout, FAST, CostParams(software=software, software_scope="job",
                                                     kernels=free), {"t": routing},
                            include_control=False)

    densified = push("allreduce", both)
    assert densified.phases["push"] == pytest.approx(4e-4 + 3e-4)
    assert "latency" not in densified.resources
    gathered = push("allgather", both)
    assert gathered.phases["push"] == pytest.approx(7e-4 + 1e-4)
    older = push("allreduce", SOFTWARE)
    # MPICH's Allreduce on 2 ranks: the table (32 floats) reduce-scatter + allgather, 2
    # rounds; its row mask (8 bytes) recursive doubling, 1 round
    assert older.phases["push"] == pytest.approx(7e-4 + 1e-4 + 3 * A)


def test_operations_pay_per_row_of_the_busiest_worker():
    """``per_row_s`` (measured with many ids against 16) is charged for the most ids a
    worker moves: here 2 unique ids on each worker, one variable."""
    layout = Layout.from_shape(1, 2, 0)
    per_row = {**SOFTWARE, "ps_pull_no_aggregation": {"call_s": 5e-4, "per_variable_s": 1e-4,
                                                      "per_row_s": 1e-5}}
    job = predict_step(layout, FAST, CostParams(software=per_row, software_scope="job"),
                       {"t": _ps_routing(layout)}, include_control=False)
    assert job.phases["pull"] == pytest.approx(5e-4 + 1e-4 + 2 * 1e-5)
    assert CostParams(software=per_row).overhead("ps_pull_no_aggregation", 3, 10) == \
        pytest.approx(5e-4 + 3 * 1e-4 + 10 * 1e-5)
    assert CostParams(software=SOFTWARE).overhead("ps_pull", 1, 1000) == pytest.approx(1.2e-3)


def test_the_per_partition_cost_is_kept_only_above_its_noise():
    from hpcpax.tune.operation_costs import per_partition

    noise = np.random.default_rng(0).normal(0.0, 1e-4, 60)  # no cost, 0.1 ms noise
    assert per_partition(noise, 15) == 0.0
    assert per_partition(np.abs(noise), 15) > 0  # what clamping each draw would keep
    real = noise + 15 * 20e-6  # 20 us per partition under the same noise
    assert per_partition(real, 15) == pytest.approx(20e-6 + noise.mean() / 15)
    assert per_partition(real, 0) == 0.0 and per_partition([1.0], 15) == 0.0


def test_a_calibration_becomes_the_job_scope_constants_the_check_validates():
    """``cost_params`` (what ``--plan auto`` and cost_model_check both use) keeps every
    measured constant: a pull priced with it is the operation's job-scope cost."""
    from hpcpax.tune.calibrate import cost_params

    calibration = {"kernels": {"gather": {"call_s": 1e-6, "unit_s": 2e-9}},
                   "handoff": {"per_work": 0.1}, "software": SOFTWARE,
                   "software_scope": "job", "partition_overhead_s": 7e-5,
                   "partition_overhead_per": "exchange", "fabric": {}, "one_host": True}
    params = cost_params(calibration)
    assert params.source == "calibrated in this job"
    assert (params.kernels, params.handoff, params.software) == (
        calibration["kernels"], calibration["handoff"], SOFTWARE)
    assert (params.software_scope, params.partition_overhead_s,
            params.partition_overhead_per) == ("job", 7e-5, "exchange")
    layout = Layout.from_shape(1, 2, 0)
    bare = cost_params({**calibration, "kernels": {}, "partition_overhead_s": 0.0})
    step = predict_step(layout, FAST, bare, {"t": _ps_routing(layout)}, dense_bytes=[],
                        include_control=False)
    assert step.phases["pull"] == pytest.approx(5e-4 + 1e-4)  # no latencies: job scope
    # the measured cost per partition exchange is charged on top
    step = predict_step(layout, FAST, cost_params({**calibration, "kernels": {}}),
                        {"t": _ps_routing(layout)}, dense_bytes=[], include_control=False)
    assert step.phases["pull"] > 5e-4 + 1e-4
    # older calibrations without the newer keys: the model's defaults
    old = cost_params({k: v for k, v in calibration.items()
                       if not k.startswith("partition") and k != "software_scope"})
    assert (old.software_scope, old.partition_overhead_s) == ("process", 0.0)


def test_cpu_work_survives_a_rank_descheduled_at_its_first_clock_read(monkeypatch):
    """A rank that loses the CPU between reading the clock and testing it still
    counts one call (it divided by zero on a busy CI node)."""
    import inspect

    from mpi4py import MPI
    from hpcpax.tune import calibrate

    clock = iter([0.0, 0.5] + [0.5 + 1e-4 * i for i in range(1, 10_000)])
    monkeypatch.setattr(calibrate.time, "perf_counter", lambda: next(clock))
    work = calibrate._cpu_work(MPI.COMM_SELF, 1.0)
    # one call, timed at 0.5001 s: two calls make the asked-for second
    assert inspect.getclosurevars(work).nonlocals["count"] == 2
