"""Under the real Slurm (``.ci/slurm_up.sh``): preemption, requeue, resubmission.

- USR1 to the batch shell -> checkpoint, requeue, resume (Slurm holds a
  requeued job 2 min before it starts again; the test moves its begin time
  to now once it is pending again, as ``scontrol update`` lets its owner);
- USR1 to the ranks only (``scancel --signal=USR1`` without ``--batch``) ->
  checkpoint, exit status 3, the job script requeues the job;
- the same job script submitted twice continues its run instead of
  training it again from step 1.

Skips cleanly without Slurm. Serial suite only; a few minutes at most.
"""

import json
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hpcpax.app import checkpoint_files as ckpt
from reliability_jobs import ROOT, TINY, serial_only
from slurm_wait import submit_and_wait

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


def _steps_alive(job_id):
    """Whether a ``slurmstepd`` of ``job_id`` still runs here (the one-node Slurm):
    a requeued job started before its old step is gone reuses the step's id and
    fails in its PMI exchange."""
    return subprocess.run(["pgrep", "-f", f"slurmstepd: \\[{job_id}\\."],
                          capture_output=True, timeout=15).returncode == 0


def _script(tmp_path, run_dir, steps, checkpoint_every, extra=()):
    """Render the single-node template for the tiny model; returns its path."""
    if not _slurm_up():
        pytest.skip("no Slurm (run .ci/slurm_up.sh)")
    script = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "single_node", "--job-name",
                    "hpcpax-rel", "--ntasks-per-node", "4", "--time", "00:10:00",
                    "--slurm-output", str(tmp_path / "slurm-%j.out"),
                    "--activate", str(Path(sys.executable).parent / "activate"),
                    "--train-args", " ".join([*TINY, "--steps", str(steps), *extra]),
                    "--checkpoint-every", str(checkpoint_every),
                    "--run-dir", str(run_dir), "-o", str(script)], cwd=ROOT, check=True)
    return script


def _submit(script, *flags):
    return subprocess.run(["sbatch", "--parsable", "--overcommit", "--chdir", str(ROOT), *flags,
                           str(script)], capture_output=True, text=True, check=True,
                          timeout=600).stdout.strip().split(";")[0]


def _run_to_end(script):
    """Submit ``script`` and wait for its end, polled (``tests/slurm_wait.py``: ``sbatch
    --wait`` sleeps up to 32 s between looks); its id."""
    job_id, _, _ = submit_and_wait(["--overcommit", "--chdir", str(ROOT), str(script)], 240)
    return job_id


def _wait_for_metrics(run_dir, job_id):
    deadline = time.monotonic() + 120
    metrics = run_dir / "metrics.jsonl"
    while time.monotonic() < deadline and not (metrics.exists()
                                               and len(metrics.read_text()) > 0):
        time.sleep(0.5)
    assert metrics.exists(), f"job {job_id} wrote no metrics: {_state(job_id)}"


@pytest.mark.timeout(400)
def test_usr1_checkpoints_requeues_and_finishes(tmp_path):
    serial_only()
    run_dir = tmp_path / "run"
    script = _script(tmp_path, run_dir, steps=300, checkpoint_every=150)
    job_id = _submit(script)
    try:
        _wait_for_metrics(run_dir, job_id)
        subprocess.run(["scancel", "--signal=USR1", "--batch", job_id], check=True, timeout=30)
        deadline, released = time.monotonic() + 240, False
        while time.monotonic() < deadline:
            state, restarts = _state(job_id)
            if state == "COMPLETED" or (state in ("FAILED", "CANCELLED", "TIMEOUT")):
                break
            if state == "PENDING" and int(restarts) >= 1 and not released \
                    and not _steps_alive(job_id):
                # requeued, its old steps gone: only Slurm's requeue delay is left
                released = subprocess.run(["scontrol", "update", f"JobId={job_id}",
                                           "StartTime=now"], timeout=30).returncode == 0
                print(f"released at {time.monotonic() - deadline + 240:.1f} s")
            time.sleep(0.5)
        output = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
        print(output[-3000:])
        assert "asking the ranks to checkpoint" in output and "requeueing job" in output
        assert state == "COMPLETED" and int(restarts) >= 1, (state, restarts, output[-2000:])
        assert "restart 1" in output
        assert ckpt.latest(run_dir).endswith(ckpt.checkpoint_name(300))
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


