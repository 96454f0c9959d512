"""Stragglers: relaxed consistency (ssp:3, asp) against BSP on the ``lm`` model.

Three scenarios, each a pair of training runs in this ``mpirun`` job (in-process
:class:`~hpcpax.app.trainer.Trainer` runs, synthetic data, ``--plan ps``),
interleaved round by round (``bsp``, relaxed, ``bsp``, relaxed, ...) so the
machine's noise hits both alike:

- ``none``: no straggler; ``bsp`` vs ``ssp:3``;
- ``transient``: every worker stalls 5x on 5 % of its steps (``--stalls
  0.05:5``, the same steps in both runs); ``bsp`` vs ``ssp:3``;
- ``persistent``: the last worker is 2x slower all the time (``--straggler
  RANK:2``); ``bsp`` vs ``asp``;
- ``persistent_heavy``: the same straggler on a compute-heavier step
  (``HEAVY``: hidden 512-512, 12288 samples per step, ``--heavy-steps``
  steps; compute about 62 % of a BSP step where the default size's is
  20-30 %, so the straggler is close to a 2x slower worker); ``bsp`` vs
  ``balanced`` only.

Besides, ``balanced`` (BSP with ``--batch-shares speed --rebalance-every 10``)
runs in ``persistent`` and ``persistent_heavy``, and ``auto``
(``--consistency auto --auto-segment 10``) in the first three scenarios:
``ratio_balanced_bsp_vs_bsp_persistent`` (measured in ``persistent_heavy``,
the setting of its goal: at the default size a 2x slower compute makes BSP
only about 1.2x slower, which bounds what balancing can win; that size's
figure is ``ratio_balanced_bsp_vs_bsp_persistent_default_size``) and
``ratio_auto_vs_best_fixed`` (the minimum over the scenarios of auto over
the best fixed mode of that round; each scenario also under its own key)
compare samples over training seconds (mode changes included) of every
mode alike; ``loss_gap_auto`` is the worst scenario's relative loss gap of
``auto`` against ``bsp`` (``loss_gap_by_mode``: every mode's, per scenario;
``asp`` applies each worker's push as its own optimizer update, so its loss
is not BSP's even without staleness). ``bound_wait_share`` is the seconds
the relaxed pulls waited at the staleness bound over the workers' training
seconds. In ``none``, ``ssp:3+dense-auto`` (``ssp:3`` with
``--dense-period auto``) runs too: ``ratio_dense_period_auto_vs_every_step``
and ``loss_gap_dense_period_auto`` compare it with ``ssp:3`` (replicas
refreshed every step), with each worker's final ``k`` and the number of
changes in ``dense_k`` / ``dense_k_changes``. ``--only`` and ``--modes``
run a subset.

A straggler sleeps (FACTOR - 1) x its own compute time, so it costs no CPU.
Samples/s is every worker's samples over the training wall time (``asp`` runs
until the workers together trained steps x global batch samples). The loss is
the mean training loss of the last fifth of the steps (the same samples for
``bsp`` and ``ssp``). Figures: median over the rounds of each round's ratio,
with the spread (min, max). ``slowdown_from_*`` compare each model with its
own runs without stragglers: on an oversubscribed node most of the ratios
is the cost of the lockstep collectives, not of the stragglers.

Dense Adam runs at lr 0.001 (``--lr``): at the trainer's default 0.003 the
3-step-stale dense updates of ``ssp:3`` made this model's loss climb after
~150 steps (see docs/measurements.md, "Consistency: the relaxed models").

``--emulate COMPUTE`` (``--dilation D``) runs every mode with emulated
accelerators (``--emulate-compute``: the forward and backward a wait that
holds no CPU, the stalls and the straggler stretching it), so that 4-8
workers on 2 cores measure the consistency models, not a queue for the
cores: ``cpu_busy_max`` (the workers' CPU seconds over cores x wall, the
busiest step) says whether they did. The loss is not computed there, so the
loss gaps are measured without ``--emulate``. ``--loss-gaps FILE`` (an
earlier real-compute run's output) adds ``ratio_auto_vs_best_fixed_within_loss_gap``:
auto against the fixed modes whose loss gap to bsp there meets
``loss_gap_auto``'s goal, the modes it leaves out in ``excluded_by_loss_gap``.

Run: ``mpirun -n 4 python -m mpi4py benchmarks/stragglers.py`` (1 server + 3
workers; ``--quick`` for a tiny check). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import numpy as np
from mpi4py import MPI

from hpcpax.app.trainer import Trainer

MODEL = {"model": "lm", "vocab_size": 20_000, "emb_dim": 32, "context": 4,
         "hidden": [256, 256], "out_dim": 32, "num_sampled": 256, "global_batch": 768,
         "plan": "ps", "quiet": True}
QUICK = {"model": "lm", "vocab_size": 2_000, "emb_dim": 8, "context": 3, "hidden": [32],
         "out_dim": 8, "num_sampled": 32, "global_batch": 96, "plan": "ps", "quiet": True}
STALLS = "0.05:5"
STALENESS = 3
#: ssp:3 with the dense refresh period set at run time (--dense-period auto).
DENSE_AUTO = f"ssp:{STALENESS}+dense-auto"
GOALS = {"ratio_ssp_vs_bsp_transient": (">=", 1.3), "ratio_asp_vs_bsp_persistent": (">=", 1.5),
         "overhead_relaxed_no_straggler": ("<=", 1.05), "loss_gap_ssp": ("<=", 0.02),
         "ratio_balanced_bsp_vs_bsp_persistent": (">=", 1.4),
         "ratio_auto_vs_best_fixed": (">=", 0.9), "loss_gap_auto": ("<=", 0.02)}


#: Modes that are not a --consistency value: their settings.
MODES = {"balanced": {"consistency": "bsp", "batch_shares": "speed", "rebalance_every": 10},
         "auto": {"consistency": "auto", "auto_segment": 10},
         DENSE_AUTO: {"consistency": f"ssp:{STALENESS}", "dense_period": "auto"}}


#: The model of ``persistent_heavy``: compute about 62 % of a BSP step here (the
#: default size's is 20-30 %), so a worker with 2x slower compute is close to a
#: 2x slower worker, the setting of the balanced-BSP goal (ideal 1.67 at 3
#: workers). 6144 samples per step until 2026-12-04n (compute 60-61 %; the
#: goal's figure 1.35-1.43 there, 1.46-1.50 at 12288: see docs/measurements.md).
HEAVY = {"hidden": [512, 512], "global_batch": 12288}
HEAVY_STEPS = 100


def scenarios(workers_last_rank, heavy=None):
    """``{name: (settings, (reference, relaxed, *more modes))}``."""
    return {
        "none": ({}, ("bsp", f"ssp:{STALENESS}", "auto", DENSE_AUTO)),
        "transient": ({"stalls": STALLS}, ("bsp", f"ssp:{STALENESS}", "auto")),
        "persistent": ({"straggler": f"{workers_last_rank}:2"},
                       ("bsp", "asp", "balanced", "auto")),
        "persistent_heavy": ({"straggler": f"{workers_last_rank}:2", **(heavy or HEAVY)},
                             ("bsp", "balanced")),
    }


def one_run(comm, base, consistency, extra, steps, seed, workdir):
    run_dir = comm.bcast(tempfile.mkdtemp(dir=workdir) if comm.Get_rank() == 0 else None)
    mode = MODES.get(consistency, {"consistency": consistency})
    trainer = Trainer({**base, **extra, **mode, "steps": steps,
                       "seed": seed, "run_dir": run_dir}, comm=comm)
    summary = trainer.run()
    leader = trainer.topology.worker_ranks[0]
    result = None
    if comm.Get_rank() == leader:
        losses = trainer.losses
        tail = losses[-max(1, len(losses) // 5):]
        config = trainer.config
        stale = bound_waits(summary, config["consistency"], config["time_dilation"],
                            trainer.topology.num_workers)
        servers = summary.get("servers") or []
        # this run's batch (persistent_heavy sets its own)
        samples = summary.get("samples") or steps * trainer.config["global_batch"]
        busy = cpu_busy(run_dir)
        result = {"samples_per_s": summary["mean_samples_per_s"],
                  "cpu_busy_max": busy,
                  # every mode alike: samples over the training seconds, mode changes included
                  "samples_per_s_train": samples / summary["train_seconds"],
                  # each decision: measured at step, in force from step, mode, why
                  "auto": [(d["step"], d.get("applies_from", d["step"] + 1), d["to"],
                            d["reason"]) for d in summary.get("auto") or []],
                  "auto_decision_wait_s": summary.get("auto_decision_wait_s"),
                  "loss": float(np.mean(tail)), "worker_steps": summary.get("worker_steps"),
                  "compute_share": compute_share(run_dir),
                  "dense_k": (summary.get("dense_period") or {}).get("final_k"),
                  "dense_k_changes": len((summary.get("dense_period") or {}).get("changes", [])),
                  "max_staleness": stale.get("max_gap"),
                  "bound_wait_share": stale.get("bound_wait_share"),
                  "staleness_violations": stale.get("violations"),
                  "server_cpu_fraction": (sum(s["cpu_seconds"] for s in servers)
                                          / max(1e-9, sum(s["phase_seconds"] for s in servers))
                                          if servers else None)}
    return comm.bcast(result, root=leader)


def bound_waits(summary, consistency, dilation, workers) -> dict:
    """The run's staleness figures: ``max_gap`` and ``violations`` (``auto``: over its
    ``ssp:S`` phases), and ``bound_wait_share``, the seconds the relaxed pulls waited
    at the staleness bound over the workers' training seconds (undilated)."""
    records = summary.get("staleness") or {}
    logs = [records[consistency]] if consistency in records else (
        list(records.values()) if consistency == "auto" else [])
    if not logs:
        return {}
    waited = sum(log["wait_seconds"] for log in logs) / dilation
    return {"max_gap": max(log["max_gap"] for log in logs),
            "violations": sum(log["violations"] for log in logs),
            "bound_wait_share": waited / max(1e-12, workers * summary["train_seconds"])}


