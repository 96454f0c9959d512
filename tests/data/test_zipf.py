"""Zipf ranks without a table of the id space (issue 49): exact against a NumPy CDF table,
the right frequencies at 10^10 ids, bounded memory."""

import math
import tracemalloc

import numpy as np
import pytest

from hpcpax.data import zipf
from hpcpax.data.zipf import HEAD_RANKS, TABLE_MAX, ZipfQuantiles, zipf_quantiles


def table_reference(unit, num_ranks, exponent):
    """The inverse CDF by a table of every rank (what the generators did before)."""
    cdf = np.cumsum(np.arange(1, num_ranks + 1, dtype=np.float64) ** -exponent)
    cdf /= cdf[-1]
    return np.minimum(np.searchsorted(cdf, unit, side="right"), num_ranks - 1)


def harmonic_reference(n, exponent):
    """``sum_{k<=n} k**-s``: exact NumPy sums to 10^6, then the midpoint-rule integral."""
    exact = min(n, 10**6)
    total = math.fsum(np.arange(1, exact + 1, dtype=np.float64) ** -exponent)
    if n > exact:  # sum_{k=a}^{b} f(k) ~ integral over [a - 1/2, b + 1/2]: error ~ f''/24
        a, b = exact + 0.5, n + 0.5
        total += (math.log(b / a) if exponent == 1.0 else
                  (b ** (1 - exponent) - a ** (1 - exponent)) / (1 - exponent))
    return total


@pytest.mark.parametrize("exponent", [0.0, 0.7, 1.0, 1.1, 2.0])
def test_above_the_table_bound_ranks_equal_the_tabled_ones(exponent):
    num_ranks = 3 * 10**6  # > TABLE_MAX: the analytic path
    unit = np.random.default_rng(7).random(200_000)
    unit[:3] = (0.0, 1 - 2.0**-53, 0.999999)  # both ends of [0, 1)
    got = ZipfQuantiles(num_ranks, exponent)(unit)
    want = table_reference(unit, num_ranks, exponent)
    assert got.dtype == np.int64 and got.shape == unit.shape
    assert got.min() >= 0 and got.max() <= num_ranks - 1
    # Only a float64 rounding tie between the two CDFs may differ, and by one rank.
    assert (got != want).sum() <= 2 and np.abs(got - want).max() <= 1


@pytest.mark.parametrize("num_ranks", [1, 2, 5000, TABLE_MAX])
def test_up_to_the_table_bound_it_is_the_table(num_ranks):
    unit = np.random.default_rng(3).random(50_000)
    assert np.array_equal(zipf_quantiles(unit, num_ranks, 1.1),
                          table_reference(unit, num_ranks, 1.1))


@pytest.mark.parametrize("exponent", [0.5, 1.0, 1.1, 2.0])
def test_tail_sum_is_the_harmonic_number(exponent):
    head = harmonic_reference(HEAD_RANKS, exponent)
    for n in (HEAD_RANKS + 1, 10**5, 10**6, 3 * 10**6, 10**10):
        got = head + zipf._tail_sum(np.float64(n), exponent)
        assert got == pytest.approx(harmonic_reference(n, exponent), rel=1e-12), n


def test_ten_billion_ids_have_zipf_frequencies_and_bracket_the_target():
    num_ranks, exponent, draws = 10**10, 1.1, 1_000_000
    sampler = ZipfQuantiles(num_ranks, exponent)
    ranks = sampler(np.random.default_rng(11).random(draws))
    total = harmonic_reference(num_ranks, exponent)
    for low, high in ((0, 1), (1, 10), (10, 10**4), (10**4, 10**7), (10**7, 10**9),
                      (10**9, num_ranks)):
        p = (harmonic_reference(high, exponent) - harmonic_reference(low, exponent)) / total
        seen = np.count_nonzero((ranks >= low) & (ranks < high))
        assert abs(seen - draws * p) < 5 * math.sqrt(draws * p * (1 - p)) + 1, (low, high)
    # Exact inversion: H(r) <= u * H(N) < H(r+1), checked on the Euler-Maclaurin tail.
    unit = np.random.default_rng(12).random(20_000)
    ranks = sampler(unit)
    far = ranks > HEAD_RANKS
    excess = unit[far] * sampler._total - sampler._head[-1]
    r = ranks[far].astype(np.float64)
    assert far.sum() > 5000
    assert (zipf._tail_sum(r, exponent) <= excess).all()
    assert (zipf._tail_sum(r + 1, exponent) > excess).all()


def test_ten_billion_ids_take_no_memory_of_their_count():
    unit = np.random.default_rng(5).random(100_000)
    tracemalloc.start()
    try:
        ranks = zipf_quantiles(unit, 10**10, 1.1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ranks.max() > 2**31  # ids past int32 do occur
    assert peak < 100 * unit.size + (1 << 20), peak  # a table would be 80 GB
