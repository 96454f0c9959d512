"""--device auto decides by a measured trial step (hpcpax.app.device_choice).

The rule on injected times (both outcomes, the margin, a worker without a
GPU), the trial's timer on the CPU, and the Trainer end to end with the GPU
probe and the timer replaced: the choice is the same on every rank, printed
on the first worker and saved in summary.json.
"""

import json
import os
import types

import numpy as np
import pytest

from hpcpax.app import device_choice
from hpcpax.app.device_choice import MARGIN, decide, measure_step
from hpcpax.backend import Device
from hpcpax.models import build_model
from trainer_runs import first_worker, run_trainer, shared_dir

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "plan": "ps", "steps": 3,
}


def test_gpu_only_when_faster_by_the_margin():
    faster = decide(cpu_step_s=0.010, gpu_step_s=0.004)
    assert faster.device == "gpu"
    assert faster.reason == ("device auto: gpu workers (a trial step took 4 ms on the GPU, "
                             "10 ms on the CPU)")
    slower = decide(cpu_step_s=0.002, gpu_step_s=0.006)
    assert slower.device == "cpu"
    assert slower.reason == ("device auto: cpu workers (a trial step took 6 ms on the GPU, "
                             "2 ms on the CPU; the GPU must take under 0.9x the CPU's)")
    assert decide(0.010, 0.010 * MARGIN * 1.001).device == "cpu"  # a near tie stays on the CPU
    assert decide(0.010, 0.010 * MARGIN * 0.999).device == "gpu"
    mixed = decide(0.010, 0.001, every_worker_has_gpu=False)
    assert mixed.device == "cpu" and mixed.gpu_step_s is None
    assert mixed.to_dict() == {"device": "cpu", "cpu_step_s": 0.010, "gpu_step_s": None,
                               "reason": "device auto: cpu workers (not every worker sees a GPU)",
                               "trial_steps": 5, "margin": 0.9}


@pytest.mark.parametrize("model,flags", [
    ("lm", {"vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
            "num_sampled": 16}),
    ("ctr", {"n_dense": 3, "n_fields": 4, "table_rows": [50, 60, 70, 80], "emb_dim": 4,
             "bottom": [8, 4], "top": [8]}),
])
def test_the_trial_times_a_local_step(model, flags):
    config = {"seed": 0, "optimizer": "adam", "lr": 0.01}
    seconds = measure_step(build_model(model, **flags), config, np, 16, steps=3)
    assert 0 < seconds < 5


def _fake_trial(monkeypatch, cpu_s, gpu_s):
    """Every rank sees a GPU; the trial measures ``cpu_s``/``gpu_s``; devices stay CPUs."""
    picked, trial_gpu = [], types.SimpleNamespace(kind="gpu", index=0, xp="the GPU's xp")

    def select(rank, choice):
        picked.append(choice)
        # the trial's GPU (the first pick) is a stand-in; the choice then runs on the CPU
        return trial_gpu if len(picked) == 1 and choice == "gpu" else Device("cpu")

    monkeypatch.setattr(device_choice, "has_gpu", lambda: True)
    monkeypatch.setattr(device_choice, "select_device", select)
    monkeypatch.setattr(device_choice, "measure_step",
                        lambda model, config, xp, batch: cpu_s if xp is np else gpu_s)
    return picked


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("cpu_s,gpu_s,want", [(0.002, 0.006, "cpu"), (0.010, 0.004, "gpu")])
def test_trainer_records_and_prints_the_choice(comm, tmp_path, monkeypatch, capsys, cpu_s, gpu_s,
                                               want):
    picked = _fake_trial(monkeypatch, cpu_s, gpu_s)
    run_dir = shared_dir(comm, tmp_path, "run")
    trainer = run_trainer(comm, {**TINY, "device": "auto", "run_dir": run_dir})
    if trainer.topology.is_worker:
        assert picked == ["gpu", want]  # the trial's GPU, then the choice
    else:
        assert picked == []  # servers neither measure nor take a GPU
    summary = first_worker(comm, trainer, trainer.summary)
    assert summary["device_choice"]["device"] == want
    assert summary["device_choice"]["cpu_step_s"] == pytest.approx(cpu_s)
    assert summary["device_choice"]["gpu_step_s"] == pytest.approx(gpu_s)
    if comm.Get_rank() == 0:
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
            assert json.load(handle)["device_choice"]["device"] == want
    printed = capsys.readouterr().out
    if trainer.is_leader:
        assert f"device auto: {want} workers (a trial step took" in printed


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_no_trial_without_a_gpu_or_with_a_fixed_device(comm, tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(device_choice, "measure_step", lambda *a: measured.append(a) or 1.0)
    monkeypatch.setattr(device_choice, "has_gpu", lambda: False)
    trainer = run_trainer(comm, {**TINY, "device": "auto",
                                 "run_dir": shared_dir(comm, tmp_path, "auto")})
    monkeypatch.setattr(device_choice, "has_gpu", lambda: True)
    fixed = run_trainer(comm, {**TINY, "device": "cpu", "run_dir": shared_dir(comm, tmp_path, "cpu")})
    assert measured == []
    assert trainer.device.kind == fixed.device.kind == "cpu"
    assert "device_choice" not in (first_worker(comm, trainer, trainer.summary) or {})