def compute_share(run_dir):
    """Mean share of a step the workers spent in ``compute`` (straggler sleeps included)."""
    phases = {}
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            for phase, seconds in record.get("time", {}).items():
                phases[phase] = phases.get(phase, 0.0) + seconds
    total = sum(phases.values())
    return phases.get("compute", 0.0) / total if total else None


def cpu_busy(run_dir):
    """The machine's busiest step: all workers' CPU seconds over cores x the step's wall
    seconds (the server's CPU is not in the metrics lines: ``server_cpu_fraction``)."""
    cores, busiest = os.cpu_count() or 1, 0.0
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        for line in handle:
            record = json.loads(line)
            if record.get("cpu_busy"):
                busiest = max(busiest, sum(record["cpu_busy"]) / cores)
    return busiest


def spread(values):
    values = [v for v in values if v is not None]
    if not values:
        return {"median": None, "min": None, "max": None}
    return {"median": float(np.median(values)), "min": float(min(values)),
            "max": float(max(values))}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--lr", type=float, default=0.001, help="dense Adam learning rate "
                        "(the trainer's default 0.003 is unstable under ssp:3 staleness here)")
    parser.add_argument("--global-batch", type=int, default=MODEL["global_batch"])
    parser.add_argument("--hidden", default=None, help="hidden widths, e.g. 512,512 "
                        "(default 256,256); with --global-batch: a compute-heavier step")
    parser.add_argument("--heavy-steps", type=int, default=HEAVY_STEPS,
                        help="steps of the persistent_heavy runs (at most --steps)")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--emulate", default=None, metavar="COMPUTE",
                        help="emulated accelerators: --emulate-compute COMPUTE for every run "
                        "(stalls and the straggler slow the modeled wait); loss figures are "
                        "then not measured (the loss is not computed)")
    parser.add_argument("--dilation", type=float, default=1.0,
                        help="with --emulate: --time-dilation (the modeled compute x D, "
                        "times reported / D)")
    parser.add_argument("--only", default=None, help="comma-separated scenarios to run "
                        "(none, transient, persistent, persistent_heavy; default all)")
    parser.add_argument("--modes", default=None, help="comma-separated modes to run in each "
                        "scenario (default all: bsp, ssp:3 or asp, balanced, auto)")
    parser.add_argument("--loss-gaps", default=None, metavar="FILE",
                        help="an earlier real-compute run's output: also compare auto with "
                        "the fixed modes whose loss gap to bsp there meets loss_gap_auto's "
                        "goal (ratio_auto_vs_best_fixed_within_loss_gap)")
    args = parser.parse_args()
    if args.loss_gaps:
        measured_loss_gaps(args.loss_gaps)  # refused before the runs, not after
    base = dict(MODEL)
    if args.quick:
        base, args.steps, args.rounds = dict(QUICK), 12, 1
    base["lr"] = args.lr
    if args.emulate:
        base.update(emulate_compute=args.emulate, time_dilation=args.dilation)
    if not args.quick:
        base["global_batch"] = args.global_batch
        if args.hidden:
            base["hidden"] = [int(x) for x in args.hidden.split(",")]
    comm = MPI.COMM_WORLD
    size = comm.Get_size()
    if size < 3:
        raise SystemExit("stragglers.py needs >= 3 ranks (1 server + 2 workers)")
    heavy = {"global_batch": 4 * QUICK["global_batch"]} if args.quick else HEAVY
    cases = scenarios(size - 1, heavy)
    heavy_steps = min(args.steps, args.heavy_steps)
    if args.only:
        cases = {k: v for k, v in cases.items() if k in args.only.split(",")}
    if args.modes:
        keep = args.modes.split(",")
        cases = {k: (extra, tuple(m for m in modes if m in keep))
                 for k, (extra, modes) in cases.items()}
    cores = os.cpu_count() or 1
    out = {"benchmark": "stragglers", "ranks": size,
           "layout": f"{size} ranks on one node: 1 parameter server + {size - 1} workers "
                     f"(servers_per_node=1), {cores} cores"
                     + (" (oversubscribed)" if size > cores else ""),
           "model": base, "steps": args.steps, "rounds": args.rounds, "stalls": STALLS,
           "straggler": f"rank {size - 1} x2", "staleness_bound": STALENESS,
           "emulated": bool(args.emulate)}
    if "persistent_heavy" in cases:  # its model: the base with these settings
        out.update(heavy=heavy, heavy_steps=heavy_steps)
    runs = {name: {c: [] for c in pair} for name, (_, pair) in cases.items()}
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        workdir = comm.bcast(scratch if comm.Get_rank() == 0 else None)
        one_run(comm, base, "bsp", {}, 3, 0, workdir)  # warm-up: kernels compiled, caches
        for r in range(args.rounds):
            for name, (extra, pair) in cases.items():
                steps = heavy_steps if name == "persistent_heavy" else args.steps
                for consistency in pair:
                    runs[name][consistency].append(
                        one_run(comm, base, consistency, extra, steps, r, workdir))
    out["seconds"] = time.perf_counter() - started
    ratio = {}
    for name, (_, modes) in cases.items():
        reference, relaxed = scenarios(size - 1)[name][1][:2]  # bsp against ssp:3 / asp
        pairs = (list(zip(runs[name][reference], runs[name][relaxed]))
                 if reference in modes and relaxed in modes else [])
        ratio[name] = [b["samples_per_s"] / a["samples_per_s"] for a, b in pairs]
        ratio[name + "_loss"] = [abs(b["loss"] - a["loss"]) / a["loss"] for a, b in pairs
                                 if a["loss"]]  # emulated runs compute no loss
        out[name] = {c: {"samples_per_s": spread([x["samples_per_s"] for x in results]),
                         "compute_share": spread([x["compute_share"] for x in results]),
                         "samples_per_s_train": spread([x["samples_per_s_train"]
                                                        for x in results]),
                         "auto_decisions": [x["auto"] for x in results] if c == "auto"
                         else None,
                         "auto_decision_wait_s": [x["auto_decision_wait_s"] for x in results]
                         if c == "auto" else None,
                         "loss": spread([x["loss"] for x in results]),
                         "cpu_busy_max": max(x["cpu_busy_max"] for x in results),
                         "worker_steps": results[-1]["worker_steps"],
                         "max_staleness": max((x["max_staleness"] or 0) for x in results),
                         "bound_wait_share": spread([x["bound_wait_share"] for x in results]),
                         "dense_k": [x["dense_k"] for x in results],
                         "dense_k_changes": [x["dense_k_changes"] for x in results],
                         "server_cpu_fraction": spread([x["server_cpu_fraction"]
                                                        for x in results])}
                     for c, results in runs[name].items()}
    figures = {
        "ratio_ssp_vs_bsp_transient": spread(ratio.get("transient", [])),
        "ratio_asp_vs_bsp_persistent": spread(ratio.get("persistent", [])),
        "overhead_relaxed_no_straggler": spread([1.0 / x for x in ratio.get("none", [])]),
        "loss_gap_ssp": spread(ratio.get("transient_loss", [])),
        "loss_gap_ssp_no_straggler": spread(ratio.get("none_loss", [])),
    }
    figures.update(runtime_figures(runs, cases))
    if args.loss_gaps:
        within, excluded = within_loss_gap(runs, cases, measured_loss_gaps(args.loss_gaps))
        figures.update(within)
        out["loss_gaps_from"] = os.path.basename(args.loss_gaps)
        out["excluded_by_loss_gap"] = excluded
    if "loss_gap_by_mode" in figures:  # {scenario: {mode: spread}}
        out["loss_gap_by_mode"] = figures.pop("loss_gap_by_mode")
    for key, value in figures.items():
        out[key] = value["median"]
        out[key + "_spread"] = [value["min"], value["max"]]
    # What the stragglers cost each model, against its own runs without them: on an
    # oversubscribed node most of the ratios above is the lockstep collectives' cost
    ssp = f"ssp:{STALENESS}"
    needed = {"none": ("bsp", ssp), "transient": ("bsp", ssp), "persistent": ("bsp", "asp")}
    if not all(runs.get(name, {}).get(m) for name, modes in needed.items() for m in modes):
        return report(comm, out)  # --only / --modes left some out
    none_bsp = [x["samples_per_s"] for x in runs["none"]["bsp"]]
    none_ssp = [x["samples_per_s"] for x in runs["none"][ssp]]
    def slowdown(without, scenario, model):
        return spread([a / b["samples_per_s"] for a, b in zip(without, runs[scenario][model])])

    out["slowdown_from_stalls"] = {"bsp": slowdown(none_bsp, "transient", "bsp"),
                                   ssp: slowdown(none_ssp, "transient", ssp)}
    out["slowdown_from_persistent_straggler"] = {
        "bsp": slowdown(none_bsp, "persistent", "bsp"),
        "asp (against ssp:3 without stragglers)": slowdown(none_ssp, "persistent", "asp")}
    relaxed_runs = runs["transient"][ssp]
    out["max_observed_staleness"] = max((x["max_staleness"] or 0) for x in relaxed_runs)
    out["staleness_violations"] = sum((x["staleness_violations"] or 0) for x in relaxed_runs)
    return report(comm, out)


