"""Start-up is measured in seconds, not bytes: the plan's measurements on a slow link.

A 2-node emulated cluster of its own (100 Mbit/s links, prefix ``hps``)
trains one step under ``--plan hybrid`` (the fabric probe and the fusion-size
autotune) and ``--plan auto`` (the calibration too). Before the budgets,
the autotune reduced a 16 MiB pattern 13 times whatever the link (about 340
MB on each node's link of a 4-node cluster) and the calibration timed the
Allreduce up to 16 MiB across hosts (1.19 GB per link, 79 s at 62.5
Mbit/s); the bounds below are ten times what the budgets allow and far
below those.
"""

import json

import pytest

from cluster_jobs import TINY, cluster_skip_reason, run_on_cluster

pytestmark = pytest.mark.cluster

PREFIX, SUBNET = "hps", "10.213.249.0/24"


@pytest.fixture(scope="module")
def slow_cluster():
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    from hpcpax import cluster as emu

    emu.down(PREFIX, log=lambda text: None)
    try:
        yield emu.up(2, rate="100mbit", prefix=PREFIX, subnet=SUBNET, check_links=False)
    finally:
        emu.down(PREFIX, log=lambda text: None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("plan, max_engine_s, max_link_bytes", [
    ("hybrid", 5.0, 10e6), ("auto", 30.0, 40e6)])
def test_the_plans_start_up_keeps_to_its_budget(slow_cluster, tmp_path, plan, max_engine_s,
                                                max_link_bytes):
    run_dir = tmp_path / plan
    tiny = list(TINY)
    at = tiny.index("--plan")
    del tiny[at:at + 2]
    argv = ["python", "-m", "hpcpax.train", *tiny, "--steps", "1", "--plan", plan,
            "--emulate-compute", "0.01", "--run-dir", str(run_dir)]
    result, sent = run_on_cluster(slow_cluster, 2, argv, timeout=240)
    assert result.returncode == 0, result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    startup = summary["startup_seconds"]
    assert startup["engine"] < max_engine_s, startup
    assert max(sent.values()) < max_link_bytes, sent
    assert summary["emulated_compute"]["fixed_s"] == 0.01
