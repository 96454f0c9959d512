"""Hot rows: an owner's received ids grouped by their exact set of sources,
and the shape of the tree each group takes.

See :mod:`hpcpax.ps.hot_rows.routing` for what the groups are for. Not collective.
"""

from __future__ import annotations

import numpy as np

__all__ = ["MAX_PIECES", "classify", "tree_order", "parent_of", "children_of", "pieces_of",
           "chunk_sizes"]

#: The most pieces one group is cut into.
MAX_PIECES = 64


def classify(ids, counts, min_nodes, min_bytes, row_bytes):
    """Group an owner's received ids by their set of sources; choose trees.

    Not collective.

    Args:
        ids: int64 ids as received, concatenated by source rank.
        counts: rows received from each source rank.
        min_nodes, min_bytes, row_bytes: the choice (see the module);
            ``min_bytes`` an int, or a list indexed by a group's member
            count (``None`` or past its end: that group never takes a tree).

    Returns:
        ``(group, groups)``: per received id the index of its group in
        ``groups`` or -1 (moves as today); ``groups`` a list of ``(members,
        unique ids)`` (ascending ranks, ascending ids).
    """
    group = np.full(len(ids), -1, np.int64)
    if min_nodes < 2 or len(ids) == 0:
        return group, []
    size = len(counts)
    unique, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    sources = np.bincount(inverse, minlength=len(unique))
    candidates = np.flatnonzero(sources >= min_nodes)
    if len(candidates) == 0:
        return group, []
    words = (size + 62) // 63
    masks = np.zeros((len(unique), words), np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    for s in np.flatnonzero(counts).tolist():  # one fancy update per source (no ufunc.at)
        masks[inverse[bounds[s]:bounds[s + 1]], s // 63] |= np.int64(1) << np.int64(s % 63)
    if not np.array_equal(_popcount(masks), sources):
        return group, []  # a source sent an id twice: leave everything as it is
    if words == 1:  # one word per row: a 1-D unique, far cheaper than axis=0
        keys, key_of = np.unique(masks[candidates, 0], return_inverse=True)
        keys = keys.reshape(-1, 1)
    else:
        keys, key_of = np.unique(masks[candidates], axis=0, return_inverse=True)
    key_of = key_of.reshape(-1)
    group_of_unique = np.full(len(unique), -1, np.int64)
    groups = []
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
    group[:] = group_of_unique[inverse]
    return group, groups


def _popcount(masks):
    """Set bits of each row of an int64 ``[n, words]`` array."""
    if hasattr(np, "bitwise_count"):  # NumPy >= 2
        return np.bitwise_count(masks).sum(axis=1, dtype=np.int64)
    bits = np.unpackbits(np.ascontiguousarray(masks).view(np.uint8), axis=1)
    return bits.sum(axis=1, dtype=np.int64)


def tree_order(members, node_of, owner, chain):
    """Members in tree order: a chain starts on the owner's node (one intra-node
    copy, then one copy leaves it); a binomial tree starts off it (its first
    member forwards ``log2 k`` copies over its own link, not the owner's)."""
    local = (node_of[members] == node_of[owner]).tolist()
    keys = [(is_local != chain, int(m)) for is_local, m in zip(local, members)]
    return np.array([m for _, m in sorted(keys)], np.int64)


def parent_of(position, chain) -> int:
    """The tree position a member at ``position`` receives from (-1: the owner).

    A chain: the one before. A binomial tree: ``position`` minus its
    highest power of two (member ``i`` sends to ``i + 1, i + 2, i + 4, ...``
    above ``i``).
    """
    if position == 0:
        return -1
    if chain:
        return position - 1
    return position - (1 << (int(position).bit_length() - 1))


def children_of(position, k, chain) -> list:
    """Tree positions a member at ``position`` of ``k`` forwards to, nearest first."""
    if chain:
        return [position + 1] if position + 1 < k else []
    out, step = [], 1
    while step <= position:
        step <<= 1
    while position + step < k:
        out.append(position + step)
        step <<= 1
    return out


def pieces_of(group_bytes, chunk_bytes) -> int:
    """Pieces a group of ``group_bytes`` goes in: about ``chunk_bytes`` each
    (0: one), at most :data:`MAX_PIECES`."""
    if chunk_bytes <= 0 or group_bytes <= chunk_bytes:
        return 1
    return min(MAX_PIECES, -(-int(group_bytes) // int(chunk_bytes)))


def chunk_sizes(rows, row_bytes, chunk_bytes) -> list:
    """Rows of each consecutive piece of a group of ``rows`` (the first ones larger)."""
    n = max(1, min(pieces_of(rows * row_bytes, chunk_bytes), int(rows)))
    return [rows // n + (1 if j < rows % n else 0) for j in range(n)]
