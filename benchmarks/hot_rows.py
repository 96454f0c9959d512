"""Hot rows travel once: owner bytes and step time with and without trees.

Zipf(1.1) ids put the same head rows on every node at every step; with
hot rows on, an owner sends such a row once down a broadcast tree (pull)
and receives it once at the end of a reduction chain (push), by
point-to-point messages among the tree's members, in pieces of
``--chunk-bytes`` (:mod:`hpcpax.ps.hot_rows`). Which groups take a tree is
the plan's decision (``--rule model``, the default): the cost model
(:func:`hpcpax.plan.hot_rows_cost.decide`) on the fabric measured at the
start, as ``--plan auto``/``hybrid`` do; ``--rule M`` is the fixed rule
(groups of >= M nodes, ``HPCPAX_HOT_ROWS_MIN_BYTES``). Uniform ids share
few rows: no tree should be chosen.

Bytes are measured on the owners (the server ranks: ``pull`` bytes they
send, ``push`` bytes they receive) and on every rank (``relay``), in one
pass per configuration (``--steps`` steps each; the counters are exact, so
one pass suffices). Step time (pull + push of one table) is timed
interleaved (today, trees, today, trees, ... for both id distributions),
``--repeats`` times each, the slowest worker per step; median and spread.

    HPCPAX_RANKS_PER_NODE=2 mpirun -n 6 python benchmarks/hot_rows.py
    python benchmarks/hot_rows.py --quick      # smoke, any rank count

Virtual nodes share one host: the bytes are the real figures of the
exchange, the times are not those of a network (no shaped links here).
Keys: ``ratio_owner_egress_before_vs_after`` (pull, Zipf),
``ratio_owner_ingress_before_vs_after`` (push, Zipf), the same on the hot
set alone (``*_hot_set``: each worker's Zipf ids that every node draws
in that step, or at least ``--hot-set-nodes``, a third pair of byte
passes),
``ratio_step_time_before_vs_after`` (Zipf) and ``ratio_uniform`` (uniform
ids, today / trees on), ``uniform_trees_chosen`` (any relay byte).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.comm.fabric import measure_fabric
from hpcpax.plan.hot_rows_cost import decide
from hpcpax.ps.sparse_grad import SparseGrad

def step_ids(kind, worker, step, args, cdf, topo=None):
    """A worker's ids of one step: Zipf, uniform, or its Zipf ids that other nodes share."""
    rng = np.random.default_rng([worker, step, 0 if kind.startswith("zipf") else 1])
    if kind == "uniform":
        return rng.integers(0, args.rows, args.ids, dtype=np.int64)
    ids = _common.zipf_ids(rng, args.ids, cdf)
    if kind == "zipf_hot":  # the hot set: rows that at least args.hot_set_nodes nodes draw
        nodes = {}
        for w, rank in enumerate(topo.worker_ranks):
            nodes.setdefault(int(topo.node_of[rank]), []).append(
                step_ids("zipf", w, step, args, cdf))
        drawn = np.concatenate([np.unique(np.concatenate(v)) for v in nodes.values()])
        rows, count = np.unique(drawn, return_counts=True)
        ids = ids[np.isin(ids, rows[count >= args.hot_set_nodes])]
    return ids


def one_step(ps, name, kind, worker, step, args, cdf, topo=None, ids=None):
    ids = step_ids(kind, worker, step, args, cdf, topo) if ids is None else ids
    rng = np.random.default_rng([worker, step, 2])
    ps.pull_unique(name, ids)
    ps.push(name, SparseGrad(ids, rng.standard_normal((len(ids), args.dim), dtype=np.float32),
                             args.rows))


def hot_rows_server(topo, names, entry):
    """A parameter server whose tables ``names`` take the hot-rows ``entry``."""
    ps = ParameterServer(topo, seed=1, hot_rows=0)
    ps.set_hot_rows({name: entry for name in names})
    return ps


