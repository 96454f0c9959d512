"""Hot rows by relays: an owner sends a shared row once, to one of the nodes that want it.

Trees (:mod:`~hpcpax.ps.hot_rows.routing`) move the rows of one exact set of
sources as one group. With Zipf ids on many nodes most shared rows fall in
groups of a few rows each: too small to pay for a tree, so the owner's link
still carries their copies (at 16 nodes the rows every node touches are 7 %
of the owner's bytes, the rows two or more nodes touch 58 %). Relays take
every row that at least two sources off the owner's node touch, whatever
its set, in one message per pair of ranks:

- **Pull**: the owner picks each such row's *relay* among those sources, in
  turn over the row's sources (:func:`choose_relays`: shared rows spread
  over all the nodes), and sends each relay its rows once, with one mask of
  sources per row. The relay keeps them (it asked for every one) and
  forwards each row to the row's other sources off the owner's node: one
  message per (relay, requester) pair. Sources on the owner's node get
  their rows from the owner directly, as today. Rows are copies: results
  equal today's exactly. The reply exchange (``Alltoall`` of counts,
  ``Alltoallv``) brings each requester its cold rows and a manifest of
  ``(relay, rows)`` pairs.
- **Push**: one ids-only exchange to the owners and ``1 + words`` int64 per
  id back (the row's relay or -1; the relay also gets the row's mask of
  sources). Every source of a relayed row, on the owner's node too, sends
  its gradient row to the relay; the relay adds them to zero in ascending
  source rank, the order in which the owner would have summed them
  (``dedup_sum``), and sends the owner one row: the owner's sum is
  **bitwise** today's, in float64 and float32 (a row of more than
  ``SUM_CHUNK`` = 64 sources, which the owner would sum in chunks, gets the
  sequential sum: equal to rounding). Cold rows go as today.

Relays move as many bytes in all as today (the owner's copies now leave
the relays' links); they pay where the owner's link is the busiest, as with
one partition of a table or a few hot owners, and only add a hop where
every owner is equally loaded. So in each operation every owner tells the
others, in one ``Allgather`` of two int64, the bytes of row copies it
sends off its node and those its relays would save, and every rank takes
the same decision (:func:`owners_that_relay`): the busiest owners relay,
one by one, while each lowers the busiest node link, and only if the
busiest link then carries at least ``HPCPAX_HOT_ROWS_RELAY_SHARE`` (0.2)
less than today (uniform ids share too few rows). An ``Iallreduce`` tells
everyone whether any owner relayed (for
:meth:`~hpcpax.ps.hot_rows.routing.HotRows.pulled`).

Bytes: as for trees (``pull``/``push`` what owners send or receive,
``relay`` what relays and sources send each other; owner bytes counted as
rows from or to their owner). Every operation is **collective** over
``topology.comm``.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ...comm.exchange import alltoallv_many, exchange_counts_many
from ...comm.polling import wait
from ...options import options
from .routing import assemble_rows, finish_push, poll_cap
from .trees import TreeTraffic

__all__ = ["ROUTES", "Choice", "choose_relays", "owners_that_relay", "members_of", "pull_reply",
           "push_relayed"]

#: The routes of a hot-rows entry (``"route"``): exact-set trees, or relays.
ROUTES = ("trees", "relays")


def _words(size) -> int:
    return (int(size) + 62) // 63


class Choice(NamedTuple):
    """One owner's relays for one variable (:func:`choose_relays`)."""

    #: Per received id its row's relay, or -1 (moves as today).
    relay: np.ndarray
    #: The relayed rows (ascending ids) and their relays.
    rows: np.ndarray
    relays: np.ndarray
    #: ``[rows, words]`` int64 masks of each relayed row's sources: bit ``s %
    #: 63`` of word ``s // 63`` for source rank ``s`` (on the owner's node too).
    masks: np.ndarray
    #: Row copies the owner sends off its node today, and those the relays save.
    copies: int
    saved: int


