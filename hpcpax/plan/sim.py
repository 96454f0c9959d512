"""Predict step time and throughput of a model on a cluster, per sync strategy.

Usage::

    python -m hpcpax.sim --model lm1b --cluster parallax_8x6 [--nodes N]
        [--gpus-per-node G] [--servers-per-node S] [--bandwidth-gbps X]
        [--latency-us Y] [--compute-ms Z] [--partitions P] [--png out.png]
        [--json]

``--model`` and ``--cluster`` take a preset name (files in
``hpcpax/plan/presets/``) or a path to a JSON file of the same form.
Strategies, all priced by :mod:`hpcpax.plan.cost_model`:

* ``allreduce``: every variable allreduced, sparse ones densified.
* ``horovod``: sparse gradients allgathered as (indices, values), dense
  allreduced (Horovod's default for sparse gradients).
* ``ps``: sparse variables on the servers without local aggregation, dense
  allreduced.
* ``ps_all``: every variable on the servers, no local aggregation (a plain
  parameter-server setup, like TensorFlow's PS).
* ``hybrid``: Parallax: sparse on the servers with local aggregation, dense
  allreduced.
* ``auto``: per variable, the cost model's fastest method.

A sparse variable's ``access`` gives its row densities (``alpha`` per
worker and per node, the expected distinct rows of its draws) and its
duplicate ratio: lookups per step (every draw; each of a sampler's distinct
ids once) over its expected distinct rows. Kernels that take every id (a
worker's ``unique`` and ``dedup``) and an allgather of raw rows (a cluster
whose framework sends one row per lookup, ``allgather_rows: "raw"``) see
the lookups, the rest the distinct rows.

A cluster whose ranks outnumber its cores (an emulated cluster on one
host) may give ``round_wait_s``: the seconds each round of a collective
waits for its ranks' turns on the cores (:func:`oversubscription_round_wait`).

Each strategy's step is priced by the same step model as the trainer's
(:func:`hpcpax.plan.step_model.predict_step`: compute, then the batched
exchanges of every variable, each phase after the other, the dense
allreduce overlapped with the push and, where the preset says the
framework does it, with the backward pass);
throughput = samples per worker x workers / step time. Beside it the
report names the bottleneck resource of each strategy (the link, the
node NIC, the servers' CPU, the latency or the kernels that take the most
of the step) at this scale and at 1, 2, 4, ... nodes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from importlib import resources

import numpy as np

from ..errors import ConfigError, HpcpaxError
from ..input_checks import (check_float, check_int, check_text, parse_json_text, read_text_file,
                            shown, shown_path)
from ..ps.spec import MAX_PARTITIONS
from ..options import counted
from ..comm.fabric import Fabric, LinkModel
from ..comm.polling import WITHIN_SPIN_SECONDS
from ..sync.methods import method_of
from .auto import make_plan
from .cost_model import ClusterShape, CostParams, VarSpec
from .step_model import predict_step
from .traffic import Layout, expected_routing
from .measure import (
    draws_for_unique,
    expected_touched_fraction,
    log_uniform_probabilities,
    zipf_probabilities,
)

__all__ = ["STRATEGIES", "load_preset", "list_presets", "simulate", "main"]

STRATEGIES = {
    "allreduce": "everything allreduce (sparse densified)",
    "horovod": "allgather sparse + allreduce dense",
    "ps": "ps sparse (no local agg) + allreduce dense",
    "ps_all": "everything on ps, no local agg",
    "hybrid": "Parallax: ps + local agg sparse, allreduce dense",
    "auto": "cost model's choice per variable",
}


def list_presets() -> list:
    """Names of the shipped presets."""
    folder = resources.files("hpcpax.plan") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


#: Most ranks of a simulated job (its rank-by-rank traffic matrices grow with the square).
MAX_SIM_RANKS = 4096


def load_preset(name_or_path: str) -> dict:
    """A preset by name, or a JSON file by path (read by :mod:`hpcpax.input_checks`).

    Raises:
        ConfigError: no such preset or file, or a file that is not a checked JSON object.
    """
    check_text(name_or_path, "preset")
    if os.path.exists(name_or_path):
        path = name_or_path
        text = read_text_file(path, "preset")
    else:
        resource = resources.files("hpcpax.plan") / "presets" / f"{name_or_path}.json"
        if "/" in name_or_path or not resource.is_file():
            raise ConfigError(f"preset must be a file or one of {list_presets()}, "
                              f"not {shown(name_or_path)}")
        path, text = str(resource), resource.read_text(encoding="utf-8")
    data = parse_json_text(text, f"preset {shown_path(path)}")
    if not isinstance(data, dict):
        raise ConfigError(f"preset {shown_path(path)} must hold a JSON object, "
                          f"not {type(data).__name__}")
    return data


_PROBABILITY_CACHE = {}


def _access_terms(access: list, rows: int) -> list:
    """``[(probabilities, draws), ...]`` of one worker's accesses per step."""
    terms = []
    for item in access:
        kind = item.get("distribution")
        key = (kind, rows, item.get("exponent"))
        if key not in _PROBABILITY_CACHE:
            if kind == "zipf":
                _PROBABILITY_CACHE[key] = zipf_probabilities(rows, item.get("exponent", 1.0))
            elif kind == "log_uniform":
                _PROBABILITY_CACHE[key] = log_uniform_probabilities(rows)
            elif kind == "uniform":
                _PROBABILITY_CACHE[key] = None
            else:
                raise ConfigError(f"access distribution must be zipf, log_uniform or uniform, not {kind!r}")
        probabilities = _PROBABILITY_CACHE[key]
        if probabilities is None:
            probabilities = np.full(rows, 1.0 / rows)
        if "draws" in item:
            draws = float(item["draws"])
        elif "unique" in item:
            unique_key = (key, item["unique"])
            if unique_key not in _PROBABILITY_CACHE:
                _PROBABILITY_CACHE[unique_key] = draws_for_unique(probabilities, float(item["unique"]))
            draws = _PROBABILITY_CACHE[unique_key]
        else:
            raise ConfigError(f"access item needs 'draws' or 'unique', not {sorted(item)}")
        terms.append((probabilities, draws))
    return terms