def byte_pass(topo, args, cdf, kind, entry):
    """Owner egress/ingress and relay bytes of ``args.steps`` steps, summed over ranks."""
    spec = SparseVariableSpec("emb", args.rows, args.dim, partitioning=args.partitioning,
                              num_partitions=args.partitions)
    ps = hot_rows_server(topo, ["emb"], entry)
    topo.accounting.reset()
    if topo.is_server:
        ps.serve()
    else:
        ps.register([spec])
        for step in range(args.steps):
            one_step(ps, "emb", kind, topo.worker_index, step, args, cdf, topo)
        ps.shutdown()
    acct = topo.accounting
    owner = topo.is_server if topo.server_ranks else ps.variables["emb"].layout.is_owner
    pull, push, relay = acct.phase("pull"), acct.phase("push"), acct.phase("relay")
    mine = np.array([pull["sent_bytes"] * owner, pull["sent_inter_bytes"] * owner,
                     push["recv_bytes"] * owner, push["recv_inter_bytes"] * owner,
                     relay["sent_bytes"], relay["sent_inter_bytes"]], np.int64)
    total = topo.comm.allreduce(mine, op=MPI.SUM)
    topo.accounting.reset()
    keys = ("owner_egress", "owner_egress_inter", "owner_ingress", "owner_ingress_inter",
            "relay", "relay_inter")
    return {k: int(v) for k, v in zip(keys, total)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=4096, help="ids per worker per step")
    parser.add_argument("--steps", type=int, default=5, help="steps of each byte pass")
    parser.add_argument("--repeats", type=int, default=7, help="timed steps of each mode")
    parser.add_argument("--rule", default="model",
                        help="which groups take a tree in the trees runs: model (the plan's "
                             "cost model on the measured fabric) or M (groups of >= M nodes)")
    parser.add_argument("--hot-set-nodes", type=int, default=0,
                        help="the hot set: ids at least this many nodes draw in a step "
                             "(default 0: every node)")
    parser.add_argument("--partitioning", default="mod", choices=("mod", "range"),
                        help="range puts the Zipf head on one owner (a hot partition)")
    parser.add_argument("--partitions", type=int, default=None,
                        help="partitions of the table (default: one per server); 1 puts every "
                             "row on one owner, whose link is then the bottleneck")
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="HPCPAX_HOT_ROWS_CHUNK_BYTES (pieces of a pipelined chain; default "
                             "the option's)")
    parser.add_argument("--links", default="virtual nodes on one shared host (no shaped links)",
                        help="what the nodes and links are, for the report")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.dim, args.ids, args.steps, args.repeats = 5000, 16, 512, 2, 3
        args.rule, args.hot_set_nodes = "2", 2
        hpcpax.options.hot_rows_min_bytes = 0
    if args.chunk_bytes is not None:  # only the trees runs have hot rows on
        hpcpax.options.hot_rows_chunk_bytes = args.chunk_bytes
    topo = hpcpax.init()
    args.hot_set_nodes = args.hot_set_nodes or topo.num_nodes
    cdf = _common.zipf_cdf(args.rows, 1.1)
    fabric = measure_fabric(topo, budget_s=2.0)
    row_bytes = args.dim * 4
    entry = (decide(topo.num_nodes, row_bytes, fabric, topo.size) if args.rule == "model"
             else decide(topo.num_nodes, row_bytes, fabric, topo.size, setting=int(args.rule)))
    off = {"min_nodes": 0, "min_saved_bytes": [], "reason": "hot rows: off"}
    chunk = hpcpax.options.hot_rows_chunk_bytes
    result = {"benchmark": "hot_rows", "ranks": topo.size, "servers": len(topo.server_ranks),
              "nodes": topo.num_nodes, "rows": args.rows, "dim": args.dim,
              "partitioning": args.partitioning, "partitions": args.partitions,
              "ids_per_worker": args.ids, "zipf_s": 1.1, "hot_set_nodes": args.hot_set_nodes,
              "rule": args.rule, "decision": entry, "fabric": fabric.to_dict(), "plan": "ps",
              "methods": {"today": "ps, local aggregation, hot rows off",
                          "trees": f"ps, local aggregation, hot rows: {entry['reason']}, "
                                   f"pieces of {chunk} B (point-to-point)"},
              "chunk_bytes": chunk, "links": args.links}
    bytes_ = {f"{kind}_{mode}": byte_pass(topo, args, cdf, kind,
                                          entry if mode == "trees" else off)
              for kind in ("zipf", "zipf_hot", "uniform") for mode in ("today", "trees")}
    result["bytes"] = bytes_
    result["ratio_owner_egress_before_vs_after"] = _common.ratio(
        bytes_["zipf_today"]["owner_egress"], bytes_["zipf_trees"]["owner_egress"])
    result["ratio_owner_ingress_before_vs_after"] = _common.ratio(
        bytes_["zipf_today"]["owner_ingress"], bytes_["zipf_trees"]["owner_ingress"])
    result["ratio_owner_egress_hot_set"] = _common.ratio(
        bytes_["zipf_hot_today"]["owner_egress"], bytes_["zipf_hot_trees"]["owner_egress"])
    result["ratio_owner_ingress_hot_set"] = _common.ratio(
        bytes_["zipf_hot_today"]["owner_ingress"], bytes_["zipf_hot_trees"]["owner_ingress"])
    result["uniform_trees_chosen"] = bytes_["uniform_trees"]["relay"] > 0
    result["seconds"] = timing(topo, args, cdf, entry, off)
    s = result["seconds"]
    result["ratio_step_time_before_vs_after"] = _common.ratio(s["zipf_today"]["median"],
                                                              s["zipf_trees"]["median"])
    result["ratio_step_time_hot_set"] = _common.ratio(s["zipf_hot_today"]["median"],
                                                      s["zipf_hot_trees"]["median"])
    result["ratio_uniform"] = _common.ratio(s["uniform_today"]["median"],
                                            s["uniform_trees"]["median"])
    _common.emit(result, topo.rank)
    topo.free()


