"""Hot-row trees against nodes: ``hot_rows.py`` at 4, 8, 12 and 16 emulated nodes, dilated links.

Brings up one emulated cluster of the largest node count (``python -m
hpcpax.cluster``: network namespaces as nodes, links shaped to ``--rate /
--dilation``, its own prefix ``hph`` and subnet, so that it never meets
another benchmark's cluster), runs :mod:`hot_rows` (one ``mpirun`` per node
count, ``--ranks-per-node`` ranks per node: 1 server + the rest workers,
Zipf(1.1) ids, trees on vs off, step times undilated) on the first N nodes,
and tears the cluster down at the end, also on failure; without root or
``ip netns`` it prints one JSON line with ``skipped``.

Default table: 200,000 rows of 192 floats in one partition (``--partitions
1``): one owner's link carries every row, the case hot-row trees relieve
(the owner sends a hot row once instead of once per node), and one where the
links, not the cores, set the step time: the owner's link moves (N - 1)
copies of every node's rows while each rank's CPU per step stays flat. With
one partition per server (``--partitions 0``) every link carries 1/N of the
rows and 32 ranks on 2 cores are CPU-bound. The binding pass is the hot set
alone (``zipf_hot``: about 7 % of the Zipf bytes at 16 nodes, yet every
rank's waits and bookkeeping): 192 floats per row give its steps enough
link time; 4,096 ids per worker, 1 step per byte pass (the counters are
exact) and 3 timed steps per mode keep 4-16 nodes within about 10 minutes
(the uniform pass, 2.5x the Zipf bytes, is most of it).

Every rank waits by the sleep policy (``HPCPAX_WAIT=sleep``), its longest
sleep scaled with the dilation (``HPCPAX_POLL_SECONDS`` = ``--poll-seconds``
x D, 8 ms by default: 1 ms on undilated links): an idle rank's polls cost
~7.6 % of a core here at 1 ms and ~1.2 % at 8 ms, and 32 ranks that wait
on slowed links would fill 2 cores at 1 ms.

A node count counts only where ``cpu_busy_max`` (the machine's: every rank's
CPU seconds over cores x wall, the busiest timed pass, i.e. one mode's timed
steps) is at most
``--cpu-busy-limit`` (0.6): then the links and the trees set the step time,
not a queue for the cores.

``--rule relays``: the relays' route instead of trees (``hot_rows.py
--rule``); the keys keep the name ``trees`` for the mode with hot rows on.

Keys, per node count (``nodes_N``): ``ratio_step_time_before_vs_after``
(Zipf, today / trees), ``ratio_step_time_hot_set``, ``ratio_uniform``,
``hot_share_owner_bytes``, the owner egress/ingress ratios (Zipf and hot
set), ``uniform_trees_chosen``, ``seconds`` (undilated medians),
``cpu_busy_max``, ``cpu_busy`` (per pass), ``cpu_busy_step_max``, ``valid``,
``decision`` (the trees' rule on the measured fabric), ``wall_seconds``,
``machine_cpu_busy_run`` (the whole machine over the run, other users' jobs
included: /proc/stat); top level: ``ratio_step_time_before_vs_after_N`` for
every N, ``ratio_uniform_min``, ``curve`` (the ratios against nodes),
``cpu_busy_max``, ``valid``.

Usage: ``python benchmarks/hot_rows_scaling.py [--quick] [--nodes 4,8,12,16]``
(``--quick``: 2 nodes, ``hot_rows.py --quick`` sizes). ``--raw FILE`` appends
each node count's ``hot_rows`` line to FILE.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import _common  # noqa: E402

PREFIX, SUBNET = "hph", "10.213.245.0/24"
#: Figures copied from each node count's ``hot_rows`` line.
FIGURES = ("ratio_step_time_before_vs_after", "ratio_step_time_hot_set", "ratio_uniform",
           "hot_share_owner_bytes", "ratio_owner_egress_before_vs_after",
           "ratio_owner_ingress_before_vs_after", "ratio_owner_egress_hot_set",
           "ratio_owner_ingress_hot_set", "uniform_trees_chosen", "cpu_busy_max", "cpu_busy",
           "cpu_busy_step_max", "decision", "dilation", "poll_seconds", "cores", "ranks",
           "servers")
#: The curve's figures against nodes.
CURVE = ("ratio_step_time_before_vs_after", "ratio_step_time_hot_set", "ratio_uniform",
         "hot_share_owner_bytes", "ratio_owner_egress_hot_set", "cpu_busy_max")


def hot_rows_argv(args, nodes):
    """``python -m mpi4py hot_rows.py ...`` for one node count."""
    workers = args.ranks_per_node - 1
    count = f"{args.partitions} partitions" if args.partitions else "one partition per server"
    table = ("the table in 1 partition: one owner's link carries every row"
             if args.partitions == 1 else f"{args.partitioning} partitioning, {count}")
    links = (f"emulated cluster: {nodes} network namespaces, {args.rate} links slowed "
             f"{args.dilation:g}x (tbf, times undilated), {args.ranks_per_node} ranks per node "
             f"(1 server + {workers} worker{'s' if workers != 1 else ''}); {table}")
    argv = [sys.executable, "-m", "mpi4py", os.path.join(HERE, "hot_rows.py"),
            "--dilation", str(args.dilation), "--links", links]
    if args.quick:
        return argv + ["--quick"]
    argv += ["--rows", str(args.rows), "--dim", str(args.dim), "--ids", str(args.ids),
             "--steps", str(args.steps), "--repeats", str(args.repeats), "--rule", args.rule,
             "--partitioning", args.partitioning]
    if args.partitions:
        argv += ["--partitions", str(args.partitions)]
    if args.chunk_bytes is not None:
        argv += ["--chunk-bytes", str(args.chunk_bytes)]
    return argv


def run_nodes(spec, nodes, args):
    """One ``mpirun`` of ``hot_rows.py`` on the first ``nodes`` nodes; its JSON line."""
    from hpcpax.cluster import mpirun_argv, mpirun_env

    env = mpirun_env()
    env.update({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore", "MPIEXEC_TIMEOUT": str(args.timeout),
                "HPCPAX_RANKS_PER_NODE": str(args.ranks_per_node),
                "HPCPAX_SERVERS_PER_NODE": "1", "HPCPAX_WAIT": "sleep",
                "HPCPAX_POLL_SECONDS": f"{args.poll_seconds * args.dilation:g}",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    command = mpirun_argv(spec, args.ranks_per_node, hot_rows_argv(args, nodes), nodes=nodes)
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=args.timeout + 30)
    lines = [t for t in done.stdout.splitlines() if t.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"hot_rows on {nodes} nodes failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    return json.loads(lines[-1])


def machine_cpu():
    """``(busy, total)`` jiffies of the whole machine, every user's processes (/proc/stat)."""
    try:
        with open("/proc/stat", encoding="ascii") as handle:
            fields = [int(v) for v in handle.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
    return sum(fields[:8]) - idle, sum(fields[:8])


def summary(line, limit):
    """The figures of one node count's ``hot_rows`` line, and whether it counts."""
    out = {k: line.get(k) for k in FIGURES}
    out["seconds"] = {k: (v or {}).get("median") for k, v in (line.get("seconds") or {}).items()}
    # the step-time ratio measured, and the CPU under the limit (a null figure is no measurement)
    out["valid"] = (_common.measured(line.get("ratio_step_time_before_vs_after"))
                    and _common.measured(line.get("cpu_busy_max"))
                    and line["cpu_busy_max"] <= limit)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 nodes, tiny sizes")
    parser.add_argument("--nodes", default="4,8,12,16")
    parser.add_argument("--rate", default="1gbit", help="undilated link rate per direction")
    parser.add_argument("--dilation", type=float, default=8.0,
                        help="links slowed this many times; step times reported divided by it")
    parser.add_argument("--ranks-per-node", type=int, default=2,
                        help="ranks per node: 1 server + the rest workers")
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=192)
    parser.add_argument("--ids", type=int, default=4096, help="ids per worker per step")
    parser.add_argument("--steps", type=int, default=1, help="steps of each byte pass")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps of each mode")
    parser.add_argument("--rule", default="model", help="hot_rows.py --rule")
    parser.add_argument("--partitioning", default="mod", choices=("mod", "range"))
    parser.add_argument("--partitions", type=int, default=1,
                        help="partitions of the table (0: one per server)")
    parser.add_argument("--chunk-bytes", type=int, default=None, help="hot_rows.py --chunk-bytes")
    parser.add_argument("--poll-seconds", type=float, default=0.001,
                        help="the wait policy's longest sleep on undilated links "
                             "(HPCPAX_POLL_SECONDS is this x the dilation)")
    parser.add_argument("--cpu-busy-limit", type=float, default=0.6)
    parser.add_argument("--timeout", type=int, default=420, help="seconds per node count")
    parser.add_argument("--raw", default=None, help="append each hot_rows line to this file")
    parser.add_argument("--prefix", default=PREFIX, help="the cluster's name prefix")
    parser.add_argument("--subnet", default=SUBNET, help="the cluster's subnet")
    args = parser.parse_args()
    node_counts = [2] if args.quick else [int(n) for n in args.nodes.split(",") if n]
    if not node_counts or min(node_counts) < 2:
        parser.error(f"--nodes must be counts >= 2, not {args.nodes!r}")
    if args.ranks_per_node < 2:
        parser.error(f"--ranks-per-node must be >= 2 (1 server + workers), "
                     f"not {args.ranks_per_node}")
    if not args.poll_seconds > 0:
        parser.error(f"--poll-seconds must be > 0, not {args.poll_seconds}")
    if args.partitions < 0:
        parser.error(f"--partitions must be >= 0, not {args.partitions}")
    from hpcpax import cluster

    out = {"benchmark": "hot_rows_scaling"}
    reason = cluster.preflight()
    if reason:
        out["skipped"] = f"no emulated cluster here: {reason}"
        _common.emit(out)
        return 0
    rate, delay = cluster.spec.dilate(args.rate, "0", args.dilation)
    out.update({"rate": args.rate, "dilation": args.dilation, "link_rate_dilated": rate,
                "nodes": node_counts, "quick": args.quick,
                "layout": f"{args.ranks_per_node} ranks per node (1 server + "
                          f"{args.ranks_per_node - 1} worker"
                          f"{'s' if args.ranks_per_node > 2 else ''}), HPCPAX_WAIT=sleep, "
                          f"HPCPAX_POLL_SECONDS={args.poll_seconds * args.dilation:g}",
                "sizes": ({"quick": "hot_rows.py --quick"} if args.quick else
                          {"rows": args.rows, "dim": args.dim, "ids": args.ids,
                           "steps": args.steps, "repeats": args.repeats, "rule": args.rule,
                           "partitioning": args.partitioning,
                           "partitions": args.partitions or "one per server",
                           "chunk_bytes": args.chunk_bytes}),
                "zipf_s": 1.1, "cpu_busy_limit": args.cpu_busy_limit,
                "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg()})
    start = time.perf_counter()
    errors = {}
    cluster.down(args.prefix, log=lambda text: None)
    try:
        spec = cluster.up(max(node_counts), rate=rate, delay=delay, prefix=args.prefix,
                          subnet=args.subnet)
        check = spec.extra.get("link_check") or {}
        out["link_check"] = {k: check.get(k) for k in ("gbit_per_s", "latency_us", "used")}
        out["cluster_up_seconds"] = time.perf_counter() - start
        for nodes in node_counts:
            began, jiffies = time.perf_counter(), machine_cpu()
            loadavg = os.getloadavg()
            try:
                line = run_nodes(spec, nodes, args)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                errors[nodes] = str(exc)[-1500:]
                out[f"nodes_{nodes}"] = {"error": errors[nodes], "valid": False,
                                         "wall_seconds": time.perf_counter() - began}
                print(f"hot_rows_scaling: {nodes} nodes failed", file=sys.stderr, flush=True)
                continue
            if args.raw:
                with open(args.raw, "a", encoding="utf-8") as handle:
                    handle.write(json.dumps(line) + "\n")
            after = machine_cpu()
            # the whole machine over the run, other users' jobs included (ours: cpu_busy_max)
            machine = (_common.ratio(after[0] - jiffies[0], after[1] - jiffies[1])
                       if jiffies and after else None)
            out[f"nodes_{nodes}"] = {**summary(line, args.cpu_busy_limit),
                                     "wall_seconds": time.perf_counter() - began,
                                     "machine_cpu_busy_run": machine,
                                     "loadavg_at_start": loadavg}
            print(f"hot_rows_scaling: {nodes} nodes: " + json.dumps(
                {k: out[f"nodes_{nodes}"][k] for k in CURVE}), file=sys.stderr, flush=True)
    finally:
        cluster.down(args.prefix, log=lambda text: None)
    measured = [n for n in node_counts if n not in errors]
    for n in node_counts:
        out[f"ratio_step_time_before_vs_after_{n}"] = out[f"nodes_{n}"].get(
            "ratio_step_time_before_vs_after")
    uniform = [out[f"nodes_{n}"]["ratio_uniform"] for n in measured
               if out[f"nodes_{n}"]["ratio_uniform"] is not None]
    out["ratio_uniform_min"] = min(uniform) if uniform else None
    out["curve"] = {"nodes": measured,
                    **{k: [out[f"nodes_{n}"][k] for n in measured] for k in CURVE}}
    busy = [out[f"nodes_{n}"]["cpu_busy_max"] for n in measured
            if out[f"nodes_{n}"]["cpu_busy_max"] is not None]
    out["cpu_busy_max"] = max(busy) if busy else None
    out["valid"] = _common.all_valid(out[f"nodes_{n}"] for n in node_counts)
    if errors:
        out["errors"] = {str(n): e for n, e in errors.items()}
    out["wall_seconds"] = time.perf_counter() - start
    out["loadavg_at_end"] = os.getloadavg()
    _common.emit(out)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
