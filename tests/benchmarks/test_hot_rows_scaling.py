"""``benchmarks/hot_rows_scaling.py --quick``: hot-row trees on 2 emulated nodes, figures sane.

Needs the emulated cluster (root, ``ip netns``); skipped otherwise. No time
threshold and no validity check (the machine is shared, and the quick sizes
are too small for the links to set the step time): every figure is there,
the byte figures are positive and finite, and the trees took bytes off the
owners (the quick run's fixed rule puts groups of 2 nodes on trees).
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # cluster_env, under any import mode
from cluster_env import cluster_benchmark_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.cluster

PER_NODES = ("ratio_step_time_before_vs_after", "ratio_step_time_hot_set", "ratio_uniform",
             "hot_share_owner_bytes", "ratio_owner_egress_before_vs_after",
             "ratio_owner_ingress_before_vs_after", "ratio_owner_egress_hot_set",
             "ratio_owner_ingress_hot_set", "cpu_busy_max", "valid", "decision", "seconds")
BYTES = ("hot_share_owner_bytes", "ratio_owner_egress_before_vs_after",
         "ratio_owner_ingress_before_vs_after", "ratio_owner_egress_hot_set",
         "ratio_owner_ingress_hot_set")


def positive(value) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value) and value > 0


@pytest.mark.timeout(300)
def test_hot_rows_scaling_quick_reports_every_figure():
    env = cluster_benchmark_env()
    # a prefix of its own: the benchmark tears down its prefix's cluster before it starts,
    # and one running the full measurement must not lose it (the shared subnet makes the
    # second one refuse to start instead)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hot_rows_scaling.py"),
                           "--quick", "--timeout", "180", "--prefix", "hpr"], cwd=ROOT,
                          capture_output=True, text=True, timeout=270, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["benchmark"] == "hot_rows_scaling" and result["nodes"] == [2]
    entry = result["nodes_2"]
    for key in PER_NODES:
        assert key in entry, key
    for key in BYTES:
        assert positive(entry[key]), (key, entry[key])
    assert entry["hot_share_owner_bytes"] <= 1.0  # the hot set is part of the Zipf ids
    assert entry["ratio_owner_egress_hot_set"] > 1.0  # trees took hot rows off the owners
    assert all(positive(v) for v in entry["seconds"].values()), entry["seconds"]
    assert 0 < entry["cpu_busy_max"] < 1.5  # measured; quick sizes are CPU-bound
    assert entry["decision"]["min_nodes"] == 2
    assert positive(result["ratio_step_time_before_vs_after_2"])
    assert positive(result["ratio_uniform_min"])
    assert result["curve"]["nodes"] == [2]
    assert result["curve"]["hot_share_owner_bytes"] == [entry["hot_share_owner_bytes"]]
    assert result["cpu_busy_max"] == entry["cpu_busy_max"]
    assert result["valid"] is (entry["cpu_busy_max"] <= result["cpu_busy_limit"])