def measured_loss_gaps(path) -> dict:
    """``{scenario: {mode: relative loss gap to bsp}}`` of an earlier real-compute run of
    this benchmark (its JSON line, in ``path``): each mode's median loss against bsp's."""
    with open(path, encoding="utf-8") as handle:
        line = [x for x in handle if x.startswith("{")][-1]
    earlier = json.loads(line)
    if earlier.get("emulated"):
        raise SystemExit(f"--loss-gaps {path}: an emulated run computes no loss")
    gaps = {}
    for name, modes in earlier.items():
        if not (isinstance(modes, dict) and isinstance(modes.get("bsp"), dict)
                and modes["bsp"].get("loss", {}).get("median")):
            continue
        bsp = modes["bsp"]["loss"]["median"]
        gaps[name] = {m: abs(v["loss"]["median"] - bsp) / bsp for m, v in modes.items()
                      if m != "bsp" and isinstance(v, dict) and v.get("loss", {}).get("median")}
    return gaps


def within_loss_gap(runs, cases, gaps) -> dict:
    """``ratio_auto_vs_best_fixed`` against the fixed modes whose loss gap to bsp in
    ``gaps`` (:func:`measured_loss_gaps`) meets ``loss_gap_auto``'s goal (a mode the
    earlier run did not measure counts as meeting it): auto's own loss is held to that
    goal, so a fixed mode that misses it is not a speed auto could take. Per scenario and
    the minimum; ``excluded_by_loss_gap`` names the modes left out, with their gaps."""
    limit = GOALS["loss_gap_auto"][1]

    def allowed(name, mode):
        return gaps.get(name, {}).get(mode, 0.0) <= limit

    excluded = {name: {m: gap for m, gap in gaps.get(name, {}).items()
                       if m in modes and m != "auto" and not allowed(name, m)}
                for name, (_, modes) in cases.items() if "auto" in modes and len(modes) >= 2}
    return (auto_vs_best_fixed(runs, cases, "ratio_auto_vs_best_fixed_within_loss_gap",
                               allowed), excluded)


