"""Hot rows: does a tree pay for a group of rows that ``k`` nodes touch?

Pure arithmetic on the fabric's alpha-beta links (no MPI, not collective).
:mod:`hpcpax.ps.hot_rows` moves a group of ``rows`` rows (``G = rows x
row_bytes`` bytes, one copy) that ``k`` nodes pull and push by
point-to-point messages among the group's members, in ``c`` pieces of about
``HPCPAX_HOT_ROWS_CHUNK_BYTES`` (:func:`~hpcpax.ps.hot_rows.groups.pieces_of`);
this module prices that against today's path, one group alone. ``a`` is a
link's latency, ``b`` its seconds per byte; ``piece = a_inter + G / c x
b_inter``.

- **pull, today**: the owner's link sends one copy to every member node
  but its own, one after the other: ``c_o = k - 1`` copies when the owner's
  node is a member (else ``k``): ``a + c_o x G x b_inter``.
- **pull, tree**: a chain (``k <= 3`` or ``c > 1``) starting on the owner's
  node when it is a member (one intra-node piece, then ``k - 1`` inter-node
  hops; else ``k``), pipelined: ``(hops + c - 1) x piece``; or, one piece
  and ``k > 3``, a binomial tree starting off it, ``1 + ceil(log2 k)``
  inter-node hops of ``a + G b``. The reply's count exchange (an
  ``Alltoall``) adds ``ceil(log2 ranks) x a``.
- **push, today**: the owner's link receives ``c_o`` copies.
- **push, chain**: ``k`` inter-node hops (member to member, the last to the
  owner), pipelined: ``(k + c - 1) x piece``; the codes' reply and the cold
  rows' own exchange add ``2 a``, and the codes (16 bytes per row and member)
  leave through the owner's link.

For a given ``c`` both are linear in ``G``: a group pays when its saved owner
bytes ``(k - 1) x G`` reach :func:`min_saved_bytes`, found over ``c = 1, 2,
...`` in turn (more pieces pipeline better, so bigger groups pay more). One
piece is store and forward: with the owner's node a member a tree then pays
only from ``k = 7`` nodes; pipelined, from ``k = 3``. :func:`decide` turns that
into the plan's per-variable setting: the smallest ``k`` that can pay
(``min_nodes``, 0: off) and the per-``k`` byte thresholds the owners apply to
each group.

Not priced: what a tree costs the hosts (the members' bookkeeping, a relay's
turn on a busy core). Measured on an emulated 4-node cluster with 2 cores for
8 ranks, the same decision paid at 0.1 Gbit/s and lost at 20 Gbit/s (docs/measurements.md,
"Hot rows, latest run"), so the trainer checks it on live steps
(:mod:`hpcpax.tune.hot_rows_trial`).
"""

from __future__ import annotations

import math

from ..options import options
from ..ps.hot_rows.groups import MAX_PIECES, pieces_of
from ..sync.methods import method_of

__all__ = ["tree_gain", "min_saved_bytes", "decide", "plan_entry"]


def _links(fabric):
    """``(latency_s, seconds per byte)`` of the intra- and inter-node links."""
    if isinstance(fabric, dict):
        intra, inter = fabric["intra"], fabric["inter"]
        return ((float(intra["latency_s"]), 1.0 / float(intra["bandwidth_Bps"])),
                (float(inter["latency_s"]), 1.0 / float(inter["bandwidth_Bps"])))
    return ((fabric.intra.latency_s, 1.0 / fabric.intra.bandwidth_Bps),
            (fabric.inter.latency_s, 1.0 / fabric.inter.bandwidth_Bps))


def _check(k, rows, row_bytes, ranks):
    for label, value, low in (("k", k, 2), ("rows", rows, 0), ("row_bytes", row_bytes, 1),
                              ("ranks", ranks, 2)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label} must be int, not {type(value).__name__}")
        if value < low:
            raise ValueError(f"{label} must be >= {low}, not {value}")


