"""Run every benchmark side by side, in one go: results JSON, Markdown table, plots.

Each benchmark script runs under ``mpirun`` (``python -m mpi4py``, so an
error on one rank aborts the job) at the rank counts it needs, as a
subprocess with a timeout; its one JSON line is folded into
``benchmarks/results/<YYYY-MM-DD>[-quick].json``, the Markdown table
``benchmarks/results/<date>[-quick].md`` (also printed) and PNG plots
``benchmarks/results/<date>[-quick]-*.png``.

Scaling: 1, 2, 4 ranks, and 1, 2, 4 virtual nodes (``HPCPAX_RANKS_PER_NODE``).
Threads per rank: ``max(1, cores // ranks)`` (``OMP_NUM_THREADS``,
``NUMBA_NUM_THREADS``, torch's intra-op threads), the same for every method.

The emulated-cluster benchmarks (``cluster_lm.py``, ``cluster_plan_modes.py``:
real network namespaces as nodes, shaped links) run in the full set only;
they are drivers that start their own ``mpirun`` jobs and say ``skipped``
(with the reason) where they cannot build a cluster (not root, no ``ip netns``).

Usage: ``python benchmarks/run_all.py [--quick] [--only NAME ...]``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
CORES = os.cpu_count() or 1

#: (script, ranks, ranks_per_node or None, extra args) per benchmark, full run.
FULL_JOBS = [
    ("limits.py", 1, None, []), ("limits.py", 2, None, []), ("limits.py", 4, None, []),
    ("torch_sparse.py", 1, 1, []), ("torch_sparse.py", 2, 2, []), ("torch_sparse.py", 4, 4, []),
    ("torch_sparse.py", 2, 1, []), ("torch_sparse.py", 4, 2, []), ("torch_sparse.py", 4, 1, []),
    ("torch_lm.py", 1, 1, []), ("torch_lm.py", 2, 2, []), ("torch_lm.py", 4, 4, []),
    ("torch_lm.py", 4, 2, []),
    ("mpi_baselines.py", 2, 2, []), ("mpi_baselines.py", 4, 2, []),
    ("allreduce.py", 2, None, []), ("allreduce.py", 4, None, []),
    ("kernels.py", 1, None, []),
    ("sparse_sync.py", 4, None, ["--ranks-per-node", "2", "--servers-per-node", "0"]),
    ("ps_batching.py", 4, 2, []),
    ("hot_rows.py", 6, 2, []),
    # Drivers (ranks 0: run directly, not under mpirun): they bring up an emulated
    # multi-node cluster themselves and report "skipped" without root or ip netns.
    ("cluster_lm.py", 0, None, []),
    ("cluster_plan_modes.py", 0, None, []),
    ("stragglers.py", 4, None, []),
    ("torch_adapter.py", 4, 2, ["--model", "lm"]), ("torch_adapter.py", 4, 2, ["--model", "dlrm"]),
]
#: The same, tiny (``--quick``): the smallest layouts that still cross a node.
QUICK_JOBS = [
    ("limits.py", 2, None, []),
    ("torch_sparse.py", 1, 1, []), ("torch_sparse.py", 2, 1, []),
    ("torch_lm.py", 2, 1, []),
    ("mpi_baselines.py", 2, 1, []),
    ("allreduce.py", 2, None, []),
    ("kernels.py", 1, None, []),
    ("sparse_sync.py", 2, None, ["--ranks-per-node", "1", "--servers-per-node", "0"]),
    ("ps_batching.py", 2, 1, []),
    ("stragglers.py", 3, None, []),
]

TARGETS = [
    # (key in the results JSON, description, op, threshold)
    ("ratio_torch_sparse_vs_hpcpax", "torch gloo sparse allreduce time / hpcpax PS time, "
     "4 ranks", ">=", 2.0),
    ("ratio_hpcpax_vs_torch_ddp_lm", "hpcpax samples/s / torch DDP samples/s, lm, 4 ranks",
     ">=", 1.5),
    ("ratio_offnode_allgather_vs_hpcpax", "off-node bytes allgather / hpcpax, 4 ranks "
     "as 2 nodes", ">=", 3.0),
    ("ratio_offnode_hpcpax_vs_lower_bound", "off-node bytes hpcpax / lower bound, 4 ranks "
     "as 2 nodes", "<=", 1.05),
    ("cluster_ratio_auto_vs_allgather", "emulated cluster, lm: allgather s/step / auto's, "
     "worst of 2 and 3 nodes", ">=", 1.5),
    ("cluster_ratio_auto_vs_torch_ddp", "emulated cluster, lm: torch DDP s/step / auto's",
     ">=", 2.0),
    ("cluster_ratio_auto_vs_best_fixed", "emulated cluster, lm: best fixed plan s/step / "
     "auto's", ">=", 0.9),
    ("cluster_ratio_step_vs_limit", "emulated cluster, lm: auto s/step / (compute + "
     "lower-bound off-node bytes / link rate)", "<=", 1.5),
    ("cluster_plan_modes_ratio_auto_vs_best", "emulated cluster, plan_modes at 0.5/2/10 "
     "Gbit/s: auto / best fixed samples/s, worst rate", ">=", 0.9),
    ("ratio_ssp_vs_bsp_transient", "samples/s ssp:3 / bsp, every worker stalls 5x on 5 % of "
     "steps, 1 server + 3 workers", ">=", 1.3),
    ("ratio_asp_vs_bsp_persistent", "samples/s asp / bsp, one worker 2x slower", ">=", 1.5),
    ("overhead_relaxed_no_straggler", "samples/s bsp / ssp:3 without stragglers", "<=", 1.05),
    ("loss_gap_ssp", "relative training-loss gap ssp:3 vs bsp, same samples", "<=", 0.02),
    ("ratio_adapter_vs_torch_ddp_lm", "hpcpax.torch samples/s / torch DDP samples/s, "
     "examples/torch_lm.py, 4 ranks as 2 nodes", ">=", 1.3),
    ("overhead_adapter_1rank_lm", "plain torch samples/s / hpcpax.torch samples/s, "
     "examples/torch_lm.py, 1 rank", "<=", 1.15),
]

NOTES = [
    f"This machine has {CORES} cores: runs with more ranks than cores are oversubscribed "
    "(4 ranks on 2 cores), so times there include scheduling waits; bytes do not.",
    "Virtual nodes: HPCPAX_RANKS_PER_NODE cuts the ranks into nodes of that many "
    "consecutive ranks; off-node bytes are those between virtual nodes.",
    "Fair layout: hpcpax runs with servers_per_node=0 (every rank a worker hosting its "
    "partitions), as torch's N workers; the same processes do the gradient work.",
    "gloo's sparse allreduce is an allgather; its bytes are computed by the allgather "
    "formula (each rank's coalesced nnz x (8 + 4 dim) bytes reach each other rank).",
    "Off-node lower bound: for each node, unique rows of the node whose owner is on another "
    "node, x (8 + 4 dim) for the push and the same for the pull (ids out, rows back).",
    "hpcpax's sparse sync time holds the pull and the owner-side optimizer update; torch's "
    "sync-only time holds neither (a replica needs no pull).",
    "stragglers.py: 1 parameter server + 3 workers (quick: + 2) on one node; a straggler "
    "sleeps (FACTOR - 1) x its compute time (no CPU); bsp and the relaxed model interleaved, "
    "median of the rounds' ratios.",
]


def threads_for(ranks):
    return max(1, CORES // ranks)


def run_job(script, ranks, ranks_per_node, extra, quick, timeout):
    """Run one benchmark under mpirun; returns a record (its JSON line, or the error)."""
    env = dict(os.environ)
    threads = threads_for(max(ranks, 1))
    env.update({"OMP_NUM_THREADS": str(threads), "NUMBA_NUM_THREADS": str(threads),
                "MKL_NUM_THREADS": str(threads), "PYTHONPATH": ROOT + os.pathsep
                + env.get("PYTHONPATH", ""), "PYTHONWARNINGS": "ignore"})
    env.pop("HPCPAX_RANKS_PER_NODE", None)
    if ranks_per_node is not None:
        env["HPCPAX_RANKS_PER_NODE"] = str(ranks_per_node)
    if ranks == 0:  # a driver that starts its own mpirun jobs (on an emulated cluster)
        command = [sys.executable, os.path.join(HERE, script)] + extra + (
            ["--quick"] if quick else [])
        record = {"script": script, "ranks": 0, "ranks_per_node": None, "num_nodes": None,
                  "threads_per_rank": 1, "oversubscribed": False,
                  "command": " ".join(["python", f"benchmarks/{script}"] + command[2:])}
        timeout = max(timeout, 3600)
    else:
        command = ["mpirun", "-n", str(ranks), sys.executable, "-m", "mpi4py",
                   os.path.join(HERE, script)] + extra + (["--quick"] if quick else [])
        record = {"script": script, "ranks": ranks, "ranks_per_node": ranks_per_node or ranks,
                  "num_nodes": ranks // (ranks_per_node or ranks), "threads_per_rank": threads,
                  "oversubscribed": ranks > CORES, "command": " ".join(command[:3] + [
                      "python -m mpi4py", f"benchmarks/{script}"] + command[6:])}
    start = time.perf_counter()
    try:
        # mpirun's own timeout kills every rank; the subprocess one is the backstop.
        env["MPIEXEC_TIMEOUT"] = str(timeout)
        done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=timeout + 15)
        record["returncode"] = done.returncode
        stdout, stderr = done.stdout, done.stderr
    except subprocess.TimeoutExpired as exc:
        record["returncode"] = "timeout"
        stdout = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        stderr = exc.stderr.decode() if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    record["wall_seconds"] = round(time.perf_counter() - start, 2)
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    parsed = []
    for line in lines:
        try:
            parsed.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    if parsed:
        record["result"] = parsed[-1]
    else:
        record["error"] = (stderr or stdout)[-2000:]
    return record


def find(records, script, ranks, num_nodes):
    for r in records:
        if (r["script"] == script and r["ranks"] == ranks and r["num_nodes"] == num_nodes
                and "result" in r):
            return r["result"]
    return None


def headline(records, quick):
    """The cross-benchmark ratios, at 4 ranks as 2 nodes (quick: 2 ranks as 2 nodes)."""
    ranks, nodes = (2, 2) if quick else (4, 2)
    sparse = find(records, "torch_sparse.py", ranks, nodes) or {}
    lm = (find(records, "torch_lm.py", ranks, 2 if not quick else 2)
          or find(records, "torch_lm.py", ranks, 1) or {})
    base = find(records, "mpi_baselines.py", ranks, nodes) or {}
    cluster = find(records, "cluster_lm.py", 0, None) or {}
    plan_modes = find(records, "cluster_plan_modes.py", 0, None) or {}
    stragglers = find(records, "stragglers.py", 3 if quick else 4, 1) or {}
    adapter = find(records, "torch_adapter.py", ranks, nodes) or {}
    return {
        **{key: stragglers.get(key) for key in (
            "ratio_ssp_vs_bsp_transient", "ratio_asp_vs_bsp_persistent",
            "overhead_relaxed_no_straggler", "loss_gap_ssp", "max_observed_staleness",
            "staleness_bound")},
        "headline_layout": f"{ranks} ranks as {nodes} virtual nodes",
        "ratio_torch_sparse_vs_hpcpax": sparse.get("ratio_torch_vs_hpcpax"),
        "ratio_hpcpax_vs_torch_ddp_lm": lm.get("ratio_hpcpax_vs_torch_ddp"),
        "ratio_offnode_allgather_vs_hpcpax": base.get("ratio_offnode_allgatherv_vs_hpcpax"),
        "ratio_offnode_torch_sparse_vs_hpcpax": sparse.get("ratio_offnode_torch_vs_hpcpax"),
        "ratio_offnode_hpcpax_vs_lower_bound": base.get("ratio_offnode_hpcpax_vs_lower_bound"),
        "ratio_adapter_vs_torch_ddp_lm": adapter.get("ratio_vs_torch_ddp"),
        "overhead_adapter_1rank_lm": adapter.get("overhead_1rank_vs_torch"),
        "ratio_offnode_allgather_vs_lower_bound_push": _ratio(
            base.get("sparse_offnode_bytes_per_step_allgatherv"),
            base.get("sparse_offnode_lower_bound_push_per_step")),
        **{f"cluster_{k}": cluster.get(k) for k in (
            "ratio_auto_vs_allgather", "ratio_auto_vs_torch_ddp", "ratio_auto_vs_best_fixed",
            "ratio_step_vs_limit", "offnode_predicted_error", "skipped")},
        "cluster_plan_modes_ratio_auto_vs_best": plan_modes.get("ratio_auto_vs_best"),
    }


def _ratio(a, b):
    return a / b if a is not None and b else None


def _fmt(value):
    if value is None:
        return "-"
    if isinstance(value, float):
        if value == 0:
            return "0"
        if abs(value) >= 1e5:
            return f"{value:.3e}"
        return f"{value:.4g}"
    return str(value)


TABLE_COLUMNS = {
    "torch_sparse.py": ["seconds_per_step_torch", "seconds_per_step_hpcpax",
                        "seconds_pull_hpcpax", "seconds_push_hpcpax", "ratio_torch_vs_hpcpax",
                        "bytes_per_step_torch", "bytes_per_step_hpcpax",
                        "offnode_bytes_per_step_torch", "offnode_bytes_per_step_hpcpax",
                        "offnode_lower_bound_per_step", "ratio_offnode_hpcpax_vs_lower_bound"],
    "torch_lm.py": ["samples_per_s_torch_ddp", "samples_per_s_hpcpax",
                    "ratio_hpcpax_vs_torch_ddp", "bytes_per_step_torch_ddp",
                    "bytes_per_step_hpcpax", "offnode_bytes_per_step_torch_ddp",
                    "offnode_bytes_per_step_hpcpax"],
    "mpi_baselines.py": ["dense_seconds_per_tensor", "dense_seconds_one_buffer",
                         "dense_seconds_hpcpax", "sparse_seconds_allgatherv",
                         "sparse_seconds_hpcpax_ps", "sparse_offnode_bytes_per_step_allgatherv",
                         "sparse_offnode_bytes_per_step_hpcpax",
                         "sparse_offnode_lower_bound_per_step",
                         "ratio_offnode_allgatherv_vs_hpcpax",
                         "ratio_offnode_hpcpax_vs_lower_bound"],
    "limits.py": None,
    "allreduce.py": None,
    "kernels.py": None,
    "sparse_sync.py": None,
    "ps_batching.py": None,
    "hot_rows.py": ["ratio_owner_egress_before_vs_after", "ratio_owner_egress_hot_set",
                    "ratio_owner_ingress_hot_set", "uniform_trees_chosen",
                    "ratio_step_time_before_vs_after", "ratio_uniform"],
    "cluster_lm.py": ["ratio_auto_vs_allgather", "ratio_auto_vs_torch_ddp",
                      "ratio_auto_vs_best_fixed", "ratio_step_vs_limit",
                      "offnode_bytes_auto", "offnode_bytes_predicted", "skipped"],
    "cluster_plan_modes.py": ["ratio_auto_vs_best", "skipped"],
    "stragglers.py": ["ratio_ssp_vs_bsp_transient", "ratio_asp_vs_bsp_persistent",
                      "overhead_relaxed_no_straggler", "loss_gap_ssp", "max_observed_staleness",
                      "staleness_bound"],
    "torch_adapter.py": ["samples_per_s_torch_ddp", "samples_per_s_adapter",
                         "ratio_vs_torch_ddp", "samples_per_s_plain_1rank",
                         "samples_per_s_adapter_1rank", "overhead_1rank_vs_torch",
                         "bytes_per_step_torch_ddp", "bytes_per_step_adapter"],
}


def markdown(report):
    out = [f"# hpcpax benchmarks, {report['date']}{' (quick)' if report['quick'] else ''}", ""]
    out += [f"- {note}" for note in report["notes"]] + [""]
    out += ["## Targets", "", "| figure | value | target | met |", "|---|---|---|---|"]
    for key, text, op, threshold in TARGETS:
        value = report.get(key)
        met = "-" if value is None else ("yes" if (value >= threshold if op == ">=" else
                                                   value <= threshold) else "**no**")
        out.append(f"| {text} (`{key}`) | {_fmt(value)} | {op} {threshold} | {met} |")
    out.append("")
    for script, columns in TABLE_COLUMNS.items():
        records = [r for r in report["runs"] if r["script"] == script]
        if not records:
            continue
        out += [f"## {script}", ""]
        ok = [r for r in records if "result" in r]
        if columns is None:
            keys = []
            for r in ok:
                keys += [k for k, v in r["result"].items()
                         if isinstance(v, (int, float)) and not isinstance(v, bool)
                         and k not in keys and k not in ("ranks", "nodes")]
            columns = keys[:14]
        out.append("| ranks | nodes | " + " | ".join(columns) + " |")
        out.append("|---|---|" + "---|" * len(columns))
        for r in ok:
            over = "*" if r["oversubscribed"] else ""
            out.append(f"| {r['ranks']}{over} | {r['num_nodes']} | "
                       + " | ".join(_fmt(r["result"].get(c)) for c in columns) + " |")
        for r in records:
            if "error" in r:
                out.append(f"\n{script} at {r['ranks']} ranks failed "
                           f"(returncode {r['returncode']}): `{r['error'][-300:].strip()}`")
        out.append("")
    out.append("`*` oversubscribed (more ranks than cores). Seconds are medians per step; "
               "bytes are per step summed over ranks (sent side).")
    return "\n".join(out) + "\n"


def plots(report, stem):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    runs = [r for r in report["runs"] if "result" in r]

    def series(script, pick, key):
        points = sorted((r["ranks"], r["num_nodes"], r["result"].get(key)) for r in runs
                        if r["script"] == script and pick(r) and r["result"].get(key) is not None)
        return points

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    one_node = lambda r: r["num_nodes"] == 1  # noqa: E731
    for key, label in (("seconds_per_step_torch", "torch gloo"),
                       ("seconds_per_step_hpcpax", "hpcpax PS")):
        pts = series("torch_sparse.py", one_node, key)
        axes[0].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    axes[0].set(title="sparse sync, 1 node: s/step", xlabel="ranks (4 = oversubscribed)",
                ylabel="seconds per step")
    four = lambda r: r["ranks"] == max(x["ranks"] for x in runs)  # noqa: E731
    for key, label in (("offnode_bytes_per_step_torch", "torch (allgather)"),
                       ("offnode_bytes_per_step_hpcpax", "hpcpax PS"),
                       ("offnode_lower_bound_per_step", "lower bound")):
        pts = sorted((p[1], p[2]) for p in series("torch_sparse.py", four, key))
        axes[1].plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=label)
    axes[1].set(title="sparse sync: off-node bytes/step", xlabel="virtual nodes",
                ylabel="bytes per step")
    for key, label in (("samples_per_s_torch_ddp", "torch DDP"),
                       ("samples_per_s_hpcpax", "hpcpax.train")):
        pts = series("torch_lm.py", lambda r: r["num_nodes"] == 1, key)
        axes[2].plot([p[0] for p in pts], [p[2] for p in pts], "o-", label=label)
    axes[2].set(title="lm training, 1 node: samples/s", xlabel="ranks", ylabel="samples/s")
    for ax in axes:
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    path = f"{stem}-scaling.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    written.append(path)
    return written


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, smallest layouts")
    parser.add_argument("--only", nargs="*", help="run only these scripts (e.g. torch_lm.py)")
    parser.add_argument("--timeout", type=int, default=None, help="seconds per job")
    parser.add_argument("--out", default=RESULTS, help="results folder")
    args = parser.parse_args()
    timeout = args.timeout or (90 if args.quick else 600)
    jobs = QUICK_JOBS if args.quick else FULL_JOBS
    if args.only:
        jobs = [j for j in jobs if j[0] in args.only]
    runs = []
    for script, ranks, rpn, extra in jobs:
        if not os.path.exists(os.path.join(HERE, script)):
            runs.append({"script": script, "ranks": ranks, "ranks_per_node": rpn or ranks,
                         "num_nodes": ranks // (rpn or ranks), "oversubscribed": ranks > CORES,
                         "returncode": None, "error": "script not present"})
            continue
        print(f"run_all: {script} on {ranks} ranks"
              + (f" as {ranks // rpn} virtual nodes" if rpn else ""), file=sys.stderr, flush=True)
        runs.append(run_job(script, ranks, rpn, extra, args.quick, timeout))
    date = datetime.date.today().isoformat()
    report = {
        "date": date, "quick": args.quick,
        "machine": {"cores": CORES, "platform": platform.platform(),
                    "python": platform.python_version(), "loadavg_at_end": os.getloadavg(),
                    "torch": _torch_version()},
        "notes": NOTES,
        **headline(runs, args.quick),
        "targets": {key: {"description": text, "op": op, "threshold": t}
                    for key, text, op, t in TARGETS},
        "runs": runs,
    }
    os.makedirs(args.out, exist_ok=True)
    stem = os.path.join(args.out, date + ("-quick" if args.quick else ""))
    with open(stem + ".json", "w", encoding="utf-8") as handle:
        json.dump(_finite(report), handle, indent=1)
    table = markdown(report)
    with open(stem + ".md", "w", encoding="utf-8") as handle:
        handle.write(table)
    try:
        report_plots = plots(report, stem)
    except Exception as exc:  # a plot must never lose the numbers
        report_plots = [f"plot failed: {exc}"]
    print(table)
    print(f"run_all: wrote {stem}.json, {stem}.md, " + ", ".join(report_plots), file=sys.stderr)
    return 0 if all("result" in r for r in runs) else 1


def _finite(value):
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _torch_version():
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return None


if __name__ == "__main__":
    sys.exit(main())
