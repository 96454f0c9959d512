"""Emulated accelerators and time dilation (``--emulate-compute``, ``--time-dilation``).

The emulated forward/backward is a wait that holds no CPU (CPU seconds of a
long emulated step, not wall time, are asserted), its gradients cover exactly
the rows pulled, a dilated run reports its times divided by the dilation, and
the calibration's Allreduce measurement keeps to its time budget.
"""

import json
import os
import time

import numpy as np
import pytest

from hpcpax.app.emulation import (GRAD_VALUE, ComputeModel, EmulatedCompute, dilated_waits,
                                  parse_emulate_compute)
from hpcpax.options import options
from hpcpax.errors import ConfigError


@pytest.mark.parametrize("spec, fixed, per_sample", [
    ("0.05", 0.05, 0.0), ("0.02+0.001/sample", 0.02, 0.001), ("1e-4/sample", 0.0, 1e-4),
    ("lm1b", 0.0, 0.1 / 128),  # the preset's 100 ms per 128 sequences
])
def test_the_forms_of_the_flag(spec, fixed, per_sample):
    model = parse_emulate_compute(spec, 2.0)
    assert model.fixed_s == pytest.approx(fixed) and model.per_sample_s == pytest.approx(per_sample)
    assert model.seconds(10) == pytest.approx((fixed + 10 * per_sample) * 2.0)
    assert parse_emulate_compute("off") is None and parse_emulate_compute(None) is None


@pytest.mark.parametrize("spec, dilation, message", [
    ("fast", 1.0, "emulate_compute must be SECONDS"),
    ("-0.1", 1.0, "finite and >= 0"),
    ("0.1", 0.0, "time_dilation must be a number > 0"),
])
def test_bad_values_are_refused(spec, dilation, message):
    with pytest.raises(ConfigError, match=message):
        parse_emulate_compute(spec, dilation)


def test_an_emulated_step_waits_without_cpu_and_grads_the_rows_pulled():
    compute = EmulatedCompute(ComputeModel(0.3, 0.0), {"w": (4, 3), "b": (3,)}, np.float32)
    rows = {"emb": (np.array([2, 5, 9]), np.zeros((3, 8), np.float32)),
            "bias": (np.array([1]), np.zeros((1, 1), np.float32))}
    batch = {"x": np.zeros((16, 2))}
    cpu, wall = time.process_time(), time.perf_counter()
    result = compute.forward_backward({"w": None, "b": None}, rows, batch, 0)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall >= 0.3 and cpu < 0.05, (wall, cpu)  # a sleep: the core is free
    assert result.loss == 0.0
    assert np.array_equal(result.sparse_grads["emb"][0], [2, 5, 9])
    assert result.sparse_grads["emb"][1].shape == (3, 8)
    assert np.all(result.sparse_grads["emb"][1] == np.float32(GRAD_VALUE))
    assert result.sparse_grads["bias"][1].shape == (1, 1)
    assert result.dense_grads["w"].shape == (4, 3) and result.dense_grads["b"].shape == (3,)


def _train(tmp_path, name, **flags):
    from mpi4py import MPI

    from hpcpax.app.trainer import Trainer

    run_dir = str(tmp_path / name)
    trainer = Trainer({"steps": 4, "run_dir": run_dir, "quiet": True, "servers_per_node": 0,
                       **flags}, comm=MPI.COMM_SELF)
    trainer.run()
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        lines = [json.loads(line) for line in handle if '"loss"' in line]
    with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
        return lines, json.load(handle)


def test_an_emulated_run_holds_no_cpu_while_it_computes(tmp_path):
    lines, summary = _train(tmp_path, "emulated", emulate_compute="0.25")
    assert len(lines) == 4 and all(line["emulated"] for line in lines)
    assert all(line["loss"] == 0.0 for line in lines)
    for line in lines[1:]:  # the first step warms up
        assert line["time"]["compute"] >= 0.25
        # the emulated compute's CPU seconds, all workers together, are a small part of it
        assert set(line["cpu_by_phase"]) == set(line["time"])
        assert line["cpu_by_phase"]["compute"] < 0.1, line
        assert line["cpu_busy"][0] < 0.5, line  # a real step here is all CPU
    assert summary["emulated_compute"]["fixed_s"] == 0.25
    assert summary["startup_seconds"]["total"] >= summary["startup_seconds"]["engine"] > 0


