"""Multi-node Slurm on the emulated cluster: ``jobscripts/multi_node.sbatch`` COMPLETES.

One slurmd per node namespace (``hpx1..3``, partition ``cluster`` of the
slurm.conf that ``.ci/slurm_up.sh`` writes); the single-node ``vm`` node and
its partition are untouched. The job is rendered once per node count (each
with its own run directory) and submitted with ``sbatch -N 2`` and ``-N 3``
at the same time (the nodes are shared, as the
host node is); each run saw that many nodes and counted inter-node bytes,
and at least those bytes crossed the veth links (the nodes' slurmd gives
every task the cluster's transport settings).
"""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cluster_jobs import ROOT, TINY, cluster_skip_reason

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
    from hpcpax.cluster.slurmd import slurmd_pid, wait_nodes

    spec = emu.running(SLURM_PREFIX)
    # A cluster left up by a run that ended without its teardown (killed, or a machine
    # restored from a snapshot) keeps its namespaces and state files but not its slurmds:
    # jobs would pend there forever. Reuse only a cluster whose slurmds all run.
    built = (spec is None or spec.nodes < NODES or not spec.extra.get("slurm_partition")
             or not all(slurmd_pid(SLURM_PREFIX, n) for n in spec.node_names))
    if not built:
        wait_nodes(spec.node_names, timeout=60.0)
    if built:
        emu.down(SLURM_PREFIX, log=lambda text: None)
    try:
        if built:
            spec = emu.up(NODES, rate="2gbit", prefix=SLURM_PREFIX, slurm=True)
        yield spec
    finally:
        if built:
            emu.down(SLURM_PREFIX, log=lambda text: None)


def _render(tmp_path, nodes):
    """The multi-node template rendered for a job of ``nodes`` nodes, writing to ``run{nodes}``."""
    venv = os.path.dirname(os.path.dirname(sys.executable))
    script = tmp_path / f"job{nodes}.sbatch"
    subprocess.run([sys.executable, "-m", "hpcpax.jobscript", "multi_node", "--job-name",
                    "hpcpax-cluster-test", "--nodes", "2", "--ntasks-per-node", "2",
                    "--time", "00:05:00", "--partition", "cluster", "--signal-seconds", "30",
                    "--activate", f"{venv}/bin/activate",
                    "--train-args", " ".join(TINY + ["--steps", "5"]),
                    "--checkpoint-every", "0", "--run-dir", str(tmp_path / f"run{nodes}"),
                    "-o", str(script)], check=True, cwd=ROOT, timeout=60)
    return script


FINAL = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "BOOT_FAIL", "DEADLINE", "PREEMPTED")


def _job(job_id):
    line = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True,
                          text=True, timeout=15).stdout
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


#: What a failed PMI wire-up in MPI_Init leaves in a job's output or its nodes' slurmd logs.
PMI_GARBLED = ("mpi/pmi2: value not properly terminated in client request",
               "MPIDI_UCX_comm_addr_exchange")
#: Where the nodes' slurmds log (SlurmdLogFile of hpcpax.cluster.slurmd).
SLURMD_LOGS = Path("/var/log/slurm")


def _log_marks() -> dict:
    """Sizes of the nodes' slurmd logs and slurmctld's now: what a job logs is past these."""
    paths = [*SLURMD_LOGS.glob(f"slurmd-{SLURM_PREFIX}*.log"), SLURMD_LOGS / "slurmctld.log"]
    return {path: path.stat().st_size for path in paths if path.exists()}


def _appended(path, marks) -> str:
    """What ``path`` holds past its mark ("" when it cannot be read)."""
    try:
        with open(path, "rb") as handle:
            handle.seek(marks.get(path, 0))
            return handle.read().decode(errors="replace")
    except OSError:
        return ""


