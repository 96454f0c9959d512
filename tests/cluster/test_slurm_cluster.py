"""Multi-node Slurm on the emulated cluster: ``jobscripts/multi_node.sbatch`` COMPLETES.

One slurmd per node namespace (``hpx1..3``, partition ``cluster`` of the
slurm.conf that ``.ci/slurm_up.sh`` writes); the single-node ``vm`` node and
its partition are untouched. The job is rendered once and submitted with
``sbatch -N 2`` and ``-N 3``; its run saw that many nodes, counted
inter-node bytes, and at least those bytes crossed the veth links (the
nodes' slurmd gives every task the cluster's transport settings).
"""

import json
import os
import shutil
import subprocess
import sys

import pytest

from conftest import ROOT, TINY, cluster_skip_reason

pytestmark = [pytest.mark.cluster, pytest.mark.slurm]

SLURM_PREFIX = "hpx"
NODES = 3


def _slurm_skip_reason():
    if shutil.which("sbatch") is None or shutil.which("sinfo") is None:
        return "no Slurm client here (.ci/slurm_up.sh installs and starts one)"
    try:
        out = subprocess.run(["sinfo", "-h", "-p", "cluster", "-o", "%D"], capture_output=True,
                             text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return "Slurm does not answer"
    if out.returncode != 0 or not out.stdout.strip():
        return "Slurm has no partition 'cluster' (rerun .ci/slurm_up.sh)"
    if int(out.stdout.split()[0]) < NODES:
        return f"partition 'cluster' has fewer than {NODES} nodes"
    return None


@pytest.fixture(scope="module")
def slurm_cluster():
    """The ``hpx`` cluster with a slurmd per node; torn down after the module (if we built it)."""
    reason = cluster_skip_reason() or _slurm_skip_reason()
    if reason:
        pytest.skip(f"multi-node Slurm unavailable: {reason}")
    from hpcpax import cluster as emu

    spec = emu.running(SLURM_PREFIX)
    built = spec is None or spec.nodes < NODES or not spec.extra.get("slurm_partition")
    if built:
        emu.down(SLURM_PREFIX, log=lambda text: None)
    try:
        if built:
            spec = emu.up(NODES, rate="2gbit", prefix=SLURM_PREFIX, slurm=True)
        yield spec
    finally:
        if built:
            emu.down(SLURM_PREFIX, log=lambda text: None)


def _render(tmp_path):
    venv = os.path.dirname(os.path.dirname(sys.executable))
    script = tmp_path / "job.sbatch"
    subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "multi_node", "--job-name",
                    "hpcpax-cluster-test", "--nodes", "2", "--ntasks-per-node", "2",
                    "--time", "00:05:00", "--partition", "cluster", "--signal-seconds", "30",
                    "--slurm-output", str(tmp_path / "slurm-%j.out"),
                    "--activate", f"source '{venv}/bin/activate'",
                    "--train-args", " ".join(TINY + ["--steps", "5"]),
                    "--checkpoint-every", "0", "--run-dir", str(tmp_path / "run"),
                    "-o", str(script)], check=True, cwd=ROOT, timeout=60)
    return script


def _job_state(job_id):
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=15).stdout
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return fields.get("JobState"), fields.get("ExitCode")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("nodes", [2, 3])
def test_multi_node_job_completes_across_the_emulated_nodes(slurm_cluster, tmp_path, nodes):
    from hpcpax.cluster import link_counters

    script = _render(tmp_path)
    before = link_counters(slurm_cluster)
    result = subprocess.run(["sbatch", "--parsable", "--wait", "-N", str(nodes), "--chdir",
                             str(ROOT), str(script)], capture_output=True, text=True,
                            timeout=200)
    after = link_counters(slurm_cluster)
    job_id = result.stdout.strip().split(";")[0]
    outputs = "".join(p.read_text(errors="replace") for p in tmp_path.glob("slurm-*.out"))
    assert result.returncode == 0, result.stderr + outputs[-4000:]
    state, exit_code = _job_state(job_id)
    assert state in ("COMPLETED", None) and exit_code in ("0:0", None), (state, outputs[-4000:])
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps_run"] == 5
    assert summary["topology"]["num_nodes"] == nodes
    assert summary["topology"]["size"] == 2 * nodes
    inter = summary["total"]["sent_inter_bytes"]
    assert inter > 0
    moved = {n: after[n]["sent"] - before[n]["sent"] for n in slurm_cluster.node_names}
    used = [n for n in slurm_cluster.node_names if moved[n] > 0]
    assert len(used) >= nodes and sum(moved.values()) >= inter, (moved, inter)
    # the single-node partition and its node are still there and usable
    vm = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%T"], capture_output=True,
                        text=True, timeout=15).stdout.split()
    assert vm and all(s.rstrip("*") in ("idle", "mixed", "allocated", "completing") for s in vm)
