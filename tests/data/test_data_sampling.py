"""Batch geometry: shards tile the global batch, epochs wrap, shuffles are permutations."""

import numpy as np
import pytest

from hpcpax.data import SyntheticCTR, SyntheticLM, sample_indices
from hpcpax.data.sampling import permute
from hpcpax.errors import DataError


@pytest.mark.parametrize("num_samples", [1, 2, 3, 7, 64, 100, 1000, 4099])
def test_permute_is_a_bijection(num_samples):
    result = permute(np.arange(num_samples), num_samples, seed=5, epoch=2)
    assert np.array_equal(np.sort(result), np.arange(num_samples))


def test_permute_depends_on_seed_and_epoch_and_mixes():
    offsets = np.arange(1000)
    base = permute(offsets, 1000, seed=1, epoch=0)
    assert not np.array_equal(base, permute(offsets, 1000, seed=2, epoch=0))
    assert not np.array_equal(base, permute(offsets, 1000, seed=1, epoch=1))
    assert np.array_equal(base, permute(offsets, 1000, seed=1, epoch=0))
    assert (base == offsets).sum() < 20  # a random permutation has about one fixed point


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_shards_concatenate_to_global_batch(num_shards, shuffle):
    num_samples, global_batch = 50, 12
    for step in range(12):  # 144 positions: wraps the 50 samples twice
        whole = sample_indices(step, global_batch, 0, 1, num_samples, shuffle, seed=3)
        parts = [sample_indices(step, global_batch, shard, num_shards, num_samples, shuffle,
                                seed=3) for shard in range(num_shards)]
        assert np.array_equal(np.concatenate(parts), whole)


def test_unshuffled_order_wraps_around_epochs():
    # Step 2 of batch 4 is positions 8..11: shard 0 ends epoch 0, shard 1 starts epoch 1.
    assert sample_indices(2, 4, 0, 2, num_samples=10).tolist() == [8, 9]
    assert sample_indices(2, 4, 1, 2, num_samples=10).tolist() == [0, 1]
    got = sample_indices(2, 6, 0, 1, num_samples=10)  # positions 12..17 -> 2..7
    assert got.tolist() == [2, 3, 4, 5, 6, 7]
    got = sample_indices(1, 6, 0, 1, num_samples=10)  # positions 6..11 -> 6..9, 0, 1
    assert got.tolist() == [6, 7, 8, 9, 0, 1]


def test_shuffled_epoch_visits_every_sample_once():
    num_samples, global_batch = 60, 12
    steps = num_samples // global_batch
    for epoch in range(2):
        seen = np.concatenate([sample_indices(epoch * steps + step, global_batch, 0, 1,
                                              num_samples, True, seed=9)
                               for step in range(steps)])
        assert np.array_equal(np.sort(seen), np.arange(num_samples))
        assert not np.array_equal(seen, np.arange(num_samples))


@pytest.mark.parametrize("reader", [SyntheticLM(num_tokens=300, vocab_size=20, context=4),
                                    SyntheticCTR(num_samples=90, n_dense=2, n_fields=3)],
                         ids=["lm", "ctr"])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_reader_shards_concatenate(reader, num_shards):
    reader.shuffle = True
    for step in (0, 3, 17):  # step 17 is past the first epoch
        whole = reader.batch(step, 24)
        parts = [reader.batch(step, 24, shard, num_shards) for shard in range(num_shards)]
        for key, value in whole.items():
            assert np.array_equal(np.concatenate([part[key] for part in parts]), value)


@pytest.mark.parametrize("global_batch, num_shards, words", [
    (10, 3, ["10", "3", "evenly"]),
    (2, 4, ["2", "4", "evenly"]),
    (0, 2, ["empty"]),
    (64, 2, ["50 samples", "64"]),
])
def test_bad_geometry_raises_data_error(global_batch, num_shards, words):
    with pytest.raises(DataError) as info:
        sample_indices(0, global_batch, 0, num_shards, num_samples=50)
    for word in words:
        assert word in str(info.value)


def test_bad_arguments():
    with pytest.raises(DataError, match="shard"):
        sample_indices(0, 4, 2, 2, num_samples=50)
    with pytest.raises(DataError, match="step"):
        sample_indices(-1, 4, 0, 2, num_samples=50)
    with pytest.raises(TypeError, match="global_batch must be int, not float"):
        sample_indices(0, 4.0, 0, 2, num_samples=50)
    assert sample_indices(np.int64(1), np.int32(4), 0, 1, num_samples=50).tolist() == [4, 5, 6, 7]