def timing(topo, args, cdf, entry, off):
    """Median and spread of step seconds, modes interleaved; on every rank.

    Each timed step (a pull and a push of one mode's table) follows an
    untimed step of the same mode: an owner applies a push after the workers
    have sent it, so the apply ends inside the next step's pull, as in
    training. Without the step before, each mode was charged the previous
    mode's apply (today after uniform, trees after today): a bias of up to
    20 % between two identical modes.
    """
    kinds = ("zipf", "zipf_hot", "uniform")
    names = [f"{kind}_{mode}" for kind in kinds for mode in ("today", "trees")]
    specs = [SparseVariableSpec(name, args.rows, args.dim, partitioning=args.partitioning,
                                num_partitions=args.partitions)
             for name in names]  # one table per mode: a pull without trees pauses its table's
    ps = ParameterServer(topo, seed=1, hot_rows=0)  # classification
    ps.set_hot_rows({name: entry if name.endswith("trees") else off for name in names})
    times = None
    if topo.is_server:
        ps.serve()
    else:
        ps.register(specs)
        step = {}
        ids = {(kind, n): step_ids(kind, topo.worker_index, n, args, cdf, topo)
               for kind in kinds for n in range(2 * (1 + args.repeats))}  # drawn before timing

        def mode(kind, name):
            def call():
                n = step.setdefault((kind, name), 0)
                one_step(ps, f"{kind}_{name}", kind, topo.worker_index, n, args, cdf,
                         ids=ids[kind, n])
                step[(kind, name)] = n + 1
            return call

        methods = {f"{kind}_{name}": mode(kind, name)
                   for kind in kinds for name in ("today", "trees")}
        times = _common.interleaved(topo.workers, methods, args.repeats, warmup=1,
                                    before=lambda name: methods[name]())
        ps.shutdown()
    times = topo.comm.bcast(times, root=topo.worker_ranks[0])
    return {k: {"median": _common.median(v), "min": float(min(v)), "max": float(max(v))}
            for k, v in times.items()}


if __name__ == "__main__":
    main()
