"""``benchmarks/soak.py --quick`` at 4 ranks: flat memory, no MPI request left (serial suite)."""

import json
import sys

import pytest

from reliability_jobs import ROOT, clean_env, mpirun, serial_only


@pytest.mark.timeout(180)
def test_soak_quick():
    serial_only()
    import subprocess

    done = subprocess.run(["timeout", "-s", "KILL", "150", mpirun(), "-n", "4", sys.executable,
                           "-m", "mpi4py", str(ROOT / "benchmarks" / "soak.py"), "--quick"],
                          cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=170)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, done.stdout + done.stderr
    result = json.loads(lines[-1])
    print(lines[-1])
    assert result["ok"] and result["max_rss_growth"] < 0.05 and result["active_requests"] == 0
    assert done.returncode == 0
