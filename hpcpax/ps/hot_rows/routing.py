"""Hot rows travel once: broadcast trees for pulls, reduction chains for pushes.

With node-local aggregation each node asks an owner for a row once, but a
row that ``k`` nodes touch still leaves (pull) or reaches (push) its owner
``k`` times. Here the owner, which receives every node's ids anyway, counts
the *sources* of each row (one per node under local aggregation, one per
worker without it) and groups the rows by their exact set of sources ``S``
(:func:`~hpcpax.ps.hot_rows.groups.classify`). A group whose ``|S|`` reaches the
variable's ``min_nodes`` and whose saved owner bytes, ``(|S| - 1) x rows x
row bytes``, reach the plan's threshold takes a tree; the other rows move
as before.

Tree messages are point-to-point among exactly the members of each tree
(:class:`~hpcpax.ps.hot_rows.trees.TreeTraffic`): nobody else takes part and
nothing waits for a round; a member forwards a piece as soon as it has it.

- **Pull**: one reply exchange (``Alltoall`` of counts, ``Alltoallv``)
  brings each requester its cold rows as today plus, per group it is a
  member of, the tree's *manifest* (members in tree order, pieces).
  The owner sends the group once, to the first member
  (:func:`~hpcpax.ps.hot_rows.groups.tree_order`: a chain starts on the owner's
  node, so the owner's link carries one copy), which forwards it down a
  chain (``|S| <= 3`` or pipelined) or a binomial tree (member ``i`` sends
  to ``i + 1, i + 2, i + 4, ...`` above it). Every member needs every row
  of its group, so no row goes where it is not wanted. Rows are copies:
  results equal today's exactly. Whether any owner chose a tree is agreed
  by an ``Iallreduce`` that overlaps the trees.
- **Push**, when the last pull of one of its variables chose a tree (so a
  pull without shared rows costs a push nothing, and after such a pull only
  one pull in :data:`PROBE_EVERY` looks again): one ids-only exchange to
  the owners and two int64 per id back: cold, or the row's piece, its
  predecessor and its next hop in its group's chain. Cold rows go to the
  owners in one ``Alltoallv`` (counts known on both sides). The chain runs
  through ``S`` in ascending rank: member 0 sends ``0 + g_0``, member ``j``
  adds its own gradient to the partial it received, the last sends the sum
  to the owner. That is the order in which the owner would have summed the
  rows it received from ``S`` (``dedup_sum``: input order, sources by
  rank, one at a time while ``|S| <= SUM_CHUNK``), so the owner's sum is
  **bitwise** today's, in float64 and in float32 alike (the partials are
  kept in the variable's dtype, as the owner's sum is). A chain, not a
  binomial tree, because only the chain keeps the left-to-right order; a
  balanced tree would round differently. (A group of more than
  ``SUM_CHUNK`` = 64 members, which the owner would sum in chunks and a
  tree, gets the chain's sequential sum: equal to rounding, not bitwise.)
- **Pipelining**: a group larger than ``HPCPAX_HOT_ROWS_CHUNK_BYTES``
  (256 KiB) goes in pieces of about that size (at most
  :data:`~hpcpax.ps.hot_rows.groups.MAX_PIECES`), each on its own, down a
  chain: a member forwards one piece while the next arrives. Each row
  keeps its path and order, so results stay bitwise today's.

Bytes: what owners send (pull) or receive (push) is counted in ``pull`` /
``push`` as before; what tree members forward to each other in ``relay``.
Every function is **collective** over ``topology.comm``.
"""

from __future__ import annotations

import numpy as np

from ...backend import to_host
from ...comm.exchange import alltoallv_many, exchange_counts_many
from ...comm.polling import spinning, wait
from ...options import options
from .groups import children_of, chunk_sizes, classify, parent_of, tree_order
from .trees import TreeTraffic