def variable_specs(model: dict, workers_per_node: int) -> list:
    """:class:`VarSpec` of every model variable, alphas derived from ``access``."""
    specs = []
    for var in model["variables"]:
        alpha, alpha_node = var.get("alpha"), var.get("alpha_node")
        if var["kind"] == "sparse" and "access" in var:
            terms = _access_terms(var["access"], int(var["shape"][0]))
            alpha = expected_touched_fraction(terms, 1)
            alpha_node = expected_touched_fraction(terms, workers_per_node)
        duplicate_ratio = float(var.get("duplicate_ratio", 1.0))
        if var["kind"] == "sparse" and "access" in var and alpha:
            # lookups per step: every draw, or each of a sampler's distinct ids once
            lookups = sum(float(item["draws"]) if "draws" in item else float(item["unique"])
                          for item in var["access"])
            duplicate_ratio = max(1.0, lookups / (alpha * int(var["shape"][0])))
        specs.append(VarSpec(name=var["name"], kind=var["kind"], shape=tuple(var["shape"]),
                             dtype=var.get("dtype", "float32"),
                             alpha=1.0 if alpha is None else alpha, alpha_node=alpha_node,
                             duplicate_ratio=duplicate_ratio))
    return specs


def cluster_fabric(cluster: dict) -> Fabric:
    """The link models of a cluster preset."""
    return Fabric(intra=LinkModel(**cluster["intra"]), inter=LinkModel(**cluster["inter"]),
                  allreduce_bucket_bytes=int(cluster.get("allreduce_bucket_bytes", 64 << 20)))


def oversubscription_round_wait(ranks: int, cores: int, spin_s: float = WITHIN_SPIN_SECONDS
                                ) -> float:
    """Seconds each round of a collective waits for its ranks' turns on ``cores`` cores.

    hpcpax's wait policy (:mod:`hpcpax.comm.polling`) polls for ``spin_s``
    inside an operation before it sleeps, so a rank that waits for a
    message holds a core meanwhile. With ``ranks`` busy in one collective on
    fewer ``cores``, a rank whose message the round needs queues behind the
    ``ranks / cores - 1`` others on its core; each of those is assumed to be,
    on average, half-way through its spin (an assumption, not a fit: a spin
    begun at a uniformly random time before). 0 when every rank has a core.
    """
    if cores < 1 or ranks <= cores:
        return 0.0
    return (ranks / cores - 1.0) * float(spin_s) / 2.0


def _fabric_of(cluster: dict):
    """The fabric the step model prices with: the preset's links, plus its
    ``round_wait_s`` (seconds each collective round waits for its ranks' turns)."""
    fabric = cluster_fabric(cluster)
    if cluster.get("round_wait_s"):
        return dict(fabric.to_dict(), round_wait_s=float(cluster["round_wait_s"]))
    return fabric