def _chunk_bytes(chunk_bytes):
    return options.hot_rows_chunk_bytes if chunk_bytes is None else int(chunk_bytes)


def _gain(k, rows, row_bytes, links, ranks, owner_in_group, pieces):
    """:func:`tree_gain` with the number of pieces given."""
    (a_in, b_in), (a_out, b_out) = links
    g, c = float(rows) * row_bytes, pieces
    copies = k - 1 if owner_in_group else k
    pull_today = push_today = a_out + copies * g * b_out
    piece = a_out + g / c * b_out
    if k <= 3 or c > 1:  # a chain, from the owner's node when it is a member
        pull_tree = ((k - 1 + c - 1) * piece + a_in + g / c * b_in if owner_in_group
                     else (k + c - 1) * piece)
    else:  # a binomial tree from a member off the owner's node
        pull_tree = (1 + math.ceil(math.log2(k))) * (a_out + g * b_out)
    pull_tree += math.ceil(math.log2(ranks)) * a_out  # the reply's count exchange
    push_tree = (k + c - 1) * piece + 2 * a_out + 16 * k * rows * b_out
    today, trees = pull_today + push_today, pull_tree + push_tree
    return {"today_s": today, "trees_s": trees, "saved_s": today - trees,
            "pull_saved_s": pull_today - pull_tree, "push_saved_s": push_today - push_tree,
            "pieces": c}


def tree_gain(k: int, rows: int, row_bytes: int, fabric, ranks: int,
              owner_in_group: bool = True, chunk_bytes: int | None = None) -> dict:
    """Seconds one group of hot rows takes today and by trees (pull + push).

    Not collective.

    Args:
        k: member nodes of the group (>= 2).
        rows: rows of the group; row_bytes: bytes of one row.
        fabric: :class:`~hpcpax.comm.fabric.Fabric` or its ``to_dict()``.
        ranks: ranks of the job (prices the reply's count exchange).
        owner_in_group: whether the owner's node is one of the ``k``.
        chunk_bytes: ``HPCPAX_HOT_ROWS_CHUNK_BYTES`` (None: the option).

    Returns:
        ``{"today_s", "trees_s", "saved_s", "pull_saved_s", "push_saved_s",
        "pieces"}`` (``saved = today - trees``; negative: trees lose).
    """
    _check(k, rows, row_bytes, ranks)
    pieces = pieces_of(rows * row_bytes, _chunk_bytes(chunk_bytes))
    return _gain(k, rows, row_bytes, _links(fabric), ranks, owner_in_group, pieces)


def min_saved_bytes(k: int, row_bytes: int, fabric, ranks: int,
                    owner_in_group: bool = True, chunk_bytes: int | None = None):
    """Smallest saved owner bytes ``(k - 1) x rows x row_bytes`` at which a tree pays.

    Not collective. Returns an int, or ``None`` when no group of ``k``
    members pays at any size (a tree's hops cost at least the copies it
    saves).
    """
    _check(k, 0, row_bytes, ranks)
    links, chunk = _links(fabric), _chunk_bytes(chunk_bytes)
    per_row = row_bytes * links[1][1]  # one row over an inter-node link
    top = 1 if chunk <= 0 else MAX_PIECES
    for c in range(1, top + 1):  # rows in (low, high] go in c pieces
        low = 0 if c == 1 else (c - 1) * chunk // row_bytes
        high = None if c == top else c * chunk // row_bytes
        if high is not None and high <= low:
            continue
        zero = _gain(k, 0, row_bytes, links, ranks, owner_in_group, c)["saved_s"]
        slope = _gain(k, 1, row_bytes, links, ranks, owner_in_group, c)["saved_s"] - zero
        if slope <= 1e-9 * per_row:  # zero or negative, up to rounding
            continue
        rows = max(low + (c > 1), math.floor(-zero / slope) + 1)
        if high is None or rows <= high:
            return int((k - 1) * rows * row_bytes)
    return None


