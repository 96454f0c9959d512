"""Which samples a rank reads at a step: batch geometry and epoch shuffling.

The order is a pure function of ``(step, global_batch, shard, num_shards,
num_samples, shuffle, seed)``; no reader keeps a position. The global batch of
step ``s`` is the run of *positions* ``[s*G, (s+1)*G)``; position ``p`` falls
in epoch ``p // N`` at offset ``p % N`` and names sample ``offset`` (or
``permutation(seed, epoch)[offset]`` when shuffling). Shard ``r`` of ``n``
takes the contiguous run ``[s*G + r*G/n, s*G + (r+1)*G/n)`` of positions, so
concatenating the shards in rank order gives the global batch.

The shuffle is a keyed Feistel network over ``[0, a*b)`` (``a, b`` about
``sqrt(N)``, rounds alternating the moduli ``a`` and ``b``) with cycle walking
into ``[0, N)`` (rarely needed: ``a*b - N < a``): a bijection that a rank
evaluates for its own ``G/n`` positions only, in ``O(G/n)`` time and memory,
however large ``N`` is. Readers evaluate it for a block of steps at a time.
"""

import math
import operator

import numpy as np

from hpcpax.errors import DataError

__all__ = ["check_geometry", "check_int", "mix64", "permute", "sample_indices",
           "sample_index_block", "sample_range"]

_FEISTEL_ROUNDS = 4  # even: the last round leaves (left, right) in [0, a) x [0, b)
_TAG_SHUFFLE = 0x5348554646  # "SHUFF": separates shuffle keys from data-generation streams


