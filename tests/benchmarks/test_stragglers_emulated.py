"""``benchmarks/stragglers.py --emulate``: the consistency models with emulated accelerators.

Starts its own ``mpirun`` (1 server + 2 workers, the quick model), so it runs
in the serial suite only. No time threshold (the machine is shared): the run
says it was emulated, reports the machine's CPU busy fraction, leaves the
loss figures out (the loss is not computed there), and the straggler and the
stalls still slow the modes they slow (BSP waits for them, ``asp`` does not).
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(300)
def test_stragglers_run_on_emulated_accelerators(tmp_path):
    if os.environ.get("PMI_RANK") or os.environ.get("PMI_SIZE"):
        pytest.skip("starts its own mpirun; runs in the serial suite only")
    mpirun = shutil.which("mpirun") or shutil.which("mpiexec")
    if mpirun is None:
        pytest.skip("no mpirun on PATH")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env["MPIEXEC_TIMEOUT"] = "240"
    # an earlier real-compute run's losses (as its JSON line has them): asp 10 % off bsp
    earlier = tmp_path / "real-compute.json"
    earlier.write_text("log line\n" + json.dumps(
        {"emulated": False, "persistent": {"bsp": {"loss": {"median": 4.0}},
                                           "asp": {"loss": {"median": 3.6}},
                                           "auto": {"loss": {"median": 4.02}}}}) + "\n")
    done = subprocess.run([mpirun, "-n", "3", sys.executable, "-m", "mpi4py",
                           str(ROOT / "benchmarks" / "stragglers.py"), "--quick",
                           "--emulate", "0.002/sample", "--only", "none,persistent",
                           "--modes", "bsp,asp,auto", "--loss-gaps", str(earlier)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=270)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["emulated"] is True
    assert 0 < result["cpu_busy_max"] < 1.0
    assert result["loss_gap_ssp"] is None  # no loss is computed under emulation
    assert "loss_gap_by_mode" not in result
    # the straggler's extra wait is part of the emulated compute: BSP waits for it
    # (2x the compute of one worker), asp does not
    with_straggler = result["persistent"]["bsp"]["samples_per_s"]["median"]
    assert with_straggler < result["none"]["bsp"]["samples_per_s"]["median"]
    assert result["ratio_asp_vs_bsp_persistent"] > 1.0
    # against the fixed modes within the loss goal: asp (gap 0.1 > 0.02) left out, so
    # auto is measured against bsp alone there (one round: the ratio of the two runs)
    assert result["excluded_by_loss_gap"] == {"persistent": {"asp": pytest.approx(0.1)},
                                              "none": {}}
    persistent = result["persistent"]
    assert result["ratio_auto_vs_best_fixed_within_loss_gap_persistent"] == pytest.approx(
        persistent["auto"]["samples_per_s_train"]["median"]
        / persistent["bsp"]["samples_per_s_train"]["median"])
    assert result["ratio_auto_vs_best_fixed_persistent"] == pytest.approx(
        persistent["auto"]["samples_per_s_train"]["median"]
        / max(persistent[m]["samples_per_s_train"]["median"] for m in ("bsp", "asp")))


def test_auto_against_no_qualifying_fixed_mode_is_none():
    """A scenario where every fixed mode run misses the loss goal (``--modes`` without
    bsp) has no within-loss-gap ratio: Nones there, the minimum over the others, no
    crash after the runs (a 12-minute run once lost its output to it)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import stragglers  # noqa: PLC0415

    runs = {"persistent": {"asp": [{"samples_per_s_train": 10.0}],
                           "auto": [{"samples_per_s_train": 8.0}]},
            "none": {"ssp:3": [{"samples_per_s_train": 10.0}],
                     "auto": [{"samples_per_s_train": 9.0}]}}
    cases = {"persistent": ({}, ("asp", "auto")), "none": ({}, ("ssp:3", "auto"))}
    within, excluded = stragglers.within_loss_gap(runs, cases, {"persistent": {"asp": 0.08}})
    key = "ratio_auto_vs_best_fixed_within_loss_gap"
    assert within[f"{key}_persistent"] == {"median": None, "min": None, "max": None}
    assert within[f"{key}_none"]["median"] == pytest.approx(0.9)
    assert within[key]["median"] == pytest.approx(0.9)
    assert excluded["persistent"] == {"asp": 0.08}