def decide(num_nodes: int, row_bytes: int, fabric, ranks: int, setting="auto",
           chunk_bytes: int | None = None) -> dict:
    """The plan's hot-rows entry of one ``ps`` variable.

    Not collective.

    Args:
        num_nodes: nodes of the job; row_bytes: bytes of one row.
        fabric: the measured fabric (``Fabric`` or dict), or ``None``.
        ranks: ranks of the job.
        setting: ``"auto"`` (the cost model), ``"off"``, ``"relays"``
            (:mod:`hpcpax.ps.hot_rows.relays`: every row two or more nodes off
            its owner's touch, from 3 nodes; ``"route": "relays"``), or an
            int ``m`` (the fixed rule: ``HPCPAX_HOT_ROWS_MIN_BYTES`` for
            every group).
        chunk_bytes: ``HPCPAX_HOT_ROWS_CHUNK_BYTES`` (None: the option).

    Returns:
        ``{"min_nodes": m, "min_saved_bytes": [...], "reason": str}``:
        ``m`` 0 means off; ``min_saved_bytes[k]`` is the threshold of a
        group of ``k`` members (``None``: never), for ``k`` in
        ``0..num_nodes``; empty for the fixed rule.
    """
    if setting == "off" or (isinstance(setting, int) and not isinstance(setting, bool)
                            and setting < 2):
        return {"min_nodes": 0, "min_saved_bytes": [], "reason": "hot rows: off"}
    if isinstance(setting, int) and not isinstance(setting, bool):
        return {"min_nodes": int(setting), "min_saved_bytes": [],
                "reason": f"hot rows: fixed rule, groups of >= {setting} nodes"}
    if setting == "relays":
        if num_nodes < 3:
            return {"min_nodes": 0, "min_saved_bytes": [],
                    "reason": f"hot rows off: relays need >= 3 nodes, not {num_nodes}"}
        return {"min_nodes": 2, "min_saved_bytes": [], "route": "relays",
                "reason": "hot rows: relays (rows >= 2 nodes off the owner's share, when "
                          "that takes >= HPCPAX_HOT_ROWS_RELAY_SHARE off its link)"}
    if setting != "auto":
        raise ValueError(f"hot_rows must be 'auto', 'off', 'relays' or an int, "
                         f"not {setting!r}")
    if fabric is None or num_nodes < 2:
        return {"min_nodes": 0, "min_saved_bytes": [],
                "reason": "hot rows off: " + ("one node" if num_nodes < 2 else "no fabric")}
    ranks = max(2, int(ranks))
    table = [None, None] + [min_saved_bytes(k, int(row_bytes), fabric, ranks,
                                            chunk_bytes=chunk_bytes)
                            for k in range(2, int(num_nodes) + 1)]
    paying = [k for k, b in enumerate(table) if b is not None]
    if not paying:
        return {"min_nodes": 0, "min_saved_bytes": [],
                "reason": f"hot rows off: on {num_nodes} nodes a tree's hops cost at least "
                          "the owner copies it saves"}
    m = paying[0]
    return {"min_nodes": m, "min_saved_bytes": table,
            "reason": f"hot rows: groups of >= {m} nodes saving >= {table[m]} owner bytes"}


def plan_entry(spec, method: str, shape, fabric, setting="auto"):
    """:func:`decide` for one variable of a plan (``None`` unless it is on ``ps``).

    Not collective. ``spec`` a :class:`~hpcpax.plan.cost_model.VarSpec`,
    ``shape`` a :class:`~hpcpax.plan.cost_model.ClusterShape`; ``setting``
    one value (see :func:`decide`) or ``{name: value}`` (others ``"auto"``).
    """
    if not method_of(method).on_servers or spec.kind != "sparse":
        return None
    if isinstance(setting, dict):
        setting = setting.get(spec.name, "auto")
    ranks = shape.num_nodes * (shape.workers_per_node + shape.servers_per_node)
    return decide(shape.num_nodes, spec.dim * spec.itemsize, fabric, ranks, setting)
