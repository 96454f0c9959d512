"""partition_pack: Numba vs reference, stability, counts and errors."""

import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # ops_strategies, under any import mode
from ops_strategies import bits, make_ids, make_values, sparse_cases  # noqa: E402

from hpcpax.errors import SparseIndexError
from hpcpax.ops import PackedPartitions, partition_pack, partition_pack_reference
from hpcpax.ops.partitioning import Partitioning


def check_packed(packed, ids, values, partitioning):
    """Direct oracle: part p's slice holds ids[parts == p] in input order."""
    parts = partitioning.partition_of(ids) if ids.size else np.empty(0, np.int64)
    assert packed.counts.dtype == np.int64 and packed.displs.dtype == np.int64
    assert packed.counts.sum() == ids.size
    for p in range(partitioning.num_parts):
        lo, hi = packed.displs[p], packed.displs[p] + packed.counts[p]
        np.testing.assert_array_equal(packed.indices[lo:hi], ids[parts == p])
        if values is not None:
            np.testing.assert_array_equal(bits(packed.values[lo:hi]), bits(values[parts == p]))


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases(), kind=st.sampled_from(["mod", "range"]), num_parts=st.integers(1, 9),
       with_values=st.booleans())
def test_matches_reference_and_oracle(case, kind, num_parts, with_values):
    ids, values, num_rows = case
    values = values if with_values else None
    partitioning = Partitioning(kind, num_rows, num_parts)
    got = partition_pack(ids, values, partitioning)
    ref = partition_pack_reference(ids, values, partitioning)
    assert isinstance(got, PackedPartitions)
    for a, b in zip(got, ref):
        if a is None or b is None:
            assert a is None and b is None
        else:
            np.testing.assert_array_equal(a, b)
    check_packed(got, ids, values, partitioning)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["mod", "range"])
def test_large_input_many_chunks(dtype, kind):
    rng = np.random.default_rng(3)
    ids = make_ids("zipf", 30_000, 1000, rng)
    values = make_values(ids.size, 3, dtype, rng)
    partitioning = Partitioning(kind, 1000, 13)
    got = partition_pack(ids, values, partitioning)
    check_packed(got, ids, values, partitioning)


@pytest.mark.parametrize("numba", ["0", "1"])
def test_empty(monkeypatch, numba):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    packed = partition_pack(np.empty(0, np.int64), np.empty((0, 2)), Partitioning("mod", 10, 3))
    np.testing.assert_array_equal(packed.counts, [0, 0, 0])
    np.testing.assert_array_equal(packed.displs, [0, 0, 0])
    assert packed.indices.shape == (0,) and packed.values.shape == (0, 2)


def test_errors():
    partitioning = Partitioning("range", 10, 2)
    with pytest.raises(SparseIndexError, match=r"indices must be in \[0, 10\), not 10"):
        partition_pack(np.array([1, 10]), None, partitioning)
    with pytest.raises(TypeError, match="partitioning must be a Partitioning, not dict"):
        partition_pack(np.array([1]), None, partitioning.to_dict())
    with pytest.raises(ValueError, match="values must have 2 rows, not 1"):
        partition_pack(np.array([1, 2]), np.zeros((1, 3)), partitioning)
