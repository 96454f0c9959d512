"""A real Slurm job: the single-node template runs a short training and completes.

Runs ``.ci/slurm_job_test.sh`` (render ``jobscripts/single_node.sbatch``,
``sbatch --wait``, check the job COMPLETED and wrote ``metrics.jsonl``)
against the Slurm that ``.ci/slurm_up.sh`` started. Skipped when no Slurm
answers; serial only (it starts its own ranks through ``srun``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slurm


def _slurm_up():
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return False
    try:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True,
                             timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and any(s.strip() in ("idle", "mix", "alloc")
                                       for s in out.stdout.split())


@pytest.mark.timeout(420)
def test_single_node_job_completes_and_writes_metrics():
    if not _slurm_up():
        pytest.skip("no Slurm answers here (.ci/slurm_up.sh starts one)")
    venv = Path(sys.prefix)
    result = subprocess.run(
        ["bash", str(ROOT / ".ci" / "slurm_job_test.sh"), str(venv)],
        capture_output=True, text=True, timeout=400,
        env={**os.environ, "SLURM_JOB_TEST_TIMEOUT": "360",
             "SLURM_JOB_TEST_TRAIN_ARGS": "--model lm --steps 20 --quiet"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "OK: job" in result.stderr


@pytest.mark.timeout(120)
def test_rendered_directives_reach_slurm_as_data(tmp_path):
    """sbatch reads a job name full of syntax back unchanged; the job is held, then cancelled."""
    if not _slurm_up():
        pytest.skip("no Slurm answers here (.ci/slurm_up.sh starts one)")
    name = "odd name #1 'q' \"d\" $(touch m) `touch m` a\\b"
    job = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "single_node", "--job-name", name,
                    "--ntasks-per-node", "2", "--time", "00:01:00",
                    "--slurm-output", str(tmp_path / "out #%j 'x'.txt"), "-o", str(job)],
                   cwd=ROOT, check=True, timeout=60)
    submitted = subprocess.run(["sbatch", "--parsable", "--hold", "--overcommit", "--chdir",
                                str(tmp_path), str(job)], capture_output=True, text=True,
                               timeout=30)
    assert submitted.returncode == 0, submitted.stderr
    job_id = submitted.stdout.strip().split(";")[0]
    try:
        shown = subprocess.run(["squeue", "-h", "-j", job_id, "-o", "%j"], capture_output=True,
                               text=True, timeout=15)
        assert shown.stdout.rstrip("\n") == name, shown
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
    assert not (tmp_path / "m").exists()
