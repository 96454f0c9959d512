"""Faults only a real network has: a node's link goes down, or its processes are killed.

A 3-node job (one rank per node, no dedicated server, checkpoints every 10
steps) is hit in the middle of training. It must end within
``HPCPAX_TIMEOUT`` plus a margin, non-zero, naming the lost node and ranks
(the watchdog names the ranks that stopped answering and their host; for
killed ranks the launcher names the host), and the last checkpoint must be
intact and resume on the two remaining nodes, continuing the same training
(BSP: the same loss with fewer workers and the same global batch).
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from cluster_jobs import ROOT, TINY, run_env, run_on_cluster

pytestmark = pytest.mark.cluster

TIMEOUT = 8  # HPCPAX_TIMEOUT of the jobs
MARGIN = 30  # seconds on top, for the report, the abort and the launcher's clean-up
CHECKPOINT_EVERY = 10
ARGS = [*TINY, "--servers-per-node", "0", "--checkpoint-every", str(CHECKPOINT_EVERY)]


def _steps(run_dir):
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        if line.endswith("}"):
            record = json.loads(line)
            if "step" in record and "loss" in record:
                out[record["step"]] = record["loss"]
    return out


def _start(spec, run_dir, log):
    from hpcpax.cluster import mpirun_argv

    argv = mpirun_argv(spec, 1, [sys.executable, "-m", "hpcpax.train", *ARGS, "--steps",
                                 "100000", "--run-dir", str(run_dir)])
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True, env=run_env(HPCPAX_TIMEOUT=TIMEOUT))
    deadline = time.monotonic() + 120
    from hpcpax.app import checkpoint_files as ckpt

    while time.monotonic() < deadline:
        if max(_steps(run_dir), default=0) >= 2 * CHECKPOINT_EVERY + 5 and ckpt.latest(run_dir):
            return proc
        assert proc.poll() is None, f"job ended before the fault: {log.name}"
        time.sleep(0.1)
    raise AssertionError("the job did not reach step 25 in 120 s")


def _clean_node(spec, node, proc):
    """Kill what the fault left (our job's processes only) and bring the link back."""
    from hpcpax.cluster.netns import node_pids

    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
    for pid in node_pids(node):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "link", "set", spec.veth(node), "up"], check=True, timeout=30)


def _resume_on_two_nodes(spec, run_dir):
    """The last checkpoint is intact and training continues from it on hpt1, hpt2."""
    from hpcpax.app import checkpoint_files as ckpt

    path = ckpt.latest(run_dir)
    ckpt.verify(path)  # every file against its SHA-256 manifest
    step = ckpt.read_meta(path)["step"]
    before = _steps(run_dir)
    result, _ = run_on_cluster(spec, 1, [sys.executable, "-m", "hpcpax.train", *ARGS,
                                         "--resume", "--steps", str(step + 5), "--run-dir",
                                         str(run_dir)], nodes=spec.node_names[:2], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["topology"]["num_nodes"] == 2
    assert summary["start_step"] == step + 1 and summary["steps_run"] == 5
    # the same step as before the fault, now with 2 workers instead of 3: same loss
    after = [json.loads(t) for t in (run_dir / "metrics.jsonl").read_text().splitlines()
             if t.endswith("}")]
    resumed = [r["loss"] for r in after if r.get("step") == step + 1]
    if step + 1 not in before:
        # the fault came between the checkpoint and the next step's metrics line: the
        # reference is the same training without a fault, from step 1 on the two nodes
        before = _reference_steps(spec, run_dir.parent / "reference", step + 1)
    assert resumed[-1] == pytest.approx(before[step + 1], rel=1e-4)


def _reference_steps(spec, run_dir, steps):
    """Losses per step of a fault-free run of ``steps`` steps on the first two nodes."""
    result, _ = run_on_cluster(spec, 1, [sys.executable, "-m", "hpcpax.train", *ARGS,
                                         "--steps", str(steps), "--run-dir", str(run_dir)],
                               nodes=spec.node_names[:2], timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return _steps(run_dir)


@pytest.mark.timeout(300)
def test_link_down_mid_training_ends_the_job_naming_the_node(cluster, tmp_path):
    node = cluster.node_names[2]
    run_dir = tmp_path / "run"
    with open(tmp_path / "job.log", "w") as log:
        proc = _start(cluster, run_dir, log)
        try:
            subprocess.run(["ip", "link", "set", cluster.veth(node), "down"], check=True,
                           timeout=30)
            start = time.monotonic()
            code = proc.wait(TIMEOUT + MARGIN)
            elapsed = time.monotonic() - start
        finally:
            _clean_node(cluster, node, proc)
    output = (tmp_path / "job.log").read_text(errors="replace")
    assert code != 0 and elapsed < TIMEOUT + MARGIN, (code, elapsed, output[-3000:])
    assert "hpcpax watchdog" in output, output[-3000:]
    assert f"no answer from ranks [2] (dead or stopped?) on host {node}" in output, \
        output[-3000:]
    _resume_on_two_nodes(cluster, run_dir)


@pytest.mark.timeout(300)
def test_killed_node_ends_the_job_naming_the_node(cluster, tmp_path):
    from hpcpax.cluster.netns import node_pids

    node = cluster.node_names[2]
    run_dir = tmp_path / "run"
    with open(tmp_path / "job.log", "w") as log:
        proc = _start(cluster, run_dir, log)
        try:
            victims = []
            for pid in node_pids(node):
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if b"hpcpax.train" in handle.read():
                        victims.append(pid)
            assert victims
            for pid in victims:
                os.kill(pid, signal.SIGKILL)
            start = time.monotonic()
            code = proc.wait(TIMEOUT + MARGIN)
            elapsed = time.monotonic() - start
        finally:
            _clean_node(cluster, node, proc)
    output = (tmp_path / "job.log").read_text(errors="replace")
    assert code != 0 and elapsed < TIMEOUT + MARGIN, (code, elapsed, output[-3000:])
    # the launcher names the host and the killed process
    assert f"RUNNING AT {node}" in output and f"PID {victims[0]}" in output, output[-3000:]
    _resume_on_two_nodes(cluster, run_dir)
