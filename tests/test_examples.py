"""The example programs run as a user would launch them, and learn.

``examples/train_loop.py`` (a plain mpi4py loop on hpcpax's primitives) at 4
ranks under the project's ``mpirun``, with a wall-clock limit; the loss it
prints must fall. Serial only: it starts its own MPI job.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.timeout(300)
def test_train_loop_example_learns_at_four_ranks():
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        pytest.skip("inside an MPI job: the example starts its own")
    mpirun = Path(sys.executable).parent / "mpirun"
    result = subprocess.run(
        [str(mpirun if mpirun.exists() else "mpirun"), "-n", "4", sys.executable, "-m", "mpi4py",
         str(ROOT / "examples" / "train_loop.py")],
        capture_output=True, text=True, timeout=280, cwd=ROOT,
        env={**os.environ, "MPIEXEC_TIMEOUT": "270"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    losses = [float(x) for x in re.findall(r"loss (\d+\.\d+)", result.stdout)]
    assert len(losses) >= 2 and losses[-1] < 0.8 * losses[0], result.stdout
    assert "bytes sent per phase" in result.stdout