def choose_relays(ids, counts, node_of, owner, min_nodes) -> Choice:
    """Each received id's relay, and each relayed row's sources; not collective.

    Args:
        ids: int64 ids as received, concatenated by source rank.
        counts: ids received from each source rank.
        node_of: node of every rank; owner: the receiving rank.
        min_nodes: sources a row needs (the variable's ``min_nodes``; < 2: off).

    Returns:
        A :class:`Choice`. A row is relayed when at least two sources off
        the owner's node and ``min_nodes`` sources in all touch it; its
        relay is one of the sources off the owner's node, taken in turn
        (the ``i``-th relayed row's ``i mod k``-th of its ``k``, by rank).
    """
    ids, counts, node_of = (np.asarray(ids, np.int64), np.asarray(counts, np.int64),
                            np.asarray(node_of, np.int64))
    size, words = len(counts), _words(len(counts))
    source = np.repeat(np.arange(size, dtype=np.int64), counts)
    copies = int((node_of[source] != node_of[owner]).sum())
    none = Choice(np.full(len(ids), -1, np.int64), np.zeros(0, np.int64),
                  np.zeros(0, np.int64), np.zeros((0, words), np.int64), copies, 0)
    if min_nodes < 2 or len(ids) == 0:
        return none
    unique, inverse = np.unique(ids, return_inverse=True)
    inverse = inverse.reshape(-1)
    off = node_of[source] != node_of[owner]
    sources = np.bincount(inverse, minlength=len(unique))
    off_sources = np.bincount(inverse[off], minlength=len(unique))
    chosen = np.flatnonzero((off_sources >= 2) & (sources >= min_nodes))
    if len(chosen) == 0 or len(np.unique(inverse * size + source)) != len(ids):
        return none  # nothing shared, or a source sent an id twice: leave all as it is
    # the off-node sources of each row, by (row, rank); the row's turn picks one
    pairs = np.flatnonzero(off)
    pairs = pairs[np.lexsort((source[pairs], inverse[pairs]))]
    start = np.concatenate([[0], np.cumsum(off_sources)])[:-1]
    turn = np.arange(len(chosen), dtype=np.int64) % off_sources[chosen]
    relays = source[pairs[start[chosen] + turn]]
    masks = np.zeros((len(unique), words), np.int64)
    bounds = np.concatenate([[0], np.cumsum(counts)]).tolist()
    for s in np.flatnonzero(counts).tolist():  # one fancy update per source (no ufunc.at)
        masks[inverse[bounds[s]:bounds[s + 1]], s // 63] |= np.int64(1) << np.int64(s % 63)
    relay_of_row = np.full(len(unique), -1, np.int64)
    relay_of_row[chosen] = relays
    return Choice(relay_of_row[inverse], unique[chosen], relays, masks[chosen], copies,
                  int((off_sources[chosen] - 1).sum()))


def owners_that_relay(copies, saved, node_of, min_share=None) -> np.ndarray:
    """Which owners relay: those whose relays lower the busiest node link; not collective.

    A node's link carries its owners' off-node copies; an owner that relays
    keeps ``copies - saved`` and its ``saved`` copies leave the other nodes'
    links instead, spread evenly (its relays are taken in turn). The
    busiest owners are taken one by one while each lowers the busiest load;
    if the loads' maximum then falls by less than ``min_share``
    (``HPCPAX_HOT_ROWS_RELAY_SHARE``), nobody relays: relays move as many
    bytes in all as today, so with every owner equally loaded they only add
    a hop. ``min_share`` 0: every owner with shared rows relays, whatever
    the loads.

    Args:
        copies, saved: per rank, the bytes of row copies it sends off its
            node as an owner today, and those its relays would save.
        node_of: node of every rank.

    Returns:
        A boolean per rank.
    """
    share = options.hot_rows_relay_share if min_share is None else float(min_share)
    copies, saved = np.asarray(copies, np.float64), np.asarray(saved, np.float64)
    node_of = np.asarray(node_of, np.int64)
    nodes = int(node_of.max()) + 1 if len(node_of) else 0
    relaying = np.zeros(len(copies), bool)
    if nodes < 2:
        return relaying
    if share <= 0:  # every owner with shared rows, whatever the loads
        return saved > 0
    today = np.bincount(node_of, weights=copies, minlength=nodes)

    def loads(chosen):
        moved = np.bincount(node_of[chosen], weights=saved[chosen], minlength=nodes)
        return today - moved + (moved.sum() - moved) / (nodes - 1)

    busiest = today.max()
    for r in np.argsort(-copies, kind="stable").tolist():
        if saved[r] <= 0:
            break
        relaying[r] = True
        top = loads(relaying).max()
        if top >= busiest:
            relaying[r] = False
            break
        busiest = top
    if not relaying.any() or busiest > (1 - share) * today.max():
        return np.zeros(len(copies), bool)
    return relaying


def _agree(topology, choices, variables) -> list:
    """Every owner's choices kept or dropped by :func:`owners_that_relay`: **collective**
    (one ``Iallgather`` of two int64 per rank, waited for by the wait policy: a
    blocking one spins a core per rank while the slowest owner classifies)."""
    from ...comm.reductions import start_allgather

    comm = topology.comm
    mine = np.array([sum(c.copies * v.spec.row_bytes for c, v in zip(choices, variables)),
                     sum(c.saved * v.spec.row_bytes for c, v in zip(choices, variables))],
                    np.int64)
    everyone = np.zeros((comm.Get_size(), 2), np.int64)
    wait([start_allgather(comm, mine, everyone)], poll_cap(topology))
    node_of = np.asarray(topology.node_of, np.int64)
    if owners_that_relay(everyone[:, 0], everyone[:, 1], node_of)[comm.Get_rank()]:
        return choices
    words = _words(comm.Get_size())
    return [Choice(np.full(len(c.relay), -1, np.int64), np.zeros(0, np.int64),
                   np.zeros(0, np.int64), np.zeros((0, words), np.int64), c.copies, 0)
            for c in choices]


def members_of(masks, size) -> list:
    """Per row of ``masks`` (``[rows, words]``) a boolean column per rank: ``[size, rows]``."""
    ranks = np.arange(size)
    bits = (masks[:, ranks // 63] >> (ranks % 63).astype(np.int64)) & 1
    return bits.T.astype(bool)


def pull_reply(topology, variables, hop, wanted, policy, gather) -> tuple:
    """Answer a pull's owner hop, shared rows through relays.

    **Collective** over ``topology.comm``. As
    :func:`~hpcpax.ps.hot_rows.routing.pull_reply`: ``hop`` is the owner hop
    whose :meth:`send` returned ``wanted``, ``gather(var, ids)`` an owner's
    rows. Returns each variable's rows in the requester's input order and
    whether any owner relayed (the same on every rank).
    """
    from ...comm.reductions import start_max

    comm, acct, me, size = topology.comm, topology.accounting, topology.rank, topology.size
    node_of = np.asarray(topology.node_of, np.int64)
    names = [v.spec.name for v in variables]
    traffic = TreeTraffic(comm, acct, names, "pull")
    usable = traffic.pieces_per_owner >= 2 * len(variables)
    counts = np.zeros((size, 2 * len(variables)), np.int64)
    arrays, chose = [], False
    choices = _agree(topology, [
        choose_relays(ids, hop.recv_counts[:, k], node_of, me,
                      policy.min_nodes(var.spec.name) if usable else 0)
        for k, (var, (ids,)) in enumerate(zip(variables, wanted))], variables)
    for k, (var, (ids,)) in enumerate(zip(variables, wanted)):
        relay, rows, relays, masks = choices[k][:4]
        source = np.repeat(np.arange(size, dtype=np.int64), hop.recv_counts[:, k])
        hot = (relay >= 0) & (node_of[source] != node_of[me])
        chose |= bool(len(rows))
        for r in np.unique(relays).tolist():
            mine = relays == r
            traffic.send(r, traffic.tag(me, 2 * k),
                         [masks[mine], rows[mine], gather(var, rows[mine])], "pull", k)
        # manifest of requester d: (relay, rows) pairs, its own relay rows included
        pairs = np.unique(source[hot] * size + relay[hot], return_counts=True)
        manifest = {}
        for key, n in zip(*(a.tolist() for a in pairs)):
            manifest.setdefault(key // size, []).extend([key % size, n])
        counts[:, 2 * k] = [len(manifest.get(d, ())) for d in range(size)]
        counts[:, 2 * k + 1] = np.bincount(source[~hot], minlength=size)
        arrays.append([np.array([x for d in range(size) for x in manifest.get(d, ())],
                                np.int64)])
        arrays.append([gather(var, ids[~hot])])
    agreed = np.zeros(1, np.int64)
    agreement = start_max(comm, np.array([int(chose)], np.int64), agreed)
    twice = [n for n in names for _ in (0, 1)]
    received = exchange_counts_many(comm, counts, acct, "pull", twice)
    out = alltoallv_many(comm, counts, received, arrays, acct, "pull", twice)
    if acct is not None:  # the cold rows from their owners (the relayed ones are counted below)
        acct.record_owner("egress", sum(received[:, 2 * k + 1] * var.spec.row_bytes
                                        for k, var in enumerate(variables)))
    hot_rows = [[] for _ in variables]
    for k, var in enumerate(variables):
        _follow_manifest(traffic, k, var, out[2 * k][0], received[:, 2 * k], me, node_of,
                         size, hot_rows[k])
    cap = poll_cap(topology)
    traffic.run(cap)
    wait([agreement], cap)
    return [assemble_rows(hop, k, hot_rows[k], out[2 * k + 1][0], var)
            for k, var in enumerate(variables)], bool(agreed[0])


def _follow_manifest(traffic, k, var, manifest, per_owner, me, node_of, size, hot):
    """Post a requester's receives of relayed rows (and, as a relay, its forwards)."""
    owners = np.repeat(np.arange(len(per_owner)), per_owner)
    words, dim, dtype = _words(size), var.spec.dim, var.spec.dtype
    for pos in range(0, len(manifest), 2):
        owner, relay, n = int(owners[pos]), int(manifest[pos]), int(manifest[pos + 1])
        if relay != me:
            traffic.expect(relay, traffic.tag(owner, 2 * k + 1),
                           [((n,), np.int64), ((n, dim), dtype)], "relay", k,
                           lambda arrays: hot.append(tuple(arrays)))
            continue
        state = {}

        def forward(owner=owner, state=state):
            hot.append((state["ids"], state["rows"]))
            members = members_of(state["masks"], size)
            for d in np.flatnonzero(members.any(axis=1)).tolist():
                if d == me or node_of[d] == node_of[owner]:
                    continue  # the relay keeps its rows; the owner's node had them directly
                sel = members[d]
                traffic.send(d, traffic.tag(owner, 2 * k + 1),
                             [state["ids"][sel], state["rows"][sel]], "relay", k)

        def got_masks(arrays, state=state, forward=forward):
            state["masks"] = arrays[0]
            if "rows" in state:
                forward()

        def got_rows(arrays, state=state, forward=forward):
            state["ids"], state["rows"] = arrays
            if "masks" in state:
                forward()

        tag = traffic.tag(owner, 2 * k)
        traffic.expect(owner, tag, [((n, words), np.int64)], "pull", k, got_masks)
        traffic.expect(owner, tag, [((n,), np.int64), ((n, dim), dtype)], "pull", k, got_rows,
                       owner="egress")


def push_relayed(topology, variables, hop, ids, values, policy, apply) -> None:
    """A push whose shared rows are summed on their relays.

    **Collective** over ``topology.comm``. As
    :func:`~hpcpax.ps.hot_rows.routing.push_chain`: ``hop`` an ids-only
    owner hop of ``ids`` (not yet sent), ``values`` the gradient rows of
    ``ids``, ``apply(var, ids, rows)`` the owner's sum-and-update.
    """
    comm, acct, me, size = topology.comm, topology.accounting, topology.rank, topology.size
    node_of = np.asarray(topology.node_of, np.int64)
    names = [v.spec.name for v in variables]
    words = _words(size)
    traffic = TreeTraffic(comm, acct, names, "push")
    usable = traffic.pieces_per_owner >= 2 * len(variables)
    wanted = hop.send()
    codes, cold_masks, finals = [], [], [[] for _ in variables]
    choices = _agree(topology, [
        choose_relays(got, hop.recv_counts[:, k], node_of, me,
                      policy.min_nodes(var.spec.name) if usable else 0)
        for k, (var, (got,)) in enumerate(zip(variables, wanted))], variables)
    for k, (var, (got,)) in enumerate(zip(variables, wanted)):
        relay, rows, relays, masks = choices[k][:4]
        source = np.repeat(np.arange(size, dtype=np.int64), hop.recv_counts[:, k])
        code = np.zeros((len(got), 1 + words), np.int64)  # [relay or -1, the relay's mask]
        code[:, 0] = relay
        if len(rows):
            row_of = np.searchsorted(rows, got)
            at_relay = np.flatnonzero((relay >= 0) & (source == relay))
            code[at_relay, 1:] = masks[row_of[at_relay]]
        for r in np.unique(relays).tolist():
            part = rows[relays == r]
            traffic.expect(r, traffic.tag(me, 2 * k + 1),
                           [((len(part), var.spec.dim), var.spec.dtype)], "push", k,
                           lambda arrays, part=part, k=k: finals[k].append((part, arrays[0])))
        codes.append(code)
        cold_masks.append(relay < 0)
    finish_push(topology, traffic, variables, hop, wanted, values, codes, cold_masks, finals,
                lambda k, var, ids, own, code, owner_of: _post_relayed(
                    traffic, k, var, ids, own, code, owner_of, me, size), apply)


def _post_relayed(traffic, k, var, ids, own, code, owner_of, me, size):
    """A source's relayed rows: send them to their relays; as a relay, sum and pass on."""
    relay = code[:, 0]
    for owner in np.unique(owner_of).tolist():
        of_owner = owner_of == owner
        for r in np.unique(relay[of_owner]).tolist():
            sel = np.flatnonzero(of_owner & (relay == r))
            sel = sel[np.argsort(ids[sel], kind="stable")]  # ascending ids: the relay's order
            if r != me:
                traffic.send(r, traffic.tag(owner, 2 * k), [own[sel]], "relay", k)
                continue
            _sum_on_relay(traffic, k, var, own[sel], code[sel, 1:], owner, me, size)


def _sum_on_relay(traffic, k, var, own, masks, owner, me, size):
    """Receive a relay's rows from their other sources, add them in rank order, send the sum."""
    members = members_of(masks, size)
    senders = [s for s in np.flatnonzero(members.any(axis=1)).tolist() if s != me]
    parts = {me: own}

    def add_and_send():
        total = np.zeros_like(own)
        for s in sorted(parts):  # ascending source rank, from zero: the owner's order
            total[members[s]] += parts[s]
        traffic.send(owner, traffic.tag(owner, 2 * k + 1), [total], "push", k, "ingress")

    for s in senders:
        def arrived(arrays, s=s):
            parts[s] = arrays[0]
            if len(parts) == len(senders) + 1:
                add_and_send()

        traffic.expect(s, traffic.tag(owner, 2 * k), [((int(members[s].sum()), var.spec.dim),
                                                      var.spec.dtype)], "relay", k, arrived)
