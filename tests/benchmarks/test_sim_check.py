"""``benchmarks/sim_check.py`` on the committed scaling results: its figures are all there,
and the simulator's shape of the Parallax paper's LM-1B chart (deterministic) holds.

Runs with ``--no-measure`` (links and compute only: no timing on a shared machine).
Agreement with the measured step times is the benchmark's report, not asserted here.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "2026-12-05-scaling.json"
METHODS = {"hybrid", "auto", "allgather", "ps_no_aggregation", "allreduce"}


def _load_check():
    """The benchmark module (``benchmarks/`` is not a package)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import sim_check
    return sim_check


@pytest.fixture(scope="module")
def report():
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "sim_check.py"),
                           "--results", str(RESULTS), "--no-measure"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_every_method_and_node_count_is_compared(report):
    assert set(report["methods"]) == METHODS
    for method, per_nodes in report["methods"].items():
        assert set(per_nodes) == {"2", "4", "8", "16"}, method
        for entry in per_nodes.values():
            assert entry["measured_step_s"] > 0 and entry["sim_step_s"] > 0
            assert math.isclose(entry["relative_error"],
                                entry["sim_step_s"] / entry["measured_step_s"] - 1, rel_tol=1e-3,
                                abs_tol=1e-5)
    errors = [abs(e["relative_error"]) for per in report["methods"].values() for e in per.values()]
    assert math.isclose(report["sim_error_max"], max(errors), rel_tol=1e-4)
    assert 0 <= report["sim_error_median"] <= report["sim_error_max"]
    assert report["inputs"] == {"measured_here": False}


def test_paper_shape_figures(report):
    paper, sim = report["paper_ratios"], report["sim_paper_ratios"]
    assert set(paper) == set(sim) == {"6", "12", "24", "48"}
    assert math.isclose(paper["48"], 276.8 / 39.4, rel_tol=1e-4)
    # hybrid's lead over Horovod grows with the GPUs, as in the paper
    assert sim["6"] < sim["12"] < sim["24"] < sim["48"]
    assert abs(sim["48"] / paper["48"] - 1) <= 0.3
    falling = report["sim_horovod_samples_per_s"]
    assert report["sim_horovod_falling"] == (falling["12"] > falling["24"] > falling["48"])
    within = all(abs(sim[g] / paper[g] - 1) <= 0.3 for g in ("12", "24", "48"))
    assert report["sim_paper_ratios_within_30pct"] == within
    assert report["sim_paper_shape"] == (within and report["sim_horovod_falling"])
    # the hybrid curves beside them: the paper's is the chart's words/s over 20 words
    assert math.isclose(report["paper_hybrid_samples_per_s"]["48"], 276.8e3 / 20, rel_tol=1e-6)
    hybrid = {int(g): v for g, v in report["sim_hybrid_samples_per_s"].items()}
    ratios = {int(g): v for g, v in report["paper_ratios"].items()}
    assert math.isclose(hybrid[48] / report["sim_horovod_samples_per_s"]["48"], sim["48"],
                        rel_tol=1e-4)  # the report's figures are rounded to 6 digits
    assert report["sim_paper_shape_reachable_by_horovod"] == (
        _load_check().horovod_window(hybrid, ratios) is not None)
    if report["sim_paper_shape"]:
        assert report["sim_paper_shape_reachable_by_horovod"]


def test_horovod_window_beside_the_papers_own_hybrid_is_the_papers_horovod_shape():
    check = _load_check()
    words = check.PAPER_WORDS_PER_S
    hybrid = {g: w / 20 for g, w in words["hybrid"].items()}
    ratios = {g: words["hybrid"][g] / words["horovod"][g] for g in words["hybrid"]}
    curve = check.horovod_window(hybrid, ratios)
    assert curve is not None and list(curve) == [12, 24, 48]
    assert curve[12] > curve[24] > curve[48]
    for g, value in curve.items():  # each point inside its 30 % interval
        assert 0.7 - 1e-12 <= hybrid[g] / value / ratios[g] <= 1.3 + 1e-12
    # the paper's own Horovod is one of the curves the window allows, and lies under it
    for g in curve:
        assert words["horovod"][g] / 20 <= curve[g]


