"""Uneven shares of a global batch (balanced BSP): ranges tile it exactly as even shards do."""

import numpy as np
import pytest

from hpcpax.data import SyntheticLM, sample_indices
from hpcpax.data.sampling import sample_range
from hpcpax.errors import DataError


@pytest.mark.parametrize("shuffle", [False, True])
def test_ranges_concatenate_to_global_batch(shuffle):
    num_samples, global_batch = 50, 12
    for step in range(12):  # wraps the 50 samples twice
        whole = sample_indices(step, global_batch, 0, 1, num_samples, shuffle, seed=3)
        for bounds in ([0, 7, 10, 12], [0, 1, 12], [0, 6, 12]):
            parts = [sample_range(step, global_batch, a, b, num_samples, shuffle, seed=3)
                     for a, b in zip(bounds[:-1], bounds[1:])]
            assert np.array_equal(np.concatenate(parts), whole)


@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_even_range_equals_shard(num_shards):
    size = 12 // num_shards
    for shard in range(num_shards):
        assert np.array_equal(
            sample_range(5, 12, shard * size, (shard + 1) * size, 50, True, seed=1),
            sample_indices(5, 12, shard, num_shards, 50, True, seed=1))


def test_reader_batch_range_matches_batch():
    reader = SyntheticLM(num_tokens=400, vocab_size=50, context=3, seed=2, shuffle=True)
    whole = reader.batch(4, 12)
    parts = [reader.batch_range(4, 12, a, b) for a, b in ((0, 9), (9, 11), (11, 12))]
    for key in whole:
        assert np.array_equal(np.concatenate([p[key] for p in parts]), whole[key])


@pytest.mark.parametrize("start, stop", [(3, 3), (-1, 4), (5, 13), (6, 2)])
def test_bad_range_raises(start, stop):
    with pytest.raises(DataError, match="batch range"):
        sample_range(0, 12, start, stop, 50)


def test_range_needs_a_whole_global_batch():
    with pytest.raises(DataError, match="fewer than one global batch"):
        sample_range(0, 12, 0, 6, 10)
