"""Slurm on the emulated nodes: one slurmd per node namespace.

slurmctld stays on the host (started by ``.ci/slurm_up.sh``, whose
``slurm.conf`` already lists the emulated nodes with their addresses, in a
partition of their own). Each node's slurmd runs under ``nsenter --net``
with its own hostname (``unshare --uts``) and its own mount namespace, in
which a node copy of ``slurm.conf`` is bind-mounted over the host's; that
copy differs only in what a node needs:

- ``SlurmctldHost`` points at the host's address on the bridge (127.0.0.1
  inside a node is the node itself);
- spool directory, pid file and log file per node (``%n``);
- ``TaskProlog`` exports the transport settings
  (:data:`~hpcpax.cluster.launcher.TRANSPORT_ENV`) into every task, so that
  jobs' inter-node MPI traffic crosses the shaped links like ``mpirun``'s.

Jobs' batch scripts and ``srun`` run inside the node too and see the same copy.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import ConfigError, TopologyError
from .spec import STATE_ROOT, ClusterSpec

__all__ = ["SLURM_CONF", "node_conf_text", "cluster_partition", "start_slurmds", "stop_slurmds",
           "slurmd_pid", "wait_nodes"]

SLURM_CONF = Path("/etc/slurm/slurm.conf")
_NODE_KEYS = ("SlurmdPidFile", "SlurmdSpoolDir", "SlurmdLogFile", "TaskProlog")


def _words(line):
    return dict(w.split("=", 1) for w in line.split() if "=" in w)


def cluster_partition(spec: ClusterSpec, conf_text: str) -> str:
    """Name of the partition holding exactly ``spec``'s nodes in ``conf_text``.

    Raises ConfigError when a node is missing, has another address, or no
    partition lists the nodes (the message names the fix).
    """
    hint = "run .ci/slurm_up.sh (its slurm.conf lists the emulated nodes)"
    addresses = {}
    partitions = {}
    for line in conf_text.splitlines():
        words = _words(line.split("#", 1)[0])
        if "NodeName" in words:
            addresses[words["NodeName"]] = words.get("NodeAddr", words["NodeName"])
        if "PartitionName" in words:
            partitions[words["PartitionName"]] = words.get("Nodes", "")
    for node in spec.node_names:
        if node not in addresses:
            raise ConfigError(f"slurm.conf must list NodeName={node}, not lack it; {hint}")
        if addresses[node] != spec.address(node):
            raise ConfigError(f"slurm.conf NodeAddr of {node} must be {spec.address(node)}, "
                              f"not {addresses[node]}; {hint}")
    for name, nodes in partitions.items():
        listed = _expand(nodes)
        if set(spec.node_names) <= listed and all(n.startswith(spec.prefix) for n in listed):
            return name
    raise ConfigError(f"slurm.conf must have a partition of the nodes {spec.node_names}; {hint}")


def _expand(nodes_field):
    """``hpx[1-3],vm`` -> {"hpx1", "hpx2", "hpx3", "vm"} (the forms slurm_up.sh writes)."""
    out = set()
    for part in re.findall(r"[^,\[]+(?:\[[^\]]*\])?", nodes_field):
        match = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", part)
        if match:
            out |= {f"{match.group(1)}{i}" for i in range(int(match.group(2)),
                                                          int(match.group(3)) + 1)}
        else:
            out.add(part)
    return out


def node_conf_text(spec: ClusterSpec, conf_text: str) -> str:
    """The node copy of the host's ``slurm.conf`` (see the module docstring)."""
    state = spec.state_dir
    lines = []
    for line in conf_text.splitlines():
        key = line.split("=", 1)[0].strip()
        if key == "SlurmctldHost":
            name = line.split("=", 1)[1].split("(")[0].strip()
            line = f"SlurmctldHost={name}({spec.host_address})"
        elif key in _NODE_KEYS:
            continue
        lines.append(line)
    lines += [
        "# Emulated node (hpcpax.cluster): per-node files, transport settings for every task.",
        f"SlurmdPidFile={state}/slurmd-%n.pid",
        f"SlurmdSpoolDir={state}/spool-%n",
        "SlurmdLogFile=/var/log/slurm/slurmd-%n.log",
        f"TaskProlog={state}/task_prolog",
    ]
    return "\n".join(lines) + "\n"


