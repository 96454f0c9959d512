"""A real Slurm job runs ``examples/torch_dlrm.py`` through ``hpcpax.torch`` under srun.

Renders ``jobscripts/script.sbatch`` (4 tasks: 1 server + 3 workers), submits
it (polled to its end: ``tests/slurm_wait.py``), and compares the parameters the job dumped with
the same script run here as one plain PyTorch process: equal to 1e-5.
Skipped when no Slurm answers or torch is missing; serial only.
"""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from slurm_wait import submit_and_wait
from test_sbatch_job import _slurm_up

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--steps", "20", "--batch", "96", "--rows-scale", "0.01", "--dim", "8",
        "--optimizer", "adagrad", "--log-every", "10"]

pytestmark = pytest.mark.slurm


@pytest.mark.timeout(600)
def test_torch_example_under_srun_equals_one_process(tmp_path):
    if not _slurm_up():
        pytest.skip("no Slurm answers here (.ci/slurm_up.sh starts one)")
    venv = Path(sys.prefix)
    job = tmp_path / "job.sbatch"
    four, one = tmp_path / "four.npz", tmp_path / "one.npz"
    render = [sys.executable, "-m", "hpcpax.jobscript", "script", "--job-name", "hpcpax-torch",
              "--ntasks-per-node", "4", "--time", "00:10:00",
              "--slurm-output", str(tmp_path / "slurm-%j.out"),
              "--activate", f"{venv}/bin/activate",
              "--script", "examples/torch_dlrm.py",
              "--script-args", " ".join(ARGS + ["--dump", str(four)]), "-o", str(job)]
    subprocess.run(render, cwd=ROOT, check=True, timeout=60)
    cpus = subprocess.run(["sinfo", "-h", "-o", "%c"], capture_output=True, text=True,
                          timeout=15).stdout.split()
    extra = ["--overcommit"] if cpus and int(cpus[0].rstrip("+")) < 4 else []
    job_id, state, status = submit_and_wait(["--chdir", str(ROOT), *extra, str(job)], 560)
    output = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert status == 0 and state == "COMPLETED", (job_id, state, status, output[-3000:])
    assert "hpcpax.torch: 4 ranks (1 server, 3 workers" in output
    sys.path.insert(0, str(ROOT / "examples"))
    try:
        import torch_dlrm
    finally:
        sys.path.pop(0)
    torch_dlrm.main(ARGS + ["--single-process", "--dump", str(one)])
    a, b = np.load(one), np.load(four)
    errors = {k: float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a.files}
    assert sorted(a.files) == sorted(b.files) and max(errors.values()) <= 1e-5, errors
    assert os.path.getsize(four) > 0
