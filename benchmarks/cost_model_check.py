"""Does the cost model predict what the trainer then does? Bytes, times, choices.

For each layout (2-6 ranks, virtual nodes, 0-2 servers), each round and
each model, the job first measures the model's constants under the same
load as the runs that follow (:func:`hpcpax.tune.calibrate.calibrate`:
fabric, ``Allreduce`` on reused and fresh buffers, kernel rates with every
rank busy, hand-off, and hpcpax's fixed cost per operation and per
partition on the job's own ranks; the model's own work per step, data,
forward/backward and dense optimizer, from a short trial run of the
trainer: :func:`_trial_phases`). Then it trains each model (``lm``, ``ctr``) at two sparsity
levels with each method (``ps`` with and without local aggregation, ``ps``
with 16 partitions, ``allgather``, ``dense``), interleaved over
``--rounds`` rounds (the methods' order rotates from round to round), and
compares:

* bytes: the model's routing of each step's real ids
  (:func:`hpcpax.plan.traffic.routing_from_ids`) against the accounting's
  bytes per step, phase and direction (``bytes_exact``);
* time: the step model's prediction (median over rounds, each with its own
  calibration) against the median measured step (``time_median_abs_error``,
  ``time_worst_abs_error``: relative errors);
* ranking: Spearman correlation of predicted and measured method times per
  (layout, model, sparsity) group (``spearman_min``), and how often the
  predicted best is within 10 % of the measured best (``choice_within_10pct``);
  beside them, ``resolved_pairs_ordered``: of the pairs of methods of a group
  whose measured rounds do not overlap (an order the measurement settles),
  the fraction the model orders the same way (a tied prediction counts a
  half), with their number (``resolved_pairs``) and the pairs the
  measurement leaves open (``unresolved_pairs``; which ones: ``ties``);
* ``kernel_rates_only``: the same three figures for the constants ``--plan
  auto`` has with ``--no-plan-calibrate`` (kernel rates timed on one rank,
  the fabric's links alone, no per-operation costs), predicted for the same
  runs: what calibrating in the job (the trainer's default) buys.

Every run is appended to the run log (source ``cost_model_check``), and the
learned correction is checked for transfer: fitted on the ``lm`` runs of
this check, it predicts the ``ctr`` runs and the reverse
(``transfer_error_analytic`` / ``transfer_error_learned``: median relative
errors without / with it; ``transfer_cross_validation``: whether
leave-one-layout-out cross-validation on the fitting runs kept it, else the
analytic model is used). Nothing is fitted to the measured step times
except that correction.

Usage: ``python benchmarks/cost_model_check.py [--quick] [--rounds 3]
[--layouts 2-2-0 4-2-1] [--methods ps allgather] [--save-jobs DIR] [--cluster 2gbit]``
(``--methods``: a subset of the methods, default all; it starts its
own ``mpirun`` jobs; ``--save-jobs`` keeps each layout's per-phase
predictions and calibrations). On a 2-core machine layouts with more
than 2 ranks oversubscribe the cores; the constants are measured under that
oversubscription. One JSON line.

``--cluster RATE`` runs the layouts on an emulated cluster instead of
virtual nodes (:mod:`hpcpax.cluster`, root): each node a network namespace
whose link is shaped to ``RATE`` per direction, the ranks of a node in one
namespace, inter-node traffic over TCP across the shaped links. The
calibration then measures that link as the inter-node class. Without
``--layouts`` only the layouts of 2+ nodes run. Without root or ``ip
netns`` the line says ``skipped``.

``--emulate COMPUTE`` (with ``--cluster``; ``--dilation D``, default 1)
runs every trainer run with emulated accelerators (the trainer's
``emulate_compute`` and ``time_dilation``, :mod:`hpcpax.app.emulation`): a
worker's forward and backward is a wait of the modeled duration x ``D`` that
holds no CPU, and the links are shaped to ``RATE / D``
(:func:`hpcpax.cluster.spec.dilate`), so that 4-16 nodes on a few cores
measure the links and the mechanisms, not a queue for the cores. The
calibration measures the dilated links and the real kernels, so its
predictions are in wall-clock (dilated) seconds, while the trainer's
metrics are undilated (divided by ``D``): the measured step and phase
seconds (the trial run's phases too) are multiplied by ``D`` back into wall
seconds before they are compared, so the times the line reports are wall
seconds of the dilated cluster (divide by ``dilation`` for undilated ones;
relative errors and rankings are the same in either unit). The line then
carries ``emulate_compute``, ``dilation``, ``cpu_busy_max`` (the machine's
busiest timed step over every run: all ranks' CPU seconds over cores x the
step's wall seconds; a server's, which the metrics lines do not carry,
its CPU seconds over its run's wall seconds), per layout in
``cpu_busy_max_by_layout``, and ``valid`` (``cpu_busy_max`` at most
``--cpu-busy-limit``, 0.6: the cores did not set the step times). Layouts
for it: one rank per node, no servers, e.g. ``--layouts 4-1-0 8-1-0
16-1-0`` (every rank a worker hosting partitions; ``ps-no-aggregation``,
the same as ``ps`` at one worker per node, is left out; the densified
``allreduce``'s step is seconds on 8-16 dilated nodes, ``--methods ps
ps-16-partitions allgather`` leaves it out). ``--prefix`` / ``--subnet``
name the cluster (default ``hpk``, 10.213.249.0/24).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

#: (ranks, ranks per virtual node, servers per node)
LAYOUTS = [(2, 2, 0), (3, 3, 1), (4, 2, 1), (4, 2, 0), (6, 3, 1), (6, 2, 0)]
QUICK_LAYOUTS = [(3, 3, 1), (4, 2, 0)]
CONFIGS = {
    "lm-dense": {"model": "lm", "vocab_size": 2_000, "emb_dim": 32, "hidden": [64],
                 "out_dim": 32, "num_sampled": 64, "global_batch": 240},
    "lm-sparse": {"model": "lm", "vocab_size": 100_000, "emb_dim": 32, "hidden": [64],
                  "out_dim": 32, "num_sampled": 64, "global_batch": 240},
    "ctr-dense": {"model": "ctr", "n_fields": 8, "table_rows": 1_000, "emb_dim": 16,
                  "global_batch": 240},
    "ctr-sparse": {"model": "ctr", "n_fields": 8, "table_rows": 50_000, "emb_dim": 16,
                   "global_batch": 240},
}
METHODS = {
    "ps": {"plan": "ps", "local_aggregation": True},
    "ps-no-aggregation": {"plan": "ps", "local_aggregation": False},
    "ps-16-partitions": {"plan": "ps", "local_aggregation": True, "partitions": 16},
    "allgather": {"plan": "allgather"},
    "allreduce": {"plan": "allreduce"},
}
#: the emulated cluster of ``--cluster`` (apart from the tests' and other benchmarks')
CLUSTER_PREFIX, CLUSTER_SUBNET = "hpk", "10.213.249.0/24"
BYTE_FIELDS = ("sent", "recv", "sent_inter")
ROW_FIELDS = {"sent": 0, "recv": 1, "sent_inter": 2}


# ----------------------------------------------------------------------------- job side
def _plan_for(trainer_names, method):
    if "partitions" not in method:
        return None
    return {name: {"method": "ps", "partitions": method["partitions"]} for name in trainer_names}


#: the plan of the trial run whose phases give the model's own work per step
TRIAL_PLAN = "allgather"


def _trial_phases(comm, config, steps, warmup, workdir):
    """Data, forward/backward and dense-optimizer seconds per step, from a short run.

    **Collective.** Parallax's way: the model's own work is measured in real
    steps of the trainer (``TRIAL_PLAN``, whose pull is a local read and whose
    servers idle), with the caches and the allocator as a step leaves them,
    not predicted. Timed apart (every worker at once, caches evicted before
    each call), the same calls took 0.06-0.09 ms of data and 0.34-0.45 ms of
    compute where the steps took 0.18-0.19 and 0.44-0.46 ms (lm-sparse, 3 ranks
    with 1 server, ps).
    Medians over the timed steps (each step's phase a mean over workers, as
    the runs' own figures are).
    """
    _, leader, rows = _train(comm, {**config, "plan": TRIAL_PLAN}, steps, warmup, workdir)
    phases = None
    if rows is not None:
        dilation = _dilation(config)  # metrics are undilated; the model's units are wall's
        phases = tuple(float(np.median([r["time"][p] for r in rows])) * dilation
                       for p in ("data", "compute", "optimizer"))
    return comm.bcast(phases, root=leader)


def _dilation(config):
    """The run's time dilation ``D`` (1 without ``--emulate``)."""
    return float(config.get("time_dilation", 1.0))


def _cpu_busy(trainer, summary, rows):
    """The machine's busiest timed step: all ranks' CPU seconds over cores x its wall seconds.

    The metrics lines carry the workers' (per step, real wall seconds); a
    server's is its CPU seconds over its run's wall seconds (``summary.json``).
    """
    cores = os.cpu_count() or 1
    per_rank = summary.get("cpu_busy") or []
    servers = sum(per_rank[rank] or 0.0 for rank in trainer.topology.server_ranks
                  if rank < len(per_rank))
    return max((sum(r.get("cpu_busy") or [0.0]) + servers) / cores for r in rows)


def _train(comm, settings, steps, warmup, workdir, plan=None):
    """``(trainer, leader, timed metrics lines)``: one run of ``steps`` (**collective**);
    the lines after ``warmup``, on the first worker (``leader``) only, else None (with
    ``trainer.cpu_busy_max``, :func:`_cpu_busy`, set there)."""
    from hpcpax.app.trainer import Trainer

    run_dir = comm.bcast(tempfile.mkdtemp(dir=workdir) if comm.Get_rank() == 0 else None)
    trainer = Trainer({**settings, "steps": steps, "run_dir": run_dir, "quiet": True},
                      comm=comm, plan=plan)
    summary = trainer.run()
    leader = trainer.topology.worker_ranks[0]
    rows = None
    if comm.Get_rank() == leader:
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        rows = [r for r in rows if "loss" in r and r["step"] > warmup]
        trainer.cpu_busy_max = _cpu_busy(trainer, summary or {}, rows)
    return trainer, leader, rows


def _aggregation_on(trainer, var):
    """The PS's local-aggregation setting of ``var`` (its communicators are freed by now)."""
    enabled = var.local_aggregation
    return bool(trainer.engine.ps.local_aggregation if enabled is None else enabled)


def _replay(trainer, steps):
    """Each timed step's routing of every sparse variable, from the real ids."""
    from hpcpax.plan.traffic import Layout, routing_from_ids

    layout = Layout.from_topology(trainer.topology.describe())
    n, batch = len(layout.worker_ranks), trainer.config["global_batch"]
    out = []
    for step in steps:
        position = step - 1
        ids = [trainer.model.sparse_ids(trainer.reader.batch(position, batch, w, n), position)
               for w in range(n)]
        routings = {}
        for name, sync in trainer.engine.sync.variables.items():
            spec = sync.spec
            row_bytes = spec.dim * np.dtype(spec.dtype).itemsize
            per_worker = [np.asarray(i[name]) for i in ids]
            if sync.method == "ps":
                var = trainer.engine.ps.variables[name]
                routings[name] = routing_from_ids(
                    layout, "ps", spec.rows, row_bytes, per_worker,
                    partitions=var.layout.num_partitions, owners=list(var.layout.owners),
                    local_aggregation=_aggregation_on(trainer, var))
            else:
                routings[name] = routing_from_ids(layout, sync.method, spec.rows, row_bytes,
                                                  per_worker)
        out.append(routings)
    return layout, out


def _one_run(comm, config, method, steps, warmup, workdir, calibration, compute, check_bytes):
    from hpcpax.app.trainer import Trainer
    from hpcpax.plan.collectives import Links
    from hpcpax.comm.fabric import Fabric
    from hpcpax.tune.calibrate import cost_params
    from hpcpax.plan.cost_model import CostParams
    from hpcpax.plan.step_model import predict_step
    from hpcpax.plan.traffic import step_bytes

    settings = {**config, **{k: v for k, v in method.items() if k != "partitions"}}
    from hpcpax.app.datasets import build_model

    names = [s.name for s in build_model(Trainer({**settings, "quiet": True}).config)
             .sparse_specs()]
    trainer, leader, rows = _train(comm, settings, steps, warmup, workdir,
                                   plan=_plan_for(names, method))
    result = None
    if rows is not None:
        timed = [r["step"] for r in rows]
        layout, routings = _replay(trainer, timed)
        dense_bytes = [int(p.nbytes) for p in trainer.dense.values()]
        mismatches = 0
        if check_bytes:
            for row, step_routing in zip(rows, routings):
                predicted = step_bytes(layout, step_routing, dense_bytes)
                workers = list(layout.worker_ranks)
                phases = set(predicted) | set(row["bytes"])
                for phase in phases:
                    got = row["bytes"].get(phase, {})
                    want = predicted.get(phase)
                    for field in BYTE_FIELDS:
                        value = 0 if want is None else int(round(
                            want[ROW_FIELDS[field]][workers].sum()))
                        if value != int(got.get(field, 0)):
                            mismatches += 1
        params = cost_params(calibration)
        links = Links.from_fabric(calibration["fabric"])
        # emulated accelerators' compute is a wait that holds no core
        on_host = not config.get("emulate_compute")
        predictions = [predict_step(layout, links, params, r, dense_bytes, compute_s=compute[1],
                                    data_s=compute[0], optimizer_s=compute[2],
                                    compute_on_host=on_host)
                       for r in routings[:3]]
        best = min(predictions, key=lambda p: abs(p.seconds - np.median(
            [q.seconds for q in predictions])))
        # the constants `--plan auto` had before it calibrated (--no-plan-calibrate):
        # kernel rates timed on one rank, the fabric's links alone
        plain = [predict_step(layout, Links.from_fabric(Fabric.from_dict(calibration["fabric"])),
                              CostParams.measured(), r, dense_bytes, compute_s=compute[1],
                              data_s=compute[0], optimizer_s=compute[2],
                              compute_on_host=on_host).seconds
                 for r in routings[:3]]
        specs = {n: v.spec for n, v in trainer.engine.sync.variables.items()}
        strategy = {n: {"method": trainer.engine.sync[n].method,
                        "partitions": trainer.engine.sync[n].partitions,
                        "local_aggregation": (_aggregation_on(trainer, trainer.engine.ps.variables[n])
                                              and layout.workers_per_node() > 1
                                              if trainer.engine.sync[n].method == "ps" else None)}
                    for n in specs}
        first = routings[0]
        variables = [{"name": n, "kind": "sparse", "shape": [s.rows, s.dim], "dtype": s.dtype,
                      "alpha": float(np.mean(first[n].unique[list(layout.worker_ranks)]) / s.rows),
                      "duplicate_ratio": float(first[n].raw.sum() / max(first[n].unique.sum(), 1))}
                     for n, s in specs.items()]
        variables += [{"name": n, "kind": "dense", "shape": list(p.shape), "dtype": str(p.dtype)}
                      for n, p in trainer.dense.items()]
        dilation = _dilation(config)  # metrics are undilated; the predictions are wall's
        result = {
            "measured_s": float(np.median([r["seconds"] for r in rows])) * dilation,
            "measured_phases": {p: float(np.median([r["time"][p] for r in rows])) * dilation
                                for p in rows[0]["time"]},
            "cpu_busy_max": trainer.cpu_busy_max,
            "predicted": best.to_dict(), "byte_mismatches": mismatches,
            "predicted_kernel_rates_s": float(np.median(plain)),
            "byte_checks": len(rows) * 3 if check_bytes else 0,
            "record": {"model": {"name": config["model"], "variables": variables},
                       "layout": {**trainer.topology.describe(),
                                  "workers": len(layout.worker_ranks),
                                  "servers": len(layout.server_ranks)},
                       "fabric": calibration["fabric"], "strategy": strategy,
                       "global_batch": config["global_batch"]},
        }
        if config.get("emulate_compute"):  # its times in wall seconds of the dilated cluster
            result["record"].update(emulated_compute=config["emulate_compute"],
                                    time_dilation=dilation)
    return comm.bcast(result, root=leader)


def job_main(args):
    import hpcpax
    from mpi4py import MPI

    from hpcpax.tune.calibrate import calibrate

    comm = MPI.COMM_WORLD
    ranks_per_node, servers = args.ranks_per_node, args.servers_per_node
    os.environ["HPCPAX_RANKS_PER_NODE"] = str(ranks_per_node)
    os.environ["HPCPAX_SERVERS_PER_NODE"] = str(servers)
    configs = {k: v for k, v in CONFIGS.items() if k in args.configs}
    results, calibrations = [], []
    with tempfile.TemporaryDirectory() as scratch:
        workdir = comm.bcast(scratch if comm.Get_rank() == 0 else None)
        for round_index in range(args.rounds):
            for name, config in configs.items():
                # each (round, model) measures its constants just before its runs, under
                # the same load (the machine is shared: the load drifts within a round)
                base = {**config, "ranks_per_node": ranks_per_node, "servers_per_node": servers}
                if args.emulate:
                    base.update(emulate_compute=args.emulate, time_dilation=args.dilation)
                topo = hpcpax.init(ranks_per_node, servers)
                calibration = calibrate(topo, fabric_seconds=1.0)
                several_per_node = topo.num_workers > topo.num_nodes
                topo.free()
                compute = _trial_phases(comm, base, args.steps, args.warmup, workdir)
                calibrations.append({**calibration, "compute": compute, "config": name,
                                     "round": round_index})
                methods = [(k, v) for k, v in METHODS.items() if k in args.methods
                           and (several_per_node or k != "ps-no-aggregation")]
                shift = round_index % len(methods)  # rotate the order from round to round
                for method_name, method in methods[shift:] + methods[:shift]:
                    outcome = _one_run(comm, base, method, args.steps, args.warmup, workdir,
                                       calibration, compute, check_bytes=round_index == 0)
                    results.append({"config": name, "method": method_name, "round": round_index,
                                    **outcome})
    if comm.Get_rank() == 0:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump({"layout": [comm.Get_size(), ranks_per_node, servers],
                       "calibrations": calibrations, "runs": results}, handle)


# ----------------------------------------------------------------------- orchestrator side
def _ranks(values):
    """Ranks from 0, tied values sharing the mean of their ranks (Spearman's definition:
    an order made up between equal predictions would count as a wrong one, or a right one)."""
    values = np.asarray(values, np.float64)
    ranks = np.empty(len(values))
    ranks[np.argsort(values, kind="stable")] = np.arange(len(values), dtype=np.float64)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def _spearman(a, b):
    ra, rb = _ranks(a), _ranks(b)
    if ra.std() == 0 or rb.std() == 0:
        return 1.0
    return float(np.corrcoef(ra, rb)[0, 1])


def _resolved_pairs(members, ties=None):
    """``(ordered, settled, open)``: over pairs whose measured rounds do not overlap,
    how many the prediction orders the same way (a predicted tie counts 0.5); the
    pairs left open appended to ``ties`` (layout, model, the two methods)."""
    ordered, settled, unsettled = 0.0, 0, 0
    for i, a in enumerate(members):
        for b in members[i + 1:]:
            (a_low, a_high), (b_low, b_high) = a["measured_range"], b["measured_range"]
            if a_high >= b_low and b_high >= a_low:
                unsettled += 1
                if ties is not None:
                    ties.append("-".join(map(str, a["layout"])) + f" {a['config']}: "
                                f"{a['method']} ~ {b['method']}")
                continue
            settled += 1
            faster = a_high < b_low  # a measured faster than b in every round
            diff = a["predicted_s"] - b["predicted_s"]
            ordered += 0.5 if diff == 0 else float((diff < 0) == faster)
    return ordered, settled, unsettled


def _summaries(layout_results):
    """One entry per (layout, config, method): measured median over rounds, spread, prediction."""
    out = []
    for job in layout_results:
        groups = {}
        for run in job["runs"]:
            groups.setdefault((run["config"], run["method"]), []).append(run)
        for (config, method), runs in groups.items():
            measured = [r["measured_s"] for r in runs]
            out.append({"layout": job["layout"], "config": config, "method": method,
                        "measured_s": float(np.median(measured)),
                        "measured_range": (float(min(measured)), float(max(measured))),
                        "spread": float((max(measured) - min(measured)) / np.median(measured)),
                        "predicted_s": float(np.median([r["predicted"]["seconds"] for r in runs])),
                        "predicted_kernel_rates_s": float(np.median(
                            [r.get("predicted_kernel_rates_s", np.nan) for r in runs])),
                        "bottleneck": runs[0]["predicted"]["bottleneck"],
                        "byte_mismatches": sum(r["byte_mismatches"] for r in runs),
                        "byte_checks": sum(r["byte_checks"] for r in runs),
                        "record": {**runs[0]["record"],
                                   "measured": {"step_s": float(np.median(measured)),
                                                "phases": runs[0]["measured_phases"]},
                                   "predicted": runs[0]["predicted"]}})
    return out


def _groups(entries):
    """The entries of each (layout, model) with >= 2 methods: the strategies compared."""
    groups = {}
    for e in entries:
        groups.setdefault((tuple(e["layout"]), e["config"]), []).append(e)
    return [members for members in groups.values() if len(members) >= 2]


def _agreement(entries, key):
    """``(relative errors, Spearman per group, pick within 10 % per group)`` of the
    predictions under ``key`` against the measured step times (NaN predictions left out)."""
    entries = [e for e in entries if np.isfinite(e.get(key, np.nan))]
    errors = np.array([abs(e[key] - e["measured_s"]) / e["measured_s"] for e in entries])
    spearman, within = [], []
    for members in _groups(entries):
        measured = [m["measured_s"] for m in members]
        predicted = [m[key] for m in members]
        spearman.append(_spearman(predicted, measured))
        pick = members[int(np.argmin(predicted))]["measured_s"]
        within.append(pick <= 1.10 * min(measured))
    return errors, spearman, within


def _transfer(entries):
    from hpcpax.runlog.learned import fit_correction

    out_analytic, out_learned, validation = {}, {}, {}
    for fit_on, predict_on in (("lm", "ctr"), ("ctr", "lm")):
        train = [e["record"] for e in entries if e["record"]["model"]["name"] == fit_on]
        test = [e["record"] for e in entries if e["record"]["model"]["name"] == predict_on]
        correction = fit_correction(train)
        key = f"fit_{fit_on}_predict_{predict_on}"
        if correction is None or not test:
            out_analytic[key] = out_learned[key] = None
            continue
        measured = np.array([r["measured"]["step_s"] for r in test])
        analytic = np.array([r["predicted"]["seconds"] for r in test])
        learned = np.array([correction.apply(r["predicted"]) for r in test])
        out_analytic[key] = float(np.median(np.abs(analytic - measured) / measured))
        out_learned[key] = float(np.median(np.abs(learned - measured) / measured))
        validation[key] = correction.validation
    return out_analytic, out_learned, validation


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--ranks-per-node", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--servers-per-node", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    parser.add_argument("--configs", nargs="*", default=list(CONFIGS))
    parser.add_argument("--methods", nargs="*", default=list(METHODS),
                        help=f"subset of {', '.join(METHODS)} (default all; the densified "
                             "allreduce's step is seconds on 8+ dilated nodes)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--timeout", type=int, default=600)
    parser.add_argument("--layouts", nargs="*", default=None,
                        help="subset of layouts as RANKS-PERNODE-SERVERS, e.g. 2-2-0 4-2-1")
    parser.add_argument("--save-jobs", default=None,
                        help="folder to keep each layout job's raw JSON (per-phase detail)")
    parser.add_argument("--cluster", default=None, metavar="RATE",
                        help="run on an emulated cluster with links shaped to RATE (2gbit); "
                             "root")
    parser.add_argument("--emulate", default=None, metavar="COMPUTE",
                        help="with --cluster: emulated accelerators, the trainer's "
                             "emulate_compute (0.05: seconds per step; 0.001/sample)")
    parser.add_argument("--dilation", type=float, default=1.0,
                        help="with --emulate: time dilation D (links RATE / D, modeled "
                             "compute x D; the line's times are wall seconds)")
    parser.add_argument("--cpu-busy-limit", type=float, default=0.6,
                        help="with --emulate: the largest cpu_busy_max of a valid run")
    parser.add_argument("--prefix", default=CLUSTER_PREFIX,
                        help="with --cluster: the cluster's name prefix")
    parser.add_argument("--subnet", default=CLUSTER_SUBNET,
                        help="with --cluster: the cluster's subnet")
    args = parser.parse_args()
    if args.job:
        return job_main(args)
    from _common import emit

    unknown = sorted(set(args.methods) - set(METHODS))
    if unknown or len(args.methods) < 2:
        parser.error(f"--methods must name 2 or more of {list(METHODS)}, not {args.methods}")
    link_rate = args.cluster
    if args.emulate:
        from hpcpax.app.emulation import parse_emulate_compute
        from hpcpax.cluster.spec import dilate
        from hpcpax.errors import ConfigError

        if not args.cluster:
            parser.error("--emulate needs --cluster RATE (the emulated cluster's links)")
        try:
            parse_emulate_compute(args.emulate, args.dilation)
            link_rate, _ = dilate(args.cluster, "0", args.dilation)
        except ConfigError as exc:
            parser.error(f"--emulate {args.emulate} --dilation {args.dilation:g}: {exc}")
    elif args.dilation != 1.0:
        parser.error("--dilation needs --emulate (it slows the emulated compute with the links)")

    layouts = QUICK_LAYOUTS if args.quick else LAYOUTS
    if args.cluster and not args.layouts:
        layouts = [layout for layout in layouts if layout[0] // layout[1] >= 2]
    if args.layouts:
        layouts = [tuple(int(x) for x in name.split("-")) for name in args.layouts]
    for ranks, per_node, servers in layouts:
        if per_node < 1 or ranks % per_node:
            parser.error(f"layout {ranks}-{per_node}-{servers}: the ranks must fill whole "
                         f"nodes of {per_node}")
    if args.quick:
        args.rounds, args.steps, args.warmup = 1, 8, 3
    fabric = {"kind": "virtual nodes (one host's shared memory)"}
    if not args.cluster:
        jobs, failures = _run_layouts(args, layouts, None)
    else:
        from hpcpax import cluster

        reason = cluster.preflight()
        if reason:
            emit({"benchmark": "cost_model_check", "cluster": args.cluster,
                  "skipped": f"no emulated cluster here: {reason}"})
            return 0
        nodes = max(ranks // per_node for ranks, per_node, _ in layouts)
        cluster.down(args.prefix, log=lambda text: None)
        try:
            spec = cluster.up(nodes, rate=link_rate, prefix=args.prefix,
                              subnet=args.subnet, check_links=nodes >= 2)
            check = spec.extra.get("link_check") or {}
            fabric = {"kind": f"emulated cluster: network namespaces, links shaped to "
                              f"{link_rate} per direction, TCP between nodes",
                      "link_check": {k: check.get(k) for k in ("gbit_per_s", "latency_us",
                                                               "used", "reason")}}
            if args.emulate:
                fabric["kind"] += (f" ({args.cluster} dilated {args.dilation:g}x; emulated "
                                   f"accelerators, {args.emulate} s x {args.dilation:g})")
            jobs, failures = _run_layouts(args, layouts, spec)
        finally:
            cluster.down(args.prefix, log=lambda text: None)
    return _report(args, jobs, failures, fabric, emit)


def _run_layouts(args, layouts, spec):
    """One ``mpirun`` job per layout (on the emulated cluster ``spec`` if given)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    if spec is not None:
        from hpcpax.cluster import mpirun_env

        env = mpirun_env(env)
        root = os.path.dirname(HERE)
        env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    jobs, failures = [], []
    with tempfile.TemporaryDirectory() as scratch:
        for ranks, per_node, servers in layouts:
            out = os.path.join(scratch, f"{ranks}-{per_node}-{servers}.json")
            job = [sys.executable, "-m", "mpi4py", os.path.abspath(__file__), "--job",
                   "--ranks-per-node", str(per_node), "--servers-per-node", str(servers),
                   "--out", out, "--rounds", str(args.rounds), "--steps", str(args.steps),
                   "--warmup", str(args.warmup), "--configs", *args.configs,
                   "--methods", *args.methods]
            if args.emulate:
                job += ["--emulate", args.emulate, "--dilation", repr(args.dilation)]
            if spec is None:
                command = ["mpirun", "-n", str(ranks), *job]
            else:
                from hpcpax.cluster import mpirun_argv

                command = mpirun_argv(spec, per_node, job, nodes=ranks // per_node)
            try:
                done = subprocess.run(command, env=env, capture_output=True, text=True,
                                      timeout=args.timeout)
            except subprocess.TimeoutExpired:
                failures.append({"layout": [ranks, per_node, servers],
                                 "error": f"did not finish within {args.timeout} s"})
                continue
            if done.returncode != 0 or not os.path.exists(out):
                failures.append({"layout": [ranks, per_node, servers],
                                 "error": (done.stderr or done.stdout)[-400:]})
                continue
            with open(out, encoding="utf-8") as handle:
                jobs.append(json.load(handle))
            if args.save_jobs:
                os.makedirs(args.save_jobs, exist_ok=True)
                with open(os.path.join(args.save_jobs, os.path.basename(out)), "w",
                          encoding="utf-8") as handle:
                    json.dump(jobs[-1], handle)
    return jobs, failures


def emulated_valid(busy_by_layout, limit, entries, failures) -> bool:
    """Whether an emulated run counts: every layout ran (no failure) and measured its CPU,
    each under ``limit``, and at least one case was compared. A run that measured
    nothing is not valid."""
    import _common

    return (bool(entries) and not failures and bool(busy_by_layout)
            and all(_common.measured(b) and b <= limit for b in busy_by_layout.values()))


def _report(args, jobs, failures, fabric, emit):
    """Compare the jobs' measured steps with the predictions; emit the JSON line."""
    from hpcpax.runlog.log import RunLog

    entries = _summaries(jobs)
    log = RunLog()
    for entry in entries:
        log.append(entry["record"], source="cost_model_check")
    errors, spearman, within = _agreement(entries, "predicted_s")
    pairs, ties = np.zeros(3), []
    for members in _groups(entries):
        pairs += _resolved_pairs(members, ties)
    plain = _agreement(entries, "predicted_kernel_rates_s")
    analytic, learned, validation = _transfer(entries)
    checks = sum(e["byte_checks"] for e in entries)
    line = {
        "benchmark": "cost_model_check", "fabric": fabric,
        "layouts": [list(j["layout"]) for j in jobs], "failures": failures,
        "configs": args.configs, "rounds": args.rounds, "steps": args.steps,
        "runs": len(entries) * args.rounds,
        "bytes_exact": bool(entries) and all(e["byte_mismatches"] == 0 for e in entries),
        "byte_fields_checked": checks,
        "time_median_abs_error": float(np.median(errors)) if len(errors) else None,
        "time_worst_abs_error": float(np.max(errors)) if len(errors) else None,
        "spearman_min": min(spearman) if spearman else None,
        "spearman_median": float(np.median(spearman)) if spearman else None,
        "choice_within_10pct": float(np.mean(within)) if within else None,
        "kernel_rates_only": {  # the constants of --no-plan-calibrate, the same runs
            "time_median_abs_error": float(np.median(plain[0])) if len(plain[0]) else None,
            "spearman_min": min(plain[1]) if plain[1] else None,
            "choice_within_10pct": float(np.mean(plain[2])) if plain[2] else None},
        "resolved_pairs_ordered": float(pairs[0] / pairs[1]) if pairs[1] else None,
        "resolved_pairs": int(pairs[1]), "unresolved_pairs": int(pairs[2]),
        "ties": ties,
        "transfer_error_analytic": analytic, "transfer_error_learned": learned,
        "transfer_cross_validation": validation,
        "measured_spread_median": float(np.median([e["spread"] for e in entries])) if entries
        else None,
        "cases": [{"layout": e["layout"], "config": e["config"], "method": e["method"],
                   "measured_ms": e["measured_s"] * 1e3, "predicted_ms": e["predicted_s"] * 1e3,
                   "predicted_kernel_rates_ms": e["predicted_kernel_rates_s"] * 1e3,
                   "spread": e["spread"], "bottleneck": e["bottleneck"]} for e in entries],
        "machine": f"{os.cpu_count()} cores, shared with other jobs",
    }
    if args.methods != list(METHODS):
        line["methods"] = args.methods
    if args.emulate:
        by_layout = {"-".join(map(str, job["layout"])): max(
            (run["cpu_busy_max"] for run in job["runs"]), default=None) for job in jobs}
        known = [v for v in by_layout.values() if v is not None]
        busiest = max(known) if known else None
        line.update({"emulate_compute": args.emulate, "dilation": args.dilation,
                     "time_unit": "wall seconds of the dilated cluster (undilated: / dilation)",
                     "cpu_busy_max": busiest, "cpu_busy_max_by_layout": by_layout,
                     "cpu_busy_limit": args.cpu_busy_limit,
                     "valid": emulated_valid(by_layout, args.cpu_busy_limit, entries,
                                             failures)})
    emit(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