def test_a_dilated_run_reports_undilated_times(tmp_path):
    d = 4.0
    lines, summary = _train(tmp_path, "dilated", emulate_compute="0.05", time_dilation=d)
    assert summary["time_dilation"] == d and summary["emulated_compute"]["time_dilation"] == d
    for line in lines:
        # the step waited 0.05 x D for real; its reported seconds are the real ones / D
        assert line["time"]["compute"] >= 0.05 and line["seconds"] >= 0.05
        assert line["seconds"] * d <= summary["wall_seconds"]
    real = sum(line["seconds"] for line in lines) * d
    assert real <= summary["wall_seconds"]
    assert summary["train_seconds"] * d == pytest.approx(real, rel=0.2)
    batch = lines[0]["samples_per_s"] * lines[0]["seconds"]
    assert all(line["samples_per_s"] * line["seconds"] == pytest.approx(batch) for line in lines)
    # waits were dilated as well (the default 1 ms poll cap x D), and restored after the run
    assert summary["wait"]["poll_seconds"] == pytest.approx(0.001 * d)
    assert options.poll_seconds == 0.001 and options.source("poll_seconds") == "default"


def test_dilated_waits_keep_a_cap_the_user_set(monkeypatch):
    monkeypatch.delenv("HPCPAX_POLL_SECONDS", raising=False)
    with dilated_waits(8.0):
        assert options.poll_seconds == pytest.approx(0.008)
    with dilated_waits(1.0):
        assert options.poll_seconds == 0.001 and options.source("poll_seconds") == "default"
    options.poll_seconds = 0.0002
    try:
        with dilated_waits(8.0):
            assert options.poll_seconds == 0.0002
    finally:
        del options.poll_seconds
    monkeypatch.setenv("HPCPAX_POLL_SECONDS", "0.003")
    with dilated_waits(8.0):
        assert options.poll_seconds == 0.003
    assert options.source("poll_seconds") == "environment"


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_the_allreduce_calibration_keeps_to_its_budget(comm):
    from hpcpax.tune.calibrate import ALLREDUCE_SIZES, measure_allreduce

    tight = measure_allreduce(comm, budget_s=1e-9, repeats=2)
    assert tight["sizes"] == sorted(ALLREDUCE_SIZES)[:2]  # the fit needs two
    loose = measure_allreduce(comm, sizes=(256, 4096, 65536), budget_s=60.0, repeats=2)
    assert loose["sizes"] == [256, 4096, 65536] and loose["bandwidth_Bps"] > 0


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_a_run_of_known_length_keeps_its_start_up_to_two_percent(comm, tmp_path):
    """Emulated compute makes the run's length known before it starts: ``auto``'s
    timed start-up parts keep to 2 % of it where the defaults allow seconds;
    ``plan.json`` says what each part was given."""
    from hpcpax.app.trainer import Trainer
    from hpcpax.engine.settings import STARTUP_SHARE
    from hpcpax.plan import Plan
    from hpcpax.tune.calibrate import OPERATIONS_BUDGET_S

    base = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    config = {"model": "lm", "vocab_size": 2000, "emb_dim": 8, "out_dim": 8, "hidden": [8],
              "num_sampled": 16, "global_batch": 32, "steps": 12, "plan": "auto",
              "plan_steps": 2, "quiet": True}
    budgets = {}
    for label, extra in (("defaults", {}), ("known", {"emulate_compute": "0.01"})):
        trainer = Trainer({**config, **extra, "run_dir": os.path.join(base, label)}, comm=comm)
        trainer.run()
        plan = trainer.engine.settings.plan
        if label == "known":  # 12 steps x 10 ms: 0.12 s, of which 2 %
            assert plan.planned_run_s == pytest.approx(0.12)
            assert plan.startup_budget_s == pytest.approx(STARTUP_SHARE * 0.12)
        else:
            assert plan.planned_run_s is None and plan.startup_budget_s is None
        comm.Barrier()
        budgets[label] = Plan.load(os.path.join(base, label, "plan.json")).search[
            "startup_budgets"]
    cap = STARTUP_SHARE * 0.12
    assert budgets["defaults"]["operations_s"] == OPERATIONS_BUDGET_S
    assert budgets["defaults"]["planned_run_s"] is None
    assert budgets["known"]["planned_run_s"] == pytest.approx(0.12)
    assert budgets["known"]["operations_s"] == pytest.approx(0.5 * cap)
    assert budgets["known"]["fabric_s"] == pytest.approx(0.2 * cap)
    assert budgets["known"]["allreduce_s"] <= 0.2 * cap + 1e-12
