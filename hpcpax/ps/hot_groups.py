"""Hot rows: an owner's received ids grouped by their exact set of sources.

See :mod:`hpcpax.ps.hot_rows` for what the groups are for. Not collective.
"""

from __future__ import annotations

import numpy as np

__all__ = ["classify"]


def classify(ids, counts, min_nodes, min_bytes, row_bytes, rounds_of):
    """Group an owner's received ids by their set of sources; choose trees.

    Not collective.

    Args:
        ids: int64 ids as received, concatenated by source rank.
        counts: rows received from each source rank.
        min_nodes, min_bytes, row_bytes: the choice (see the module);
            ``min_bytes`` an int, or a list indexed by a group's member
            count (``None`` or past its end: that group never takes a tree).
        rounds_of: rounds a tree over ``k`` members takes.

    Returns:
        ``(group, groups, rounds)``: per received id the index of its group
        in ``groups`` or -1 (moves as today); ``groups`` a list of
        ``(members, unique ids)`` (ascending ranks, ascending ids); the most
        rounds a chosen group needs (0: none chosen).
    """
    group = np.full(len(ids), -1, np.int64)
    if min_nodes < 2 or len(ids) == 0:
        return group, [], 0
    size = len(counts)
    src = np.repeat(np.arange(size, dtype=np.int64), counts)
    unique, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    sources = np.bincount(inverse, minlength=len(unique))
    if len(np.unique(inverse * size + src)) != len(ids):
        return group, [], 0  # a source sent an id twice: leave everything as it is
    candidates = np.flatnonzero(sources >= min_nodes)
    if len(candidates) == 0:
        return group, [], 0
    words = (size + 62) // 63
    masks = np.zeros((len(unique), words), np.int64)
    for w in range(words):
        sel = src // 63 == w
        np.bitwise_or.at(masks[:, w], inverse[sel], np.left_shift(np.int64(1), src[sel] % 63))
    keys, key_of = np.unique(masks[candidates], axis=0, return_inverse=True)
    key_of = key_of.reshape(-1)
    group_of_unique = np.full(len(unique), -1, np.int64)
    groups, rounds = [], 0
    for g, key in enumerate(keys):
        members = np.array([63 * w + b for w in range(words) for b in range(63)
                            if (int(key[w]) >> b) & 1], np.int64)
        rows = candidates[key_of == g]
        need = min_bytes
        if isinstance(min_bytes, (list, tuple)):
            need = min_bytes[len(members)] if len(members) < len(min_bytes) else None
        if need is None or (len(members) - 1) * len(rows) * row_bytes < need:
            continue
        group_of_unique[rows] = len(groups)
        groups.append((members, unique[rows]))
        rounds = max(rounds, rounds_of(len(members)))
    group[:] = group_of_unique[inverse]
    return group, groups, rounds
