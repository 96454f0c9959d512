"""Balanced BSP's shares of the global batch (pure functions, no MPI)."""

import numpy as np
import pytest

from hpcpax.errors import ConfigError
from hpcpax.plan.shares import (FIT_MAX_FIXED, FIT_MIN_SPREAD, balanced_shares, even_shares,
                                fit_work, parse_shares, relative_gain, share_ranges,
                                step_work)


def test_even_shares_spread_the_remainder_first():
    assert even_shares(12, 3) == [4, 4, 4]
    assert even_shares(14, 4) == [4, 4, 3, 3]


def test_shares_follow_speed():
    # worker 2 takes twice as long per sample: it gets half a fast worker's share
    assert balanced_shares([1.0, 1.0, 2.0], 100) == [40, 40, 20]
    assert balanced_shares([1e-3, 1e-3, 1e-3, 1e-3], 64) == [16] * 4
    shares = balanced_shares([1.0, 3.0], 64)
    assert sum(shares) == 64 and shares == [48, 16]


def test_shares_sum_to_the_batch_and_ties_go_to_the_lower_worker():
    for times in ([1.0, 1.0, 1.0], [1.0, 1.3, 1.7, 2.9], [0.5, 2.0, 2.0]):
        for batch in (7, 12, 31, 100):
            shares = balanced_shares(times, batch)
            assert sum(shares) == batch and min(shares) >= 1
    assert balanced_shares([1.0, 1.0, 1.0], 13) == [5, 4, 4]


def test_minimum_share_and_missing_measurements():
    shares = balanced_shares([1.0, 1000.0], 100)
    assert shares[1] == 5  # MIN_SHARE_FRACTION of an even share of 50
    # an unmeasured (nan, 0) worker counts as the median
    assert balanced_shares([1.0, float("nan"), 1.0], 30) == [10, 10, 10]
    assert balanced_shares([0.0, 0.0], 10) == [5, 5]


def test_deterministic():
    times = [0.0123, 0.0456, 0.0123, 0.0789]
    assert all(balanced_shares(times, 97) == balanced_shares(list(times), 97)
               for _ in range(5))


def test_balanced_shares_cut_the_predicted_step():
    times = [1.0, 1.0, 2.0]
    even, balanced = even_shares(12, 3), balanced_shares(times, 12)
    assert step_work(even, times) == 8.0
    assert step_work(balanced, times) <= 5.0
    assert relative_gain(even, balanced, times) >= 0.375
    assert relative_gain(even, even, times) == 0.0


def test_ranges():
    assert share_ranges([5, 4, 3]) == [(0, 5), (5, 9), (9, 12)]


def test_parse_shares():
    assert parse_shares("4, 4,2", 10, 3) == [4, 4, 2]
    assert parse_shares(None, 10, 3) is None
    for bad in ("4,4", "5,5,0", "a,b,c", "4,4,4"):
        with pytest.raises(ConfigError, match="batch_shares must be"):
            parse_shares(bad, 10, 3)


def test_bad_arguments():
    with pytest.raises(ValueError, match="one value per worker"):
        balanced_shares([], 10)
    with pytest.raises(ValueError, match="global_batch must be >="):
        balanced_shares([1.0, 1.0, 1.0], 2)


def test_fixed_costs_shift_the_shares():
    # worker 1 has 0.1 s per step that does not grow with its share
    shares = balanced_shares([1e-3, 1e-3], 400, fixed=[0.0, 0.1])
    assert shares == [250, 150]  # both finish at 0.25 s
    assert step_work(shares, [1e-3, 1e-3], [0.0, 0.1]) == pytest.approx(0.25)
    assert balanced_shares([1e-3, 1e-3], 400, fixed=[0.0, 0.0]) == [200, 200]


def test_fit_work_recovers_the_line():
    fixed, per_sample = fit_work([100, 150, 50], [0.05 + 1e-3 * s for s in (100, 150, 50)])
    assert fixed == pytest.approx(0.05) and per_sample == pytest.approx(1e-3)
    # one share seen: proportional
    assert fit_work([100, 100], [0.2, 0.2]) == (0.0, pytest.approx(2e-3))
    # a negative intercept is clamped to 0, the slope refitted through the origin
    fixed, per_sample = fit_work([100, 200, 200], [0.05, 0.2, 0.2])
    assert fixed == 0.0 and per_sample == pytest.approx((5 + 40 + 40) / (1e4 + 4e4 + 4e4))


def test_fit_work_needs_evaluations_that_determine_a_line():
    # two points: proportional at the share in force (the last), not the line through them
    assert fit_work([100, 150], [0.15, 0.2]) == (0.0, pytest.approx(0.2 / 150))
    # three points, shares 10 % apart (< FIT_MIN_SPREAD): proportional, median at the last share
    assert FIT_MIN_SPREAD == 0.2
    assert fit_work([100, 110, 110, 110], [0.1, 0.1, 0.13, 0.11]) == (
        0.0, pytest.approx(0.11 / 110))
    # spread and points enough: the line
    fixed, per_sample = fit_work([100, 130, 160], [0.03 + 1e-3 * s for s in (100, 130, 160)])
    assert fixed == pytest.approx(0.03) and per_sample == pytest.approx(1e-3)


def test_fit_work_rejects_a_line_that_is_mostly_fixed_part():
    """As measured on a 2-core node (--straggler 3:2, the compute-heavy lm, even shares
    then balanced ones): a fast worker's work hardly moves while its share rises by a
    quarter, because the slow worker's smaller share frees CPU. The line through that is
    nearly flat (a fixed part of 95 % of the work, 4e-6 s per sample where the worker
    takes 8e-5): proportional instead."""
    shares, work = [2048, 2560, 2560], [0.2095, 0.2110, 0.2121]
    fixed, per_sample = fit_work(shares, work)
    assert (fixed, per_sample) == (0.0, pytest.approx(np.median([0.2110, 0.2121]) / 2560))
    assert FIT_MAX_FIXED == 0.8
    # a real fixed part (50 % of the work) is kept
    work = [0.1 + 5e-5 * s for s in (2048, 2431, 1700)]
    fixed, per_sample = fit_work([2048, 2431, 1700], work)
    assert fixed == pytest.approx(0.1) and per_sample == pytest.approx(5e-5)