"""An LM-1B-shaped model on an emulated 2- and 3-node cluster: auto vs allgather, PS, torch DDP.

Brings up an emulated cluster itself (``python -m hpcpax.cluster``: network
namespaces as nodes, tc-shaped links, MPI traffic between nodes checked to
cross them) and tears it down at the end, also on failure. Needs root and
``ip netns``; otherwise prints one JSON line with ``skipped`` and the reason.

Model (sized to a 2-core machine, shaped like LM-1B): vocabulary 400,000
rows, embedding and softmax width 128, one hidden layer of 256, sampled
softmax with 4,096 log-uniform negatives, Zipf(1.1) token frequencies
(the synthetic data), global batch 1,152 (divides by 4 and 6 workers), SGD. Every rank is a worker
(``servers_per_node=0``), as DDP's; 2 ranks per node.

Links: intra-node traffic stays in MPICH's shared memory (gloo: loopback);
inter-node traffic crosses a veth shaped to ``--rate`` per direction. The
intra/inter ratio is measured with the same MPI probe and reported
(``link_probe``): a real cluster's is about 10-40 (e.g. 10-25 GB/s shared
memory or NVLink per rank against 25-100 Gb/s Ethernet or InfiniBand per node).

Per node count, ``--rounds`` jobs (one ``mpirun`` each, method order rotated
per round, so noise hits every method alike) run ``_cluster_lm_job.py``:
``--plan auto``, every sparse table on ``allgather`` (Horovod), all ``ps``,
and torch DDP (gloo, ``nn.Embedding(sparse=True)``) on the same batches.
Figures are medians over rounds with [min, max].

Keys: ``ratio_auto_vs_allgather`` (allgather s/step over auto's),
``ratio_auto_vs_torch_ddp``, ``ratio_auto_vs_best_fixed`` (best of allgather
and ps over auto), ``offnode_bytes_auto`` (accounting, per step, summed over
ranks), ``offnode_bytes_predicted`` (the cost model's byte terms for auto's
plan with the alphas of the same steps), ``plan_auto``,
``ratio_step_vs_limit`` = auto's step time over (its non-communication time
+ the lower-bound off-node bytes per node / link rate). Top-level ratios are
the worst over the node counts; per node count under ``nodes_N``.

Usage: ``python benchmarks/cluster_lm.py [--quick] [--rounds 3] [--rate 2gbit]``.
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

PREFIX, SUBNET = "hpb", "10.213.252.0/24"
FULL = {"vocab-size": 400_000, "emb-dim": 128, "out-dim": 128, "hidden": 256,
        "num-sampled": 4096, "global-batch": 1152, "steps": 16, "plan-steps": 5, "warmup": 2}
QUICK = {"vocab-size": 20_000, "emb-dim": 16, "out-dim": 16, "hidden": 32,
         "num-sampled": 256, "global-batch": 128, "steps": 10, "plan-steps": 3, "warmup": 1}


def _spread(values):
    values = [v for v in values if v is not None]
    return {"median": _common.median(values), "min": min(values), "max": max(values),
            "n": len(values)} if values else None


def _torch_available():
    done = subprocess.run([sys.executable, "-c", "import torch"], capture_output=True,
                          timeout=120)
    return done.returncode == 0


def run_round(spec, nodes, ranks_per_node, methods, sizes, timeout):
    from hpcpax.cluster import mpirun_argv, mpirun_env

    argv = [sys.executable, "-m", "mpi4py", os.path.join(HERE, "_cluster_lm_job.py"),
            "--methods", ",".join(methods)] + [a for k, v in sizes.items()
                                                for a in (f"--{k}", str(v))]
    env = mpirun_env()
    env.update({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
                "GLOO_SOCKET_IFNAME": "eth0", "PYTHONWARNINGS": "ignore",
                "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                "MPIEXEC_TIMEOUT": str(timeout)})
    done = subprocess.run(mpirun_argv(spec, ranks_per_node, argv, nodes=nodes), cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=timeout + 30)
    lines = [t for t in done.stdout.splitlines() if t.startswith("{")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"round on {nodes} nodes failed ({done.returncode}): "
                           f"{(done.stderr or done.stdout)[-1500:]}")
    return json.loads(lines[-1])


def probe_links(spec):
    """Same MPI stream probe inside one node and between two: the intra/inter ratio."""
    from hpcpax.cluster import check, mpirun_argv, mpirun_env

    inter = check(spec, nbytes=64 << 20)
    argv = mpirun_argv(spec, 2, [sys.executable, "-m", "hpcpax.cluster.probe", str(256 << 20)],
                       nodes=1)
    done = subprocess.run(argv, capture_output=True, text=True, timeout=120, env=mpirun_env())
    intra = json.loads([t for t in done.stdout.splitlines() if t.startswith("{")][-1])
    intra_gbit = intra["bytes"] * 8 / intra["seconds"] / 1e9
    return {"inter_gbit_per_s": inter["gbit_per_s"], "inter_latency_us": inter["latency_us"],
            "intra_gbit_per_s": intra_gbit, "intra_latency_us": intra["latency_s"] * 1e6,
            "ratio_intra_vs_inter": intra_gbit / inter["gbit_per_s"],
            "links_used": inter["used"], "link_check": inter["reason"]}


def summarize(jobs, rate_bps, nodes):
    methods = {}
    for name in ("auto", "allgather", "ps", "torch"):
        results = [j["methods"][name] for j in jobs if name in j["methods"]]
        if not results:
            continue
        entry = {"seconds_per_step": _spread([r["seconds_per_step"] for r in results]),
                 "wire_bytes_per_step": _spread([r.get("wire_bytes_per_step") for r in results])}
        if name != "torch":
            entry["offnode_bytes_per_step"] = _spread([r["offnode_bytes_per_step"]
                                                       for r in results])
            entry["plan"] = results[-1]["plan"]
            entry["final_loss"] = results[-1]["final_loss"]
            entry["seconds_by_phase"] = results[-1]["seconds_by_phase"]
        methods[name] = entry
    sec = {m: e["seconds_per_step"]["median"] for m, e in methods.items()}
    auto_runs = [j["methods"]["auto"] for j in jobs]
    measured = _common.median([r["offnode_bytes_per_step"] for r in auto_runs])
    predicted = _common.median([r["offnode_bytes_predicted"] for r in auto_runs])
    bound = _common.median([j["lower_bound_offnode_bytes"] for j in jobs])
    compute = _common.median([r["compute_seconds"] for r in auto_runs])
    limit = compute + bound / nodes / (rate_bps / 8)
    best_fixed = min(sec[m] for m in ("allgather", "ps"))
    return {
        "methods": methods,
        "plan_auto": methods["auto"]["plan"],
        "fabric_auto": auto_runs[-1].get("fabric"),
        "ratio_auto_vs_allgather": _common.ratio(sec["allgather"], sec["auto"]),
        "ratio_auto_vs_ps": _common.ratio(sec["ps"], sec["auto"]),
        "ratio_auto_vs_best_fixed": _common.ratio(best_fixed, sec["auto"]),
        "ratio_auto_vs_torch_ddp": _common.ratio(sec.get("torch"), sec["auto"]),
        "offnode_bytes_auto": measured,
        "offnode_bytes_predicted": predicted,
        "offnode_predicted_error": abs(predicted - measured) / measured if measured else None,
        "offnode_bytes_lower_bound": bound,
        "ratio_offnode_auto_vs_lower_bound": _common.ratio(measured, bound),
        "seconds_compute_auto": compute,
        "seconds_limit": limit,
        "ratio_step_vs_limit": _common.ratio(sec["auto"], limit),
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny model, 1 round, 2 nodes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nodes", default="2,3", help="node counts")
    parser.add_argument("--ranks-per-node", type=int, default=2)
    parser.add_argument("--rate", default="2gbit", help="inter-node link rate per direction")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per round")
    args = parser.parse_args()
    from hpcpax import cluster

    out = {"benchmark": "cluster_lm"}
    reason = cluster.preflight()
    if reason:
        out["skipped"] = f"no emulated cluster here: {reason}"
        _common.emit(out)
        return 0
    sizes = dict(QUICK if args.quick else FULL)
    node_counts = [2] if args.quick else [int(n) for n in args.nodes.split(",")]
    rounds = 1 if args.quick else args.rounds
    methods = ["auto", "allgather", "ps"] + (["torch"] if _torch_available() else [])
    out.update({"rate": args.rate, "ranks_per_node": args.ranks_per_node, "rounds": rounds,
                "model": sizes, "layout": "servers_per_node=0 (every rank a worker, as DDP)",
                "methods_compared": methods, "machine_shared": True,
                "cores": os.cpu_count(), "loadavg_at_start": os.getloadavg()})
    if "torch" not in methods:
        out["torch_skipped"] = "torch is not installed (pip install torch)"
    start = time.perf_counter()
    cluster.down(PREFIX, log=lambda text: None)
    try:
        spec = cluster.up(max(node_counts), rate=args.rate, prefix=PREFIX, subnet=SUBNET)
        out["link_probe"] = probe_links(spec)
        for nodes in node_counts:
            jobs, errors = [], []
            for r in range(rounds):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                try:
                    jobs.append(run_round(spec, nodes, args.ranks_per_node, order, sizes,
                                          args.timeout))
                    print(f"cluster_lm: {nodes} nodes, round {r + 1}: "
                          f"{json.dumps(jobs[-1])}", file=sys.stderr, flush=True)
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    errors.append(str(exc)[-1500:])
            out[f"nodes_{nodes}"] = summarize(jobs, spec.rate_bps, nodes) if jobs else {}
            if errors:
                out[f"nodes_{nodes}"]["errors"] = errors
    finally:
        cluster.down(PREFIX, log=lambda text: None)
    per_n = [out[f"nodes_{n}"] for n in node_counts if "methods" in out[f"nodes_{n}"]]
    if not per_n:
        out["error"] = "every round failed (see nodes_N.errors)"
        _common.emit(out)
        return 1
    for key in ("ratio_auto_vs_allgather", "ratio_auto_vs_torch_ddp",
                "ratio_auto_vs_best_fixed"):
        values = [p[key] for p in per_n if p[key] is not None]
        out[key] = min(values) if values else None
    out["ratio_step_vs_limit"] = max(p["ratio_step_vs_limit"] for p in per_n)
    out["offnode_predicted_error"] = max(p["offnode_predicted_error"] for p in per_n)
    last = per_n[-1]
    out.update({k: last[k] for k in ("offnode_bytes_auto", "offnode_bytes_predicted",
                                     "plan_auto")})
    out["wall_seconds"] = time.perf_counter() - start
    out["loadavg_at_end"] = os.getloadavg()
    _common.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
