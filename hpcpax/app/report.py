"""``python -m hpcpax.report RUN_DIR``: plots and a text summary of a run.

Reads ``metrics.jsonl`` (and ``summary.json``, ``plan.json`` when present)
and writes ``loss.png``, ``throughput.png`` and ``bytes.png`` into RUN_DIR
with matplotlib's Agg backend; prints the summary on stdout. Works on a run
still going (``metrics.jsonl`` is flushed line by line). Not collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from ..errors import DependencyError
from ..models.metrics import perplexity
from .metrics import read_metrics
from .throughput import steady_throughput, unsteady_steps

__all__ = ["main", "make_report", "summarize"]


def _load(run_dir):
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: no such file (is {run_dir} a run directory?)")
    records = read_metrics(path)
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval" in r]
    extra = {"decisions": [r for r in records if "batch_shares" in r],
             "dense_period": [r["dense_period"] for r in records if "dense_period" in r]}
    for name in ("summary.json", "plan.json", "config.json"):
        file_path = os.path.join(run_dir, name)
        if os.path.isfile(file_path):
            with open(file_path, encoding="utf-8") as handle:
                extra[name.split(".")[0]] = json.load(handle)
    return steps, evals, extra


def _human(nbytes):
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{nbytes:,.1f} {unit}" if unit != "B" else f"{int(nbytes):,} B"
        nbytes /= 1024


def summarize(run_dir) -> str:
    """The text summary of a run directory."""
    steps, evals, extra = _load(run_dir)
    lines = [f"run: {os.path.abspath(run_dir)}"]
    config = extra.get("config", {})
    if config:
        lines.append(f"model: {config.get('model')}  global batch: {config.get('global_batch')}"
                     f"  optimizers: {config.get('optimizer')} (dense), "
                     f"{config.get('sparse_optimizer')} (sparse)")
    plan = extra.get("plan")
    if plan and "variables" in plan:  # a planner Plan (auto/hybrid), not a fixed table
        entries = plan["variables"]
        plan = entries if isinstance(entries, dict) else {e["name"]: e for e in entries}
    if plan:
        lines.append("plan: " + ", ".join(f"{n}={e.get('method')}" for n, e in plan.items()))
    if steps:
        losses = np.array([r["loss"] for r in steps], dtype=float)
        rates = np.array([r["samples_per_s"] for r in steps], dtype=float)
        head = min(5, len(losses))
        lines.append(f"steps: {steps[0]['step']}..{steps[-1]['step']} ({len(steps)} logged)")
        lines.append(f"loss: first {losses[0]:.4f}, last {losses[-1]:.4f} "
                     f"(mean of first {head}: {losses[:head].mean():.4f}, "
                     f"last {head}: {losses[-head:].mean():.4f})")
        lines.append(_throughput_line(steps, config, extra.get("summary"), rates))
        times = {}
        for r in steps:
            for phase, seconds in r.get("time", {}).items():
                times[phase] = times.get(phase, 0.0) + seconds
        total_time = sum(times.values()) or 1.0
        if times:
            lines.append("time per step by phase (mean over workers): " + ", ".join(
                f"{p} {1e3 * s / len(steps):.1f} ms ({100 * s / total_time:.0f}%)"
                for p, s in times.items()))
        moved = _bytes_by_phase(steps)
        if moved:
            lines.append("bytes sent by workers per step: " + ", ".join(
                f"{p} {_human(v.sum() / len(steps))}" for p, v in moved.items()))
        owner = [r["owner"] for r in steps if "owner" in r]
        if owner:  # the parameter-server owners' links (hot rows load them)
            mean = {k: sum(o[k] for o in owner) / len(steps) for k in owner[0]}
            lines.append("owner row bytes per step: " + ", ".join(
                f"{d} {_human(mean[d])} ({_human(mean[d + '_inter'])} off-node)"
                for d in ("egress", "ingress")))
    if evals:
        lines.append(f"last eval (step {evals[-1]['step']}): "
                     + _eval_text(evals[-1]["eval"], config.get("model")))
    summary = extra.get("summary")
    if summary:
        lines.append(f"wall: {summary.get('wall_seconds', 0):.1f} s, checkpoints "
                     f"{summary.get('checkpoint_seconds', 0):.1f} s"
                     + (f", preempted by {summary['signal']}" if summary.get("preempted") else ""))
        phases = summary.get("phases", {})
        if phases:
            lines.append("totals over all ranks: " + ", ".join(
                f"{p} {_human(e.get('sent_bytes', 0))} sent"
                for p, e in phases.items() if e.get("sent_bytes")))
        if summary.get("trace"):
            lines.append(f"timeline: {summary['trace']} (open in https://ui.perfetto.dev or "
                         "chrome://tracing)")
        shares = [r["batch_shares"] for r in extra.get("decisions", [])]
        if shares:
            lines.append(f"batch shares: {len(shares)} change(s), last at step "
                         f"{shares[-1]['step']}: {shares[-1]['to']}")
    record = (extra.get("summary") or {}).get("dense_period")
    if record:
        lines.append(f"dense refresh period ({record['setting']}): "
                     f"{len(extra['dense_period'])} change(s), final k per worker "
                     f"{record['final_k']}; plot: dense_period.png")
    return "\n".join(lines)


def _eval_text(values, model):
    """One eval record as text; an lm's perplexity is ``exp(loss)`` of the set's mean
    loss (runs before issue 11 logged a mean of per-worker perplexities)."""
    values = dict(values)
    if values.get("loss") is not None and (model == "lm" or "perplexity" in values):
        values["perplexity"] = perplexity(values["loss"])
    return ", ".join(f"{k}={v}" if k == "samples" or v is None else f"{k}={v:.4f}"
                     for k, v in values.items())


def _throughput_line(steps, config, summary, rates):
    """Steady-state samples/s (as in summary.json, or worked out the same way)."""
    figure = (summary or {}).get("throughput")
    if not figure and config.get("global_batch"):
        first = steps[0]["step"]
        figure = steady_throughput(steps, config["global_batch"],
                                   unsteady_steps(config, first)) if "plan" in config else None
    line = f"throughput: median {np.median(rates):,.0f} samples/s per step"
    if figure and figure.get("samples_per_s"):
        line = (f"throughput: steady state {figure['samples_per_s']:,.0f} samples/s over steps "
                f"{figure['steps']}; median {np.median(rates):,.0f} samples/s per step, "
                f"all steps {figure['all_steps_samples_per_s']:,.0f}")
    return line


def _bytes_by_phase(steps):
    phases = sorted({p for r in steps for p in r.get("bytes", {})})
    return {p: np.array([r.get("bytes", {}).get(p, {}).get("sent", 0) for r in steps], float)
            for p in phases}


def make_report(run_dir) -> list:
    """Write the PNG plots into ``run_dir``; returns their paths."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise DependencyError("plots need matplotlib: pip install hpcpax[plot]") from None
    steps, evals, extra = _load(run_dir)
    x = [r["step"] for r in steps]
    written = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["loss"] for r in steps], label="train loss (global mean)")
    if evals:
        for key in sorted(evals[0]["eval"]):
            if key in ("loss", "auc"):
                ax.plot([r["step"] for r in evals], [r["eval"][key] for r in evals], "o-",
                        label=f"eval {key}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    ax.grid(alpha=0.3)
    written.append(_save(fig, run_dir, "loss.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(x, [r["samples_per_s"] for r in steps])
    ax.set_xlabel("step")
    ax.set_ylabel("samples / s")
    ax.grid(alpha=0.3)
    written.append(_save(fig, run_dir, "throughput.png", plt))

    fig, ax = plt.subplots(figsize=(7, 4))
    moved = _bytes_by_phase(steps)
    if moved:
        ax.stackplot(x, *moved.values(), labels=list(moved))
        ax.legend(loc="upper right", fontsize="small")
    ax.set_xlabel("step")
    ax.set_ylabel("bytes sent per step (all workers)")
    ax.grid(alpha=0.3)
    written.append(_save(fig, run_dir, "bytes.png", plt))

    periods = [r for r in steps if "dense_k" in r]
    if periods:
        written.append(_plot_dense_period(periods, extra["dense_period"], run_dir, plt))
    return written


def _plot_dense_period(steps, changes, run_dir, plt):
    """``dense_period.png``: each worker's refresh period k over the steps, the
    divergence measured at each change beside it."""
    fig, ax = plt.subplots(figsize=(7, 4))
    workers = sorted({w for r in steps for w in r["dense_k"]}, key=int)
    for w in workers:
        points = [(r["step"], r["dense_k"][w]) for r in steps if w in r["dense_k"]]
        ax.step([p[0] for p in points], [p[1] for p in points], where="post",
                label=f"worker {w}")
    ax.set_xlabel("step")
    ax.set_ylabel("dense refresh period k (steps)")
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3)
    if changes:
        other = ax.twinx()
        other.plot([c["step"] for c in changes], [c["divergence"] for c in changes], "k.",
                   label="divergence at a change")
        other.set_ylabel("replica divergence |w - mean| / |mean|")
        other.legend(loc="upper right", fontsize="small")
    ax.legend(loc="upper left", fontsize="small")
    return _save(fig, run_dir, "dense_period.png", plt)


def _save(fig, run_dir, name, plt):
    path = os.path.join(run_dir, name)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv=None) -> int:
    """``python -m hpcpax.report RUN_DIR``: summary, plots and files of a run; the exit status."""
    parser = argparse.ArgumentParser(prog="python -m hpcpax.report",
                                     description="Plot and summarize an hpcpax.train run.")
    parser.add_argument("run_dir", help="the run directory (holds metrics.jsonl)")
    parser.add_argument("--no-plots", action="store_true", help="print the summary only")
    args = parser.parse_args(argv)
    try:
        print(summarize(args.run_dir))
        if not args.no_plots:
            for path in make_report(args.run_dir):
                print(f"wrote {path}")
    except (FileNotFoundError, DependencyError) as exc:
        print(f"hpcpax.report: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
