"""``benchmarks/_cluster_lm_job.py``'s figures from a run's metrics lines."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))


def test_phase_cpu_busy_is_the_busiest_exchange_phase_in_real_seconds():
    """Every worker's CPU seconds in a phase (real) over cores x the phase's seconds
    (undilated, so x D): the busiest exchange phase, median over the steps; the
    compute phase (an emulated wait), phases under a tenth of the step and phases
    without CPU figures are left out."""
    from _cluster_lm_job import phase_cpu_busy

    phases = ("pull", "push", "dense")
    rows = [
        # D = 4, 2 cores: pull 0.8 / (2 x 0.1 x 4) = 1.0, push 0.4 / (2 x 0.2 x 4) = 0.25;
        # dense (1 ms of a 0.4 s step) would be 1.25
        {"seconds": 0.4, "time": {"pull": 0.1, "push": 0.2, "dense": 0.001, "compute": 0.1},
         "cpu_by_phase": {"pull": 0.8, "push": 0.4, "dense": 0.01, "compute": 3.0}},
        {"seconds": 0.4, "time": {"pull": 0.1, "push": 0.2, "compute": 0.1},
         "cpu_by_phase": {"pull": 0.4, "push": 0.8, "compute": 3.0}},  # push 0.5
        {"seconds": 0.3, "time": {"pull": 0.1, "push": 0.1, "compute": 0.1},
         "cpu_by_phase": {"pull": 0.16, "push": 0.16, "compute": 3.0}},  # 0.2 each
    ]
    assert phase_cpu_busy(rows, 2, 4.0, phases) == pytest.approx(0.5)
    assert phase_cpu_busy(rows[:1], 2, 4.0, phases) == pytest.approx(1.0)
    assert phase_cpu_busy([{"seconds": 0.2, "time": {"pull": 0.1}}], 2, 4.0, phases) is None
