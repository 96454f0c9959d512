"""Hot rows travel once: broadcast trees for pulls, reduction chains for pushes.

With node-local aggregation each node asks an owner for a row once, but a
row that ``k`` nodes touch still leaves (pull) or reaches (push) its owner
``k`` times. Here the owner, which receives every node's ids anyway, counts
the *sources* of each row (one per node under local aggregation, one per
worker without it) and groups the rows by their exact set of sources ``S``.
A group whose ``|S|`` reaches the variable's ``min_nodes`` and whose saved
owner bytes, ``(|S| - 1) x rows x row bytes``, reach ``min_bytes`` (the
price of the added rounds) takes a tree; the other rows move as before.

- **Pull**: the owner sends the group once, to the first member of ``S``
  (:func:`_tree_order`: the owner's node link carries one copy); from
  there a chain when ``|S| <= 3`` (each node forwards once), else a
  binomial tree over ``S`` (round ``r >= 1``: member ``i < 2^(r-1)`` sends
  to member ``i + 2^(r-1)``): ``1 + ceil(log2 |S|)`` rounds either way.
  Every member needs every row of its group, so no row goes where it is
  not wanted. Rows are copies: results equal today's exactly.
- **Push**, when the last pull of one of its variables chose a tree (so a
  step without shared rows pays nothing more than one ``Allreduce`` in its
  pull, and after such a pull only one pull in :data:`PROBE_EVERY` looks
  again): before the values move, one ids-only exchange to the owners
  (the *count exchange*) and one int64 per id back: cold, or the row's
  position in its group's chain and the next hop. The chain runs through
  ``S`` in ascending rank: member 0 sends ``0 + g_0``, member ``j`` adds its
  own gradient to the partial it received, the last sends the sum to the
  owner. That is the order in which the owner would have summed the rows it
  received from ``S`` (``dedup_sum``: input order, sources by rank), so the
  owner's sum is **bitwise** today's, in float64 and in float32 alike (the
  partials are kept in the variable's dtype, as the owner's sum is).
  ``|S|`` rounds: a chain, not a binomial tree, because only the chain
  keeps the left-to-right order; a balanced tree would round differently.
- **Pipelining** (``HPCPAX_HOT_ROWS_CHUNKS=c > 1``): every group takes a
  chain and its rows go in ``c`` chunks, chunk ``j`` ``j`` rounds behind
  chunk 0, so a member forwards one chunk while the next arrives:
  ``|S| + c - 1`` rounds of ``1/c`` of the bytes. Each row keeps its path
  and order, so results stay bitwise today's.

Every round is one ``Alltoall`` of counts and one ``Alltoallv`` over
``topology.comm``; the number of rounds is agreed by one ``Allreduce``.
Bytes: what owners send (pull) or receive (push) is counted in ``pull`` /
``push`` as before; what tree members forward to each other in ``relay``.
Every function is **collective** over ``topology.comm``.
"""

from __future__ import annotations

import time

import numpy as np

from ..backend import to_host
from ..comm.exchange import alltoallv_many, exchange_counts_many
from ..options import options
from .hot_groups import classify

__all__ = ["HotRows", "classify", "pull_reply", "push_chain"]

RELAY = "relay"
#: After a pull without trees, the pulls of the same variables classify again every this many.
PROBE_EVERY = 16


