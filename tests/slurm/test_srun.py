"""check_mpi_world under a real srun (skipped without Slurm; .ci/slurm_up.sh starts one)."""

import pathlib
import shutil
import subprocess
import sys

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
PROBE = """
from mpi4py import MPI
from hpcpax.errors import TopologyError
from hpcpax.comm.slurm import SlurmEnv, check_mpi_world
comm = MPI.COMM_WORLD
try:
    print("direct", check_mpi_world(SlurmEnv.from_environ(), comm.Get_size(), comm.Get_rank()),
          comm.Get_rank(), comm.Get_size(), flush=True)
except TopologyError as error:
    print("TopologyError", error, flush=True)
"""


def slurm_answers():
    if shutil.which("srun") is None or shutil.which("sinfo") is None:
        return False
    try:
        result = subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True, timeout=10)
    except subprocess.TimeoutExpired:
        return False
    return result.returncode == 0 and any(
        state.startswith(("idle", "mixed")) for state in result.stdout.split())


pytestmark = [
    pytest.mark.slurm,
    pytest.mark.skipif(not slurm_answers(), reason="no idle Slurm node (run .ci/slurm_up.sh)"),
]


def srun(mpi, ntasks):
    # --immediate: fail fast instead of queueing behind someone else's job.
    result = subprocess.run(
        ["srun", f"--mpi={mpi}", "-n", str(ntasks), "--immediate=30", "--time=1",
         sys.executable, "-c", PROBE],
        capture_output=True, text=True, timeout=90, cwd=REPO)
    assert result.returncode == 0, result.stderr
    return sorted(result.stdout.splitlines())


def test_srun_pmi2_gives_one_world():
    assert srun("pmi2", 2) == ["direct True 0 2", "direct True 1 2"]


def test_srun_without_pmi_raises_with_fix():
    lines = srun("none", 2)
    assert len(lines) == 2
    for line in lines:
        assert line.startswith("TopologyError Slurm started 2 tasks but MPI sees a world of size 1")
        assert "srun --mpi=pmi2" in line
