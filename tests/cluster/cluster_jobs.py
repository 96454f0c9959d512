"""Helpers of the emulated-cluster tests: the cluster's name, its jobs' environment and launch.

A module, not ``conftest.py``: ``from conftest import`` finds whichever conftest
pytest imported last when several folders' tests are collected together.

The fixture (``conftest.py``): a 3-node cluster, always torn down.

The cluster (prefix ``hpt``, its own subnet) is built once per session by
the first test that asks for it and removed by the fixture's finalizer, also
when a test fails; leftovers of a crashed earlier session are removed first.
Skipped, with the reason, when not root, without ``ip netns`` or inside an
``mpirun`` rank (the tests start their own).
"""

import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parents[2]
PREFIX = "hpt"
SUBNET = "10.213.250.0/24"
#: A tiny language model on synthetic data: seconds per run on 2 cores.
TINY = ["--model", "lm", "--vocab-size", "300", "--context", "3", "--emb-dim", "8",
        "--hidden", "16", "--out-dim", "8", "--num-sampled", "16", "--global-batch", "12",
        "--synthetic-samples", "5000", "--lr", "0.01", "--sparse-lr", "0.2", "--plan", "ps",
        "--quiet"]


def cluster_skip_reason():
    """Why the cluster tests cannot run here, or None."""
    if os.environ.get("PMI_RANK") or os.environ.get("PMI_SIZE"):
        return "starts its own mpirun; runs in the serial suite only"
    from hpcpax.cluster import preflight

    return preflight()


def run_env(**extra):
    """This environment for a child job: no parent MPI/PMI variables, the repo importable."""
    from hpcpax.cluster import mpirun_env

    env = mpirun_env()
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_on_cluster(spec, ranks_per_node, argv, timeout=120, nodes=None, **env):
    """``mpirun`` ``argv`` on the cluster; ``(CompletedProcess, bytes sent per node)``."""
    from hpcpax.cluster import link_counters, mpirun_argv

    before = link_counters(spec)
    result = subprocess.run(mpirun_argv(spec, ranks_per_node, argv, nodes=nodes), cwd=ROOT,
                            capture_output=True, text=True, timeout=timeout, env=run_env(**env))
    after = link_counters(spec)
    return result, {n: after[n]["sent"] - before[n]["sent"] for n in spec.node_names}


def python():
    return sys.executable
