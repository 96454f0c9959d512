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


def check_packed(packed, ids, values, partitioning, lut=None):
    """Direct oracle: destination d's slice holds ids[dest == d] in input order."""
    dest = partitioning.partition_of(ids) if ids.size else np.empty(0, np.int64)
    if lut is not None:
        dest = np.asarray(lut)[dest]
    num_dest = partitioning.num_parts if lut is None else len(packed.counts)
    assert packed.counts.dtype == np.int64 and packed.displs.dtype == np.int64
    assert packed.counts.sum() == ids.size
    np.testing.assert_array_equal(packed.indices, ids[packed.order])
    for d in range(num_dest):
        lo, hi = packed.displs[d], packed.displs[d] + packed.counts[d]
        np.testing.assert_array_equal(packed.indices[lo:hi], ids[dest == d])
        np.testing.assert_array_equal(packed.order[lo:hi], np.flatnonzero(dest == d))
        if values is not None:
            np.testing.assert_array_equal(bits(packed.values[lo:hi]), bits(values[dest == d]))


def _same(got, ref):
    assert isinstance(got, PackedPartitions)
    for a, b in zip(got, ref):
        if a is None or b is None:
            assert a is None and b is None
        else:
            np.testing.assert_array_equal(a, b)


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases(), kind=st.sampled_from(["mod", "range"]), num_parts=st.integers(1, 9),
       with_values=st.booleans())
def test_matches_reference_and_oracle(case, kind, num_parts, with_values):
    ids, values, num_rows = case
    values = values if with_values else None
    partitioning = Partitioning(kind, num_rows, num_parts)
    got = partition_pack(ids, values, partitioning)
    _same(got, partition_pack_reference(ids, values, partitioning))
    check_packed(got, ids, values, partitioning)


@settings(max_examples=50, deadline=None)
@given(case=sparse_cases(), kind=st.sampled_from(["mod", "range"]), num_parts=st.integers(1, 9),
       num_dest=st.integers(1, 4), seed=st.integers(0, 2**16), with_values=st.booleans())
def test_by_destination_matches_reference_and_oracle(case, kind, num_parts, num_dest, seed,
                                                     with_values):
    """Partitions mapped to owners out of order (as the PS packs by owner rank)."""
    ids, values, num_rows = case
    values = values if with_values else None
    partitioning = Partitioning(kind, num_rows, num_parts)
    lut = np.random.default_rng(seed).integers(0, num_dest, num_parts)
    got = partition_pack(ids, values, partitioning, lut, num_dest)
    _same(got, partition_pack_reference(ids, values, partitioning, lut, num_dest))
    check_packed(got, ids, values, partitioning, lut)
    assert len(got.counts) == num_dest


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
    with pytest.raises(ValueError, match=r"dest_of_part must have 2 entries, not \(3,\)"):
        partition_pack(np.array([1]), None, partitioning, [0, 1, 0], 2)
    with pytest.raises(ValueError, match=r"dest_of_part must be in \[0, 2\), not 0..2"):
        partition_pack(np.array([1]), None, partitioning, [0, 2], 2)
    with pytest.raises(ValueError, match="num_dest must be a positive int"):
        partition_pack(np.array([1]), None, partitioning, [0, 1], None)