def auto_vs_best_fixed(runs, cases, key, allowed=lambda name, mode: True) -> dict:
    """``key_<scenario>``: auto over the fastest fixed mode of each round that
    ``allowed(scenario, mode)`` (a spread of Nones where no mode run there is);
    ``key``: the minimum over the scenarios that have one, per round."""
    figures, worst = {}, None
    for name, (_, modes) in cases.items():
        if "auto" not in modes or len(modes) < 2:
            continue
        fixed = [m for m in modes if m not in ("auto", DENSE_AUTO) and allowed(name, m)]
        if not fixed:  # no fixed mode run here qualifies (e.g. --modes without bsp)
            figures[f"{key}_{name}"] = spread([])  # medians None
            continue
        per_round = [x["samples_per_s_train"] / max(runs[name][m][r]["samples_per_s_train"]
                                                    for m in fixed)
                     for r, x in enumerate(runs[name]["auto"])]
        figures[f"{key}_{name}"] = spread(per_round)
        worst = per_round if worst is None else [min(a, b) for a, b in zip(worst, per_round)]
    if worst is not None:
        figures[key] = spread(worst)
    return figures


def runtime_figures(runs, cases) -> dict:
    """Balanced BSP and ``auto`` against the fixed modes, per round (samples over training
    seconds, every mode alike); a scenario or mode not run gives None."""
    figures = {}
    for name, key in (("persistent_heavy", "ratio_balanced_bsp_vs_bsp_persistent"),
                      ("persistent", "ratio_balanced_bsp_vs_bsp_persistent_default_size")):
        persistent = runs.get(name, {})
        if persistent.get("balanced") and persistent.get("bsp"):
            figures[key] = spread([b["samples_per_s_train"] / a["samples_per_s_train"]
                                   for a, b in zip(persistent["bsp"], persistent["balanced"])])
    none = runs.get("none", {})
    ssp = f"ssp:{STALENESS}"
    if none.get(DENSE_AUTO) and none.get(ssp):
        pairs = list(zip(none[ssp], none[DENSE_AUTO]))
        figures["ratio_dense_period_auto_vs_every_step"] = spread(
            [b["samples_per_s_train"] / a["samples_per_s_train"] for a, b in pairs])
        figures["loss_gap_dense_period_auto"] = spread(
            [abs(b["loss"] - a["loss"]) / a["loss"] for a, b in pairs if a["loss"]])
    figures.update(auto_vs_best_fixed(runs, cases, "ratio_auto_vs_best_fixed"))
    gaps = []
    for name, (_, modes) in cases.items():
        if "auto" not in modes or len(modes) < 2:
            continue
        if "bsp" in modes and all(b["loss"] for b in runs[name]["bsp"]):
            gaps.append([abs(a["loss"] - b["loss"]) / b["loss"]
                         for a, b in zip(runs[name]["auto"], runs[name]["bsp"])])
    # every mode's relative loss gap to bsp (real compute only): the speed of a fixed
    # mode beside what it does to the loss (asp applies each worker's push as its own
    # optimizer update, ssp one sum per clock as bsp does)
    by_mode = {name: {m: spread([abs(a["loss"] - b["loss"]) / b["loss"]
                                 for a, b in zip(results, runs[name]["bsp"])])
                      for m, results in runs[name].items() if m != "bsp"}
               for name in runs if runs[name].get("bsp")
               and all(b["loss"] for b in runs[name]["bsp"])}
    if by_mode:
        figures["loss_gap_by_mode"] = by_mode
    if gaps:
        figures["loss_gap_auto"] = spread([max(g) for g in zip(*gaps)])
    return figures


def report(comm, out) -> None:
    """Goals and the load; rank 0 prints the JSON line."""
    busy = [mode["cpu_busy_max"] for scenario in out.values() if isinstance(scenario, dict)
            for mode in scenario.values() if isinstance(mode, dict) and "cpu_busy_max" in mode]
    out["cpu_busy_max"] = max(busy) if busy else None
    out["goals"] = {k: f"{op} {v}" for k, (op, v) in GOALS.items()}
    out["goals_met"] = {k: (out[k] >= v if op == ">=" else out[k] <= v)
                        for k, (op, v) in GOALS.items() if out.get(k) is not None}
    out["load_average"] = list(os.getloadavg())
    if comm.Get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