def _write_files(spec: ClusterSpec, conf_text: str) -> Path:
    from .launcher import TRANSPORT_ENV

    spec.state_dir.mkdir(parents=True, exist_ok=True)
    conf = spec.state_dir / "slurm.conf"
    conf.write_text(node_conf_text(spec, conf_text))
    prolog = spec.state_dir / "task_prolog"
    prolog.write_text("#!/bin/sh\n# hpcpax emulated cluster: inter-node MPI over the shaped links\n"
                      + "".join(f'echo "export {k}={v}"\n' for k, v in TRANSPORT_ENV.items()))
    prolog.chmod(0o755)
    for node in spec.node_names:
        (spec.state_dir / f"spool-{node}").mkdir(exist_ok=True)
    return conf


def slurmd_pid(prefix: str, node: str):
    """Pid of ``node``'s slurmd from its pid file, when that process is a slurmd (else None)."""
    try:
        pid = int((STATE_ROOT / prefix / f"slurmd-{node}.pid").read_text().split()[0])
        with open(f"/proc/{pid}/cmdline", "rb") as handle:
            return pid if b"slurmd" in handle.read() else None
    except (OSError, ValueError, IndexError):
        return None


def start_slurmds(spec: ClusterSpec, log=None, timeout=60.0) -> str:
    """Start one slurmd per node and wait until Slurm has them idle. Returns the partition.

    Raises:
        ConfigError: ``slurm.conf`` does not list the nodes (run .ci/slurm_up.sh).
        TopologyError: slurmd is missing, does not start, or a node is not ready in time.
    """
    from .launcher import node_argv

    log = log or (lambda text: print(f"[hpcpax.cluster] {text}", file=sys.stderr))
    slurmd = shutil.which("slurmd") or shutil.which("slurmd", path="/usr/sbin:/sbin")
    if slurmd is None or not SLURM_CONF.exists():
        raise TopologyError("slurmd and /etc/slurm/slurm.conf must exist; run .ci/slurm_up.sh")
    conf_text = SLURM_CONF.read_text()
    partition = cluster_partition(spec, conf_text)
    conf = _write_files(spec, conf_text)
    for node in spec.node_names:
        if slurmd_pid(spec.prefix, node):
            continue
        inner = f"mount --bind {conf} {SLURM_CONF} && exec {slurmd} -N {node}"
        argv = node_argv(spec, node, ["sh", "-c", inner], uts=True, mount=True)
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
        if result.returncode != 0:
            raise TopologyError(f"slurmd on {node} did not start ({result.returncode}): "
                                f"{result.stderr.strip()} (see /var/log/slurm/slurmd-{node}.log)")
    wait_nodes(spec.node_names, timeout=timeout, log=log)
    spec.extra["slurm_partition"] = partition
    spec.save()
    log(f"slurm: slurmd on {', '.join(spec.node_names)}, partition {partition!r}")
    return partition


def _node_states(nodes):
    result = subprocess.run(["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"],
                            capture_output=True, text=True, timeout=15)
    return dict(line.split()[:2] for line in result.stdout.splitlines() if len(line.split()) >= 2)


def wait_nodes(nodes, timeout=60.0, log=None) -> None:
    """Wait until every node in ``nodes`` is idle (resuming down ones). Raises TopologyError."""
    deadline = time.monotonic() + timeout
    states = {}
    while time.monotonic() < deadline:
        try:
            states = _node_states(nodes)
        except (OSError, subprocess.TimeoutExpired):
            states = {}
        if states and all(states.get(n, "").rstrip("*") in ("idle", "mixed", "allocated")
                          and not states[n].endswith("*") for n in nodes):
            return
        for node, state in states.items():
            if state.startswith(("down", "drain")) and not state.endswith("*"):
                subprocess.run(["scontrol", "update", f"NodeName={node}", "State=RESUME"],
                               capture_output=True, timeout=15)
        time.sleep(0.5)
    raise TopologyError(f"Slurm nodes not ready within {timeout:g} s: {states or 'no answer'}")


def stop_slurmds(prefix: str, nodes, log=None, wait_s=10.0) -> None:
    """Stop the slurmds of ``nodes`` (by pid file) and mark the nodes down. Idempotent."""
    log = log or (lambda text: None)
    pids = {n: slurmd_pid(prefix, n) for n in nodes}
    pids = {n: p for n, p in pids.items() if p}
    if not pids:
        return
    log(f"stopping slurmd on {', '.join(pids)}")
    for pid in pids.values():
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and any(slurmd_pid(prefix, n) for n in pids):
        time.sleep(0.1)
    for node in pids:
        pid = slurmd_pid(prefix, node)
        if pid:
            os.kill(pid, signal.SIGKILL)
    if shutil.which("scontrol"):
        # down now rather than "not responding" minutes later; they return on registration
        subprocess.run(["scontrol", "update", f"NodeName={','.join(pids)}", "State=DOWN",
                        "Reason=hpcpax emulated cluster down"], capture_output=True, timeout=15)
