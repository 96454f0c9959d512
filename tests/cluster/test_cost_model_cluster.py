"""The cost-model check's job on the emulated cluster: shaped links, exact bytes.

``benchmarks/cost_model_check.py --cluster RATE`` runs its layouts with each
node a network namespace; here one small layout (2 nodes x 2 ranks, no
servers, the ``ctr-dense`` model, every method) runs its job on the
session's 3-node cluster: the calibration must see the shaped link as the
slower class, the accounting's bytes must equal the model's routing of the
same ids on every step, phase and direction, and both nodes' links must
have carried traffic.
"""

import json
import sys

from cluster_jobs import ROOT, run_on_cluster


def test_cost_model_job_on_shaped_links_measures_the_link_and_predicts_the_bytes(cluster,
                                                                                   tmp_path):
    out = tmp_path / "job.json"
    result, moved = run_on_cluster(
        cluster, 2, [sys.executable, "-m", "mpi4py", str(ROOT / "benchmarks" /
                                                          "cost_model_check.py"),
                     "--job", "--ranks-per-node", "2", "--servers-per-node", "0",
                     "--out", str(out), "--rounds", "1", "--steps", "6", "--warmup", "2",
                     "--configs", "ctr-dense"], timeout=300, nodes=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    job = json.loads(out.read_text())
    assert job["layout"] == [4, 2, 0]
    fabric = job["calibrations"][0]["fabric"]
    # a 2 Gbit/s veth against one host's shared memory
    assert fabric["inter"]["bandwidth_Bps"] < fabric["intra"]["bandwidth_Bps"] / 2, fabric
    assert fabric["inter"]["bandwidth_Bps"] < 2e9 / 8 * 1.2, fabric
    # the model's own work per step (data, compute, optimizer) from the trial run's steps
    assert all(seconds > 0 for seconds in job["calibrations"][0]["compute"]), job["calibrations"]
    methods = {run["method"] for run in job["runs"]}
    assert {"ps", "ps-no-aggregation", "ps-16-partitions", "allgather", "allreduce"} <= methods
    for run in job["runs"]:
        assert run["byte_checks"] > 0 and run["byte_mismatches"] == 0, run["method"]
        assert run["measured_s"] > 0 and run["predicted"]["seconds"] > 0
    assert moved["hpt1"] > 0 and moved["hpt2"] > 0, moved
