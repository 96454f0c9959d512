"""ModelSync, the step API: a NumPy training loop on N ranks = the same loop in one process.

The loop: each sample ``s`` with ids ``i`` in two tables and a weight ``c_s``
has loss ``c_s (|a[i]|^2 + |b[j]|^2) / 2 + w . x_s``, so a step's row
gradients depend on the rows pulled (``c_s a[i]``) and the dense gradient is
the batch mean of ``x_s``. Every worker takes its share of the global batch,
pulls, pushes, allreduces; every rank computes the one-process loop on the
whole batch and the tables (read back) and dense vector must agree, for each
plan (``auto`` moves tables mid-run). A checkpoint written under one plan and
loaded under another continues the same way; initial values and
``set_table`` replace rows.
"""

import numpy as np
import pytest

import hpcpax
from hpcpax import ModelSync, SparseVariableSpec
from hpcpax.errors import ConfigError
from hpcpax.ops.optimizers import make_optimizer

ROWS_A, ROWS_B, DIM_A, DIM_B, DENSE = 40, 25, 3, 2, 4
GLOBAL = 12  # shared evenly by 1, 2, 3 or 4 workers


def specs():
    return [SparseVariableSpec("a", ROWS_A, DIM_A, dtype="float64", initializer="uniform",
                               optimizer="adagrad", optimizer_params={"lr": 0.1}),
            SparseVariableSpec("b", ROWS_B, DIM_B, dtype="float64", initializer="zeros",
                               optimizer="sgd", optimizer_params={"lr": 0.2})]


def batch(step, size):
    rng = np.random.default_rng([7, step])
    return (rng.integers(0, ROWS_A, size), rng.integers(0, ROWS_B, size),
            rng.uniform(0.5, 1.5, size), rng.standard_normal((size, DENSE)))


def row_grads(ids, rows_of, weights, count):
    """Per-sample ``c_s row`` gradients of the mean loss over ``count`` samples."""
    return ids, rows_of(ids) * (weights / count)[:, None]


def reference(steps, initial_b=None):
    """The loop in one process on the whole batch (what every rank computes)."""
    a = make_optimizer("adagrad", lr=0.1)
    b = make_optimizer("sgd", lr=0.2)
    from hpcpax.ps.initializers import init_rows

    table_a = init_rows("uniform", 0, "a", np.arange(ROWS_A), DIM_A, np.float64, 0.05)
    table_b = np.zeros((ROWS_B, DIM_B)) if initial_b is None else initial_b.copy()
    state_a, state_b = a.init_state(table_a.shape, table_a.dtype), {}
    w = np.zeros(DENSE)
    size = GLOBAL
    for step in range(steps):
        ids_a, ids_b, c, x = batch(step, size)
        for table, state, opt, ids in ((table_a, state_a, a, ids_a), (table_b, state_b, b, ids_b)):
            grads = table[ids] * (c / size)[:, None]
            unique, inverse = np.unique(ids, return_inverse=True)
            summed = np.zeros((len(unique), table.shape[1]))
            np.add.at(summed, inverse, grads)
            opt.apply_rows_reference(table, state, unique, summed)
        w -= 0.1 * x.mean(0)
    return table_a, table_b, w


def run(sync, steps, first=0, w=None):
    """The loop on this worker's share; returns the dense vector."""
    topo = sync.topology
    w = np.zeros(DENSE) if w is None else w.copy()
    share = GLOBAL // topo.num_workers
    for step in range(first, first + steps):
        ids_a, ids_b, c, x = batch(step, GLOBAL)
        mine = slice(share * topo.worker_index, share * (topo.worker_index + 1))
        rows = sync.pull({"a": ids_a[mine], "b": ids_b[mine]})
        grads = {}
        for name, ids in (("a", ids_a[mine]), ("b", ids_b[mine])):
            unique, values = rows[name]
            lookup = values[np.searchsorted(unique, ids)]
            grads[name] = (ids, lookup * (c[mine] / share)[:, None])
        sync.push(grads)
        gradient = [x[mine].mean(0)]
        sync.allreduce(gradient)  # mean over workers, in place
        w -= 0.1 * gradient[0]
    return w


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", ["ps", "allgather", "allreduce", "auto"])
@pytest.mark.parametrize("servers", [0, 1])
def test_loop_equals_one_process(comm, all_ok, plan, servers):
    if servers and comm.Get_size() == 1:
        pytest.skip("a server needs a second rank")
    topo = hpcpax.init(servers_per_node=servers)
    sync = ModelSync(specs(), {"w": ((DENSE,), np.float64)}, plan=plan, topology=topo,
                     plan_steps=2, fabric_seconds=0.2, quiet=True)
    ok = True
    try:
        if sync.is_server:
            sync.serve()
        else:
            w = run(sync, 5)
            tables = sync.read_tables()
            want_a, want_b, want_w = reference(5)
            ok = (np.allclose(tables["a"], want_a, rtol=1e-12, atol=1e-14)
                  and np.allclose(tables["b"], want_b, rtol=1e-12, atol=1e-14)
                  and np.allclose(w, want_w, rtol=1e-12, atol=1e-14)
                  and sync.steps == 5 and set(sync.methods()) == {"a", "b"})
            if plan != "auto":
                ok &= set(sync.methods().values()) == {plan}
            elif topo.num_workers > 1:  # the constants it planned with were timed here
                params = sync.planning.params
                ok &= params is not None and params.source == "calibrated in this job"
            sync.finish()
    finally:
        topo.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_checkpoint_under_one_plan_continues_under_another(comm, all_ok, tmp_path_factory):
    run_dir = comm.bcast(str(tmp_path_factory.mktemp("ms")) if comm.Get_rank() == 0 else None)
    initial_b = np.arange(ROWS_B * DIM_B, dtype=np.float64).reshape(ROWS_B, DIM_B) / 100
    ok = True
    topo = hpcpax.init(servers_per_node=1)
    sync = ModelSync(specs(), {"w": ((DENSE,), np.float64)}, plan="ps", topology=topo,
                     initial={"b": initial_b}, quiet=True)
    if sync.is_server:
        sync.serve()
    else:
        w = run(sync, 3)
        path = sync.save(run_dir, 3, dense={"w": w}, meta={"note": "three steps"})
        ok &= path.endswith("step_000003")
        sync.finish()
    topo.free()
    topo = hpcpax.init(servers_per_node=0)  # another layout (no server) and plan
    sync = ModelSync(specs(), {"w": ((DENSE,), np.float64)}, plan="allgather", topology=topo,
                     quiet=True)
    step, dense, _, meta = sync.load(run_dir)
    w = run(sync, 3, first=3, w=dense["w"])
    tables = sync.read_tables()
    sync.set_table("a", np.ones((ROWS_A, DIM_A)))
    after = sync.read_tables()["a"]
    sync.finish()
    topo.free()
    want_a, want_b, want_w = reference(6, initial_b)
    ok &= step == 3 and meta["note"] == "three steps" and np.all(after == 1.0)
    ok &= (np.allclose(tables["a"], want_a, rtol=1e-12, atol=1e-14)
           and np.allclose(tables["b"], want_b, rtol=1e-12, atol=1e-14)
           and np.allclose(w, want_w, rtol=1e-12, atol=1e-14))
    assert all_ok(ok)


