"""Hot rows travel once: owner bytes and step time with and without trees.

Zipf(1.1) ids put the same head rows on every node at every step; with
hot rows on, an owner sends such a row once down a broadcast tree (pull)
and receives it once at the end of a reduction chain (push), by
point-to-point messages among the tree's members, in pieces of
``--chunk-bytes`` (:mod:`hpcpax.ps.hot_rows`). Which groups take a tree is
the plan's decision (``--rule model``, the default): the cost model
(:func:`hpcpax.plan.hot_rows_cost.decide`) on the fabric measured at the
start, as ``--plan auto``/``hybrid`` do; ``--rule M`` is the fixed rule
(groups of >= M nodes, ``HPCPAX_HOT_ROWS_MIN_BYTES``); ``--rule relays``
takes the other route (:mod:`hpcpax.ps.hot_rows.relays`: every row two or
more nodes off its owner touch, once to one of them, which forwards it; the
"trees" mode of the keys then means relays). Uniform ids share few rows: no
tree should be chosen.

Bytes are measured on the owners (the server ranks: ``pull`` bytes they
send, ``push`` bytes they receive) and on every rank (``relay``), in one
pass per configuration (``--steps`` steps each; the counters are exact, so
one pass suffices). Step time (pull + push of one table) is timed
interleaved (today, trees, today, trees, ... for both id distributions),
``--repeats`` times each, the slowest worker per step; median and spread.

    HPCPAX_RANKS_PER_NODE=2 mpirun -n 6 python benchmarks/hot_rows.py
    python benchmarks/hot_rows.py --quick      # smoke, any rank count
    python benchmarks/hot_rows_scaling.py      # 4-16 emulated nodes, dilated links

Virtual nodes share one host: the bytes are the real figures of the
exchange, the times are not those of a network (no shaped links here). On
an emulated cluster whose links were slowed ``--dilation`` times (``python
-m hpcpax.cluster up --dilation D``) the step times are reported divided by
it (undilated).

The timed steps' barriers and maxima wait by the one wait policy
(:func:`hpcpax.comm.polling.wait`), so a worker done first does not spin on
a core another is still working on. ``cpu_busy_max``: the machine's CPU
busy fraction in the busiest timed pass (a mode's ``--repeats`` timed
steps: every rank's ``time.process_time()`` in them over cores x their wall
seconds; a server samples its clock every 10 ms, a worker at its step's
start and end); above about 0.6 the step times measure a queue for the
cores, not the links. ``cpu_busy`` per pass, ``cpu_busy_step_max`` the
busiest single step. On a host with more ranks than cores, scale the wait
policy's longest sleep with the dilation (``HPCPAX_POLL_SECONDS``, 1 ms x
D): a rank's idle polls then cost what they would on undilated links.

Keys: ``ratio_owner_egress_before_vs_after`` (pull, Zipf),
``ratio_owner_ingress_before_vs_after`` (push, Zipf), the same on the hot
set alone (``*_hot_set``: each worker's Zipf ids that every node draws
in that step, or at least ``--hot-set-nodes``, a third pair of byte
passes),
``hot_share_owner_bytes`` (the hot set's owner egress + ingress over the
full Zipf pass's, today),
``ratio_step_time_before_vs_after`` (Zipf) and ``ratio_uniform`` (uniform
ids, today / trees on), ``uniform_trees_chosen`` (any relay byte),
``dilation``, ``cpu_busy_max``, ``cpu_busy``, ``cpu_busy_step_max``.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.comm import polling
from hpcpax.comm.fabric import measure_fabric
from hpcpax.comm.topology import affinity, kernel_id
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
                        help="which rows travel once in the trees runs: model (the plan's "
                             "cost model on the measured fabric), M (groups of >= M nodes) or "
                             "relays (hpcpax.ps.hot_rows.relays: every row >= 2 nodes off its "
                             "owner share, through one of them)")
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
    parser.add_argument("--dilation", type=float, default=1.0,
                        help="the links were slowed this many times (python -m hpcpax.cluster "
                             "up --dilation D): step times are reported divided by it")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if not args.dilation >= 1:
        parser.error(f"--dilation must be a number >= 1, not {args.dilation}")
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
    setting = {"model": "auto", "relays": "relays"}.get(args.rule) or int(args.rule)
    entry = decide(topo.num_nodes, row_bytes, fabric, topo.size, setting=setting)
    off = {"min_nodes": 0, "min_saved_bytes": [], "reason": "hot rows: off"}
    chunk = hpcpax.options.hot_rows_chunk_bytes
    result = {"benchmark": "hot_rows", "ranks": topo.size, "servers": len(topo.server_ranks),
              "nodes": topo.num_nodes, "rows": args.rows, "dim": args.dim,
              "partitioning": args.partitioning, "partitions": args.partitions,
              "ids_per_worker": args.ids, "zipf_s": 1.1, "hot_set_nodes": args.hot_set_nodes,
              "rule": args.rule, "decision": entry, "fabric": fabric.to_dict(), "plan": "ps",
              "methods": {"today": "ps, local aggregation, hot rows off",
                          "trees": f"ps, local aggregation, {entry['reason']}"
                                   + ("" if entry.get("route") == "relays" else
                                      f", pieces of {chunk} B (point-to-point)")},
              "chunk_bytes": chunk, "links": args.links, "dilation": args.dilation,
              "wait": hpcpax.options.wait, "poll_seconds": hpcpax.options.poll_seconds}
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
    result["hot_share_owner_bytes"] = _common.ratio(
        bytes_["zipf_hot_today"]["owner_egress"] + bytes_["zipf_hot_today"]["owner_ingress"],
        bytes_["zipf_today"]["owner_egress"] + bytes_["zipf_today"]["owner_ingress"])
    result["uniform_trees_chosen"] = bytes_["uniform_trees"]["relay"] > 0
    result["seconds"], busy, cores = timing(topo, args, cdf, entry, off)
    result["cores"] = cores
    result["cpu_busy"] = {k: v["pass"] for k, v in busy.items()}
    result["cpu_busy_max"] = max(result["cpu_busy"].values())
    result["cpu_busy_step_max"] = max(v["step_max"] for v in busy.values())
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
    """Median and spread of undilated step seconds, modes interleaved; on every rank.

    Each timed step (a pull and a push of one mode's table) follows an
    untimed step of the same mode: an owner applies a push after the workers
    have sent it, so the apply ends inside the next step's pull, as in
    training. Without the step before, each mode was charged the previous
    mode's apply (today after uniform, trees after today): a bias of up to
    20 % between two identical modes.

    Returns:
        ``(seconds, cpu_busy, cores)``: per mode its seconds and the machine's CPU
        busy fraction over its timed steps (``pass``) and in the busiest one
        (``step_max``; :func:`cpu_seconds`).
    """
    kinds = ("zipf", "zipf_hot", "uniform")
    names = [f"{kind}_{mode}" for kind in kinds for mode in ("today", "trees")]
    specs = [SparseVariableSpec(name, args.rows, args.dim, partitioning=args.partitioning,
                                num_partitions=args.partitions)
             for name in names]  # one table per mode: a pull without trees pauses its table's
    ps = ParameterServer(topo, seed=1, hot_rows=0)  # classification
    ps.set_hot_rows({name: entry if name.endswith("trees") else off for name in names})
    times, samples, windows = None, [], []
    if topo.is_server:
        with CpuSampler(samples):
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

        def timed(call):
            def record():
                start = clock(samples)
                call()
                windows.append((start, clock(samples)))
            return record

        methods = {f"{kind}_{name}": mode(kind, name)
                   for kind in kinds for name in ("today", "trees")}
        times = _common.interleaved(SleepingComm(topo.workers),
                                    {k: timed(call) for k, call in methods.items()},
                                    args.repeats, warmup=1, before=lambda name: methods[name]())
        ps.shutdown()
        windows = windows[len(methods):]  # the warm-up round is not timed
    times = topo.comm.bcast(times, root=topo.worker_ranks[0])
    cpu, wall, cores = cpu_seconds(topo, samples, windows)
    busy = {name: {"pass": cpu[i::len(names)].sum() / (cores * wall[i::len(names)].sum()),
                   "step_max": (cpu[i::len(names)] / (cores * wall[i::len(names)])).max()}
            for i, name in enumerate(names)}
    seconds = {k: [t / args.dilation for t in v] for k, v in times.items()}
    return ({k: {"median": _common.median(v), "min": float(min(v)), "max": float(max(v))}
             for k, v in seconds.items()}, busy, cores)


class SleepingComm:
    """``comm`` for :func:`_common.interleaved`: its barrier and maximum wait by the one
    wait policy (a worker done with a timed step first must not spin on a core that
    another worker still needs for that step)."""

    def __init__(self, comm):
        self.comm = comm

    def Barrier(self):
        polling.wait([self.comm.Ibarrier()])

    def allreduce(self, value, op):
        send = np.array([value], np.float64)
        receive = np.empty_like(send)
        polling.wait([self.comm.Iallreduce(send, receive, op=op)])
        return float(receive[0])


def clock(samples):
    """Append ``(wall, CPU seconds)`` of this process to ``samples``; return the wall."""
    wall = time.perf_counter()
    samples.append((wall, time.process_time()))
    return wall


class CpuSampler:
    """Records :func:`clock` into ``samples`` every ``period_s`` from a thread, while the
    ``with`` block runs (a server, whose steps are the workers' calls)."""

    def __init__(self, samples, period_s=0.01):
        self.samples, self.period_s = samples, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._done.wait(self.period_s):
            clock(self.samples)

    def __enter__(self):
        clock(self.samples)
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()
        clock(self.samples)


def cpu_seconds(topo, samples, windows):
    """Every rank's CPU seconds in each timed step. **Collective** over ``topo.comm``.

    A step runs from its first worker's start to its last worker's end
    (``windows``: a worker's ``(start, end)`` per timed step, on the
    machine-wide monotonic clock); every rank's CPU seconds in it are
    interpolated from its ``samples``. Cores: those the ranks may run on,
    counted once per machine (its boot id: emulated nodes share one kernel).

    Returns:
        ``(cpu, wall, cores)``: CPU seconds summed over the ranks and wall seconds,
        one per timed step in the workers' order, and the cores.
    """
    everyone = [w for w in topo.comm.allgather(windows if topo.is_worker else None) if w]
    steps = np.asarray(everyone, np.float64)  # workers x steps x (start, end)
    start, end = steps[:, :, 0].min(axis=0), steps[:, :, 1].max(axis=0)
    wall, cpu = np.asarray(sorted(samples), np.float64).T
    mine = np.interp(end, wall, cpu) - np.interp(start, wall, cpu)
    total = topo.comm.allreduce(mine, op=MPI.SUM)
    machines = {}
    for boot, cores in topo.comm.allgather((kernel_id(), affinity())):
        machines.setdefault(boot, set()).update(cores)
    cores = sum(len(c) for c in machines.values())
    return total, end - start, cores


if __name__ == "__main__":
    main()
