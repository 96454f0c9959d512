"""Deterministic, learnable synthetic data, generated in memory from a seed.

Both generators are vectorised NumPy (200k tokens take a few milliseconds) and
depend only on their arguments: the same seed gives the same arrays on every
rank and every run, so ranks can each build the data instead of sharing it.

LM: ids ``1..V-1`` ranked by frequency, drawn Zipf(``zipf``) (id 1 most
frequent; id 0 ``<unk>`` is never drawn). Each id has 4 fixed successors,
themselves Zipf draws. With probability ``follow`` the next token is a
successor of the previous one (picked with weights 0.55/0.25/0.12/0.08),
otherwise a fresh Zipf draw. A model that sees the previous token can thus
beat the unigram entropy by a wide margin: its loss falls. Above 2**17 ids
the successors are not drawn into a ``V x 4`` table but hashed from
(seed, id, pick) when needed, and above :data:`hpcpax.data.zipf.TABLE_MAX`
ids the Zipf draws come from an analytic inverse CDF instead of a table:
no array grows with ``V``, so a vocabulary of 10^10 ids starts like one of
10^4 (below both bounds the streams are the tabled ones, bit for bit).

CTR: field ``f`` holds Zipf ranks ``0..cardinality[f]-1``; dense features
are standard normal; the label is Bernoulli(sigmoid(logit)) with
``logit = bias + dense @ w + sum of hidden per-id weights`` over the first
(up to) 4 fields. Hidden id weights come from a hash of (seed, field, id),
so no table of size ``cardinality`` is ever built (nor a CDF of one above
:data:`hpcpax.data.zipf.TABLE_MAX` ids).
"""

import numpy as np

from hpcpax.data.sampling import mix64
from hpcpax.data.zipf import HEAD_RANKS, TABLE_MAX, ZipfQuantiles, zipf_quantiles

__all__ = ["zipf_ranks", "generate_lm", "generate_ctr", "lm_vocab", "lm_bytes", "ctr_bytes"]

_TAG_LM = 0x4C4D  # "LM": separates the generators' random streams
_TAG_CTR = 0x435452  # "CTR"
_SUCCESSOR_WEIGHTS = np.array([0.55, 0.25, 0.12, 0.08])
_INFORMATIVE_FIELDS = 4
_CTR_BIAS = -1.0  # about a quarter of the labels positive: a realistic, imbalanced CTR
#: Largest vocabulary whose successors are drawn into a table up front;
#: above it each needed successor is a hashed draw (start-up independent of V).
_SUCCESSOR_TABLE_MAX = 1 << 17
_FIXED_BYTES = 2 << 20  # what a generator allocates whatever its size (streams, small arrays)


def zipf_ranks(rng, size, num_ranks, exponent):
    """Draw ``size`` ranks in ``[0, num_ranks)`` with P(r) proportional to ``(r+1)**-exponent``
    (no array of ``num_ranks`` above :data:`hpcpax.data.zipf.TABLE_MAX`)."""
    return zipf_quantiles(rng.random(size), num_ranks, exponent)


def _zipf_bytes(num_ranks):
    """The CDF table and the weights it is summed from, or the analytic sampler's head sums."""
    return 16 * (num_ranks if num_ranks <= TABLE_MAX else HEAD_RANKS)


def lm_bytes(num_tokens, vocab_size):
    """Peak bytes :func:`generate_lm` allocates (an upper estimate: 72 bytes a token for the
    stream and its int64 temporaries, the Zipf CDF, the successor table up to ``2**17`` ids)."""
    tables = _zipf_bytes(vocab_size)
    if vocab_size <= _SUCCESSOR_TABLE_MAX:
        tables += 96 * vocab_size
    return 72 * int(num_tokens) + tables + _FIXED_BYTES


def ctr_bytes(num_samples, n_dense, n_fields, cardinality):
    """Peak bytes :func:`generate_ctr` allocates (an upper estimate: the rows kept, a float64
    copy of the dense features, 64 bytes a row of temporaries, one Zipf CDF)."""
    row = 4 + 4 * n_dense + 8 * n_fields + 8 * n_dense + 64
    return row * int(num_samples) + _zipf_bytes(int(np.max(cardinality))) + _FIXED_BYTES


def lm_vocab(vocab_size):
    """Words of the synthetic vocabulary: ``<unk>`` then ``w1 .. w{V-1}``."""
    return ["<unk>"] + [f"w{i}" for i in range(1, vocab_size)]


