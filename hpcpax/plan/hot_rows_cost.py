"""Hot rows: does a tree pay for a group of rows that ``k`` nodes touch?

Pure arithmetic on the fabric's alpha-beta links (no MPI, not collective).
:mod:`hpcpax.ps.hot_rows` moves a group of ``rows`` rows (``G = rows x
row_bytes`` bytes, one copy) that ``k`` nodes pull and push, store and
forward; this module prices that against today's path, one group alone:

- **pull, today**: the owner's link sends one copy to every member node
  but its own, one after the other: ``c = k - 1`` copies when the owner's
  node is a member (else ``k``), ``c x G / B_inter``.
- **pull, tree**: the owner sends once; ``k <= 3``: a chain starting on the
  owner's node (one intra-node hop, then ``k - 1`` inter-node hops in
  sequence); else a binomial tree starting off it (``1 + ceil(log2 k)``
  inter-node hops on the critical path). Each round after the first is one
  more ``Alltoall`` + ``Alltoallv`` (``2 x latency``), and a classifying
  pull pays one ``Allreduce`` (``2 ceil(log2 ranks) x latency``).
- **push, today**: the owner's link receives ``c`` copies: ``c x G / B``.
- **push, chain**: ``k`` inter-node hops in sequence (member to member,
  the last to the owner), ``k`` more rounds, and an ids-only count exchange
  (8 bytes per row from each member through the owner's link, one round).

With ``HPCPAX_HOT_ROWS_CHUNKS=c > 1`` every group takes a chain and its
rows go in ``c`` chunks one round apart (pipelining): ``k + c - 1`` rounds
of ``G / c`` each way instead of ``k`` (or ``1 + ceil(log2 k)``) of ``G``.

Both are linear in ``G`` (for ``rows >= c``): ``saved(G) = slope x G - fixed``. A group pays
when ``saved > 0``, i.e. its saved owner bytes ``(k - 1) x G`` reach
:func:`min_saved_bytes`; never when ``slope <= 0``. Store and forward costs
a whole ``G / B`` per hop, so with the owner's node a member a tree saves
owner time only from ``k = 7`` nodes (``(k - 1) + (k - 1)`` copies against
``1 + ceil(log2 k) + k`` hops); with a dedicated server node (owner not a
member) from ``k = 4``; pipelined in 4 chunks from ``k = 3``. :func:`decide` turns that into the plan's
per-variable setting: the smallest ``k`` that can pay (``min_nodes``, 0:
off) and the per-``k`` byte thresholds the owners apply to each group.
"""

from __future__ import annotations

import math

from ..options import options

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


def tree_gain(k: int, rows: int, row_bytes: int, fabric, ranks: int,
              owner_in_group: bool = True, chunks: int = 1) -> dict:
    """Seconds one group of hot rows takes today and by trees (pull + push).

    Not collective.

    Args:
        k: member nodes of the group (>= 2).
        rows: rows of the group; row_bytes: bytes of one row.
        fabric: :class:`~hpcpax.comm.fabric.Fabric` or its ``to_dict()``.
        ranks: ranks of the job (prices the agreement ``Allreduce``).
        owner_in_group: whether the owner's node is one of the ``k``.
        chunks: ``HPCPAX_HOT_ROWS_CHUNKS`` (> 1: pipelined chains, ``k +
            chunks - 1`` rounds of ``G / chunks`` each way).

    Returns:
        ``{"today_s", "trees_s", "saved_s", "pull_saved_s", "push_saved_s"}``
        (``saved = today - trees``; negative: trees lose).
    """
    _check(k, rows, row_bytes, ranks)
    (a_in, b_in), (a_out, b_out) = _links(fabric)
    g = float(rows) * row_bytes
    copies = k - 1 if owner_in_group else k
    pull_today = a_out + copies * g * b_out
    push_today = a_out + copies * g * b_out
    agree = 2 * math.ceil(math.log2(ranks)) * a_out
    c = int(chunks)
    if c > 1 or k <= 3:  # a chain (from the owner's node when it is a member), c chunks
        rounds = k + c - 1
        pull_tree = (a_in + g / c * b_in + (k - 2 + c) * g / c * b_out if owner_in_group
                     else rounds * g / c * b_out)
    else:  # a binomial tree from a member off the owner's node
        rounds = 1 + math.ceil(math.log2(k))
        pull_tree = rounds * g * b_out
    pull_tree += a_out + 2 * (rounds - 1) * a_out + agree
    push_tree = ((k + c - 1) * (g / c * b_out + 2 * a_out)  # the chain's rounds
                 + 2 * a_out + k * rows * 8 * b_out)  # the ids-only count exchange
    today, trees = pull_today + push_today, pull_tree + push_tree
    return {"today_s": today, "trees_s": trees, "saved_s": today - trees,
            "pull_saved_s": pull_today - pull_tree, "push_saved_s": push_today - push_tree}