def test_horovod_window_is_empty_beside_a_hybrid_that_scales_linearly():
    check = _load_check()
    ratios = {12: 3.22, 24: 5.88, 48: 7.03}
    # hybrid doubling with the GPUs: Horovod must sit in [h/(1.3 r), h/(0.7 r)], so at
    # 48 GPUs at least 4 x 1000 / (1.3 x 7.03) = 437.7, at 12 at most 1000 / (0.7 x 3.22)
    # = 443.7; falling then needs 24's point in (437.7, 443.7] and within 2000 / (1.3 x
    # 5.88) = 261.6 .. 485.9: it fits, barely
    assert check.horovod_window({12: 1000, 24: 2000, 48: 4000}, ratios) is not None
    # a little faster at 48 GPUs and no falling curve is left
    assert check.horovod_window({12: 1000, 24: 2000, 48: 4100}, ratios) is None
    # the ceiling binds: the next point is strictly under the previous one
    flat = check.horovod_window({12: 1000, 24: 1000, 48: 1000}, {12: 1.0, 24: 1.0, 48: 1.0})
    assert flat[12] > flat[24] > flat[48] > 1000 / 1.3


def test_the_round_wait_uses_the_spin_the_run_recorded():
    sim_check = _load_check()
    from hpcpax.comm.polling import SPIN_SECONDS, WITHIN_SPIN_SECONDS

    within = {"counts": {"spin_s": SPIN_SECONDS}, "rows": {"spin_s": WITHIN_SPIN_SECONDS}}
    results = {"nodes_16": {"hybrid": {"wait_within": within}}, "nodes_8": {"hybrid": {}},
               "rate": "125mbit", "dilation": 4.0, "cores": 2}
    assert sim_check.spin_of(results, 16) == pytest.approx((SPIN_SECONDS + WITHIN_SPIN_SECONDS) / 2)
    assert sim_check.spin_of(results, 8) == WITHIN_SPIN_SECONDS  # recorded before it adapted
    assert sim_check.spin_of(results, 2) == WITHIN_SPIN_SECONDS
    inputs = {"tcp_round_trip_s": 0.0, "kernels": {}, "software": {}}
    wait = sim_check.cluster_preset(results, 16, inputs)["round_wait_s"]
    # 16 ranks on 2 cores: 7 ranks ahead, each half-way through its spin, undilated
    assert wait == pytest.approx(7 * (SPIN_SECONDS + WITHIN_SPIN_SECONDS) / 4 / 4.0)


def test_several_workers_a_node_are_modeled_with_shared_memory_inside_the_node():
    """``scaling.py --ranks-per-node 2``: the sim's cluster holds 2 workers a node that
    talk through MPICH's shared memory (half the copy rate, undilated), the CPU share
    and the round wait count every rank, the measured step is every worker's samples,
    and a node's distinct rows (local aggregation's) lie between one worker's and two's."""
    sim_check = _load_check()
    from hpcpax.comm.polling import SPIN_SECONDS

    sizes = {"vocab-size": 20_000, "emb-dim": 8, "out-dim": 8, "hidden": 16,
             "num-sampled": 64, "context": 4, "steps": 6, "plan-steps": 1, "warmup": 1}
    within = {"rows": {"spin_s": SPIN_SECONDS}}
    results = {"rate": "125mbit", "dilation": 4.0, "cores": 2, "per_worker": 64,
               "model": sizes, "ranks_per_node": 2,
               "nodes_4": {"hybrid": {"samples_per_s": {"median": 1000.0},
                                      "wait_within": within}}}
    inputs = {"tcp_round_trip_s": 0.0, "kernels": {}, "software": {}, "copy_Bps": 8e9}
    cluster = sim_check.cluster_preset(results, 4, inputs)
    assert cluster["gpus_per_node"] == 2 and cluster["num_nodes"] == 4
    assert cluster["intra"]["bandwidth_Bps"] == pytest.approx(8e9 / 2 * 4.0)
    assert cluster["inter"]["bandwidth_Bps"] == pytest.approx(125e6 / 8)
    # 8 ranks on 2 cores: 3 ranks ahead of each, half-way through their spin, undilated
    assert cluster["round_wait_s"] == pytest.approx(3 * SPIN_SECONDS / 2 / 4.0)
    assert sim_check.measured_steps(results) == {"hybrid": {4: pytest.approx(64 * 8 / 1000)}}
    access = sim_check.measured_access(results, 4)
    one = sim_check.measured_access(dict(results, ranks_per_node=1), 8)
    for name, (alpha, duplicates, alpha_node) in access.items():
        assert alpha == pytest.approx(one[name][0]) and duplicates == pytest.approx(one[name][1])
        assert one[name][2] == pytest.approx(one[name][0])  # one worker a node: the same
        assert alpha < alpha_node <= 2 * alpha, name
