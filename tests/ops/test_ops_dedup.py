"""dedup_sum: Numba path vs NumPy reference vs a plain loop of the order, bit for bit."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

sys.path.insert(0, str(Path(__file__).parent))  # ops_strategies, under any import mode
from ops_strategies import bits, make_ids, make_values, slow_dedup, sparse_cases  # noqa: E402

from hpcpax.ops import dedup_sum, dedup_sum_reference


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases())
def test_dispatch_matches_reference_and_loop(case):
    ids, values, _ = case
    unique, summed = dedup_sum(ids, values)
    ref_unique, ref_summed = dedup_sum_reference(ids, values)
    assert unique.dtype == np.int64 and summed.dtype == values.dtype
    np.testing.assert_array_equal(unique, ref_unique)
    np.testing.assert_array_equal(bits(summed), bits(ref_summed))
    loop_unique, loop_summed = slow_dedup(ids, values)
    np.testing.assert_array_equal(ref_unique, loop_unique)
    np.testing.assert_array_equal(bits(ref_summed), bits(loop_summed))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("spread", ["wide", "negative", "zipf_large"])
def test_sparse_spans_use_sort_path(dtype, spread):
    rng = np.random.default_rng(1)
    n = 5000
    if spread == "wide":  # span far beyond n: the sort fallback
        ids = rng.integers(0, 2**40, n // 2).repeat(2)
        rng.shuffle(ids)
    elif spread == "negative":
        ids = rng.integers(-1000, 1000, n)
    else:
        ids = make_ids("zipf", 50_000, 100_000, rng)
    values = make_values(ids.size, 5, dtype, rng)
    unique, summed = dedup_sum(ids, values)
    ref_unique, ref_summed = dedup_sum_reference(ids, values)
    np.testing.assert_array_equal(unique, ref_unique)
    np.testing.assert_array_equal(bits(summed), bits(ref_summed))


@pytest.mark.parametrize("numba", ["0", "1"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_empty_input(monkeypatch, numba, dtype):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    unique, summed = dedup_sum(np.empty(0, np.int32), np.empty((0, 4), dtype))
    assert unique.shape == (0,) and unique.dtype == np.int64
    assert summed.shape == (0, 4) and summed.dtype == dtype


def test_numpy_path_when_numba_off(monkeypatch):
    monkeypatch.setenv("HPCPAX_NUMBA", "0")
    ids = np.array([3, 1, 3, 3], np.uint16)
    values = np.arange(8, dtype=np.float64).reshape(4, 2)
    unique, summed = dedup_sum(ids, values)
    np.testing.assert_array_equal(unique, [1, 3])
    np.testing.assert_array_equal(summed, [[2, 3], [0 + 4 + 6, 1 + 5 + 7]])


def test_strided_values_are_accepted():
    values = np.arange(24, dtype=np.float32).reshape(4, 6)[:, ::2]
    unique, summed = dedup_sum(np.array([0, 0, 1, 0]), values)
    np.testing.assert_array_equal(summed, dedup_sum_reference(np.array([0, 0, 1, 0]), values)[1])


@pytest.mark.parametrize(
    "ids,values,error,message",
    [
        (np.array([0.0]), np.zeros((1, 2)), TypeError, "indices must be an integer array, not float64"),
        (np.array([[0]]), np.zeros((1, 2)), ValueError, "indices must be 1-D, not 2-D"),
        (np.array([0]), np.zeros(2), ValueError, "values must be 2-D, not 1-D"),
        (np.array([0]), np.zeros((1, 2), np.int32), TypeError, "values must be float32 or float64, not int32"),
        (np.array([0, 1]), np.zeros((1, 2)), ValueError, "values must have 2 rows, not 1"),
        ([0], np.zeros((1, 2)), TypeError, "indices must be a NumPy or CuPy array, not list"),
        (np.array([True]), np.zeros((1, 2)), TypeError, "indices must be an integer array, not bool"),
    ],
)
def test_bad_input(ids, values, error, message):
    with pytest.raises(error, match=message):
        dedup_sum(ids, values)
    with pytest.raises(error, match=message):
        dedup_sum_reference(ids, values)


def test_import_compiles_nothing():
    code = (
        "import sys, hpcpax.ops, hpcpax.ops.partitioning; "
        "print('numba' in sys.modules, 'cupy' in sys.modules)"
    )
    root = Path(__file__).resolve().parents[2]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=root)
    assert out.stdout.split() == ["False", "False"]


def test_the_kept_counting_table_is_zero_between_calls(monkeypatch):
    """The counting table is kept between calls: each call leaves it zeroed, so a
    smaller span after a larger one (and the reverse) still gives the reference."""
    pytest.importorskip("numba")
    from hpcpax.ops import _numba

    monkeypatch.setattr(_numba, "_SCRATCH", type(_numba._SCRATCH)())
    rng = np.random.default_rng(5)
    for span, n in ((50_000, 4000), (300, 2000), (20_000, 3000), (8, 100), (50_001, 4000)):
        ids = rng.integers(0, span, n) + 7
        values = rng.standard_normal((n, 3))
        unique, summed = dedup_sum(ids, values)
        ref_unique, ref_summed = dedup_sum_reference(ids, values)
        np.testing.assert_array_equal(unique, ref_unique)
        np.testing.assert_array_equal(bits(summed), bits(ref_summed))
        slot, seen = _numba._SCRATCH.tables
        assert not slot.any() and not seen.any()
        assert slot.size >= ids.max() - ids.min() + 1 and slot.size % 8 == 0
    monkeypatch.setattr(_numba, "SCRATCH_KEEP", 1000)
    _numba._SCRATCH.tables = None
    ids = rng.integers(0, 5000, 2000)
    dedup_sum(ids, rng.standard_normal((2000, 2)))
    assert _numba._SCRATCH.tables is None  # too large to keep
