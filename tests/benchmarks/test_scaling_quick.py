"""``benchmarks/scaling.py --quick``: every method runs on 2 emulated nodes and reports sanely.

Needs the emulated cluster (root, ``ip netns``); skipped otherwise. No time
threshold (the machine is shared): every method's figures are there and
positive, the emulated compute held no core (``cpu_busy_max`` well under 1:
a real step on these ranks is all CPU), the compute phase is the modeled
wait in undilated units, and every method moved bytes over the links.
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


@pytest.mark.timeout(600)
def test_scaling_quick_runs_every_method_on_emulated_accelerators():
    env = cluster_benchmark_env()
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "scaling.py"), "--quick",
                           "--prefix", "hpq", "--subnet", "10.213.247.0/24"], cwd=ROOT,
                          capture_output=True, text=True, timeout=540, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    methods = result["nodes_2"]
    expected = {"hybrid", "auto", "allgather", "ps_no_aggregation", "allreduce"}
    assert set(methods) == expected | ({"torch"} if "torch_skipped" not in result else set())
    for name, entry in methods.items():
        assert 0 < entry["samples_per_s"]["median"] and math.isfinite(
            entry["samples_per_s"]["median"]), name
        assert entry["cpu_busy_max"] < 0.6, (name, entry["cpu_busy_max"])
        # a node's sent bytes per undilated second never exceed its link's rate
        assert 0 < entry["link_utilisation"] <= 1.0, (name, entry["link_utilisation"])
        if name == "torch":  # DDP's reductions after the same emulated compute
            assert entry["wire_bytes_per_step"]["median"] > 0
            continue
        # the busiest exchange phase's CPU demand (None: every exchange phase under a
        # tenth of the step): a fraction of the cores
        phase = entry["cpu_busy_phase_max"]
        assert phase is None or 0 < phase < 2, (name, phase)
        # counted off-node bytes = the protocol's formula on the same ids (no trees on 2)
        assert all(abs(v - 1) < 0.01 for v in entry["offnode_vs_predicted"]), name
        # lm1b: 100 ms per 128 samples per worker, reported undilated
        assert entry["seconds_by_phase"]["compute"] >= 0.1, name
        assert entry["wire_bytes_per_step"]["median"] > entry["offnode_bytes_per_step"][
            "median"] > 0, name
    assert math.isfinite(result["ratio_hybrid_vs_allgather_2"])
    # the busiest over the methods (None where the tiny model's exchanges are all short)
    phases = [e["cpu_busy_phase_max"] for e in methods.values()
              if e.get("cpu_busy_phase_max") is not None]
    assert result["cpu_busy_phase_max"] == (max(phases) if phases else None)
