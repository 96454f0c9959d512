"""The dense refresh period ``k`` chosen on the fly from replica divergence (pure)."""

import pytest

from hpcpax.errors import ConfigError
from hpcpax.plan.dense_period import DensePeriod, parse_dense_period


def refresh_cycle(period, step, divergence, pull_refresh=0.01, pull_plain=0.001, step_s=0.05):
    """Run ``period``'s schedule up to its next refresh at or after ``step``."""
    while not period.due(step):
        period.observe(pull_plain, step_s, refreshed=False)
        step += 1
    period.observe(pull_refresh, step_s, refreshed=True)
    return step, period.refreshed(step, divergence)


def test_k_rises_while_divergence_is_tiny_and_falls_to_one_when_it_grows():
    period = DensePeriod(adaptive=True, k_max=8, threshold=0.05)
    step, ks = 1, []
    period.refreshed(0)  # the first refresh: nothing to measure
    for _ in range(5):
        step, change = refresh_cycle(period, step, divergence=1e-4)
        ks.append(period.k)
        step += 1
    assert ks == [2, 4, 8, 8, 8]
    assert [c["k_to"] for c in period.history] == [2, 4, 8]
    assert all(c["divergence"] == 1e-4 for c in period.history)
    step, change = refresh_cycle(period, step, divergence=0.2)
    assert period.k == 1 and change["k_from"] == 8 and "threshold" in change["reason"]
    assert change["refresh_cost_s"] == pytest.approx(0.009, rel=0.3)


def test_moderate_divergence_halves_k():
    period = DensePeriod(k=8, adaptive=True, k_max=8, threshold=0.05)
    period.refreshed(0)
    _, change = refresh_cycle(period, 1, divergence=0.03)
    assert period.k == 4 and change["k_to"] == 4


def test_cheap_refresh_does_not_raise_k():
    period = DensePeriod(k=2, adaptive=True, k_max=8, min_cost=0.02)
    period.refreshed(0)
    # a refresh costs 0.1 % of a step: k falls back to 1 however small the divergence
    _, change = refresh_cycle(period, 1, 1e-5, pull_refresh=0.00105, pull_plain=0.001,
                              step_s=0.05)
    assert period.k == 1 and "costs only" in change["reason"]


def test_fixed_period_never_changes_and_schedules_every_k():
    period = DensePeriod(k=3)
    due = []
    for step in range(1, 11):
        if period.due(step):
            due.append(step)
            period.refreshed(step, 0.5)
    assert due == [1, 4, 7, 10] and period.k == 3 and not period.history


def test_state_round_trip():
    period = DensePeriod(adaptive=True)
    period.refreshed(0)
    refresh_cycle(period, 1, 1e-4)
    other = DensePeriod(adaptive=True)
    other.load(period.state())
    assert other.k == period.k == 2 and other.history == period.history
    assert other.due(100)  # the schedule restarts: the next step refreshes


def test_parse():
    assert parse_dense_period("4") == (4, False, 4)
    assert parse_dense_period("auto") == (1, True, 8)
    assert parse_dense_period("auto:16") == (1, True, 16)
    for bad in ("0", "x", "auto:0", "-2"):
        with pytest.raises(ConfigError, match="dense_period must be"):
            parse_dense_period(bad)
    with pytest.raises(ConfigError, match="must be in"):
        DensePeriod(k=9, k_max=8)
