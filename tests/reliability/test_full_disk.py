"""A disk that fills up or turns read-only: whole metrics lines, one-line errors, clean resumes.

In-process (one rank, ``COMM_SELF``) on a real tmpfs of a few MiB (root only;
skipped elsewhere), as in issue 49: the disk fills in the middle of training,
a run directory is read-only when a job resumes. One 3-rank job fills it
right before a checkpoint (issue 70): one line, once.
"""

import json
import re
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.metrics import read_metrics
from hpcpax.app.trainer import Trainer
from hpcpax.errors import CheckpointError
from run_trainer import fill_disk
from reliability_jobs import (ROOT, TINY, clean_env, mount_tmpfs, remount, run_job, serial_only,
                              unmount)

SMALL = {"model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
         "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
         "plan": "ps", "quiet": True}


def run(run_dir, hooks=(), **config):
    trainer = Trainer({**SMALL, "run_dir": str(run_dir), **config}, comm=MPI.COMM_SELF,
                      hooks=hooks)
    trainer.run()
    return trainer


def whole_lines(path) -> list:
    """Every line of ``path`` parsed (fails on a cut-off or glued line)."""
    text = path.read_text()
    assert text.endswith("\n"), text[-200:]
    return [json.loads(line) for line in text.splitlines()]


@pytest.fixture
def tmpfs(tmp_path):
    run_dir = tmp_path / "run"
    mount_tmpfs(run_dir, "size=4m")
    try:
        yield run_dir
    finally:
        unmount(run_dir)


def test_a_disk_filling_mid_run_keeps_whole_metrics_lines_and_resumes_cleanly(tmp_path, tmpfs):
    run_dir = tmpfs
    run(run_dir, steps=4, checkpoint_every=4)

    def full_after_step_6(trainer, step):
        if step == 6:
            fill_disk(run_dir / "filler")

    with pytest.raises(CheckpointError, match=r"^writing .*/run/metrics.jsonl failed: No space "
                                              r"left on device \(the file ends with its last "
                                              r"whole line\); free space or choose another "
                                              r"--run-dir, then --resume$"):
        run(run_dir, hooks=[full_after_step_6], steps=400, resume=True)
    lines = whole_lines(run_dir / "metrics.jsonl")
    trained = [r["step"] for r in lines if "loss" in r]
    assert trained == [1, 2, 3, 4] + list(range(5, trained[-1] + 1)) and trained[-1] > 6
    (run_dir / "filler").unlink()
    resumed = run(run_dir, steps=trained[-1] + 2, checkpoint_every=4, resume=True)
    assert resumed.summary["start_step"] == 5
    lines = whole_lines(run_dir / "metrics.jsonl")
    assert [r for r in lines if "resumed_at" in r][-1]["resumed_at"] == 4
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == \
        list(range(1, trained[-1] + 3))


def test_resume_drops_a_cut_off_last_line_before_its_marker(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(run_dir, steps=4, checkpoint_every=2)
    metrics = run_dir / "metrics.jsonl"
    whole = metrics.read_bytes()
    with open(metrics, "ab") as handle:  # what a crash in the middle of a write leaves
        handle.write(b'{"step": 5, "loss": 1.2')
    capsys.readouterr()
    run(run_dir, steps=6, checkpoint_every=2, resume=True)
    assert f"resume: {metrics} ended in a line cut off mid-write (23 bytes); dropped it\n" in \
        capsys.readouterr().out
    text = metrics.read_bytes()
    assert text.startswith(whole)
    marker = json.loads(text[len(whole):].splitlines()[0])  # a line of its own
    assert marker["resumed_at"] == 4 and sorted(marker) == ["job_id", "resumed_at"]
    whole_lines(metrics)
    assert [r["step"] for r in read_metrics(metrics)] == [1, 2, 3, 4, 5, 6]


def test_resume_on_a_read_only_run_directory_is_one_line(tmp_path, tmpfs):
    """``python -m hpcpax.train --resume`` on a read-only file system: the start-up
    write check's line, status 1, nothing written, no traceback."""
    run_dir = tmpfs
    run(run_dir, steps=2, checkpoint_every=2)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")}
    remount(run_dir, "ro")
    done = subprocess.run([sys.executable, "-m", "hpcpax.train", *TINY, "--steps", "4",
                           "--resume", "--run-dir", str(run_dir)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120, env=clean_env())
    assert done.returncode == 1, done.stderr
    assert done.stderr == (f"hpcpax.train: error on rank 0: cannot write checkpoints into "
                           f"{run_dir}/checkpoints: Read-only file system (a read-only or full "
                           "file system?); choose another --run-dir\n"), done.stderr
    assert {p: p.stat().st_mtime_ns for p in run_dir.rglob("*")} == before
    assert ckpt.latest(run_dir).endswith(ckpt.checkpoint_name(2))


@pytest.mark.timeout(150)
def test_a_disk_full_during_a_checkpoint_is_one_line_once(tmp_path, tmpfs):
    """Every rank's write fails; h5py's message has a newline and every rank used to
    print its copy (13 lines on 4 ranks): now rank 0 prints one line, the errno's words."""
    serial_only()
    status, text = run_job(3, [*TINY, "--steps", "6", "--checkpoint-every", "3",
                               "--run-dir", str(tmpfs)], tmp_path, RELIABILITY_CLI_ERRORS=1,
                           RELIABILITY_FILL_DISK_AT_CHECKPOINT=f"3:{tmpfs / 'filler'}")
    ours = [line for line in text.splitlines() if "MPI_Abort" not in line]  # MPICH's banner
    assert status == 1 and len(ours) == 1, text
    assert re.fullmatch(r"hpcpax.train: error on rank 0: checkpoint after step 3 not written: "
                        r"rank \d could not write \S+/checkpoints/step_000003\.tmp-\S+/"
                        r"(dense|sparse_rank\d)\.h5: No space left on device( \(and \d more\))?; "
                        r"the previous checkpoint is intact", ours[0]), ours[0]
    assert ckpt.list_checkpoints(tmpfs) == []  # nothing half-written counts as a checkpoint