def generate_lm(num_tokens, vocab_size, seed=0, zipf=1.1, follow=0.75):
    """A synthetic token stream of ``num_tokens`` ids in ``[1, vocab_size)``: int32, or int64
    for a vocabulary past ``2**31`` ids.

    Args:
        num_tokens: length of the stream, >= 1.
        vocab_size: number of ids including ``<unk>`` = 0; >= 2.
        seed: non-negative int.
        zipf: Zipf exponent of the marginal draws.
        follow: probability that a token is a fixed successor of the previous one.
    """
    rng = np.random.default_rng([_TAG_LM, seed])
    words = vocab_size - 1
    id_type = np.int32 if vocab_size <= 2**31 else np.int64
    if vocab_size <= _SUCCESSOR_TABLE_MAX:
        table = 1 + zipf_ranks(rng, (vocab_size, len(_SUCCESSOR_WEIGHTS)), words, zipf)
        successors = lambda previous, pick: table[previous, pick]  # noqa: E731
        tokens = (1 + zipf_ranks(rng, num_tokens, words, zipf)).astype(id_type)
    else:  # no table of vocab_size rows: each needed successor is a hashed Zipf draw
        quantiles = ZipfQuantiles(words, zipf)  # set up once for every chain depth
        key = np.uint64((seed * 0x100000001B3 + _TAG_LM) % 2**64)

        def successors(previous, pick):
            counter = (previous.astype(np.uint64) * np.uint64(len(_SUCCESSOR_WEIGHTS))
                       + pick.astype(np.uint64))
            unit = (mix64(mix64(counter ^ key)) >> np.uint64(11)).astype(np.float64) * 2.0**-53
            return 1 + quantiles(unit)

        tokens = (1 + quantiles(rng.random(num_tokens))).astype(id_type)
    follows = rng.random(num_tokens) < follow
    follows[0] = False
    choice = rng.choice(len(_SUCCESSOR_WEIGHTS), size=num_tokens, p=_SUCCESSOR_WEIGHTS)
    # A following token depends on its predecessor: fill the chains depth by
    # depth (depth = distance from the last fresh token), each depth at once.
    positions = np.arange(num_tokens)
    last_fresh = np.maximum.accumulate(np.where(follows, 0, positions))
    depth = positions - last_fresh
    by_depth = np.argsort(depth, kind="stable")
    bounds = np.cumsum(np.bincount(depth))
    for level in range(1, len(bounds)):
        at = by_depth[bounds[level - 1]:bounds[level]]
        tokens[at] = successors(tokens[at - 1], choice[at])
    return tokens


def _hashed_uniform(seed, field, ids):
    """Uniform [-1, 1) values keyed by (seed, field, id): a hidden weight per id, no table."""
    key = np.uint64((seed * 0x100000001B3 + field * 0x9E3779B1 + _TAG_CTR) % 2**64)
    bits = mix64(mix64(np.asarray(ids, dtype=np.uint64) ^ key))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0**-52 - 1.0


def generate_ctr(num_samples, n_dense=13, n_fields=26, cardinality=1000, seed=0, zipf=1.1):
    """Synthetic CTR arrays.

    Args:
        num_samples: rows, >= 1.
        n_dense: dense features, >= 0.
        n_fields: categorical fields, >= 1.
        cardinality: int, or ``n_fields`` ints: the id space of each field.
        seed: non-negative int.
        zipf: Zipf exponent of the categorical draws.

    Returns:
        ``(label float32 [N], dense float32 [N, n_dense], categorical int64
        [N, n_fields], cardinality int64 [n_fields])``.
    """
    cardinality = np.broadcast_to(np.asarray(cardinality, dtype=np.int64), (n_fields,)).copy()
    rng = np.random.default_rng([_TAG_CTR, seed])
    categorical = np.empty((num_samples, n_fields), dtype=np.int64)
    for field in range(n_fields):
        categorical[:, field] = zipf_ranks(rng, num_samples, int(cardinality[field]), zipf)
    dense = rng.standard_normal((num_samples, n_dense), dtype=np.float32)
    dense_weights = rng.normal(0.0, 0.5, size=n_dense)
    logit = _CTR_BIAS + dense.astype(np.float64) @ dense_weights
    for field in range(min(_INFORMATIVE_FIELDS, n_fields)):
        logit += 1.5 * _hashed_uniform(seed, field, categorical[:, field])
    label = (rng.random(num_samples) < 1.0 / (1.0 + np.exp(-logit))).astype(np.float32)
    return label, dense, categorical, cardinality
