"""The one summation order (hpcpax.ops.summation), bit for bit on every CPU path.

A slow, plain-Python reference of the order (chunks of SUM_CHUNK in input
order, summed one row at a time; chunk sums paired left to right level by
level, an odd last one carried) against the NumPy twin and the Numba kernels
of dedup_sum and scatter_add_rows: np.array_equal on the bits. Segments of
1, SUM_CHUNK - 1, SUM_CHUNK, SUM_CHUNK + 1 and many chunks, random and Zipf
ids, float32 and float64, serial and parallel Numba paths. The results also
stay within the usual tolerance of np.add.at, and within the stated bound.
"""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).parent))  # ops_strategies, under any import mode
from ops_strategies import bits, make_ids, make_values, slow_dedup, slow_scatter  # noqa: E402

from hpcpax.ops import dedup_sum, dedup_sum_reference, scatter_add_rows, scatter_add_rows_reference
from hpcpax.ops import _kernel_source
from hpcpax.ops.summation import SUM_CHUNK, segment_sums, tree_depth

C = SUM_CHUNK
LENGTHS = [1, 2, C - 1, C, C + 1, 2 * C, 2 * C + 1, 3 * C, 5 * C + 7, 37 * C + 3]


def segments_case(lengths, dim, dtype, seed, spread=1):
    """ids with the given multiplicities (shuffled), values where order shows."""
    rng = np.random.default_rng(seed)
    ids = np.concatenate([np.full(n, spread * k, np.int64) for k, n in enumerate(lengths)])
    rng.shuffle(ids)
    values = make_values(ids.size, dim, dtype, rng)
    values *= (10.0 ** rng.integers(-4, 5, (ids.size, 1))).astype(dtype)
    return ids, values


def test_chunk_is_the_headers_power_of_two():
    assert C == _kernel_source.header_constant("HP_SUM_CHUNK") == 64
    assert C & (C - 1) == 0


@pytest.mark.parametrize("numba", ["0", "1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("dim", [1, 5, 64])
def test_dedup_every_segment_length_is_the_slow_order(monkeypatch, numba, dtype, dim):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    ids, values = segments_case(LENGTHS, dim, dtype, seed=dim)
    unique, summed = dedup_sum(ids, values)
    want_unique, want = slow_dedup(ids, values)
    assert np.array_equal(unique, want_unique)
    assert np.array_equal(bits(summed), bits(want))
    ref_unique, ref = dedup_sum_reference(ids, values)
    assert np.array_equal(ref_unique, want_unique) and np.array_equal(bits(ref), bits(want))


@pytest.mark.parametrize("numba", ["0", "1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["uniform", "zipf", "all_same"])
def test_dedup_random_and_zipf_ids_are_the_slow_order(monkeypatch, numba, dtype, kind):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    rng = np.random.default_rng(7)
    ids = make_ids(kind, 3000, 40, rng)  # 40 rows: most ids span several chunks
    values = make_values(ids.size, 3, dtype, rng)
    unique, summed = dedup_sum(ids, values)
    want_unique, want = slow_dedup(ids, values)
    assert np.array_equal(unique, want_unique) and np.array_equal(bits(summed), bits(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [5_000, 40_000])  # serial and parallel Numba scatter
@pytest.mark.parametrize("kind", ["segments", "zipf", "uniform"])
def test_scatter_is_the_slow_order(dtype, n, kind):
    rng = np.random.default_rng(n)
    if kind == "segments":
        ids, values = segments_case(LENGTHS * (n // 3000), 4, dtype, seed=1, spread=3)
    else:
        ids = make_ids(kind, n, 500, rng)
        values = make_values(ids.size, 4, dtype, rng)
    table = make_values(int(ids.max()) + 1, 4, dtype, rng)
    table[::5] = -0.0
    got = scatter_add_rows(table.copy(), ids, values)
    want = slow_scatter(table.copy(), ids, values)
    assert np.array_equal(bits(got), bits(want))
    assert np.array_equal(bits(scatter_add_rows_reference(table.copy(), ids, values)), bits(want))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_up_to_one_chunk_is_np_add_at(dtype):
    # every id at most SUM_CHUNK times: the sequential order, bit for bit
    rng = np.random.default_rng(3)
    ids = np.repeat(np.arange(300), rng.integers(1, C + 1, 300))
    rng.shuffle(ids)
    values = make_values(ids.size, 6, dtype, rng)
    table = make_values(300, 6, dtype, rng)
    want = table.copy()
    np.add.at(want, ids, values)
    assert np.array_equal(bits(scatter_add_rows(table.copy(), ids, values)), bits(want))
    zeros = np.zeros_like(table)
    np.add.at(zeros, ids, values)
    assert np.array_equal(bits(dedup_sum(ids, values)[1]), bits(zeros))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_long_segments_stay_within_the_bound_of_np_add_at(dtype):
    rng = np.random.default_rng(4)
    ids = np.minimum(rng.zipf(1.05, 200_000) - 1, 9_999)
    values = rng.standard_normal((ids.size, 8)).astype(dtype)
    unique, summed = dedup_sum(ids, values)
    slot = np.searchsorted(unique, ids)
    exact, magnitude = np.zeros((unique.size, 8)), np.zeros((unique.size, 8))
    np.add.at(exact, slot, values.astype(np.float64))
    np.add.at(magnitude, slot, np.abs(values.astype(np.float64)))
    sequential = np.zeros((unique.size, 8), dtype)
    np.add.at(sequential, slot, values)
    assert not np.array_equal(summed, sequential)  # the head ids are chunked
    # |error| <= gamma_d * sum|x|, d = tree_depth(occurrences) here, occurrences - 1 for add.at
    counts = np.bincount(slot)
    u = np.finfo(dtype).eps / 2
    for depth, got in (([tree_depth(int(c)) for c in counts], summed),
                       (np.maximum(counts - 1, 0), sequential)):
        depth = np.asarray(depth, np.float64)[:, None]
        assert np.all(np.abs(got - exact) <= depth * u / (1 - depth * u) * magnitude)
    # and the usual tolerance, relative to the summands' magnitude
    rtol = 1e-5 if dtype == np.float32 else 1e-13
    assert np.all(np.abs(summed - sequential) <= rtol * magnitude)


def test_tree_depth():
    assert [tree_depth(n) for n in (0, 1, 2, C, C + 1, 2 * C, 2 * C + 1, 4 * C, 4 * C + 1)] == \
        [0, 0, 1, C - 1, C, C, C + 1, C + 1, C + 2]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_chunk_count_up_to_40(dtype):
    # the strided in-place tree of the twin and the kernels = level-wise pairing
    for chunks in range(1, 41):
        ids, values = segments_case([chunks * C - chunks % 3], 2, dtype, seed=chunks)
        want = slow_dedup(ids, values)[1]
        got = segment_sums(values, np.zeros(ids.size, np.int64), [ids.size])
        assert np.array_equal(bits(got), bits(want)), chunks
        assert np.array_equal(bits(dedup_sum(ids, values)[1]), bits(want)), chunks
