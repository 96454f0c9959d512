"""``benchmarks/gpu_models.py``: its tiny mode runs here (no GPU), its full mode skips cleanly.

No time threshold (the machine is shared): every layout of both models and
the default job report finite, positive rates, the ratios are computed from
them, and the device facts say no GPU.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "benchmarks" / "gpu_models.py")


def _run(*args, timeout=600):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    done = subprocess.run([sys.executable, SCRIPT, *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1, done.stdout
    return json.loads(lines[0])


def test_without_a_gpu_the_full_run_says_so():
    from hpcpax.backend import has_gpu

    if has_gpu():
        pytest.skip("a GPU is present: the full run would start")
    result = _run(timeout=120)
    assert result["benchmark"] == "gpu_models" and result["skipped"].startswith("no CUDA device")


@pytest.mark.timeout(700)
def test_quick_reports_every_layout_and_the_default_job():
    result = _run("--quick")
    for name in ("dlrm", "lm"):
        entry = result["models"][name]
        rates = {k: entry[k]["samples_per_s"] for k in ("hpcpax_1_server_1_worker",
                                                        "hpcpax_every_rank_a_worker")}
        assert all(math.isfinite(r) and r > 0 for r in rates.values()), entry
        assert entry["best_layout"] == max(rates, key=rates.get)
        if "error" not in entry["torch"]:  # torch is optional here
            ratio = rates[entry["best_layout"]] / entry["torch"]["samples_per_s"]
            assert result["ratio_gpu_worker_vs_plain_torch"][name] == pytest.approx(ratio, rel=1e-4)
    job = result["default_job"]
    assert len(job["samples_per_s"]["cpu"]) == len(job["samples_per_s"]["auto"]) == 1
    assert result["ratio_default_auto_vs_cpu"] == pytest.approx(
        job["median"]["auto"] / job["median"]["cpu"], rel=1e-4)
    if result["device"]["gpu"] is None:
        assert job["auto_chose"] == [{"device": "cpu (no GPU seen)"}]