#: Dense variables held on servers (``ps_all``) travel as blocks of this many bytes.
DENSE_BLOCK_BYTES = 4096


def _methods(specs, strategy, shape, fabric, params, partitions):
    """``{variable: (method, local aggregation)}`` under one strategy."""
    several = shape.workers_per_node > 1
    if strategy == "auto":
        plan = make_plan(specs, "auto", shape, fabric, partitions=partitions, params=params)
        return {n: (v.method, v.local_aggregation) for n, v in plan.variables.items()}
    out = {}
    for spec in specs:
        sparse = spec.kind == "sparse"
        out[spec.name] = {
            "allreduce": ("allreduce", False),
            "horovod": ("allgather", False) if sparse else ("allreduce", False),
            "ps": ("ps", False) if sparse else ("allreduce", False),
            "ps_all": ("ps", False),
            "hybrid": ("ps", several) if sparse else ("allreduce", False),
        }[strategy]
    return out


def strategy_step(specs, methods, shape, fabric, params, partitions=None, compute_s=0.0):
    """:class:`~hpcpax.plan.step_model.StepPrediction` of one step with ``methods``."""
    layout = Layout.from_shape(shape.num_nodes, shape.workers_per_node, shape.servers_per_node)
    parts = partitions or max(1, shape.servers)
    routings, dense = {}, []
    for spec in specs:
        method, local = methods[spec.name]
        if spec.kind == "dense" and method_of(method).densified:
            dense.append(spec.nbytes)
            continue
        if spec.kind == "dense":  # whole tensor, as blocks
            rows, row_bytes, alpha, node = math.ceil(spec.nbytes / DENSE_BLOCK_BYTES), \
                DENSE_BLOCK_BYTES, 1.0, 1.0
        else:
            rows, row_bytes = spec.rows, spec.dim * spec.itemsize
            alpha, node = spec.alpha, spec.node_alpha(shape.workers_per_node)
        kind = method
        routings[spec.name] = expected_routing(layout, kind, rows, row_bytes, alpha, node,
                                               spec.duplicate_ratio, partitions=parts,
                                               local_aggregation=local)
    return predict_step(layout, fabric, params, routings, dense, compute_s=compute_s,
                        include_control=False)


def simulate(model: dict, cluster: dict, partitions: int | None = None) -> dict:
    """Predicted step of every strategy for ``model`` on ``cluster``.

    Returns:
        ``{"workers": n, "alpha": {...}, "strategies": {name: {"comm_s",
        "step_s", "samples_per_s", "bottleneck", "resources",
        "variables": {var: method}}}}``.
    """
    shape = ClusterShape(int(cluster["num_nodes"]), int(cluster["gpus_per_node"]),
                         int(cluster.get("servers_per_node", 0)))
    fabric = _fabric_of(cluster)
    cost = {k: v for k, v in cluster.get("cost", {}).items() if not k.endswith("_note")}
    params = CostParams(**cost, source=cluster.get("name", "cluster preset"))
    specs = variable_specs(model, shape.workers_per_node)
    compute_s = float(model.get("compute_ms", 0.0)) / 1e3
    samples_per_step = int(model.get("samples_per_worker", 1)) * shape.workers
    result = {
        "workers": shape.workers,
        "topology": shape.to_dict(),
        "compute_s": compute_s,
        "alpha": {s.name: [s.alpha, s.node_alpha(shape.workers_per_node)] for s in specs if s.kind == "sparse"},
        "strategies": {},
    }
    batch = dataclasses.replace(params, ps_batch=params.ps_batch or max(
        1, sum(1 for s in specs if s.kind == "sparse")))
    for strategy in STRATEGIES:
        methods = _methods(specs, strategy, shape, fabric, batch, partitions)
        step = strategy_step(specs, methods, shape, fabric, params, partitions, compute_s)
        resources = {k: v for k, v in step.resources.items() if k != "compute"}
        result["strategies"][strategy] = {
            "comm_s": step.seconds - compute_s,
            "step_s": step.seconds,
            "samples_per_s": samples_per_step / step.seconds if step.seconds > 0 else math.inf,
            "bottleneck": max(resources, key=resources.get) if resources else "compute",
            "resources": step.resources,
            "variables": {name: m + ("+agg" if local else "") for name, (m, local) in
                          methods.items()},
        }
    return result


