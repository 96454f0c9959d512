import numpy as np
import pytest

from hpcpax.plan.measure import (
    SparsityStats,
    draws_for_unique,
    expected_touched_fraction,
    expected_unique,
    zipf_probabilities,
)


def test_stats_from_per_worker_lists():
    stats = SparsityStats(workers_per_node=2)
    # node 0: workers touch {0,1} and {1,2}; node 1: {5} and {5,6,7}
    ids = [np.array([0, 1, 1, 1]), np.array([1, 2]), np.array([5, 5]), np.array([5, 6, 7])]
    stats.update(ids, rows=10)
    data = stats.to_dict()
    assert data["steps"] == 1
    assert data["alpha"] == pytest.approx((2 + 2 + 1 + 3) / 4 / 10)
    assert data["alpha_max"] == pytest.approx(0.3)
    assert data["alpha_node"] == pytest.approx((3 + 3) / 2 / 10)
    assert data["duplicate_ratio"] == pytest.approx(11 / 8)


def test_stats_from_local_and_node_union_and_means_over_steps():
    stats = SparsityStats()
    stats.update((np.array([1, 2, 2]), np.array([1, 2, 3, 4])), rows=100)
    stats.update((np.array([7]), np.array([7, 8])), rows=100)
    assert stats.alpha == pytest.approx((0.02 + 0.01) / 2)
    assert stats.alpha_node == pytest.approx((0.04 + 0.02) / 2)
    assert stats.duplicate_ratio == pytest.approx((1.5 + 1.0) / 2)


def test_stats_errors():
    stats = SparsityStats(workers_per_node=3)
    with pytest.raises(ValueError, match="split"):
        stats.update([np.array([1]), np.array([2])], rows=5)
    assert SparsityStats().to_dict()["alpha"] is None


def test_expected_unique_matches_sampling():
    rng = np.random.default_rng(0)
    p = zipf_probabilities(2000, 1.0)
    draws = 500
    observed = np.mean([np.unique(rng.choice(2000, size=draws, p=p)).size for _ in range(200)])
    assert expected_unique(p, draws) == pytest.approx(observed, rel=0.02)
    assert expected_touched_fraction([(p, draws)], 1) == pytest.approx(expected_unique(p, draws) / 2000)
    # node union of 3 workers = 3x the draws
    assert expected_touched_fraction([(p, draws)], 3) == pytest.approx(expected_unique(p, 3 * draws) / 2000)


def test_draws_for_unique_inverts_expected_unique():
    p = zipf_probabilities(5000, 1.0)
    draws = draws_for_unique(p, 1000)
    assert expected_unique(p, draws) == pytest.approx(1000, rel=1e-5)
    uniform = np.full(100, 0.01)
    assert draws_for_unique(uniform, 50) == pytest.approx(np.log(0.5) / np.log(0.99), rel=1e-5)