def check_int(value, name, minimum=None):
    """``value`` as an int: TypeError unless integral, ValueError below ``minimum``."""
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be int, not {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return value


def mix64(values):
    """SplitMix64 finalizer: a fast, well-mixed hash of uint64 values (elementwise)."""
    z = np.array(values, dtype=np.uint64)  # a copy, then in place: half the temporaries
    z += np.uint64(0x9E3779B97F4A7C15)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def _round_keys(seed, epoch):
    entropy = [_TAG_SHUFFLE, seed, epoch]
    return np.random.SeedSequence(entropy).generate_state(_FEISTEL_ROUNDS, dtype=np.uint64)


def _feistel(values, keys, moduli):
    """Alternating-modulus Feistel on ``[0, a*b)``: ``x = left*b + right``, ``left`` in
    ``[0, a)``, ``right`` in ``[0, b)``; each round maps ``(left, right)`` to
    ``(right, (left + F(right)) mod m)`` with ``m`` alternating ``a, b``, a bijection."""
    a, b = moduli
    left, right = np.divmod(values, b)
    shift = np.uint64(32)
    for round_index, key in enumerate(keys):
        modulus = a if round_index % 2 == 0 else b
        # F(right) in [0, modulus): the high 32 bits of a hash, scaled (no division)
        mixed = (mix64(right ^ key) >> shift) * modulus >> shift
        mixed += left
        mixed -= modulus * (mixed >= modulus)
        left, right = right, mixed
    return left * b + right  # an even round count ends with left in [0, a)


def permute(offsets, num_samples, seed, epoch):
    """Map offsets in ``[0, num_samples)`` through the permutation of ``(seed, epoch)``.

    Args:
        offsets: int array of offsets inside one epoch.
        num_samples: size of the permuted range, at least 1.
        seed: non-negative int.
        epoch: non-negative int.

    Returns:
        int64 array, same shape: ``permutation[offsets]``. Over all offsets of
        ``[0, num_samples)`` the result is a permutation of that range.
    """
    offsets = np.asarray(offsets, dtype=np.int64)
    if num_samples <= 1:
        return np.zeros_like(offsets)
    # a x b >= N with a, b about sqrt(N): the domain exceeds N by less than a
    a = math.isqrt(num_samples - 1) + 1
    moduli = (np.uint64(a), np.uint64(-(-num_samples // a)))
    keys = _round_keys(seed, epoch)
    result = _feistel(offsets.astype(np.uint64), keys, moduli)
    # Cycle walking: re-encrypt values that landed outside [0, N) until inside;
    # the first in-range element of each orbit keeps the map a bijection.
    outside = np.flatnonzero(result >= np.uint64(num_samples))
    while outside.size:
        result[outside] = _feistel(result[outside], keys, moduli)
        outside = outside[result[outside] >= np.uint64(num_samples)]
    return result.astype(np.int64)


def check_geometry(step, global_batch, shard, num_shards, num_samples, name):
    """Check a batch request and return the local batch size ``global_batch // num_shards``.

    Raises:
        TypeError: an argument is not an int.
        DataError: negative step, shard outside ``[0, num_shards)``, a global
            batch that does not split evenly, an empty shard, or a data set with
            fewer samples than one global batch. The message names ``name``.
    """
    step = check_int(step, "step")
    global_batch = check_int(global_batch, "global_batch")
    shard = check_int(shard, "shard")
    num_shards = check_int(num_shards, "num_shards")
    if step < 0:
        raise DataError(f"{name}: step must be >= 0, not {step}")
    if num_shards < 1:
        raise DataError(f"{name}: num_shards must be >= 1, not {num_shards}")
    if not 0 <= shard < num_shards:
        raise DataError(f"{name}: shard must be in [0, {num_shards}), not {shard}")
    if global_batch < 0:
        raise DataError(f"{name}: global_batch must be >= 0, not {global_batch}")
    if global_batch % num_shards:
        raise DataError(
            f"{name}: global batch {global_batch} does not divide evenly "
            f"by num_shards {num_shards}"
        )
    if global_batch == 0:
        raise DataError(
            f"{name}: global batch 0 over {num_shards} shard(s) leaves shard {shard} empty"
        )
    if num_samples < global_batch:
        raise DataError(
            f"{name}: holds {num_samples} samples, fewer than one global batch "
            f"of {global_batch}; shards would repeat samples within a step"
        )
    return global_batch // num_shards


def sample_index_block(first_step, steps, global_batch, shard, num_shards, num_samples,
                       shuffle=False, seed=0, name="data"):
    """Sample indices of ``shard`` for steps ``first_step .. first_step + steps - 1``.

    One vectorized permutation for many steps: a reader that asks step by
    step pays NumPy's per-call cost (the Feistel rounds are some 60 small
    array operations) once per block instead of once per step.

    Returns:
        int64 array ``[steps, global_batch // num_shards]``; row ``k`` equals
        ``sample_indices(first_step + k, ...)``.
    """
    local = check_geometry(first_step, global_batch, shard, num_shards, num_samples, name)
    steps = check_int(steps, "steps", 1)
    seed = check_int(seed, "seed")
    if seed < 0:
        raise DataError(f"{name}: seed must be >= 0, not {seed}")
    first = first_step * global_batch + shard * local  # Python int: no overflow at any step
    last = (first_step + steps - 1) * global_batch + shard * local
    if last + local >= 2**62:
        raise DataError(f"{name}: step {first_step + steps - 1} is too large for int64 positions")
    positions = (first + np.arange(steps, dtype=np.int64)[:, None] * global_batch
                 + np.arange(local, dtype=np.int64)).reshape(-1)
    return _samples_at(positions, num_samples, shuffle, seed).reshape(steps, local)


def _samples_at(positions, num_samples, shuffle, seed):
    """The sample each position names: its offset in its epoch, permuted when shuffling."""
    epochs = positions // num_samples
    offsets = positions - epochs * num_samples
    if shuffle:
        result = np.empty_like(offsets)
        for epoch in np.unique(epochs):  # each epoch has its own permutation
            in_epoch = epochs == epoch
            result[in_epoch] = permute(offsets[in_epoch], num_samples, seed, int(epoch))
        offsets = result
    return offsets


def sample_range(step, global_batch, start, stop, num_samples, shuffle=False, seed=0,
                 name="data"):
    """Indices of samples ``[start, stop)`` of step ``step``'s global batch, in batch order.

    The uneven counterpart of :func:`sample_indices`: a worker with an
    explicit share of the global batch (balanced BSP) reads positions
    ``[step*G + start, step*G + stop)``; the ranges of all workers, in
    order, concatenate to the same global batch as the even shards do, so
    ``sample_range(s, G, r*G/n, (r+1)*G/n, ...)`` equals
    ``sample_indices(s, G, r, n, ...)``. Not collective.

    Raises:
        TypeError: an argument is not an int.
        DataError: negative step or seed, a range outside ``[0, global_batch]``
            or empty, or a data set with fewer samples than one global batch.
    """
    step = check_int(step, "step")
    global_batch = check_int(global_batch, "global_batch")
    start, stop = check_int(start, "start"), check_int(stop, "stop")
    seed = check_int(seed, "seed")
    if step < 0 or seed < 0:
        raise DataError(f"{name}: step and seed must be >= 0, not {step} and {seed}")
    if not 0 <= start < stop <= global_batch:
        raise DataError(f"{name}: a batch range must satisfy 0 <= start < stop <= global batch "
                        f"{global_batch}, not [{start}, {stop})")
    if num_samples < global_batch:
        raise DataError(f"{name}: holds {num_samples} samples, fewer than one global batch "
                        f"of {global_batch}; shards would repeat samples within a step")
    first = step * global_batch + start
    if first + (stop - start) >= 2**62:
        raise DataError(f"{name}: step {step} is too large for int64 positions")
    positions = first + np.arange(stop - start, dtype=np.int64)
    return _samples_at(positions, num_samples, shuffle, seed)


def sample_indices(step, global_batch, shard, num_shards, num_samples, shuffle=False, seed=0,
                   name="data"):
    """Indices of the samples that ``shard`` of ``num_shards`` reads at ``step``.

    Not collective: every rank computes its own slice from the arguments alone.

    Returns:
        int64 array of ``global_batch // num_shards`` sample indices, in batch
        order (not sorted when ``shuffle`` is on).
    """
    return sample_index_block(step, 1, global_batch, shard, num_shards, num_samples, shuffle,
                              seed, name)[0]
