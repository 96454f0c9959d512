"""Under the real Slurm (``.ci/slurm_up.sh``): USR1 to the batch shell -> checkpoint, requeue, resume.

Slurm holds a requeued job ~2.5 min before it starts again, so this takes ~3 min.

Skips cleanly without Slurm. Serial suite only; a few minutes at most.
"""

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcpax.app import checkpoint as ckpt
from reliability_jobs import ROOT, TINY, serial_only

pytestmark = pytest.mark.slurm


def _slurm_up():
    if not shutil.which("sbatch"):
        return False
    try:
        return subprocess.run(["sinfo", "-h"], capture_output=True, timeout=15).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def _state(job_id):
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                         text=True, timeout=15).stdout
    fields = dict(p.split("=", 1) for p in out.split() if "=" in p)
    return fields.get("JobState"), fields.get("Restarts", "0")


@pytest.mark.timeout(400)
def test_usr1_checkpoints_requeues_and_finishes(tmp_path):
    serial_only()
    if not _slurm_up():
        pytest.skip("no Slurm (run .ci/slurm_up.sh)")
    run_dir = tmp_path / "run"
    train_args = " ".join(TINY + ["--steps", "1000"])
    script = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "single_node", "--job-name",
                    "hpcpax-rel", "--ntasks-per-node", "4", "--time", "00:10:00",
                    "--slurm-output", str(tmp_path / "slurm-%j.out"),
                    "--activate", f"source '{Path(sys.executable).parent / 'activate'}'",
                    "--train-args", train_args, "--checkpoint-every", "500",
                    "--run-dir", str(run_dir), "-o", str(script)], cwd=ROOT, check=True)
    job_id = subprocess.run(["sbatch", "--parsable", "--overcommit", "--chdir", str(ROOT),
                             str(script)], capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip().split(";")[0]
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while time.monotonic() < deadline and not (metrics.exists()
                                                   and len(metrics.read_text()) > 0):
            time.sleep(0.5)
        assert metrics.exists(), f"job {job_id} wrote no metrics: {_state(job_id)}"
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline:
            state, restarts = _state(job_id)
            if state == "COMPLETED" or (state in ("FAILED", "CANCELLED", "TIMEOUT")):
                break
            time.sleep(1)
        output = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
        print(output[-3000:])
        assert "asking the ranks to checkpoint" in output and "requeueing job" in output
        assert state == "COMPLETED" and int(restarts) >= 1, (state, restarts, output[-2000:])
        assert "restart 1" in output
        assert ckpt.latest(run_dir).endswith(ckpt.checkpoint_name(1000))
    finally:
        subprocess.run(["scancel", job_id], timeout=30)