def min_saved_bytes(k: int, row_bytes: int, fabric, ranks: int,
                    owner_in_group: bool = True, chunks: int = 1):
    """Smallest saved owner bytes ``(k - 1) x rows x row_bytes`` at which a tree pays.

    Not collective. Returns an int, or ``None`` when no group of ``k``
    members pays at any size (a tree's hops cost at least the copies it
    saves).
    """
    _check(k, 0, row_bytes, ranks)
    zero = tree_gain(k, 0, row_bytes, fabric, ranks, owner_in_group, chunks)["saved_s"]
    one = tree_gain(k, 1, row_bytes, fabric, ranks, owner_in_group, chunks)["saved_s"]
    slope = one - zero  # seconds saved per row (the model is linear in rows)
    per_row = row_bytes * _links(fabric)[1][1]  # one row over an inter-node link
    if slope <= 1e-9 * per_row:  # zero or negative, up to rounding
        return None
    rows = max(0, math.floor(-zero / slope) + 1)
    return int((k - 1) * rows * row_bytes)


def decide(num_nodes: int, row_bytes: int, fabric, ranks: int, setting="auto",
           chunks: int = 1) -> dict:
    """The plan's hot-rows entry of one ``ps`` variable.

    Not collective.

    Args:
        num_nodes: nodes of the job; row_bytes: bytes of one row.
        fabric: the measured fabric (``Fabric`` or dict), or ``None``.
        ranks: ranks of the job.
        setting: ``"auto"`` (the cost model), ``"off"``, or an int ``m``
            (the fixed rule: ``HPCPAX_HOT_ROWS_MIN_BYTES`` for every group).
        chunks: ``HPCPAX_HOT_ROWS_CHUNKS`` (see :func:`tree_gain`).

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
    if setting != "auto":
        raise ValueError(f"hot_rows must be 'auto', 'off' or an int, not {setting!r}")
    if fabric is None or num_nodes < 2:
        return {"min_nodes": 0, "min_saved_bytes": [],
                "reason": "hot rows off: " + ("one node" if num_nodes < 2 else "no fabric")}
    ranks = max(2, int(ranks))
    table = [None, None] + [min_saved_bytes(k, int(row_bytes), fabric, ranks, chunks=chunks)
                            for k in range(2, int(num_nodes) + 1)]
    paying = [k for k, b in enumerate(table) if b is not None]
    if not paying:
        return {"min_nodes": 0, "min_saved_bytes": [],
                "reason": f"hot rows off: on {num_nodes} nodes a tree's hops "
                          f"({chunks} chunk(s)) cost at least the owner copies it saves"}
    m = paying[0]
    return {"min_nodes": m, "min_saved_bytes": table,
            "reason": f"hot rows: groups of >= {m} nodes saving >= {table[m]} owner bytes"}


def plan_entry(spec, method: str, shape, fabric, setting="auto"):
    """:func:`decide` for one variable of a plan (``None`` unless it is on ``ps``).

    Not collective. ``spec`` a :class:`~hpcpax.plan.cost_model.VarSpec`,
    ``shape`` a :class:`~hpcpax.plan.cost_model.ClusterShape`; ``setting``
    one value (see :func:`decide`) or ``{name: value}`` (others ``"auto"``).
    """
    if method != "ps" or spec.kind != "sparse":
        return None
    if isinstance(setting, dict):
        setting = setting.get(spec.name, "auto")
    ranks = shape.num_nodes * (shape.workers_per_node + shape.servers_per_node)
    return decide(shape.num_nodes, spec.dim * spec.itemsize, fabric, ranks, setting,
                  chunks=max(1, options.hot_rows_chunks))
