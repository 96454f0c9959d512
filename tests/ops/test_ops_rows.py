"""gather_rows / scatter_add_rows: Numba vs reference vs loop, and errors."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings

sys.path.insert(0, str(Path(__file__).parent))  # ops_strategies, under any import mode
from ops_strategies import bits, make_ids, make_values, slow_scatter, sparse_cases  # noqa: E402

from hpcpax.errors import SparseIndexError
from hpcpax.ops import gather_rows, gather_rows_reference, scatter_add_rows, scatter_add_rows_reference


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases())
def test_gather_matches_reference(case):
    ids, values, num_rows = case
    table = make_values(num_rows, values.shape[1], values.dtype, np.random.default_rng(0))
    got = gather_rows(table, ids)
    np.testing.assert_array_equal(bits(got), bits(gather_rows_reference(table, ids)))
    np.testing.assert_array_equal(bits(got), bits(table[ids]))
    out = np.full_like(got, np.nan)
    assert gather_rows(table, ids, out=out) is out
    np.testing.assert_array_equal(bits(out), bits(got))


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases())
def test_scatter_add_matches_reference_and_loop(case):
    ids, values, num_rows = case
    table = make_values(num_rows, values.shape[1], values.dtype, np.random.default_rng(1))
    got = table.copy()
    assert scatter_add_rows(got, ids, values) is got
    ref = scatter_add_rows_reference(table.copy(), ids, values)
    np.testing.assert_array_equal(bits(got), bits(ref))
    np.testing.assert_array_equal(bits(ref), bits(slow_scatter(table.copy(), ids, values)))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["zipf", "all_same", "uniform"])
@pytest.mark.parametrize("num_rows", [50, 1_000_000])
def test_scatter_add_parallel_path(dtype, kind, num_rows):
    # above the serial threshold: the grouped, parallel Numba kernel
    rng = np.random.default_rng(2)
    ids = make_ids(kind, 40_000, num_rows, rng)
    values = make_values(ids.size, 4, dtype, rng)
    table = make_values(num_rows, 4, dtype, rng)
    got = scatter_add_rows(table.copy(), ids, values)
    ref = scatter_add_rows_reference(table.copy(), ids, values)
    np.testing.assert_array_equal(bits(got), bits(ref))


@pytest.mark.parametrize("numba", ["0", "1"])
def test_empty_ids(monkeypatch, numba):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    table = np.ones((3, 2), np.float32)
    assert gather_rows(table, np.empty(0, np.int64)).shape == (0, 2)
    scatter_add_rows(table, np.empty(0, np.int64), np.empty((0, 2), np.float32))
    np.testing.assert_array_equal(table, 1)


def test_bounds_errors_name_the_value():
    table = np.zeros((5, 2))
    with pytest.raises(SparseIndexError, match=r"ids must be in \[0, 5\), not 5"):
        gather_rows(table, np.array([0, 5, 1]))
    with pytest.raises(SparseIndexError, match="not -3"):
        scatter_add_rows(table, np.array([0, -3]), np.zeros((2, 2)))
    np.testing.assert_array_equal(table, 0)  # nothing written before the check


@pytest.mark.parametrize(
    "call,error,message",
    [
        (lambda t: gather_rows(t, np.array([0.5])), TypeError, "ids must be an integer array, not float64"),
        (lambda t: gather_rows(t[:, ::2], np.array([0])), ValueError, "table must be C-contiguous"),
        (lambda t: gather_rows(t.astype(np.int64), np.array([0])), TypeError,
         "table must be float32 or float64, not int64"),
        (lambda t: gather_rows(t, np.array([0]), out=np.zeros((2, 4))), ValueError,
         r"out must have shape \(1, 4\), not \(2, 4\)"),
        (lambda t: gather_rows(t, np.array([0]), out=np.zeros((1, 4), np.float32)), TypeError,
         "out must have the dtype of table"),
        (lambda t: scatter_add_rows(t, np.array([0]), np.zeros((1, 3))), ValueError,
         "values must have 4 columns, not 3"),
        (lambda t: scatter_add_rows(t, np.array([0]), np.zeros((1, 4), np.float32)), TypeError,
         r"values must have the dtype of table \(float64\), not float32"),
    ],
)
def test_bad_arguments(call, error, message):
    with pytest.raises(error, match=message):
        call(np.zeros((3, 4)))