def scaling(model: dict, cluster: dict, partitions: int | None = None) -> dict:
    """``{nodes: {strategy: (samples/s, bottleneck)}}`` for 1, 2, 4, ... nodes."""
    out = {}
    for nodes in _node_counts(int(cluster["num_nodes"])):
        result = simulate(model, dict(cluster, num_nodes=nodes), partitions)
        out[nodes] = {name: (s["samples_per_s"], s["bottleneck"])
                      for name, s in result["strategies"].items()}
    return out


def _table(header, rows, numeric=()):
    widths = [max(len(str(r[i])) for r in [header] + rows) for i in range(len(header))]

    def line(cells):
        return "  ".join(str(c).rjust(w) if i in numeric else str(c).ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(header), "  ".join("-" * w for w in widths)] + [line(r) for r in rows])


def format_report(model: dict, cluster: dict, result: dict, scale: dict | None = None) -> str:
    """The sim's text report: throughput and bottleneck per strategy (and scale)."""
    topo = result["topology"]
    lines = [
        f"model {model.get('name', '?')} on {counted(topo['num_nodes'], 'node')} x "
        f"{counted(topo['workers_per_node'], 'GPU')} ({counted(result['workers'], 'worker')}, "
        f"{counted(topo['servers_per_node'], 'server')}/node), "
        f"compute {result['compute_s'] * 1e3:.1f} ms/step",
    ]
    for name, (alpha, alpha_node) in result["alpha"].items():
        lines.append(f"  {name}: alpha per worker {alpha:.5f}, per node {alpha_node:.5f}")
    strategies = result["strategies"]
    base = strategies["allreduce"]["samples_per_s"]
    rows = [[name, STRATEGIES[name], f"{s['comm_s'] * 1e3:.2f}", f"{s['step_s'] * 1e3:.2f}",
             f"{s['samples_per_s']:.0f}", f"{s['samples_per_s'] / base:.2f}x", s["bottleneck"]]
            for name, s in strategies.items()]
    lines.append(_table(["strategy", "what", "comm ms", "step ms", "samples/s", "vs allreduce",
                         "bottleneck"], rows, numeric={2, 3, 4, 5}))
    lines.append("")
    names = list(next(iter(strategies.values()))["variables"])
    rows = [[var] + [strategies[s]["variables"][var] for s in strategies] for var in names]
    lines.append("method of each variable:")
    lines.append(_table(["variable"] + list(strategies), rows))
    if scale:
        lines.append("")
        lines.append("samples/s (bottleneck) by number of nodes:")
        rows = [[name] + [f"{scale[n][name][0]:.0f} ({scale[n][name][1]})" for n in scale]
                for name in strategies]
        lines.append(_table(["strategy"] + [counted(n, "node") for n in scale], rows))
    hybrid = strategies["hybrid"]["samples_per_s"]
    lines.append("")
    lines.append(f"predicted speedup of hybrid (Parallax) over allreduce-only: {hybrid / base:.2f}x, "
                 f"over horovod (allgather): {hybrid / strategies['horovod']['samples_per_s']:.2f}x, "
                 f"over ps_all: {hybrid / strategies['ps_all']['samples_per_s']:.2f}x")
    lines.append("(Parallax's abstract reports up to 2.8x over TensorFlow and 6.02x over Horovod for "
                 "NLP models with 48 GPUs; printed for comparison only)")
    return "\n".join(lines)


def _node_counts(max_nodes: int) -> list:
    counts, n = [], 1
    while n < max_nodes:
        counts.append(n)
        n *= 2
    return counts + [max_nodes]


