"""``benchmarks/cost_model_check.py --emulate``: the cost-model check under emulated accelerators.

The smallest layout (2 nodes, one rank each, no servers, ``lm-sparse``) on
an emulated cluster with dilated links; needs root and ``ip netns``, skipped
otherwise. No time threshold (the machine is shared): the line says how it
was emulated, the bytes are exact, the errors finite, the machine's CPU busy
fraction is reported, and the measured steps are in wall seconds of the
dilated cluster (the predictions' unit): at least the modeled wait x D.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))  # cluster_env, under any import mode
from cluster_env import cluster_benchmark_env  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "cost_model_check.py"


def _env(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    env["HPCPAX_RUN_LOG"] = str(tmp_path / "runs.sqlite")  # not the user's run log
    return env


@pytest.mark.cluster
@pytest.mark.timeout(300)
def test_cost_model_check_runs_on_emulated_accelerators_in_wall_seconds(tmp_path):
    cluster_benchmark_env()
    done = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--cluster", "1gbit",
                           "--emulate", "0.02", "--dilation", "2", "--layouts", "2-1-0",
                           "--configs", "lm-sparse", "--timeout", "200",
                           "--prefix", "hpe", "--subnet", "10.213.246.0/24"],
                          cwd=ROOT, env=_env(tmp_path), capture_output=True, text=True,
                          timeout=270)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert "skipped" not in result, result
    assert result["failures"] == [] and result["layouts"] == [[2, 1, 0]]
    assert result["emulate_compute"] == "0.02" and result["dilation"] == 2.0
    assert result["bytes_exact"] is True and result["byte_fields_checked"] > 0
    for key in ("time_median_abs_error", "time_worst_abs_error", "spearman_min",
                "resolved_pairs_ordered"):
        assert result[key] is not None and math.isfinite(result[key]), key
    # the sleeps hold no core: two mostly waiting ranks are far from filling the machine
    assert 0 < result["cpu_busy_max"] < 1.0
    assert result["cpu_busy_max_by_layout"]["2-1-0"] == result["cpu_busy_max"]
    assert result["valid"] is (result["cpu_busy_max"] <= result["cpu_busy_limit"])
    # one rank per node: no local aggregation to turn off
    assert {c["method"] for c in result["cases"]} == {"ps", "ps-16-partitions", "allgather",
                                                      "allreduce"}
    for case in result["cases"]:
        # wall seconds: a step holds the modeled wait, 20 ms x D = 40 ms (undilated: 20)
        assert case["measured_ms"] >= 40.0 * 0.98, case
        assert case["predicted_ms"] >= 40.0 * 0.98, case


def test_cost_model_check_emulate_needs_the_cluster():
    done = subprocess.run([sys.executable, str(SCRIPT), "--emulate", "0.02"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--emulate needs --cluster" in done.stderr
    done = subprocess.run([sys.executable, str(SCRIPT), "--dilation", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert "--dilation needs --emulate" in done.stderr