def test_bad_initial_values_are_refused():
    topo = hpcpax.init()
    try:
        with pytest.raises(ConfigError, match=r"initial values for unknown tables \['c'\]"):
            ModelSync(specs(), plan="ps", topology=topo, initial={"c": np.zeros(3)})
        with pytest.raises(ValueError, match=r"table 'b' must be float64 of shape \(25, 2\)"):
            ModelSync(specs(), plan="ps", topology=topo, initial={"b": np.zeros(3)})
        with pytest.raises(TypeError, match="tables must hold SparseVariableSpec, not dict"):
            ModelSync([{"name": "a"}], plan="ps", topology=topo)
    finally:
        topo.free()


@pytest.mark.parametrize("plan", ["ps", "allgather"])
def test_an_unknown_table_is_named_with_the_registered_ones(plan):
    sync = ModelSync(specs(), plan=plan, quiet=True)
    try:
        ids = np.array([1, 2])
        with pytest.raises(KeyError, match=r"unknown sparse variable 'c'; registered: \['a', 'b'\]"):
            sync.pull({"a": ids, "c": ids})
        with pytest.raises(KeyError, match=r"unknown sparse variable 'c'; registered"):
            sync.push({"c": (ids, np.ones((2, DIM_A)))})
        unique, rows = sync.pull({"a": ids})["a"]  # nothing half-done: the tables still serve
        assert np.array_equal(unique, ids) and rows.shape == (2, DIM_A)
    finally:
        sync.finish()


def test_every_command_the_planner_sends_has_a_handler():
    """PlanController sends commands to every rank (hot-row decisions, ...): a
    ModelSync (step API, torch adapter) must handle each of them, like the trainer."""
    import re
    from pathlib import Path

    import hpcpax.tune as plan_package

    sent = set()
    for source in Path(plan_package.__file__).parent.glob("*.py"):
        sent |= set(re.findall(r"commands\.run\(\s*\"(\w+)\"", source.read_text()))
    assert "hot_rows" in sent  # the test can fail: it found what the planner sends
    topo = hpcpax.init(servers_per_node=0)
    try:
        sync = ModelSync(specs(), plan="ps", topology=topo, quiet=True)
        assert sent <= set(sync.commands.handlers), sent - set(sync.commands.handlers)
        sync.finish()
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_auto_with_one_worker_keeps_each_table_that_fits_whole_on_it(comm, all_ok):
    """One worker beside the servers: ``auto`` makes every table a replica can hold
    ``allgather`` (read in place, no exchange with a server), the others ``ps``;
    training still equals one process."""
    from hpcpax.options import options

    if comm.Get_size() != 2:
        pytest.skip("one server and one worker")
    fits = ROWS_B * DIM_B * 8  # b fits with no optimizer slot; a (Adagrad, wider) does not
    options.replica_memory = fits
    topo = hpcpax.init(servers_per_node=1)
    try:
        sync = ModelSync(specs(), {"w": ((DENSE,), np.float64)}, plan="auto", topology=topo,
                         fabric_seconds=0.2, quiet=True)
        ok = True
        if sync.is_server:
            sync.serve()
        else:
            ok = sync.methods() == {"a": "ps", "b": "allgather"}
            w = run(sync, 3)
            del options.replica_memory  # reading the tables back gathers them whole
            tables = sync.read_tables()
            want_a, want_b, want_w = reference(3)
            ok = ok and np.allclose(tables["a"], want_a, rtol=1e-12, atol=1e-14) and \
                np.allclose(tables["b"], want_b, rtol=1e-12, atol=1e-14) and \
                np.allclose(w, want_w, rtol=1e-12, atol=1e-14)
            sync.finish()
    finally:
        del options.replica_memory
        topo.free()
    assert all_ok(ok)