__all__ = ["HotRows", "classify", "pull_reply", "push_chain", "finish_push", "assemble_rows"]

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
        self._routes = {}  # name -> "trees" or "relays" (set by a plan; default trees)
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
        (None: never a tree), "reason": str}``, optionally ``"route"``:
        ``"trees"`` (the default) or ``"relays"`` (see :meth:`route`).
        """
        m = entry["min_nodes"]
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise ValueError(f"min_nodes must be an int >= 0, not {m!r}")
        if not isinstance(self.setting, dict):
            self.setting, self._default = {}, self.setting
        self.setting = {**self.setting, name: int(m)}
        route = entry.get("route", "trees")
        if route not in ("trees", "relays"):
            raise ValueError(f"route must be 'trees' or 'relays', not {route!r}")
        self._thresholds[name] = list(entry.get("min_saved_bytes") or []) or None
        self._routes[name] = route
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

    def route(self, names) -> str:
        """How the shared rows of one operation on ``names`` move: ``"relays"``
        when any of them that has hot rows on was set to relays
        (:mod:`~hpcpax.ps.hot_rows.relays`), else ``"trees"``."""
        relays = any(self.min_nodes(n) and self._routes.get(n) == "relays" for n in names)
        return "relays" if relays else "trees"

    def min_nodes(self, name) -> int:
        """Sources a row needs to be hot for variable ``name`` (0: off)."""
        value = (self.setting.get(name, self._default) if isinstance(self.setting, dict)
                 else self.setting)
        value = options.hot_rows if value is None else value
        return 0 if value < 2 else int(value)


def poll_cap(topology=None) -> float:
    """How a tree member waits, by the one wait policy (:mod:`hpcpax.comm.polling`):
    polling with this cap (``options.poll_seconds``), or 0 inside MPI under
    ``HPCPAX_WAIT=spin`` (a member spinning in MPI takes the core of the member
    it waits for on a shared host: a chain is as slow as its members' turns)."""
    return 0.0 if spinning() else float(options.poll_seconds)


def _owner_pieces(var, ids, counts, policy, first, limit):
    """An owner's chosen groups of one variable, numbered into pieces.

    Returns ``(group, chosen)``: per received id its group index or -1
    (cold), and per group ``(members, unique ids, first piece, chunk
    sizes)``; pieces are numbered from ``first`` up, and groups that would
    pass ``limit`` pieces move as today (tags are finite).
    """
    name = var.spec.name
    group, found = classify(ids, counts, policy.min_nodes(name), policy.thresholds(name),
                            var.spec.row_bytes)
    chosen = []
    for index, (members, unique) in enumerate(found):
        sizes = chunk_sizes(len(unique), var.spec.row_bytes, options.hot_rows_chunk_bytes)
        if first + len(sizes) > limit:
            group[group == index] = -1
            continue
        group[group == index] = len(chosen)
        chosen.append((members, unique, first, sizes))
        first += len(sizes)
    return group, chosen


def pull_reply(topology, variables, hop, wanted, policy, gather) -> tuple:
    """Answer a pull's owner hop with trees for hot rows.

    **Collective** over ``topology.comm``. ``hop`` is the owner hop whose
    :meth:`send` returned ``wanted``; ``gather(var, ids)`` an owner's rows.
    Returns each variable's rows in the requester's input order (as
    ``hop.reply`` would) and whether any owner chose a tree (the same on
    every rank).
    """
    from ...comm.reductions import start_max

    comm, acct, me, size = topology.comm, topology.accounting, topology.rank, topology.size
    names = [v.spec.name for v in variables]
    traffic = TreeTraffic(comm, acct, names, "pull")
    pieces, groups = 0, []
    for k, (var, (ids,)) in enumerate(zip(variables, wanted)):
        group, chosen = _owner_pieces(var, ids, hop.recv_counts[:, k], policy, pieces,
                                      traffic.pieces_per_owner)
        groups.append((group, chosen))
        pieces += sum(len(sizes) for _, _, _, sizes in chosen)
    chose = np.array([pieces > 0], np.int64)
    agreed = np.zeros(1, np.int64)
    agreement = start_max(comm, chose, agreed)  # overlaps the trees
    # the reply: each requester's cold rows, and the manifest of each tree it is in
    counts = np.zeros((size, 2 * len(variables)), np.int64)
    arrays = []
    for k, (var, (ids,)) in enumerate(zip(variables, wanted)):
        group, chosen = groups[k]
        src = np.repeat(np.arange(size, dtype=np.int64), hop.recv_counts[:, k])
        cold = group < 0
        manifests = {}
        for members, unique, first, sizes in chosen:
            chain = len(members) <= 3 or len(sizes) > 1  # pieces need a chain to pipeline
            order = tree_order(members, topology.node_of, me, chain)
            record = [first, len(sizes), int(chain), len(order)]
            record += order.tolist() + list(sizes)
            for member in order.tolist():
                manifests.setdefault(member, []).extend(record)
            rows = gather(var, unique)
            at = np.cumsum([0] + sizes)
            for j in range(len(sizes)):
                part = slice(at[j], at[j + 1])
                traffic.send(order[0], traffic.tag(me, first + j), [unique[part], rows[part]],
                             "pull", k)
        counts[:, 2 * k] = [len(manifests.get(d, ())) for d in range(size)]
        counts[:, 2 * k + 1] = np.bincount(src[cold], minlength=size)
        arrays.append([np.array([x for d in range(size) for x in manifests.get(d, ())],
                                np.int64)])
        arrays.append([gather(var, ids[cold])])
    twice = [n for n in names for _ in (0, 1)]
    received = exchange_counts_many(comm, counts, acct, "pull", twice)
    out = alltoallv_many(comm, counts, received, arrays, acct, "pull", twice)
    hot = [[] for _ in variables]
    if acct is not None:  # the cold rows from their owners (the pieces are counted below)
        acct.record_owner("egress", sum(received[:, 2 * k + 1] * var.spec.row_bytes
                                        for k, var in enumerate(variables)))
    for k, var in enumerate(variables):
        _follow_manifests(traffic, k, var, out[2 * k][0], received[:, 2 * k], me, hot[k])
    cap = poll_cap(topology)
    traffic.run(cap)
    wait([agreement], cap)
    return [assemble_rows(hop, k, hot[k], out[2 * k + 1][0], var)
            for k, var in enumerate(variables)], bool(agreed[0])


def _follow_manifests(traffic, k, var, manifests, per_owner, me, hot):
    """Post a member's receives (and the forwards they trigger) of its trees."""
    owners = np.repeat(np.arange(len(per_owner)), per_owner)
    pos = 0
    while pos < len(manifests):
        owner = int(owners[pos])
        first, n_chunks, chain, k_members = (int(x) for x in manifests[pos:pos + 4])
        order = manifests[pos + 4:pos + 4 + k_members]
        sizes = manifests[pos + 4 + k_members:pos + 4 + k_members + n_chunks].tolist()
        pos += 4 + k_members + n_chunks
        i = int(np.flatnonzero(order == me)[0])
        up = parent_of(i, chain)
        source, phase = (owner, "pull") if up < 0 else (int(order[up]), "relay")
        below = [int(order[c]) for c in children_of(i, k_members, chain)]
        for j, n in enumerate(sizes):
            tag = traffic.tag(owner, first + j)

            def arrived(arrays, tag=tag, below=below):
                hot.append(tuple(arrays))
                for child in below:
                    traffic.send(child, tag, arrays, "relay", k)

            traffic.expect(source, tag, [((n,), np.int64), ((n, var.spec.dim), var.spec.dtype)],
                           phase, k, arrived, owner="egress" if up < 0 else None)


def assemble_rows(hop, k, hot, cold, var):
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
    comm, acct, me, size = topology.comm, topology.accounting, topology.rank, topology.size
    names = [v.spec.name for v in variables]
    traffic = TreeTraffic(comm, acct, names, "push")
    wanted = hop.send()
    codes, cold_masks, finals, pieces = [], [], [[] for _ in variables], 0
    for k, (var, (got,)) in enumerate(zip(variables, wanted)):
        group, chosen = _owner_pieces(var, got, hop.recv_counts[:, k], policy, pieces,
                                      traffic.pieces_per_owner)
        src = np.repeat(np.arange(size, dtype=np.int64), hop.recv_counts[:, k])
        code = np.full((len(got), 2), -1, np.int64)  # [piece * 4 + last * 2 + head, next * size + prev]
        for index, (members, unique, first, sizes) in enumerate(chosen):
            sel = np.flatnonzero(group == index)
            position = np.searchsorted(members, src[sel])
            head, last = position == 0, position == len(members) - 1
            nxt = np.append(members, me)[position + 1]
            prev = np.append(members, members[0])[position - 1]
            chunk = np.searchsorted(np.cumsum(sizes), np.searchsorted(unique, got[sel]),
                                    side="right")
            code[sel, 0] = (first + chunk) * 4 + 2 * last + head
            code[sel, 1] = nxt * size + prev
            at = np.cumsum([0] + sizes)
            for j in range(len(sizes)):
                part = unique[at[j]:at[j + 1]]
                traffic.expect(members[-1], traffic.tag(me, first + j),
                               [((len(part), var.spec.dim), var.spec.dtype)], "push", k,
                               lambda arrays, part=part, k=k: finals[k].append((part, arrays[0])))
            pieces += len(sizes)
        codes.append(code)
        cold_masks.append(group < 0)
    finish_push(topology, traffic, variables, hop, wanted, values, codes, cold_masks, finals,
                lambda k, var, ids, own, code, owner_of: _post_chain(
                    traffic, k, var, ids, own, code, owner_of, size), apply)


def finish_push(topology, traffic, variables, hop, wanted, values, codes, cold_masks, finals,
                post, apply) -> None:
    """The rest of a push whose owners coded their shared rows (chains or relays).

    **Collective** over ``topology.comm``. Sends the owners' ``codes`` back
    (column 0 < 0: a cold row), moves the cold rows to their owners in one
    ``Alltoallv``, has ``post(k, var, ids, rows, code, owner_of)`` post this
    rank's part of the shared rows' traffic, runs it, and applies on each
    owner its cold rows and the sums that arrived in ``finals``.
    """
    comm, acct, size = topology.comm, topology.accounting, topology.size
    names = [v.spec.name for v in variables]
    mine = hop.reply(codes)
    send_cold = np.zeros((size, len(variables)), np.int64)
    recv_cold = np.zeros((size, len(variables)), np.int64)
    arrays = []
    for k, var in enumerate(variables):
        order = hop.orders[k]
        p_ids = hop.arrays[k][0]
        p_values = np.asarray(to_host(values[k]), var.spec.dtype)[order]
        code = mine[k][order]
        owner_of = np.repeat(np.arange(size), hop.send_counts[:, k])
        cold = code[:, 0] < 0
        send_cold[:, k] = np.bincount(owner_of[cold], minlength=size)
        recv_cold[:, k] = np.bincount(
            np.repeat(np.arange(size), hop.recv_counts[:, k])[cold_masks[k]], minlength=size)
        arrays.append([p_values[cold]])
        post(k, var, p_ids[~cold], p_values[~cold], code[~cold], owner_of[~cold])
    cold_rows = alltoallv_many(comm, send_cold, recv_cold, arrays, acct, "push", names)
    if acct is not None:  # every id, and the cold rows (the shared rows' sums come below)
        acct.record_owner("ingress", hop.send_counts @ hop.widths + sum(
            send_cold[:, k] * var.spec.row_bytes for k, var in enumerate(variables)))
    traffic.run(poll_cap(topology))
    for k, var in enumerate(variables):
        all_ids = np.concatenate([wanted[k][0][cold_masks[k]]] + [i for i, _ in finals[k]])
        all_rows = np.concatenate([cold_rows[k][0]] + [x for _, x in finals[k]])
        apply(var, all_ids, all_rows)


def _post_chain(traffic, k, var, ids, own, code, owner_of, size):
    """A member's links of its hot rows' chains: send at a head, else add and pass on."""
    piece, flags = np.divmod(code[:, 0], 4)
    nxt, prev = np.divmod(code[:, 1], size)
    key = owner_of * (piece.max(initial=0) + 1) + piece
    order = np.lexsort((ids, key))  # by (owner, piece), then id: the owner's row order
    bounds = np.flatnonzero(np.diff(key[order])) + 1
    for sel in np.split(order, bounds) if len(order) else []:
        first = sel[0]
        tag = traffic.tag(owner_of[first], piece[first])
        dest = int(nxt[first])
        phase = "push" if flags[first] & 2 else "relay"
        mine = own[sel]
        owner = "ingress" if flags[first] & 2 else None  # the last sends the sum to the owner
        if flags[first] & 1:  # the chain's head: 0 + its own gradient
            traffic.send(dest, tag, [np.zeros_like(mine) + mine], phase, k, owner)
            continue

        def arrived(arrays, mine=mine, dest=dest, tag=tag, phase=phase, owner=owner):
            traffic.send(dest, tag, [arrays[0] + mine], phase, k, owner)

        traffic.expect(int(prev[first]), tag, [(mine.shape, var.spec.dtype)], "relay", k,
                       arrived)
