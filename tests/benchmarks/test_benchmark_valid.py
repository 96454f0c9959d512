"""Every benchmark that prints ``valid``: a run that measured nothing is not valid (issue 70).

In-process calls of the functions that compute ``valid`` (``scaling.py``,
``hot_rows_scaling.py``, ``cost_model_check.py``), with what a round that ran
past its ``--timeout`` leaves: no rounds, errors, null figures. No cluster needed.
"""

import importlib.util
import math
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def _load(name):
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def scaling():
    return _load("scaling")


def test_every_benchmark_printing_valid_is_checked_here():
    printing = sorted(p.name for p in BENCHMARKS.glob("[!_]*.py") if '"valid"' in p.read_text())
    assert printing == ["cost_model_check.py", "hot_rows_scaling.py", "scaling.py"]


def _run(samples_per_s=1000.0, cpu_busy_max=0.3):
    return {"samples_per_s": samples_per_s, "seconds_per_step": 0.1, "cpu_busy_max": cpu_busy_max,
            "cpu_busy_phase_max": None, "wire_bytes_per_step": 1e6, "plan": "ps",
            "seconds_by_phase": {}, "hot_rows_trial": None,
            "offnode_bytes_per_step": 1e5, "offnode_bytes_predicted": 1e5}


def test_scaling_that_measured_nothing_is_not_valid(scaling):
    expected = {2: ["hybrid", "allgather"], 16: ["hybrid", "allgather"]}
    good = {"methods": {"hybrid": _run(), "allgather": _run()}}
    measured = {f"nodes_{n}": scaling.per_nodes([good], 0.6) for n in expected}
    assert scaling.overall_valid(measured, expected)  # the check can pass
    # the 16-node round ran past --timeout: no job, an error, every figure null
    timed_out = dict(measured, nodes_16={**scaling.per_nodes([], 0.6),
                                         "errors": ["TimeoutExpired: 900 s"]})
    assert timed_out["nodes_16"] == {"errors": ["TimeoutExpired: 900 s"]}
    assert not scaling.overall_valid(timed_out, expected)
    # every round of every node count failed
    assert not scaling.overall_valid({f"nodes_{n}": {"errors": ["x"]} for n in expected},
                                     expected)
    assert not scaling.overall_valid({}, expected) and not scaling.overall_valid({}, {})
    # a job line whose figures are all null
    null = {"methods": {m: _run(None, None) for m in ("hybrid", "allgather")}}
    entry = scaling.per_nodes([null], 0.6)
    assert entry["hybrid"]["valid"] is False and entry["hybrid"]["samples_per_s"] is None
    assert not scaling.overall_valid(dict(measured, nodes_16=entry), expected)
    # a method left out at 16 nodes, and one round of two failing, are not valid either
    assert not scaling.overall_valid(
        dict(measured, nodes_16=scaling.per_nodes([{"methods": {"hybrid": _run()}}], 0.6)),
        expected)
    assert not scaling.overall_valid(dict(measured, nodes_16={**measured["nodes_16"],
                                                              "errors": ["round 2"]}), expected)
    assert not scaling.per_nodes([{"methods": {"hybrid": _run(math.nan)}}], 0.6)["hybrid"]["valid"]


def test_hot_rows_scaling_that_measured_nothing_is_not_valid():
    hot_rows_scaling = _load("hot_rows_scaling")
    figures = {k: 1.0 for k in hot_rows_scaling.FIGURES}
    good = {**figures, "cpu_busy_max": 0.3, "seconds": {"before": {"median": 0.1}}}
    assert hot_rows_scaling.summary(good, 0.6)["valid"] is True
    null = {**{k: None for k in hot_rows_scaling.FIGURES}, "seconds": {}}
    assert hot_rows_scaling.summary(null, 0.6)["valid"] is False
    assert hot_rows_scaling.summary({**null, "cpu_busy_max": 0.3}, 0.6)["valid"] is False


def test_common_all_valid_needs_a_measurement():
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    import _common

    assert _common.all_valid([{"valid": True}])
    assert not _common.all_valid([]) and not _common.all_valid(iter(()))
    assert not _common.all_valid([{"valid": True}, {"error": "timeout", "valid": False}])
    assert not _common.all_valid([{"valid": True}, {}]) and not _common.all_valid([None])
    assert [_common.measured(v) for v in (1, 0.5, None, math.nan, math.inf, True, "1")] == \
        [True, True, False, False, False, False, False]


def test_cost_model_check_that_measured_nothing_is_not_valid():
    check = _load("cost_model_check")
    entries = [{"layout": [3, 3, 1]}]
    assert check.emulated_valid({"3-3-1": 0.3}, 0.6, entries, [])
    assert not check.emulated_valid({}, 0.6, [], [])  # nothing ran
    assert not check.emulated_valid({"3-3-1": None}, 0.6, entries, [])
    assert not check.emulated_valid({"3-3-1": 0.3}, 0.6, entries,
                                    [{"layout": [4, 2, 0], "error": "did not finish within 900 s"}])
    assert not check.emulated_valid({"3-3-1": 0.9}, 0.6, entries, [])
