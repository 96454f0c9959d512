"""Does the simulator predict the measured emulated cluster, and the paper's shape?

Reads a results file of ``benchmarks/scaling.py`` (``--results PATH``: the
newest ``benchmarks/results/*-scaling.json`` by default) and, for exactly
that configuration, builds the simulator's inputs (:mod:`hpcpax.plan.sim`):

* the model: the results' ``model`` sizes (vocabulary, widths, context,
  sampled negatives) as :class:`hpcpax.models.lm.LanguageModel` makes them
  (its dense shapes), and each sparse table's row densities measured on
  the very batches the run trained on (the same synthetic stream, shuffle
  and seed as ``_cluster_lm_job.py``'s trainer, the timed steps): distinct
  rows per worker (``alpha``) and lookups per distinct row
  (``duplicate_ratio``), and the distinct rows of a node's workers together
  (``alpha_node``, what local aggregation sends). The compute is the run's
  emulated one (``--emulate-compute``; ``lm1b``: 100 ms per 128 samples per
  worker).
* the cluster: the run's workers per node (``ranks_per_node``, 1 unless
  the file says otherwise), ``servers_per_node`` 0 (every worker hosts
  partitions), links of the results' undilated rate per direction,
  latency the added delay (0 unless the file says otherwise) plus a TCP
  round trip through this host's kernel (loopback, measured here and
  divided by the dilation: the nodes' links are veths of one kernel);
  inside a node MPICH's shared memory (two copies a message: half this
  host's measured copy rate, undilated by multiplying it by the dilation;
  an assumption, labelled in the output);
* hpcpax's CPU costs measured here before comparing, never fitted to the
  results: kernel rates (:func:`hpcpax.plan.kernel_rates.measure_kernel_rates`)
  and the per-operation host path (:func:`hpcpax.tune.calibrate.measure_software`,
  a one-rank world). The run reported times divided by its dilation, so
  they are divided by it too; and with more ranks than the host's cores
  (``cores`` in the results), the ranks' simultaneous local work shares
  them, so CPU costs are multiplied by ``max(1, ranks / cores)`` (an
  assumption: a fair share of the cores, labelled as such in the output),
  and every round of a collective waits for its ranks' turns on the cores
  (:func:`hpcpax.plan.sim.oversubscription_round_wait`: the wait policy's
  spin inside an operation, half of it on average per rank ahead; the spin
  is the mean of the kinds ``hybrid`` recorded in the run, ``wait_within``,
  and 2 ms for results from before the policy adapted it).

Then the simulator predicts each measured method (``hybrid`` -> hybrid,
``allgather`` -> horovod, ``ps_no_aggregation`` -> ps, ``allreduce`` ->
allreduce, ``auto`` -> auto) at each node count; measured step seconds are
``per_worker * workers / samples_per_s`` (median). Beside them,
``sim_paper_shape``: the simulator's hybrid/Horovod throughput ratios for
``lm1b`` on ``parallax_8x6`` at 6/12/24/48 GPUs against the paper's
(Parallax, EuroSys'19: 1.30, 3.22, 5.88, 7.03), true when they are within
30 % at 12, 24 and 48 GPUs and the Horovod curve falls from 12 to 48 GPUs;
and ``sim_paper_shape_reachable_by_horovod``: whether any falling Horovod
curve could meet that goal beside the sim's own hybrid curve
(:func:`horovod_window`; false: the hybrid curve is part of the mismatch).

Keys: ``ranks_per_node``, ``methods`` (per method and node count: ``measured_step_s``,
``sim_step_s``, ``relative_error``), ``sim_error_median``,
``sim_error_max`` (absolute relative errors over all of them; the issue's
goals: <= 0.15 and <= 0.3), ``sim_paper_shape`` (bool),
``sim_paper_shape_reachable_by_horovod``, ``sim_paper_ratios``,
``paper_ratios``, ``sim_horovod_samples_per_s``,
``paper_horovod_samples_per_s``, ``sim_hybrid_samples_per_s``,
``paper_hybrid_samples_per_s``, ``inputs`` (what was measured here).

Usage: ``python benchmarks/sim_check.py [--results PATH] [--no-measure]``
(``--no-measure``: CPU costs left out, links and compute only). One JSON line.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import socket
import sys
import threading
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import _common  # noqa: E402

#: measured method -> the simulator's strategy
STRATEGY_OF = {"hybrid": "hybrid", "auto": "auto", "allgather": "horovod",
               "ps_no_aggregation": "ps", "allreduce": "allreduce"}
#: Parallax (EuroSys'19), LM-1B on 8 machines x 6 TITAN Xp, words/s at 6/12/24/48 GPUs
PAPER_WORDS_PER_S = {"hybrid": {6: 87.9e3, 12: 149.5e3, 24: 249.5e3, 48: 276.8e3},
                     "horovod": {6: 67.7e3, 12: 46.5e3, 24: 42.4e3, 48: 39.4e3}}
#: MPICH's shared-memory latency inside a node (real seconds; assumed) and the copy
#: rate used when this host's is not measured (``--no-measure``)
SHM_LATENCY_S, COPY_BPS = 1e-6, 5e9
#: the paper-shape goal: ratios within this of the paper's at these GPU counts
PAPER_TOLERANCE, PAPER_CHECKED_GPUS = 0.3, (12, 24, 48)


def newest_results():
    """The newest ``benchmarks/results/*-scaling.json`` (by name: dated)."""
    found = sorted(glob.glob(os.path.join(HERE, "results", "*-scaling.json")))
    return found[-1] if found else None


def workers_per_node(results) -> int:
    """The run's workers on each node (``scaling.py --ranks-per-node``; 1 before it)."""
    return int(results.get("ranks_per_node") or 1)


def measured_steps(results) -> dict:
    """``{method: {nodes: step seconds}}`` from the results (median samples/s)."""
    out, per_node = {}, workers_per_node(results)
    for key, entry in results.items():
        if not key.startswith("nodes_") or not isinstance(entry, dict):
            continue
        nodes = int(key.split("_")[1])
        for method, figures in entry.items():
            if not isinstance(figures, dict) or "samples_per_s" not in figures:
                continue
            rate = figures["samples_per_s"]["median"]
            if rate:
                out.setdefault(method, {})[nodes] = (results["per_worker"] * nodes * per_node
                                                     / rate)
    return out


def lm_model(results):
    """The :class:`~hpcpax.models.lm.LanguageModel` of the run (no tables allocated)."""
    from hpcpax.models.lm import LanguageModel

    sizes = results["model"]
    return LanguageModel(vocab_size=sizes["vocab-size"], context=sizes["context"],
                         emb_dim=sizes["emb-dim"], hidden=(sizes["hidden"],),
                         out_dim=sizes["out-dim"], num_sampled=sizes["num-sampled"])


def measured_access(results, nodes: int) -> dict:
    """``{table: (alpha, duplicate_ratio, alpha_node)}`` over the run's timed steps on
    ``nodes`` nodes: the trainer's synthetic stream (``_cluster_lm_job.py``: shuffled,
    seed 0, ``max(200,000, 32 x global batch)`` tokens, Zipf 1.1) read as it reads it;
    worker ``w`` on node ``w // workers_per_node`` (``mpirun -ppn``'s order)."""
    from hpcpax.data import open_dataset

    sizes, model = results["model"], lm_model(results)
    per_node = workers_per_node(results)
    workers = nodes * per_node
    batch = results["per_worker"] * workers
    reader = open_dataset("synthetic", "lm", num_tokens=max(200_000, 8 * batch * 4),
                          vocab_size=sizes["vocab-size"], context=sizes["context"],
                          shuffle=True, seed=0)
    first = sizes["plan-steps"] + sizes["warmup"] + 1
    lookups, distinct, on_node = {}, {}, {}
    for step in range(first, sizes["steps"] + 1):
        node_ids = {}
        for worker in range(workers):
            ids = model.sparse_ids(reader.batch(step - 1, batch, worker, workers), step)
            for name, values in ids.items():
                unique = np.unique(np.asarray(values))
                lookups[name] = lookups.get(name, 0) + np.asarray(values).size
                distinct[name] = distinct.get(name, 0) + unique.size
                node_ids.setdefault((name, worker // per_node), []).append(unique)
        for (name, _), parts in node_ids.items():
            on_node[name] = on_node.get(name, 0) + np.unique(np.concatenate(parts)).size
    steps = sizes["steps"] - first + 1
    rows = sizes["vocab-size"]
    return {name: (distinct[name] / (steps * workers) / rows, lookups[name] / distinct[name],
                   on_node[name] / (steps * nodes) / rows)
            for name in lookups}


def model_preset(results, nodes: int) -> dict:
    """A model dict like the presets, for the run on ``nodes`` nodes."""
    model = lm_model(results)
    access = measured_access(results, nodes)
    widths = {s.name: s.dim for s in model.sparse_specs()}
    variables = [{"name": name, "kind": "sparse", "shape": [model.vocab_size, widths[name]],
                  "alpha": alpha, "alpha_node": alpha_node, "duplicate_ratio": ratio}
                 for name, (alpha, ratio, alpha_node) in access.items()]
    variables += [{"name": name, "kind": "dense", "shape": list(shape)}
                  for name, shape in model.dense_shapes().items()]
    # the emulated forward/backward of a worker's samples (undilated: dilation 1)
    from hpcpax.app.emulation import parse_emulate_compute

    compute = parse_emulate_compute(results.get("emulate_compute"))
    compute_ms = 1e3 * compute.seconds(results["per_worker"]) if compute else 0.0
    return {"name": "scaling-lm", "samples_per_worker": results["per_worker"],
            "compute_ms": compute_ms, "variables": variables}


def tcp_round_trip_s(repeats: int = 300) -> float:
    """Median seconds of a 64-byte TCP round trip over loopback (this kernel's stack)."""
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(1)

    def echo():
        connection, _ = server.accept()
        connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with connection:
            while True:
                data = connection.recv(64)
                if not data:
                    return
                connection.sendall(data)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    client = socket.create_connection(server.getsockname())
    client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    payload, times = b"x" * 64, []
    with client:
        for _ in range(repeats):
            start = time.perf_counter()
            client.sendall(payload)
            got = 0
            while got < len(payload):
                got += len(client.recv(64))
            times.append(time.perf_counter() - start)
    thread.join(timeout=5)
    server.close()
    return float(np.median(times))


def copy_Bps(nbytes: int = 16 << 20, repeats: int = 9) -> float:
    """Median bytes per second of one ``nbytes`` memory copy on this host."""
    source, target = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        np.copyto(target, source)
        times.append(time.perf_counter() - start)
    return nbytes / float(np.median(times))


def measure_inputs(dim: int) -> dict:
    """This machine's CPU costs (real seconds): kernel rates, per-operation host path,
    TCP round trip, memory copy rate. Not collective."""
    from hpcpax.plan.kernel_rates import measure_kernel_rates
    from hpcpax.tune.calibrate import measure_software

    return {"kernels": measure_kernel_rates(dim, "float32", sparse_optimizer="sgd",
                                            dense_optimizer="sgd", cache=False),
            "software": measure_software(repeats=15),
            "tcp_round_trip_s": tcp_round_trip_s(), "copy_Bps": copy_Bps()}


def _scaled(table: dict, factor: float) -> dict:
    return {name: {k: float(v) * factor for k, v in entry.items()}
            for name, entry in table.items()}


def cluster_preset(results, nodes: int, inputs: dict | None) -> dict:
    """A cluster dict for the run on ``nodes`` nodes (undilated units)."""
    from hpcpax.cluster.spec import parse_delay, parse_rate

    dilation = float(results.get("dilation", 1.0))
    bandwidth = parse_rate(results["rate"]) / 8.0
    latency = parse_delay(results.get("delay", "0"))
    per_node = workers_per_node(results)
    ranks = nodes * per_node
    cost = {"partition_overhead_per": "exchange"}
    # inside a node: MPICH's shared memory, two copies a message (undilated: x dilation)
    intra = {"latency_s": SHM_LATENCY_S / dilation,
             "bandwidth_Bps": ((inputs or {}).get("copy_Bps") or COPY_BPS)
             / 2.0 * dilation}
    if inputs:
        latency += inputs["tcp_round_trip_s"] / 2 / dilation
        # the ranks' simultaneous local work shares the host's cores (assumed fair share)
        share = max(1.0, ranks / float(results.get("cores") or ranks))
        cost.update(kernels=_scaled(inputs["kernels"], share / dilation),
                    software=_scaled(inputs["software"], share / dilation),
                    software_scope="process")
    link = {"latency_s": latency, "bandwidth_Bps": bandwidth}
    cluster = {"name": f"emulated {results['rate']} x {nodes}", "num_nodes": nodes,
               "gpus_per_node": per_node, "servers_per_node": 0,
               "intra": intra if per_node > 1 else dict(link), "inter": dict(link),
               "cost": cost}
    if inputs and results.get("cores"):
        from hpcpax.plan.sim import oversubscription_round_wait

        cluster["round_wait_s"] = oversubscription_round_wait(
            ranks, int(results["cores"]), spin_of(results, nodes)) / dilation
    return cluster


def spin_of(results, nodes: int) -> float:
    """The wait policy's spin inside an operation in the run on ``nodes`` nodes:
    the mean over the kinds of waits ``hybrid`` recorded (``wait_within``, rank
    0's), else (results from before the policy adapted) its fixed 2 ms."""
    from hpcpax.comm.polling import WITHIN_SPIN_SECONDS

    entry = (results.get(f"nodes_{nodes}") or {}).get("hybrid") or {}
    spins = [kind["spin_s"] for kind in (entry.get("wait_within") or {}).values()]
    return float(np.mean(spins)) if spins else WITHIN_SPIN_SECONDS


def compare(results, inputs) -> dict:
    """Per method and node count: measured and simulated step seconds, relative error."""
    from hpcpax.plan.sim import simulate

    measured = measured_steps(results)
    out = {}
    for nodes in sorted({n for steps in measured.values() for n in steps}):
        predicted = simulate(model_preset(results, nodes), cluster_preset(results, nodes, inputs))
        for method, steps in measured.items():
            if nodes not in steps or method not in STRATEGY_OF:
                continue
            strategy = predicted["strategies"][STRATEGY_OF[method]]
            sim_s = strategy["step_s"]
            out.setdefault(method, {})[str(nodes)] = {
                "measured_step_s": steps[nodes], "sim_step_s": sim_s,
                "relative_error": (sim_s - steps[nodes]) / steps[nodes],
                "sim_bottleneck": strategy["bottleneck"], "sim_variables": strategy["variables"]}
    return out


def horovod_window(hybrid: dict, paper: dict, tolerance: float = PAPER_TOLERANCE,
                   gpus=PAPER_CHECKED_GPUS):
    """A Horovod curve that meets the paper-shape goal beside ``hybrid``, or None.

    The goal asks the ratio ``hybrid[g] / horovod[g]`` within ``tolerance`` of
    ``paper[g]`` at each of ``gpus`` and the Horovod curve falling over them;
    with the hybrid curve held, each GPU count allows Horovod the interval
    ``hybrid[g] / (paper[g] x (1 +- tolerance))``. Returns ``{g: samples/s}``,
    the largest strictly falling choice inside the intervals (each point as
    high as its interval and the point before allow), or None when no
    falling curve fits them: then no model of Horovod alone can meet the goal,
    and the hybrid curve is part of the mismatch.
    """
    curve, ceiling = {}, math.inf
    for g in gpus:
        low = hybrid[g] / (paper[g] * (1.0 + tolerance))
        high = min(hybrid[g] / (paper[g] * (1.0 - tolerance)), ceiling)
        if high <= low:
            return None
        # strictly below the previous point: a hair under the ceiling when it binds
        curve[g] = high if high < ceiling else math.nextafter(high, -math.inf)
        ceiling = curve[g]
    return curve


def paper_shape() -> dict:
    """The simulator's hybrid/Horovod ratios for lm1b on parallax_8x6 against the paper's,
    and whether any Horovod curve could meet the goal beside the sim's hybrid
    (:func:`horovod_window`)."""
    from hpcpax.plan.sim import load_preset, simulate

    model, cluster = load_preset("lm1b"), load_preset("parallax_8x6")
    gpus_per_node = int(cluster["gpus_per_node"])
    ratios, horovod, hybrid = {}, {}, {}
    for gpus in PAPER_WORDS_PER_S["hybrid"]:
        result = simulate(model, dict(cluster, num_nodes=gpus // gpus_per_node))
        rates = {s: result["strategies"][s]["samples_per_s"] for s in ("hybrid", "horovod")}
        ratios[gpus] = rates["hybrid"] / rates["horovod"]
        horovod[gpus], hybrid[gpus] = rates["horovod"], rates["hybrid"]
    tokens = float(model.get("tokens_per_sample", 1))
    paper = {g: PAPER_WORDS_PER_S["hybrid"][g] / PAPER_WORDS_PER_S["horovod"][g] for g in ratios}
    within = all(abs(ratios[g] / paper[g] - 1.0) <= PAPER_TOLERANCE for g in PAPER_CHECKED_GPUS)
    checked = [horovod[g] for g in PAPER_CHECKED_GPUS]
    falling = all(a > b for a, b in zip(checked, checked[1:]))
    window = horovod_window(hybrid, paper)
    return {"sim_paper_shape": bool(within and falling),
            "sim_paper_shape_reachable_by_horovod": window is not None,
            "sim_hybrid_samples_per_s": {str(g): v for g, v in hybrid.items()},
            "paper_hybrid_samples_per_s": {str(g): w / tokens for g, w in
                                           PAPER_WORDS_PER_S["hybrid"].items()},
            "sim_paper_ratios": {str(g): r for g, r in ratios.items()},
            "paper_ratios": {str(g): r for g, r in paper.items()},
            "sim_paper_ratios_within_30pct": within, "sim_horovod_falling": falling,
            "sim_horovod_samples_per_s": {str(g): v for g, v in horovod.items()},
            "paper_horovod_samples_per_s": {str(g): w / tokens for g, w in
                                            PAPER_WORDS_PER_S["horovod"].items()}}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", default=None,
                        help="a benchmarks/scaling.py results file (default: the newest)")
    parser.add_argument("--no-measure", action="store_true",
                        help="leave this machine's CPU costs out (links and compute only)")
    args = parser.parse_args(argv)
    path = args.results or newest_results()
    out = {"benchmark": "sim_check", "results": path}
    if not path or not os.path.exists(path):
        out["skipped"] = f"no scaling results file: {path}"
        _common.emit(out)
        return 0
    results = json.load(open(path, encoding="utf-8"))
    inputs = None if args.no_measure else measure_inputs(int(results["model"]["emb-dim"]))
    methods = compare(results, inputs)
    errors = [abs(e["relative_error"]) for per in methods.values() for e in per.values()]
    out.update({
        "rate": results.get("rate"), "dilation": results.get("dilation"),
        "rounds": results.get("rounds"), "ranks_per_node": workers_per_node(results),
        "methods": methods,
        "sim_error_median": float(np.median(errors)) if errors else None,
        "sim_error_max": max(errors) if errors else None,
        **paper_shape(),
        "inputs": ({"measured_here": True, "tcp_round_trip_s": inputs["tcp_round_trip_s"],
                    "cpu_share_assumption": "CPU costs x max(1, ranks / cores) / dilation; "
                                            "each collective round waits "
                                            "(ranks / cores - 1) x spin / 2 / dilation "
                                            "(spin: the run's wait_within); inside a "
                                            "node, shared memory at half copy_Bps "
                                            "x dilation",
                    "copy_Bps": inputs["copy_Bps"],
                    "kernels": inputs["kernels"], "software": inputs["software"]}
                   if inputs else {"measured_here": False}),
    })
    _common.emit(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