def _usr1_and_wait(job_id, run_dir, folder):
    """``scancel --signal=USR1`` once the job trains; ``(state, restarts, its output)``
    once it was requeued or ended (at most 120 s)."""
    _wait_for_metrics(run_dir, job_id)
    subprocess.run(["scancel", "--signal=USR1", job_id], check=True, timeout=30)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        state, restarts = _state(job_id)
        if int(restarts) >= 1 or state in ("COMPLETED", "FAILED", "CANCELLED"):
            break
        time.sleep(1)
    output = "".join(p.read_text() for p in folder.glob("slurm-*.out"))
    print(output[-3000:])
    return state, restarts, output


@pytest.mark.timeout(200)
def test_usr1_to_the_ranks_exits_3_and_the_script_requeues(tmp_path):
    """``scancel --signal=USR1 JOB`` reaches the ranks, not the batch shell: they
    checkpoint and exit 3; the script sees 3 and requeues instead of COMPLETING."""
    serial_only()
    run_dir = tmp_path / "run"
    script = _script(tmp_path, run_dir, steps=5000, checkpoint_every=2500)
    job_id = _submit(script)
    try:
        state, restarts, output = _usr1_and_wait(job_id, run_dir, tmp_path)
        assert int(restarts) >= 1 and state != "COMPLETED", (state, restarts, output[-2000:])
        assert "checkpointed after a preemption signal; requeueing job" in output
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["preempted"] and summary["signal"] == "SIGUSR1"
        assert ckpt.latest(run_dir).endswith(ckpt.checkpoint_name(summary["steps"]))
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("consistency", ["bsp", "ssp:0", "asp"])
def test_a_preempted_job_is_requeued_under_every_consistency_model(tmp_path, consistency):
    """The rendered template (``srun --kill-on-bad-exit=1``) sees status 3 from the ranks
    after ``scancel --signal=USR1 JOB`` and requeues, not one rank killed on the way."""
    serial_only()
    run_dir = tmp_path / "run"
    script = _script(tmp_path, run_dir, steps=5000, checkpoint_every=4,
                     extra=["--consistency", consistency])
    job_id = _submit(script)
    try:
        state, restarts, output = _usr1_and_wait(job_id, run_dir, tmp_path)
        assert int(restarts) >= 1 and state != "COMPLETED", (state, restarts, output[-2000:])
        assert "checkpointed after a preemption signal; requeueing job" in output
        # srun words every non-zero exit as an error: each must be a task's own 3
        ends = re.findall(r"srun: error: \S+: tasks? [\d,-]+: (.*)", output)
        assert ends and set(ends) == {"Exited with exit code 3"}, output[-2000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["preempted"] and summary["signal"] == "SIGUSR1"
        ckpt.verify(ckpt.latest(run_dir))
    finally:
        subprocess.run(["scancel", job_id], timeout=30)


@pytest.mark.timeout(300)
def test_a_resubmitted_job_continues_its_run(tmp_path):
    """``sbatch --wait j.sbatch && sbatch --wait j.sbatch``: the second job resumes the
    finished run (no step trained twice, no file of the first run rewritten)."""
    serial_only()
    run_dir = tmp_path / "run"
    script = _script(tmp_path, run_dir, steps=6, checkpoint_every=3)
    first = _run_to_end(script)
    assert _state(first)[0] == "COMPLETED", _state(first)
    lines = (run_dir / "metrics.jsonl").read_text()
    checkpoint = ckpt.latest(run_dir)
    manifest = (Path(checkpoint) / ckpt.MANIFEST).read_text()
    second = _run_to_end(script)
    output = "".join(p.read_text() for p in tmp_path.glob("slurm-*.out"))
    assert _state(second)[0] == "COMPLETED", (_state(second), output[-2000:])
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.startswith(lines)  # appended, never cut
    added = [json.loads(line) for line in text[len(lines):].splitlines()]
    assert not [r for r in added if "loss" in r], added  # nothing trained again
    assert ckpt.latest(run_dir) == checkpoint
    assert (Path(checkpoint) / ckpt.MANIFEST).read_text() == manifest