def _slurmd_lines(marks, job_id) -> list:
    """The lines the nodes' slurmds logged about ``job_id`` since ``marks``."""
    lines = []
    for path in sorted(SLURMD_LOGS.glob(f"slurmd-{SLURM_PREFIX}*.log")):
        text = _appended(path, marks)
        tag = (f" job {job_id} ", f"[{job_id}.", f"JobId={job_id} ", f"StepId={job_id}.")
        lines += [f"{path.stem}: {line}" for line in text.splitlines()
                  if any(t in line + " " for t in tag)]
    return lines


def _output(tmp, nodes) -> str:
    path = tmp / f"slurm-{nodes}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def _pmi_garbled(tmp, nodes, job_id, marks) -> bool:
    """Did MPI_Init's wire-up of this job fail (its output, or its steps' slurmd log lines)?

    The fault can fail the ranks (the output names it) or leave them waiting in
    MPI_Init for a reply slurmd will never send (only slurmd's log names it).
    """
    text = _output(tmp, nodes) + "\n".join(_slurmd_lines(marks, job_id))
    return any(marker in text for marker in PMI_GARBLED)


def _submit(tmp, nodes, attempt=1):
    """``(job id, run dir, slurmd log marks)`` of ``_render(tmp, nodes)``'s script, ``-N nodes``."""
    script, run_dir = tmp / f"job{nodes}.sbatch", tmp / f"run{nodes}"
    if attempt > 1:
        (tmp / f"slurm-{nodes}.out").rename(tmp / f"slurm-{nodes}.attempt{attempt - 1}.out")
    marks = _log_marks()
    result = subprocess.run(["sbatch", "--parsable", "-N", str(nodes), "--chdir", str(ROOT),
                             "--output", str(tmp / f"slurm-{nodes}.out"), "--export",
                             f"ALL,JOB_ATTEMPT={attempt},"
                             f"JOB_ENV_PAD={'x' * (13 * attempt)}",
                             str(script)], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip().split(";")[0], run_dir, marks


def _diagnosis(job_id, marks, fields) -> str:
    """What Slurm says of a job that did not finish: its state and reason, the nodes, slurmd."""
    nodes = subprocess.run(["sinfo", "-h", "-N", "-p", "cluster", "-o", "%N %T %E"],
                           capture_output=True, text=True, timeout=15).stdout.strip()
    keys = ("JobState", "Reason", "NodeList", "SubmitTime", "StartTime")
    job = " ".join(f"{k}={fields.get(k)}" for k in keys)
    log = "\n".join(_slurmd_lines(marks, job_id)[-20:])
    ctld = "\n".join([line for line in _appended(SLURMD_LOGS / "slurmctld.log", marks)
                      .splitlines() if f"JobId={job_id} " in line + " "][-10:])
    return f"job: {job}\nnodes: {nodes}\nslurmctld:\n{ctld}\nslurmd:\n{log}"


def _wait(tmp, submitted, deadline) -> dict:
    """``{nodes: fields}`` of the jobs that ended; a job whose wire-up failed is cancelled
    at once (``fields["garbled"]``), the rest cancelled at the deadline (``fields["diagnosis"]``)."""
    states = {}
    try:
        while time.monotonic() < deadline and len(states) < len(submitted):
            for nodes, (job_id, _, marks) in submitted.items():
                if nodes in states:
                    continue
                fields = _job(job_id)
                if fields.get("JobState") in FINAL:
                    states[nodes] = fields
                elif _pmi_garbled(tmp, nodes, job_id, marks):
                    subprocess.run(["scancel", job_id], timeout=30)
                    states[nodes] = {**fields, "JobState": "CANCELLED", "garbled": True}
            time.sleep(0.5)
    finally:
        for nodes, (job_id, _, marks) in submitted.items():
            if nodes not in states:
                fields = _job(job_id)
                subprocess.run(["scancel", job_id], timeout=30)
                states[nodes] = {**fields, "diagnosis": _diagnosis(job_id, marks, fields)}
    for nodes, (job_id, _, marks) in submitted.items():
        states[nodes]["garbled"] = (states[nodes].get("garbled", False)
                                    or (states[nodes].get("JobState") != "COMPLETED"
                                        and _pmi_garbled(tmp, nodes, job_id, marks)))
    return states


@pytest.fixture(scope="module")
def jobs(slurm_cluster, tmp_path_factory):
    """The template submitted with -N 2 and -N 3 at once (polled, not ``sbatch --wait``)."""
    from hpcpax.cluster import link_counters

    tmp = tmp_path_factory.mktemp("multi_node")
    for nodes in (2, 3):
        _render(tmp, nodes)
    before = link_counters(slurm_cluster)
    submitted = {nodes: _submit(tmp, nodes) for nodes in (2, 3)}
    states = _wait(tmp, submitted, time.monotonic() + 200)
    # MPICH's PMI-1 client over Slurm's pmi2 plugin can garble a long wire-up value
    # in MPI_Init ("mpi/pmi2: value not properly terminated in client request"; the
    # garbage is other memory of the process): it depends on the process's memory
    # layout, which the size of the environment shifts. The ranks then fail, or wait
    # in MPI_Init for a reply that never comes (only slurmd's log names the fault).
    # That is not hpcpax: such a job is cancelled and submitted again with a padding
    # variable of another length (twice at most); if MPI still cannot start, the
    # test skips naming the fault.
    for attempt in (2, 3):
        retry = {n: _submit(tmp, n, attempt=attempt) for n in submitted
                 if states[n].get("garbled")}
        if not retry:
            break
        submitted.update(retry)
        states.update(_wait(tmp, retry, time.monotonic() + 90))
    after = link_counters(slurm_cluster)
    moved = {n: after[n]["sent"] - before[n]["sent"] for n in slurm_cluster.node_names}
    return {"states": states, "submitted": submitted, "moved": moved, "tmp": tmp}


@pytest.mark.timeout(480)
@pytest.mark.parametrize("nodes", [2, 3])
def test_multi_node_job_completes_across_the_emulated_nodes(jobs, nodes):
    job_id, run_dir, _ = jobs["submitted"][nodes]
    output = _output(jobs["tmp"], nodes)
    fields = jobs["states"][nodes]
    if fields["JobState"] != "COMPLETED" and fields["garbled"]:
        pytest.skip("MPI_Init failed in the PMI wire-up on 3 attempts (mpich wheel PMI-1 "
                    "client under Slurm's pmi2 plugin; docs/design/emulated-cluster.md)")
    assert "diagnosis" not in fields, \
        f"job {job_id} (-N {nodes}) did not finish in time:\n{fields['diagnosis']}\n" \
        f"output: {output[-3000:]}"
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", \
        (fields["JobState"], fields["ExitCode"], output[-3000:])
    assert f"on {nodes} nodes" in output
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_run"] == 5
    assert summary["topology"]["num_nodes"] == nodes
    assert summary["topology"]["size"] == 2 * nodes
    assert summary["total"]["sent_inter_bytes"] > 0
    # both jobs' off-node bytes (and more: headers, set-up) crossed the veth links
    inter = [json.loads((d / "summary.json").read_text())["total"]["sent_inter_bytes"]
             for _, d, _ in jobs["submitted"].values() if (d / "summary.json").exists()]
    assert sum(jobs["moved"].values()) >= sum(inter), (jobs["moved"], inter)
    assert sum(v > 0 for v in jobs["moved"].values()) >= nodes, jobs["moved"]
    # the single-node partition and its node are still there and usable
    vm = subprocess.run(["sinfo", "-h", "-p", "debug", "-o", "%T"], capture_output=True,
                        text=True, timeout=15).stdout.split()
    assert vm and all(s.rstrip("*") in ("idle", "mixed", "allocated", "completing") for s in vm)