def write_png(model: dict, cluster: dict, path: str, partitions: int | None = None) -> None:
    """Throughput against number of nodes, one line per strategy."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("--png needs matplotlib: pip install hpcpax[plot]") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = _node_counts(int(cluster["num_nodes"]))
    series = {name: [] for name in STRATEGIES}
    for nodes in counts:
        result = simulate(model, dict(cluster, num_nodes=nodes), partitions)
        for name, s in result["strategies"].items():
            series[name].append(s["samples_per_s"])
    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    gpus = int(cluster["gpus_per_node"])
    for name, values in series.items():
        axes.plot(counts, values, marker="o", label=name)
    axes.set_xlabel(f"nodes ({gpus} GPUs each)")
    axes.set_ylabel("samples / s (predicted)")
    axes.set_title(f"{model.get('name', 'model')} on {cluster.get('name', 'cluster')}")
    axes.set_xscale("log", base=2)
    axes.set_xticks(counts)
    axes.set_xticklabels([str(c) for c in counts])
    axes.grid(True, alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m hpcpax.sim", description=__doc__.split("\n")[0])
    parser.add_argument("--model", required=True, help="preset name or JSON file")
    parser.add_argument("--cluster", required=True, help="preset name or JSON file")
    parser.add_argument("--nodes", type=int, help="override the number of nodes")
    parser.add_argument("--gpus-per-node", type=int, help="override workers per node")
    parser.add_argument("--servers-per-node", type=int, help="override servers per node (0: workers host)")
    parser.add_argument("--bandwidth-gbps", type=float, help="override inter-node bandwidth, Gb/s")
    parser.add_argument("--latency-us", type=float, help="override inter-node latency, microseconds")
    parser.add_argument("--compute-ms", type=float, help="override compute time per step, ms")
    parser.add_argument("--partitions", type=int, help="partitions per ps variable (default: servers)")
    parser.add_argument("--png", help="write throughput vs nodes to this PNG")
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of tables")
    return parser


def main(argv=None) -> int:
    """``python -m hpcpax.sim``: the exit status (2, with the reason, for bad input)."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        model, cluster = _inputs(args)
        result = simulate(model, cluster, args.partitions)
    except (HpcpaxError, ValueError) as exc:  # a preset, a file or an override it cannot take
        parser.error(str(exc))
    return _report(args, model, cluster, result)


def _inputs(args) -> tuple:
    """``(model, cluster)`` from the presets and the overrides of ``args`` (checked)."""
    # (least value, whether the least value itself is refused, largest value)
    bounds = {"nodes": (1, False, MAX_SIM_RANKS), "gpus_per_node": (1, False, MAX_SIM_RANKS),
              "servers_per_node": (0, False, MAX_SIM_RANKS),
              "partitions": (1, False, MAX_PARTITIONS), "bandwidth_gbps": (0, True, 1e9),
              "latency_us": (0, False, 1e9), "compute_ms": (0, False, 1e9)}
    for flag, (least, strict, most) in bounds.items():
        value = getattr(args, flag)
        name = f"--{flag.replace('_', '-')}"
        if value is None:
            continue
        if isinstance(value, float):
            check_float(value, name, maximum=most)
        else:
            check_int(value, name, maximum=most)
        if not (value > least if strict else value >= least):
            raise ConfigError(f"{name} must be {'>' if strict else '>='} "
                              f"{least}, not {value:g}")
    model, cluster = load_preset(args.model), load_preset(args.cluster)
    cluster = dict(cluster, intra=dict(cluster["intra"]), inter=dict(cluster["inter"]))
    for flag, key in (("nodes", "num_nodes"), ("gpus_per_node", "gpus_per_node"),
                      ("servers_per_node", "servers_per_node")):
        if getattr(args, flag) is not None:
            cluster[key] = getattr(args, flag)
    if args.bandwidth_gbps is not None:
        cluster["inter"]["bandwidth_Bps"] = args.bandwidth_gbps * 1e9 / 8
    if args.latency_us is not None:
        cluster["inter"]["latency_s"] = args.latency_us * 1e-6
    if args.compute_ms is not None:
        model = dict(model, compute_ms=args.compute_ms)
    ranks = check_int(cluster.get("num_nodes", 1), "cluster num_nodes", 1, MAX_SIM_RANKS) * (
        check_int(cluster.get("gpus_per_node", 1), "cluster gpus_per_node", 1, MAX_SIM_RANKS)
        + check_int(cluster.get("servers_per_node", 0), "cluster servers_per_node", 0,
                    MAX_SIM_RANKS))
    if ranks > MAX_SIM_RANKS:
        raise ConfigError(f"the simulated job has {ranks} ranks (nodes x (gpus + servers) per "
                          f"node), more than the {MAX_SIM_RANKS} the simulator models "
                          "(its traffic matrices grow with the square)")
    return model, cluster


def _report(args, model, cluster, result) -> int:
    if args.json:
        print(json.dumps({"model": model.get("name"), "cluster": cluster.get("name"), **result}))
    else:
        print(format_report(model, cluster, result, scaling(model, cluster, args.partitions)))
    if args.png:
        write_png(model, cluster, args.png, args.partitions)
        if not args.json:
            print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