class HotRows:
    """Which variables use trees: ``min_nodes`` per variable (0: off).

    Args:
        setting: None (every variable takes ``options.hot_rows``), an int
            for every variable, or ``{name: int}`` (names not listed take
            ``options.hot_rows``). Must be the same on every rank.
        min_bytes: None (``options.hot_rows_min_bytes``) or bytes.
    """

    def __init__(self, setting=None, min_bytes=None):
        if not (setting is None or isinstance(setting, (int, dict))) or isinstance(setting, bool):
            raise TypeError(f"hot_rows must be None, int or dict, not {type(setting).__name__}")
        values = setting.values() if isinstance(setting, dict) else [setting]
        for v in values:
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
                raise ValueError(f"hot_rows must be an int >= 0, not {v!r}")
        self.setting = setting
        self._min_bytes = min_bytes
        self._thresholds, self._default = {}, None  # set by a plan: per variable, per k
        self.entries = {}  # name -> the plan's entry given to set()
        self._wait = {}  # names -> pulls left before the next classification
        self._chose = {}  # name -> whether its last classified pull chose a tree

    @property
    def min_bytes(self) -> int:
        """Owner bytes a group must save to take a tree."""
        return options.hot_rows_min_bytes if self._min_bytes is None else int(self._min_bytes)

    def set(self, name, entry) -> None:
        """Set variable ``name``'s choice, a plan's entry; local, the same on every rank.

        ``entry``: ``{"min_nodes": m (0: off), "min_saved_bytes": [] (the
        :attr:`min_bytes` rule) or a list indexed by a group's member count
        (None: never a tree), "reason": str}``.
        """
        m = entry["min_nodes"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_nodes must be an int >= 0, not {m!r}")
        if not isinstance(self.setting, dict):
            self.setting, self._default = {}, self.setting
        self.setting = {**self.setting, name: int(m)}
        self._thresholds[name] = list(entry.get("min_saved_bytes") or []) or None
        self.entries[name] = dict(entry)
        self._wait = {k: v for k, v in self._wait.items() if name not in k}

    def thresholds(self, name):
        """Saved owner bytes a group must reach: an int, or a list indexed by members."""
        table = self._thresholds.get(name)
        return self.min_bytes if table is None else table

    def classify_pull(self, names) -> bool:
        """Whether this pull of ``names`` classifies its rows (a tree is possible).

        After a pull that chose no tree, the next ``PROBE_EVERY - 1`` pulls of
        the same variables skip the classification and its ``Allreduce``.
        Local, but the same answer on every rank (it depends only on agreed
        results and on the sequence of pulls).
        """
        key = tuple(names)
        if not any(self.min_nodes(n) for n in names):
            return False
        wait = self._wait.get(key, 0)
        if wait:
            self._wait[key] = wait - 1
            self._chose.update((n, False) for n in names)
            return False
        return True

    def pulled(self, names, chose) -> None:
        """Record a classified pull's agreed outcome."""
        self._wait[tuple(names)] = 0 if chose else PROBE_EVERY - 1
        self._chose.update((n, chose) for n in names)

    def chain_push(self, names) -> bool:
        """Whether a push of ``names`` takes the chain (the last pull chose a tree)."""
        return any(self.min_nodes(n) and self._chose.get(n) for n in names)

    def min_nodes(self, name) -> int:
        """Sources a row needs to be hot for variable ``name`` (0: off)."""
        value = (self.setting.get(name, self._default) if isinstance(self.setting, dict)
                 else self.setting)
        value = options.hot_rows if value is None else value
        return 0 if value < 2 else int(value)


def _binomial_rounds(k) -> int:
    return 1 + int(np.ceil(np.log2(k))) if k > 1 else 1


def _agree_rounds(comm, rounds) -> int:
    from mpi4py import MPI

    return int(comm.allreduce(int(rounds), op=MPI.MAX))


def _round(comm, accounting, slots):
    """One round: ``slots`` of ``(phase, name, likes, parts)``; parts[d] lists arrays for d.

    Returns per slot the received arrays (rows by source). The counts'
    bytes go to the phase of the first slot, row bytes to each slot's phase.
    """
    size = comm.Get_size()
    start = time.perf_counter()
    send = np.zeros((size, len(slots)), np.int64)
    arrays = []
    for s, (_, _, likes, parts) in enumerate(slots):
        for d, part in parts.items():
            send[d, s] = len(part[0])
        order = sorted(parts)
        arrays.append([np.concatenate([like[:0]] + [parts[d][j] for d in order])
                       for j, like in enumerate(likes)])
    recv = exchange_counts_many(comm, send)
    out = alltoallv_many(comm, send, recv, arrays)
    seconds = time.perf_counter() - start
    if accounting is not None:
        widths = np.array([sum(int(np.prod(a.shape[1:], dtype=np.int64)) * a.itemsize
                               for a in likes) for _, _, likes, _ in slots], np.int64)
        eight = np.full((1, size), 8 * len(slots), np.int64)
        accounting.record_batched_exchange(slots[0][0], [slots[0][1]], eight, eight, calls=0)
        for phase in dict.fromkeys(p for p, _, _, _ in slots):
            idx = [s for s, slot in enumerate(slots) if slot[0] == phase]
            accounting.record_batched_exchange(
                phase, [slots[s][1] for s in idx], (send[:, idx] * widths[idx]).T,
                (recv[:, idx] * widths[idx]).T, seconds if phase == slots[0][0] else 0.0)
    return out


def pull_reply(topology, variables, hop, wanted, policy, gather) -> tuple:
    """Answer a pull's owner hop with trees for hot rows.

    **Collective** over ``topology.comm``. ``hop`` is the owner hop whose
    :meth:`send` returned ``wanted``; ``gather(var, ids)`` an owner's rows.
    Returns each variable's rows in the requester's input order (as
    ``hop.reply`` would) and whether any owner chose a tree (the same on
    every rank).
    """
    comm, acct, me = topology.comm, topology.accounting, topology.rank
    rows, groups, rounds = [], [], 0
    chunks = max(1, options.hot_rows_chunks)
    for k, (var, (ids,)) in enumerate(zip(variables, wanted)):
        rows.append(gather(var, ids))
        g, found, r = classify(ids, hop.recv_counts[:, k], policy.min_nodes(var.spec.name),
                               policy.thresholds(var.spec.name), var.spec.row_bytes,
                               _binomial_rounds if chunks == 1 else lambda n: n + chunks - 1)
        groups.append((g, found))
        rounds = max(rounds, r)
    total = _agree_rounds(comm, rounds)
    if total == 0:
        return hop.reply(rows), False
    held = []  # (k, members, ids, rows, is_root, first round, chain)
    node_of = topology.node_of
    for k, (var, (g, found)) in enumerate(zip(variables, groups)):
        for members, ids in found:
            chain = len(members) <= 3 or chunks > 1
            order = _tree_order(members, node_of, me, chain)
            got = gather(var, ids)
            for j, part in enumerate(np.array_split(np.arange(len(ids)), min(chunks, len(ids)))):
                held.append((k, order, ids[part], got[part], True, j, chain))
    hot = [[] for _ in variables]
    cold = [None] * len(variables)
    for r in range(total):
        slots = []
        for k, var in enumerate(variables):
            sends = {True: ({}, {}), False: ({}, {})}  # root's and relays' (meta, data)
            for hk, members, ids, hrows, root, first, chain in held:
                if hk != k:
                    continue
                meta, data = sends[root or chunks == 1]
                for dest in _children(members, me, r - first, root, chain):
                    meta.setdefault(dest, []).append(np.concatenate(
                        [[me, len(members)], members, [len(ids), first, chain]]).astype(np.int64))
                    data.setdefault(dest, []).append((ids, hrows))
            likes_meta = [np.zeros(0, np.int64)]
            likes_data = [np.zeros(0, np.int64), np.zeros((0, var.spec.dim), var.spec.dtype)]
            for root in (True, False)[:1 if chunks == 1 else 2]:
                meta, data = sends[root]
                phase = "pull" if (r == 0 if chunks == 1 else root) else RELAY
                slots.append((phase, var.spec.name, likes_meta,
                              {d: [np.concatenate(m)] for d, m in meta.items()}))
                slots.append((phase, var.spec.name, likes_data,
                              {d: [np.concatenate([i for i, _ in v]),
                                   np.concatenate([x for _, x in v])] for d, v in data.items()}))
            if r == 0:
                g = groups[k][0]
                keep = g < 0
                src = np.repeat(np.arange(comm.Get_size()), hop.recv_counts[:, k])
                slots.append(("pull", var.spec.name, [likes_data[1]],
                              {int(d): [rows[k][keep & (src == d)]]
                               for d in np.unique(src[keep])}))
        out = _round(comm, acct, slots)
        pairs = 1 if chunks == 1 else 2
        per = 2 * pairs + (r == 0)
        for k in range(len(variables)):
            got = out[k * per:(k + 1) * per]
            for p in range(pairs):
                _receive(held, hot[k], k, got[2 * p][0], got[2 * p + 1])
            if r == 0:
                cold[k] = got[-1][0]
    return [_assemble(hop, k, hot[k], cold[k], var) for k, var in enumerate(variables)], True


def _tree_order(members, node_of, owner, chain):
    """Members in tree order: a chain starts on the owner's node (one intra-node
    copy, then one copy leaves it); a binomial tree starts off it (its first
    member forwards ``log2 k`` copies over its own link, not the owner's)."""
    local = (node_of[members] == node_of[owner]).tolist()
    keys = [(is_local != chain, int(m)) for is_local, m in zip(local, members)]
    return np.array([m for _, m in sorted(keys)], np.int64)


def _children(members, me, r, root, chain):
    """Who I send a group (or a chunk of it) to in its round ``r`` (root: the owner).

    A chain (every node forwards once) or a binomial tree; ``r`` counts
    from the chunk's first round.
    """
    if root:
        return [int(members[0])] if r == 0 else []
    if r <= 0:
        return []
    i = int(np.flatnonzero(members == me)[0])
    if chain:
        return [int(members[i + 1])] if r == i + 1 and i + 1 < len(members) else []
    step = 1 << (r - 1)
    return [int(members[i + step])] if i < step and i + step < len(members) else []


def _receive(held, hot, k, meta, data):
    """Take the groups received in a round: keep their rows, hold them to forward."""
    ids_all, rows_all = data
    pos, at = 0, 0
    while pos < len(meta):
        n_members = int(meta[pos + 1])
        members = meta[pos + 2:pos + 2 + n_members]
        n, first, chain = (int(x) for x in meta[pos + 2 + n_members:pos + 5 + n_members])
        pos += 5 + n_members
        ids, rows = ids_all[at:at + n], rows_all[at:at + n]
        at += n
        hot.append((ids, rows))
        held.append((k, members, ids, rows, False, first, bool(chain)))


def _assemble(hop, k, hot, cold, var):
    """A requester's rows of variable ``k`` in its input order."""
    packed_ids = hop.arrays[k][0]
    back = np.empty((len(packed_ids), var.spec.dim), var.spec.dtype)
    is_hot = np.zeros(len(packed_ids), bool)
    if hot:
        hot_ids = np.concatenate([i for i, _ in hot])
        hot_rows = np.concatenate([x for _, x in hot])
        sort = np.argsort(hot_ids, kind="stable")
        is_hot = np.isin(packed_ids, hot_ids)
        back[is_hot] = hot_rows[sort][np.searchsorted(hot_ids[sort], packed_ids[is_hot])]
    back[~is_hot] = cold
    out = np.empty_like(back)
    out[hop.orders[k]] = back
    return out


def push_chain(topology, variables, hop, ids, values, policy, apply) -> None:
    """A push whose hot rows are summed up a chain of their sources.

    **Collective** over ``topology.comm``. ``hop`` is an ids-only owner hop
    of ``ids`` (not yet sent); ``values`` the gradient rows of ``ids``;
    ``apply(var, ids, rows)`` the owner's sum-and-update (today's).
    """
    comm, acct, size = topology.comm, topology.accounting, topology.comm.Get_size()
    wanted = hop.send()
    codes, cold_masks, rounds = [], [], 0
    chunks = max(1, options.hot_rows_chunks)
    for k, (var, (got,)) in enumerate(zip(variables, wanted)):
        g, found, r = classify(got, hop.recv_counts[:, k], policy.min_nodes(var.spec.name),
                               policy.thresholds(var.spec.name), var.spec.row_bytes,
                               lambda n: n + chunks - 1)
        src = np.repeat(np.arange(size, dtype=np.int64), hop.recv_counts[:, k])
        code = np.full(len(got), -1, np.int64)
        for index, (members, unique) in enumerate(found):
            sel = np.flatnonzero(g == index)
            position = np.searchsorted(members, src[sel])
            last = position == len(members) - 1
            nxt = np.append(members, topology.rank)[position + 1]
            # chunk c of the group's rows runs c rounds behind chunk 0 (pipelining)
            chunk = np.searchsorted(unique, got[sel]) * min(chunks, len(unique)) // len(unique)
            code[sel] = ((2 * (position + chunk) + last) * 2 + (position == 0)) * size + nxt
        codes.append(code)
        cold_masks.append(g < 0)
        rounds = max(rounds, r)
    mine = hop.reply(codes)
    total = max(_agree_rounds(comm, rounds), 1)
    packed = []  # per variable: (ids, values, code, destination) in packed order
    for k, var in enumerate(variables):
        order = hop.orders[k]
        packed.append((hop.arrays[k][0], np.asarray(to_host(values[k]))[order], mine[k][order],
                       np.repeat(np.arange(size), hop.send_counts[:, k])))
    partial = [(np.zeros(0, np.int64), None) for _ in variables]
    finals = [[] for _ in variables]
    cold_rows = [None] * len(variables)
    for r in range(total):
        slots = []
        for k, var in enumerate(variables):
            p_ids, p_values, code, dest_owner = packed[k]
            like = [np.zeros(0, np.int64), np.zeros((0, var.spec.dim), var.spec.dtype)]
            step, nxt = np.divmod(code, size)
            step, head = np.divmod(step, 2)
            when, last = np.divmod(step, 2)
            at = np.flatnonzero((code >= 0) & (when == r))
            acc = _accumulate(p_ids[at], p_values[at], partial[k], head[at] == 1)
            at_ids, dest, end = p_ids[at], nxt[at], last[at] == 1
            final = {int(d): [at_ids[end & (dest == d)], acc[end & (dest == d)]]
                     for d in np.unique(dest[end])}
            relay = {int(d): [at_ids[~end & (dest == d)], acc[~end & (dest == d)]]
                     for d in np.unique(dest[~end])}
            slots.append(("push", var.spec.name, like, final))
            if r == 0:
                c = code < 0
                slots.append(("push", var.spec.name, [like[1]],
                              {int(d): [p_values[c & (dest_owner == d)]]
                               for d in np.unique(dest_owner[c])}))
            slots.append((RELAY, var.spec.name, like, relay))
        out = _round(comm, acct, slots)
        per = 3 if r == 0 else 2
        for k in range(len(variables)):
            got = out[k * per:(k + 1) * per]
            finals[k].append(got[0])
            partial[k] = tuple(got[-1])
            if r == 0:
                cold_rows[k] = got[1][0]
    for k, var in enumerate(variables):
        all_ids = np.concatenate([wanted[k][0][cold_masks[k]]] + [f[0] for f in finals[k]])
        all_rows = np.concatenate([cold_rows[k]] + [f[1] for f in finals[k]])
        apply(var, all_ids, all_rows)


def _accumulate(ids, own, partial, head):
    """``0 + own`` at a chain's head, else the received partial + own (same dtype)."""
    out = np.zeros_like(own) + own
    rest = np.flatnonzero(~head)
    if len(rest):
        got_ids, got_rows = partial
        sort = np.argsort(got_ids, kind="stable")
        out[rest] = got_rows[sort[np.searchsorted(got_ids[sort], ids[rest])]] + own[rest]
    return out
