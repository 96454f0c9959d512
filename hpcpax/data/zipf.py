"""Zipf ranks from uniforms: ``P(r) = (r+1)**-s / H_s(N)`` over ranks ``[0, N)``, in
``O(min(N, TABLE_MAX))`` memory whatever ``N`` is.

Up to :data:`TABLE_MAX` ranks the CDF is a table (``cumsum`` of the weights,
8 bytes a rank) and a draw is one ``searchsorted``: the streams every
default run and every pinned test have always had. Above it, no table of
the id space is built: the CDF is the generalized harmonic number
``H_s(n) = sum_{k<=n} k**-s``, summed exactly over the first
:data:`HEAD_RANKS` ranks and past them by Euler-Maclaurin (integral, end
terms, two Bernoulli corrections: a truncation error near
``HEAD_RANKS**-(s+5)``, below float64 rounding). A draw ``u`` takes the
target ``u * H_s(N)``; ranks in the head are found by ``searchsorted``,
ranks past it by inverting the integral, a few Newton steps and a final
exact comparison against ``H_s`` at the two neighbouring integers, so a rank
``r`` is returned exactly when ``H_s(r) <= u * H_s(N) < H_s(r+1)`` (up to
float64 rounding of ``H_s``, some ``1e-15`` relative).
"""

import numpy as np

__all__ = ["HEAD_RANKS", "TABLE_MAX", "ZipfQuantiles", "zipf_quantiles"]

#: Largest rank count whose CDF is tabled (8 MiB, and as much again while it is built).
TABLE_MAX = 1 << 20
#: Ranks summed exactly before the Euler-Maclaurin tail of the analytic CDF.
HEAD_RANKS = 1 << 12
_NEWTON_STEPS = 4


def _tail_sum(x, exponent):
    """``sum_{k=HEAD_RANKS+1}^{x} k**-s`` by Euler-Maclaurin, for real ``x >= HEAD_RANKS``."""
    s, m = exponent, float(HEAD_RANKS)
    log_ratio = np.log(x / m)
    if s == 1.0:
        integral = log_ratio
    else:  # expm1: no cancellation for s near 1
        integral = m ** (1.0 - s) * np.expm1((1.0 - s) * log_ratio) / (1.0 - s)

    def first(t):  # f'(t) of f(t) = t**-s
        return -s * t ** (-s - 1.0)

    def third(t):
        return -s * (s + 1.0) * (s + 2.0) * t ** (-s - 3.0)

    # Euler-Maclaurin from k=m, less f(m): the end terms are (f(x) - f(m))/2
    return (integral + (x ** -s - m ** -s) / 2.0 + (first(x) - first(m)) / 12.0
            - (third(x) - third(m)) / 720.0)


def _invert_tail(excess, num_ranks, s):
    """Ranks ``r >= HEAD_RANKS`` with ``T(r) <= excess < T(r+1)``, ``T`` the tail sum."""
    m, top = float(HEAD_RANKS), float(num_ranks)
    # Start from the integral's inverse, then Newton on the whole Euler-Maclaurin sum.
    if s == 1.0:
        x = m * np.exp(excess)
    else:
        scaled = np.maximum((1.0 - s) * excess * m ** (s - 1.0), -1.0 + 1e-16)
        x = m * np.exp(np.log1p(scaled) / (1.0 - s))
    x = np.clip(x, m, top)
    for _ in range(_NEWTON_STEPS):
        slope = x ** -s - 0.5 * s * x ** (-s - 1.0)  # d/dx of the sum: f(x) + f'(x)/2
        x = np.clip(x - (_tail_sum(x, s) - excess) / slope, m, top)
    ranks = np.floor(x)
    # Exact at the integers: step down while T(r) > excess, up while T(r+1) <= excess.
    for _ in range(2):
        ranks -= _tail_sum(np.maximum(ranks, m), s) > excess
        ranks = np.maximum(ranks, m)
        ranks += (ranks + 1.0 <= top) & (_tail_sum(np.minimum(ranks + 1.0, top), s) <= excess)
    return ranks.astype(np.int64)


class ZipfQuantiles:
    """The inverse CDF of Zipf ranks over ``[0, num_ranks)``, set up once for many draws.

    ``P(r)`` is proportional to ``(r+1)**-exponent``. Holds the CDF table
    (up to :data:`TABLE_MAX` ranks) or the :data:`HEAD_RANKS` exact head sums,
    never more. Not collective; host NumPy.

    Args:
        num_ranks: size of the id space, >= 1 (any int64).
        exponent: the Zipf exponent, a finite float.
    """

    def __init__(self, num_ranks, exponent):
        self.num_ranks, self.exponent = int(num_ranks), float(exponent)
        if self.num_ranks <= TABLE_MAX:
            weights = np.arange(1, self.num_ranks + 1, dtype=np.float64) ** -self.exponent
            self._cdf = np.cumsum(weights)
            self._cdf /= self._cdf[-1]
        else:  # head[k-1] = H(k) exactly; the tail beyond is Euler-Maclaurin
            self._head = np.cumsum(np.arange(1, HEAD_RANKS + 1, dtype=np.float64)
                                   ** -self.exponent)
            self._total = self._head[-1] + float(_tail_sum(np.float64(self.num_ranks),
                                                           self.exponent))

    def __call__(self, unit):
        """int64 ranks, shaped like ``unit`` (float64 uniforms in ``[0, 1)``)."""
        unit = np.asarray(unit, dtype=np.float64)
        if self.num_ranks <= TABLE_MAX:
            ranks = np.searchsorted(self._cdf, unit, side="right")
            return np.minimum(ranks, self.num_ranks - 1)  # guards the cdf[-1] rounding edge
        head_total = self._head[-1]
        target = unit * self._total
        ranks = np.searchsorted(self._head, target, side="right").astype(np.int64)
        far = target >= head_total
        if far.any():
            ranks[far] = _invert_tail(target[far] - head_total, self.num_ranks, self.exponent)
        return np.minimum(ranks, self.num_ranks - 1)


def zipf_quantiles(unit, num_ranks, exponent):
    """Zipf ranks in ``[0, num_ranks)`` for uniforms ``unit``: ``ZipfQuantiles(num_ranks,
    exponent)(unit)``. Not collective; host NumPy."""
    return ZipfQuantiles(num_ranks, exponent)(unit)
