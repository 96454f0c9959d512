"""Synthetic LM data for a large vocabulary: no ``V x 4`` successor table."""

import hashlib
import tracemalloc

import numpy as np

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
