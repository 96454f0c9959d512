"""Synthetic LM data for a large vocabulary: no ``V x 4`` successor table."""

import hashlib
import tracemalloc

import numpy as np
import pytest

from hpcpax.data import synthetic


def test_large_vocab_successors_are_hashed_not_tabled():
    vocab = 2 * 10**6
    tracemalloc.start()
    try:
        tokens = synthetic.generate_lm(20_000, vocab, seed=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # the Zipf CDF and its temporaries (8 bytes per id each); a successor table
    # alone would take 32 bytes per id more
    assert peak < 30 * vocab, peak
    assert tokens.dtype == np.int32 and tokens.min() >= 1 and tokens.max() < vocab
    assert np.array_equal(tokens, synthetic.generate_lm(20_000, vocab, seed=3))
    assert not np.array_equal(tokens, synthetic.generate_lm(20_000, vocab, seed=4))
    # each id has at most 4 fixed successors: a token's followers repeat
    previous, following = tokens[:-1], tokens[1:]
    top = np.bincount(previous).argmax()
    followers = following[previous == top]
    counts = np.sort(np.bincount(followers))[::-1]
    assert counts[:4].sum() > 0.5 * followers.size  # follow = 0.75 of them


def test_vocab_up_to_2_17_gives_the_same_stream_as_before():
    """sha256 of the streams the successor-table generator gave (commit c4221cf)."""
    golden = {300: "4952f48a9b9e86d1", 10_000: "6a9ef9228afaf59e", 2**17: "f0680585c0237c84"}
    for vocab, digest in golden.items():
        tokens = synthetic.generate_lm(5_000, vocab, seed=4)
        assert hashlib.sha256(tokens.tobytes()).hexdigest()[:16] == digest, vocab


def test_below_the_zipf_table_bound_streams_are_the_old_ones():
    """sha256 of what the generators gave before the analytic Zipf sampler (commit 626d25e):
    ids up to 2**20 keep their tabled CDF, so every default run keeps its data."""
    for vocab, digest in {400_000: "2eed23c0c7d8bc98", 2**20: "8cfe717ef018ac27"}.items():
        tokens = synthetic.generate_lm(5_000, vocab, seed=4)
        assert hashlib.sha256(tokens.tobytes()).hexdigest()[:16] == digest, vocab
    arrays = synthetic.generate_ctr(3_000, 13, 26, 10_000, seed=0)[:3]
    assert [hashlib.sha256(a.tobytes()).hexdigest()[:16] for a in arrays] == \
        ["e148de4c9191945b", "2a455e7665694b37", "fa202fb661063ed7"]


def test_ten_billion_words_give_int64_ids_in_bounded_memory():
    vocab = 10**10
    tracemalloc.start()
    try:
        tokens = synthetic.generate_lm(20_000, vocab, seed=3)
        categorical = synthetic.generate_ctr(5_000, 2, 3, vocab, seed=3)[2]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, peak  # a CDF of the vocabulary would take 80 GB
    assert tokens.dtype == np.int64 and tokens.min() >= 1 and tokens.max() < vocab
    assert tokens.max() >= 2**31  # past int32: the ids are not wrapped
    assert categorical.min() >= 0 and categorical.max() < vocab
    previous, following = tokens[:-1], tokens[1:]  # still 4 successors an id
    top = np.bincount(previous[previous < 100]).argmax()
    counts = np.sort(np.unique(following[previous == top], return_counts=True)[1])[::-1]
    assert counts[:4].sum() > 0.5 * counts.sum()


@pytest.mark.parametrize("vocab", [20, 10_000, 2**17 + 1, 10**6, 10**10])
def test_lm_bytes_bounds_the_generator_peak(vocab):
    tracemalloc.start()
    try:
        synthetic.generate_lm(200_000, vocab, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= synthetic.lm_bytes(200_000, vocab) <= 2 * peak


@pytest.mark.parametrize("n_dense, n_fields, cardinality", [
    (13, 26, 1000), (0, 1, 10**6), (100, 2, 10**10), (1, 40, 10**10)])
def test_ctr_bytes_bounds_the_generator_peak(n_dense, n_fields, cardinality):
    tracemalloc.start()
    try:
        synthetic.generate_ctr(100_000, n_dense, n_fields, cardinality, seed=1)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak <= synthetic.ctr_bytes(100_000, n_dense, n_fields, cardinality) <= 2 * peak
