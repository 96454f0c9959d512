import numpy as np
import pytest

from hpcpax.plan.partition_search import cost_curve, fit_cost_curve, search_partitions


@pytest.mark.parametrize("abc", [(1e-4, 0.5, 0.1), (0.0, 2.0, 0.0), (3e-3, 0.01, 1.5)])
def test_fit_recovers_exact_coefficients(abc):
    ns = [1, 2, 4, 8, 16, 32]
    times = cost_curve(ns, *abc)
    assert fit_cost_curve(ns, times) == pytest.approx(abc, rel=1e-9, abs=1e-12)


def test_fit_needs_three_distinct_counts():
    with pytest.raises(ValueError, match="3 distinct"):
        fit_cost_curve([2, 2, 4], [1.0, 1.0, 0.5])


def _counting(curve):
    calls = []

    def measure(p):
        calls.append(p)
        return curve(p)

    return measure, calls


def _true_min(a, b, c, lo, hi):
    ns = np.arange(lo, hi + 1)
    return int(ns[np.argmin(cost_curve(ns, a, b, c))])


@pytest.mark.parametrize("abc,p0,p_max", [
    ((1e-3, 1.0, 0.2), 8, 4096),    # minimum ~32: inside, reached by doubling
    ((1e-2, 0.04, 0.2), 8, 4096),   # minimum ~2: reached by halving from the start
    ((1e-3, 0.064, 0.1), 8, 4096),  # minimum exactly at the start point (8)
    ((1e-7, 1.0, 0.0), 8, 64),      # minimum at the upper edge
    ((1e-2, 0.001, 0.0), 1, 64),    # minimum at the lower edge, start there too
])
def test_search_finds_minimum_of_convex_curve(abc, p0, p_max):
    measure, calls = _counting(lambda p: float(cost_curve(p, *abc)))
    result = search_partitions(measure, p0=p0, p_max=p_max)
    best = _true_min(*abc, 1, p_max)
    assert cost_curve(result.chosen, *abc) <= cost_curve(best, *abc) * (1 + 1e-9) or result.chosen == best
    assert len(calls) == len(set(calls)) <= 2 + int(np.log2(p_max))
    assert set(result.samples) == set(calls)
    if result.fit is not None:
        assert result.fit == pytest.approx(abc, rel=1e-6, abs=1e-9)


def test_search_with_noise_stays_near_minimum():
    rng = np.random.default_rng(7)
    abc = (1e-3, 1.0, 0.2)
    best = _true_min(*abc, 1, 4096)
    for _ in range(5):
        def measure(p):
            return float(cost_curve(p, *abc)) * (1 + rng.normal(0, 0.01))

        result = search_partitions(measure, p0=4, p_max=4096)
        assert cost_curve(result.chosen, *abc) <= cost_curve(best, *abc) * 1.05
        assert result.fit is not None


def test_search_caps_calls_and_reports():
    measure, calls = _counting(lambda p: 1.0 / p)  # keeps improving
    result = search_partitions(measure, p0=1, p_max=1 << 20, max_measurements=5)
    assert len(calls) == 5
    assert result.chosen == max(calls) or result.chosen == result.fitted_minimum
    data = result.to_dict()
    assert data["samples"][0] == [1, 1.0]
    assert result.search_seconds >= 0


def test_confirm_measures_the_fitted_minimum():
    abc = (1e-3, 1.0, 0.2)
    measure, calls = _counting(lambda p: float(cost_curve(p, *abc)))
    result = search_partitions(measure, p0=8, p_max=4096, confirm=True)
    assert result.fitted_minimum in calls
    assert result.chosen == 32 == _true_min(*abc, 1, 4096)


def test_search_rejects_bad_arguments():
    with pytest.raises(ValueError):
        search_partitions(lambda p: 1.0, p0=4, p_max=2, p_min=3)
    with pytest.raises(ValueError, match="finite"):
        search_partitions(lambda p: float("nan"), p0=1, p_max=4)
