"""Samples/s against nodes per method, on real MPI traffic: emulated accelerators, dilated links.

Brings up an emulated cluster itself (``python -m hpcpax.cluster``: network
namespaces as nodes, one rank per node, links shaped to ``--rate / --dilation``)
and tears it down at the end, also on failure; without root or ``ip netns``
it prints one JSON line with ``skipped``.

Every worker's forward and backward is emulated (``--emulate-compute``,
default 0.1 s per step: the ``lm1b`` preset's 100 ms per GPU step of 128
sequences x 20 tokens, times the dilation): a wait that holds no CPU, so
2-16 ranks on a 2-core machine measure the links and the mechanisms, not
CPU contention; everything else is real (ids, rows, pushes, dense gradients
of the model's shapes, exchanges, the optimizer). Reported times are
undilated (``--time-dilation``). Weak scaling, as Parallax's chart:
``--per-worker`` samples per worker per step (default 640: x 4 context
tokens = 2,560 looked-up tokens, Parallax's per GPU).

Model: LM-1B-shaped, scaled to this machine: ``--vocab-size`` rows (default
200,000, not 793k: an allgather rank holds every table whole, and the
densified allreduce's step at 16 nodes would be minutes), embedding and
softmax width 64, one hidden layer of 256, 1,024 sampled negatives,
Zipf(1.1) tokens, SGD; every rank a worker hosting partitions
(``servers_per_node=0``).

Methods (each a ``Trainer`` run in one ``mpirun`` per round, the order
rotated per round): ``hybrid`` (Parallax's rule: sparse on the PS, dense
allreduce), ``auto`` (the cost model), ``allgather`` (Horovod's sparse
allgather), ``ps_no_aggregation`` (the PS without local aggregation),
``allreduce`` (densified tables; up to ``--allreduce-max-nodes``, 8: at 16
its step is ~40 s of wall time) and ``torch``: PyTorch DDP's reductions
(gloo; dense grads in one bucket allreduce, ``nn.Embedding(sparse=True)``
grads by gloo's sparse allreduce) after the same emulated compute
(:meth:`torch_lm.TorchSide.emulated_backward`). ``hybrid`` and ``auto``
measure 5 steps for their plan, then (where the plan puts rows on hot-row
trees) up to 3 trial rounds of 4 steps, and are timed after them and 2
warm-up steps; the fixed plans are timed after 2 warm-up steps.

A run counts only where ``cpu_busy_max`` (the machine's: all ranks' CPU
seconds over cores x wall, the busiest timed step) is at most
``--cpu-busy-limit`` (0.6): then the links and the mechanisms set the step
time, not a queue for the cores. ``cpu_busy_phase_max`` (reported, not a
condition) is the same inside the busiest exchange phase (every worker's CPU
seconds in ``pull``, ``push``, ... over cores x that phase's wall seconds,
median over the steps): the ranks' CPU work comes in bursts at the exchanges,
so a phase can wait for the cores while the step's fraction stays low (16
nodes x 2 workers at D = 4: ``cpu_busy_max`` 0.50, and the step 19 % slower
than at D = 8). Near 1, raise ``--dilation``.

Keys: ``samples_per_s`` and ``seconds_per_step`` (per method, per node
count: median, min, max), ``ratio_hybrid_vs_allgather_N``,
``ratio_hybrid_vs_ddp_N``, ``scaling_hybrid_N_vs_2``,
``ratio_auto_vs_best_fixed_min`` (worst node count, hpcpax's fixed plans),
``offnode_bytes_vs_predicted_max`` (hpcpax's counted off-node bytes against
the protocol's formula on the same ids; plans without kept trees),
``cpu_busy_max``, ``wire_bytes`` (the veths' counters, headers included),
``link_utilisation`` (a node's wire bytes per step over the step's seconds x
the link rate, one direction), ``wait_within`` (rank 0's waits inside an
operation, last round: median seconds and the spin the wait policy chose,
per kind), ``valid``; a PNG of samples/s against nodes per method (``--png``).

Usage: ``python benchmarks/scaling.py [--quick] [--nodes 2,4,8,16] [--rounds 3]``.
"""

from __future__ import annotations

import argparse
import importlib.util
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
from cluster_lm import _spread  # noqa: E402

