"""The unigram baseline of a held-out set: what a model must beat to have learnt context.

A unigram model predicts every token with its training-set frequency
(add-one smoothed over the vocabulary, ``<unk>`` included, as the lm
predicts it). Its perplexity on a held-out file is ``exp`` of the mean
negative log probability of the held-out targets: the tokens from position
``context`` on, the targets of the samples an lm evaluates. Not collective.
"""

import numpy as np

from hpcpax.data.dataset import open_dataset
from hpcpax.data.reading import scan_chunks
from hpcpax.errors import DataError

__all__ = ["unigram_perplexity"]


def _counts(reader, vocab_size, first):
    counts = np.zeros(vocab_size, dtype=np.int64)
    tokens = reader._tokens
    start, stop = reader.span
    with reader._reading():
        for _, block in scan_chunks(tokens, tokens.dtype.itemsize, start + first, stop):
            counts += np.bincount(block, minlength=vocab_size)[:vocab_size]
    return counts


def unigram_perplexity(train_path, eval_path, context=1):
    """Perplexity of ``eval_path``'s targets under ``train_path``'s unigram frequencies.

    Args:
        train_path, eval_path: ``hpcpax-lm/1`` files with one vocabulary
            (``python -m hpcpax.data text ... --eval-output``).
        context: the lm's context; the first ``context`` held-out tokens are
            no target.

    Returns:
        dict: ``perplexity``, ``cross_entropy`` (nats per token), ``targets``.

    Raises:
        DataError: unreadable files or vocabularies of different sizes.
    """
    with open_dataset(train_path, "lm", context=context) as train, \
            open_dataset(eval_path, "lm", context=context) as held:
        if train.vocab_size != held.vocab_size:
            raise DataError(f"{eval_path}: vocab_size {held.vocab_size}, but {train_path} "
                            f"has {train.vocab_size}: not one vocabulary")
        vocab_size = train.vocab_size
        train_counts = _counts(train, vocab_size, 0)
        held_counts = _counts(held, vocab_size, context)
    log_p = np.log((train_counts + 1.0) / (train_counts.sum() + vocab_size))
    targets = int(held_counts.sum())
    cross_entropy = float(-(held_counts * log_p).sum() / targets)
    return {"perplexity": float(np.exp(cross_entropy)), "cross_entropy": cross_entropy,
            "targets": targets}
