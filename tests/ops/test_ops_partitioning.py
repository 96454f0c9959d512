"""Partitioning: round trips, sizes, serialization and argument errors."""

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hpcpax.errors import SparseIndexError
from hpcpax.ops.partitioning import Partitioning

KINDS = st.sampled_from(["mod", "range"])


@settings(max_examples=50, deadline=None)
@given(kind=KINDS, num_rows=st.integers(1, 300), num_parts=st.integers(1, 40))
def test_round_trip_and_sizes(kind, num_rows, num_parts):
    p = Partitioning(kind, num_rows, num_parts)
    ids = np.arange(num_rows)
    parts = p.partition_of(ids)
    local = p.local_index(ids)
    assert parts.dtype == np.int64 and local.dtype == np.int64
    assert parts.min() >= 0 and parts.max() < num_parts
    sizes = [p.part_rows(q) for q in range(num_parts)]
    assert sum(sizes) == num_rows
    for q in range(num_parts):
        mine = ids[parts == q]
        assert mine.size == sizes[q]
        # local ids of a part are exactly 0..rows-1, in global order
        np.testing.assert_array_equal(local[parts == q], np.arange(sizes[q]))
        np.testing.assert_array_equal(p.global_index(q, local[parts == q]), mine)


@pytest.mark.parametrize("num_rows,num_parts", [(10, 3), (7, 7), (3, 5), (1, 1), (100, 8)])
def test_range_blocks_are_contiguous_and_balanced(num_rows, num_parts):
    p = Partitioning("range", num_rows, num_parts)
    sizes = [p.part_rows(q) for q in range(num_parts)]
    base, extra = divmod(num_rows, num_parts)
    assert sizes == [base + 1] * extra + [base] * (num_parts - extra)
    parts = p.partition_of(np.arange(num_rows))
    assert np.all(np.diff(parts) >= 0)
    starts = [p.part_start(q) for q in range(num_parts)]
    assert starts == list(np.concatenate([[0], np.cumsum(sizes)[:-1]]))


def test_mod_layout():
    p = Partitioning("mod", 10, 3)
    np.testing.assert_array_equal(p.partition_of(np.arange(10)), np.arange(10) % 3)
    np.testing.assert_array_equal(p.local_index(np.arange(10)), np.arange(10) // 3)
    assert [p.part_rows(q) for q in range(3)] == [4, 3, 3]


@pytest.mark.parametrize("kind", ["mod", "range"])
def test_dict_round_trip_and_equality(kind):
    p = Partitioning(kind, 1000, 7)
    q = Partitioning.from_dict(json.loads(json.dumps(p.to_dict())))
    assert p == q and hash(p) == hash(q)
    assert p != Partitioning(kind, 1000, 6)
    assert p != Partitioning("range" if kind == "mod" else "mod", 1000, 7)


@pytest.mark.parametrize(
    "args,error,message",
    [
        (("mod", 10, 0), ValueError, "num_parts must be >= 1, not 0"),
        (("mod", 0, 2), ValueError, "num_rows must be >= 1, not 0"),
        (("hash", 10, 2), ValueError, "kind must be one of"),
        (("mod", 10.0, 2), TypeError, "num_rows must be an int, not float"),
        (("mod", 10, True), TypeError, "num_parts must be an int, not bool"),
    ],
)
def test_bad_arguments(args, error, message):
    with pytest.raises(error, match=message):
        Partitioning(*args)


def test_bad_ids():
    p = Partitioning("range", 10, 3)
    with pytest.raises(SparseIndexError, match="not 10"):
        p.partition_of(np.array([0, 10]))
    with pytest.raises(SparseIndexError, match="not -1"):
        p.local_index(np.array([-1, 3]))
    with pytest.raises(SparseIndexError, match="not 4"):
        p.global_index(0, np.array([4]))
    with pytest.raises(TypeError, match="ids must be an integer array, not float64"):
        p.partition_of(np.array([1.0]))
    with pytest.raises(ValueError, match="part must be < num_parts=3, not 3"):
        p.part_rows(3)
    with pytest.raises(ValueError, match="missing|must have"):
        Partitioning.from_dict({"kind": "mod"})