PREFIX, SUBNET = "hpk", "10.213.248.0/24"
METHODS = ("hybrid", "auto", "allgather", "ps_no_aggregation", "allreduce", "torch")
FULL = {"vocab-size": 200_000, "emb-dim": 64, "out-dim": 64, "hidden": 256,
        "num-sampled": 1024, "context": 4, "steps": 24, "plan-steps": 5, "warmup": 2}
QUICK = {"vocab-size": 20_000, "emb-dim": 16, "out-dim": 16, "hidden": 32,
         "num-sampled": 128, "context": 4, "steps": 8, "plan-steps": 3, "warmup": 1}


def run_round(spec, nodes, methods, sizes, args, timeout):
    """One ``mpirun`` of ``_cluster_lm_job.py`` over ``nodes`` nodes; its JSON line."""
    from hpcpax.cluster import mpirun_argv, mpirun_env

    job = {**sizes, "global-batch": args.per_worker * nodes * args.ranks_per_node}
    argv = [sys.executable, "-m", "mpi4py", os.path.join(HERE, "_cluster_lm_job.py"),
            "--methods", ",".join(methods), "--emulate-compute", args.emulate_compute,
            "--time-dilation", str(args.dilation),
            "--allreduce-steps", str(1 + args.allreduce_timed),
            "--fixed-steps", str(sizes["warmup"] + args.fixed_timed)]
    argv += [a for k, v in job.items() for a in (f"--{k}", str(v))]
    env = mpirun_env()
    env.update({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "PYTHONWARNINGS": "ignore", "MPIEXEC_TIMEOUT": str(timeout),
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", "")})
    done = subprocess.run(mpirun_argv(spec, args.ranks_per_node, argv, nodes=nodes), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout + 30)
    lines = [t for t in done.stdout.splitlines() if t.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"round on {nodes} nodes failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    return json.loads(lines[-1])


def per_nodes(jobs, limit):
    """Per method over the rounds of one node count."""
    out = {}
    for name in METHODS:
        runs = [j["methods"][name] for j in jobs if name in j["methods"]]
        if not runs:
            continue
        busy = [r.get("cpu_busy_max") for r in runs]
        out[name] = {
            "samples_per_s": _spread([r.get("samples_per_s") for r in runs]),
            "seconds_per_step": _spread([r.get("seconds_per_step") for r in runs]),
            "cpu_busy_max": max((b for b in busy if _common.measured(b)), default=None),
            "cpu_busy_phase_max": max((r["cpu_busy_phase_max"] for r in runs
                                       if r.get("cpu_busy_phase_max") is not None),
                                      default=None),
            # every round measured its rate and stayed under the CPU limit
            "valid": all(_common.measured(r.get("samples_per_s")) and r["samples_per_s"] > 0
                         and _common.measured(b) and b <= limit for r, b in zip(runs, busy)),
            "wire_bytes_per_step": _spread([r.get("wire_bytes_per_step") for r in runs]),
            "plan": runs[-1]["plan"]}
        if name == "torch":
            continue
        counted = [r["offnode_bytes_per_step"] for r in runs]
        predicted = [r.get("offnode_bytes_predicted") for r in runs]
        out[name].update({
            "cpu_busy_rank_max": max(r.get("cpu_busy_rank_max", 0.0) for r in runs),
            "offnode_bytes_per_step": _spread(counted),
            "offnode_bytes_predicted": _spread(predicted),
            # hpcpax's counted off-node bytes over the protocol's formula, per round
            "offnode_vs_predicted": [round(c / p, 6) for c, p in zip(counted, predicted) if p],
            "hot_rows_trial": runs[-1].get("hot_rows_trial"),
            "seconds_by_phase": runs[-1]["seconds_by_phase"],
            "cpu_seconds_by_phase": runs[-1].get("cpu_seconds_by_phase"),
            "startup_seconds": runs[-1].get("startup_seconds"),
            # rank 0's waits inside an operation (the wait policy's spin per kind)
            "wait_within": runs[-1].get("wait_within")})
    return out


def expected_methods(methods, nodes, allreduce_max_nodes) -> list:
    """The methods a round on ``nodes`` nodes runs (the densified allreduce only up to
    ``allreduce_max_nodes``)."""
    return [m for m in methods if m != "allreduce" or nodes <= allreduce_max_nodes]


def overall_valid(out, expected) -> bool:
    """The run's ``valid``: every node count measured every method it was to run
    (``expected``: ``{nodes: [method, ...]}``), each valid, and no round failed or
    timed out. A node count whose rounds all failed, or a run with no node count
    measured, is not valid."""
    entries = []
    for nodes, methods in expected.items():
        result = out.get(f"nodes_{nodes}") or {}
        if result.get("errors"):
            entries.append({"valid": False})
        entries += [result.get(m) or {"valid": False} for m in methods]
    return _common.all_valid(entries)


def plot(results, node_counts, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(6, 4))
    for name in METHODS:
        xs = [n for n in node_counts
              if ((results.get(f"nodes_{n}", {}).get(name) or {}).get("samples_per_s") or {})
              .get("median")]
        ys = [results[f"nodes_{n}"][name]["samples_per_s"]["median"] for n in xs]
        if xs:
            ax.plot(xs, ys, marker="o", label=name)
    per_node = results.get("ranks_per_node") or 1
    ax.set_xlabel(f"nodes ({per_node} emulated accelerator(s) each)")
    ax.set_ylabel("samples/s (undilated)")
    ax.set_xticks(node_counts)
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return path


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round, 2 nodes")
    parser.add_argument("--nodes", default="2,4,8,16")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rate", default="1gbit", help="undilated link rate per direction")
    parser.add_argument("--dilation", type=float, default=8.0)
    parser.add_argument("--emulate-compute", default="0.1",
                        help="seconds per worker step (lm1b's 100 ms per 2,560 tokens)")
    parser.add_argument("--per-worker", type=int, default=640,
                        help="samples per worker per step (x context 4 = 2,560 tokens)")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--ranks-per-node", type=int, default=1,
                        help="workers per node (emulated accelerators per machine; the "
                             "keys' N stays the node count)")
    parser.add_argument("--allreduce-timed", type=int, default=2,
                        help="timed steps of the densified allreduce (its step is slow)")
    parser.add_argument("--allreduce-max-nodes", type=int, default=8,
                        help="largest node count the densified allreduce runs on")
    parser.add_argument("--fixed-timed", type=int, default=5,
                        help="timed steps of the fixed plans and torch (after --warmup)")
    parser.add_argument("--cpu-busy-limit", type=float, default=0.6)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per round")
    parser.add_argument("--png", default=None, help="write the plot here")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=N",
                        help="override a model size (e.g. --set steps=20)")
    parser.add_argument("--prefix", default=PREFIX, help="the cluster's name prefix")
    parser.add_argument("--subnet", default=SUBNET, help="the cluster's subnet")
    args = parser.parse_args()
    from hpcpax import cluster

    out = {"benchmark": "scaling"}
    reason = cluster.preflight()
    if reason:
        out["skipped"] = f"no emulated cluster here: {reason}"
        _common.emit(out)
        return 0
    sizes = dict(QUICK if args.quick else FULL)
    for item in args.set:
        key, _, value = item.partition("=")
        if key not in sizes or not value.isdigit():
            parser.error(f"--set {item!r}: known sizes {sorted(sizes)}, values integers")
        sizes[key] = int(value)
    node_counts = [2] if args.quick else [int(n) for n in args.nodes.split(",")]
    rounds = 1 if args.quick else args.rounds
    methods = [m for m in args.methods.split(",") if m]
    unknown = sorted(set(methods) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; known: {list(METHODS)}")
    if "torch" in methods and importlib.util.find_spec("torch") is None:
        methods.remove("torch")
        out["torch_skipped"] = "torch is not installed (pip install -e '.[torch]')"
    out.update({"rate": args.rate, "dilation": args.dilation,
                "emulate_compute": args.emulate_compute, "per_worker": args.per_worker,
                "rounds": rounds, "model": sizes, "methods_compared": methods,
                "ranks_per_node": args.ranks_per_node,
                "layout": (f"{args.ranks_per_node} rank(s) per node, servers_per_node=0 "
                           "(every rank a worker)"),
                "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg(),
                "torch": "PyTorch DDP's reductions (gloo: dense one bucket allreduce, sparse "
                         "gloo sparse allreduce) after the same emulated compute"})
    start = time.perf_counter()
    cluster.down(args.prefix, log=lambda text: None)
    try:
        rate, delay = cluster.spec.dilate(args.rate, "0", args.dilation)
        spec = cluster.up(max(node_counts), rate=rate, delay=delay, prefix=args.prefix,
                          subnet=args.subnet)
        for nodes in node_counts:
            jobs, errors = [], []
            here = expected_methods(methods, nodes, args.allreduce_max_nodes)
            for r in range(rounds):
                order = here[r % len(here):] + here[:r % len(here)]
                try:
                    jobs.append(run_round(spec, nodes, order, sizes, args, args.timeout))
                    print(f"scaling: {nodes} nodes, round {r + 1}: "
                          + json.dumps({m: round(v["samples_per_s"]) for m, v in
                                        jobs[-1]["methods"].items()}),
                          file=sys.stderr, flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    errors.append(str(exc)[-1500:])
            out[f"nodes_{nodes}"] = per_nodes(jobs, args.cpu_busy_limit)
            if errors:
                out[f"nodes_{nodes}"]["errors"] = errors
    finally:
        cluster.down(args.prefix, log=lambda text: None)
    # link utilisation: each node's bytes on its link (headers included) per undilated
    # second of the step, over the undilated link rate (one direction)
    link_Bps = cluster.spec.parse_rate(args.rate) / 8
    for n in node_counts:
        for e in out[f"nodes_{n}"].values():
            if isinstance(e, dict) and (e.get("wire_bytes_per_step") or {}).get("median") \
                    and (e.get("seconds_per_step") or {}).get("median"):
                e["link_utilisation"] = round(e["wire_bytes_per_step"]["median"] / n / (
                    e["seconds_per_step"]["median"] * link_Bps), 4)
    rate = {n: {m: e["samples_per_s"]["median"] for m, e in out[f"nodes_{n}"].items()
                if isinstance(e, dict) and (e.get("samples_per_s") or {}).get("median")}
            for n in node_counts}
    for n in node_counts:
        out[f"ratio_hybrid_vs_allgather_{n}"] = _common.ratio(rate[n].get("hybrid"),
                                                              rate[n].get("allgather"))
        out[f"ratio_hybrid_vs_ddp_{n}"] = _common.ratio(rate[n].get("hybrid"),
                                                        rate[n].get("torch"))
    # hpcpax's counted off-node bytes against the protocol's formula on the same ids,
    # methods whose plan kept no hot-row trees (relays are not in the formula)
    errors = [abs(v - 1.0) for n in node_counts for e in out[f"nodes_{n}"].values()
              if isinstance(e, dict) and not (e.get("hot_rows_trial") or {}).get("kept")
              for v in e.get("offnode_vs_predicted", [])]
    out["offnode_bytes_vs_predicted_max"] = max(errors) if errors else None
    base = node_counts[0]
    for n in node_counts[1:]:
        out[f"scaling_hybrid_{n}_vs_{base}"] = _common.ratio(rate[n].get("hybrid"),
                                                             rate[base].get("hybrid"))
    fixed = [m for m in methods if m not in ("auto", "torch")]
    worst = [rate[n]["auto"] / max(rate[n][m] for m in fixed if m in rate[n])
             for n in node_counts if "auto" in rate[n] and any(m in rate[n] for m in fixed)]
    out["ratio_auto_vs_best_fixed_min"] = min(worst) if worst else None
    busy = [e["cpu_busy_max"] for n in node_counts for e in out[f"nodes_{n}"].values()
            if isinstance(e, dict) and "cpu_busy_max" in e]
    out["cpu_busy_max"] = max(busy) if busy else None
    phases = [e["cpu_busy_phase_max"] for n in node_counts for e in out[f"nodes_{n}"].values()
              if isinstance(e, dict) and e.get("cpu_busy_phase_max") is not None]
    out["cpu_busy_phase_max"] = max(phases) if phases else None
    out["valid"] = overall_valid(out, {n: expected_methods(methods, n, args.allreduce_max_nodes)
                                       for n in node_counts})
    if args.png:
        # the file's name only: results are committed, machine paths are not
        path = plot(out, node_counts, args.png)
        out["png"] = path and os.path.basename(path)
    out["wall_seconds"] = time.perf_counter() - start
    out["loadavg_at_end"] = os.getloadavg()
    _common.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
