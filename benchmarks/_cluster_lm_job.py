"""One round of ``cluster_lm.py`` on the emulated cluster (run under ``mpirun``; not standalone).

Trains the same LM-1B-shaped model with each method in ``--methods`` order
(``Trainer`` runs in this one job, so start-up costs are paid once). The
``torch`` method is PyTorch DDP (gloo, ``nn.Embedding(sparse=True)``,
:mod:`torch_lm`'s model) on the same batches and sampled ids: its steps run
as hooks of a PS run whose own figures are dropped (timed alone, after a
barrier). Every rank is a worker hosting partitions
(``servers_per_node=0``), as DDP's workers.

Measured per method over the timed steps (after the plan and warm-up):
step seconds (slowest rank), bytes from the accounting (hpcpax) and bytes
on each node's ``eth0`` (wire bytes with headers, read from
``/proc/net/dev`` inside the node by its first rank, so torch's bytes are
measured too, not computed). After each hpcpax run: the off-node bytes the
protocol's formula gives for its plan on the ids of the very same steps
(:func:`predicted_bytes`), and after ``auto`` the exact lower bound (each
node's unique rows owned by another node, pushed and pulled once). With
``--emulate-compute`` the torch step's forward and backward are emulated too
(:meth:`torch_lm.TorchSide.emulated_backward`: a sleep, then DDP's gloo
reductions of gradients of the real shapes).

Rank 0 prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

INDEX_BYTES = 8


def wire_bytes():
    """Bytes sent on this node's eth0 so far (this network namespace's /proc/net/dev)."""
    with open("/proc/net/dev") as handle:
        for line in handle:
            name, _, rest = line.partition(":")
            if name.strip() == "eth0":
                return int(rest.split()[8])
    return 0


class WireMeter:
    """Per-step bytes on each node's link; the node's first rank reads, rank 0 sums."""

    def __init__(self, comm, is_leader):
        self.comm, self.is_leader = comm, is_leader
        self.marks = []

    def mark(self, trainer=None, step=None):
        self.comm.Barrier()
        self.marks.append(wire_bytes() if self.is_leader else 0)

    def deltas(self, every=1, offset=0):
        """Summed over nodes: bytes between mark i and i+1, for i = offset, offset+every, ..."""
        marks = np.array(self.comm.allreduce(np.array(self.marks, np.int64), op=MPI.SUM))
        return [int(marks[i + 1] - marks[i]) for i in range(offset, len(marks) - 1, every)]


#: Methods beyond ``--plan`` values: ``ps`` without local aggregation.
PLAN_OF = {"ps_no_aggregation": "ps"}


#: Methods whose plan is fixed: no steps measured for a plan, timed after ``--warmup``.
FIXED = ("allgather", "ps", "ps_no_aggregation", "allreduce", "torch")


def steps_of(args, method):
    """Steps a method runs: ``--allreduce-steps`` for the densified allreduce (a slow
    step), ``--fixed-steps`` for the other fixed plans, else ``--steps`` (0: ``--steps``)."""
    if method == "allreduce" and args.allreduce_steps:
        return args.allreduce_steps
    if method in FIXED and args.fixed_steps:
        return args.fixed_steps
    return args.steps


def lm_config(args, method, run_dir):
    config = {"model": "lm", "vocab_size": args.vocab_size, "context": args.context,
              "emb_dim": args.emb_dim, "hidden": [args.hidden], "out_dim": args.out_dim,
              "num_sampled": args.num_sampled, "global_batch": args.global_batch,
              "steps": steps_of(args, method), "plan": PLAN_OF.get(method, method),
              "plan_steps": args.plan_steps, "servers_per_node": args.servers_per_node,
              "optimizer": "sgd", "lr": 0.05, "sparse_optimizer": "sgd", "sparse_lr": 0.1,
              "synthetic_samples": max(200_000, 8 * args.global_batch * 4),
              "run_dir": run_dir, "quiet": True,
              "local_aggregation": method != "ps_no_aggregation"}
    if args.emulate_compute:
        config.update(emulate_compute=args.emulate_compute, time_dilation=args.time_dilation)
    return config


def first_timed(run_dir, args, method):
    """The first timed step. A fixed plan: after ``--warmup`` steps (one before the
    densified allreduce's ``--allreduce-steps``). A measured plan: after the plan's
    measurement and the hot-rows trial (its steps switch trees on and off), then
    ``--warmup`` steps of the final plan."""
    if method in FIXED:
        return (1 if method == "allreduce" and args.allreduce_steps else args.warmup) + 1
    last = args.plan_steps
    try:
        trial = json.load(open(os.path.join(run_dir, "plan.json")))["search"]["hot_rows_trial"]
        last = max(last, int(trial["steps"][1]))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        pass
    return last + args.warmup + 1


def read_run(run_dir, args, method):
    records = [json.loads(t) for t in open(os.path.join(run_dir, "metrics.jsonl"))]
    first = first_timed(run_dir, args, method)
    rows = [r for r in records if "loss" in r and r["step"] >= first]
    cores = os.cpu_count() or 1
    comm_phases = ("pull", "push", "dense", "allgather", "dense_sparse")
    return {
        "seconds_per_step": _common.median([r["seconds"] for r in rows]),
        "seconds_per_step_all": [r["seconds"] for r in rows],
        "samples_per_s": args.global_batch / _common.median([r["seconds"] for r in rows]),
        "compute_seconds": _common.median([sum(v for k, v in r["time"].items()
                                               if k not in comm_phases) for r in rows]),
        "seconds_by_phase": {p: _common.median([r["time"][p] for r in rows])
                             for p in rows[0]["time"]},
        # all workers' CPU seconds in each phase (real, not divided by the dilation)
        "cpu_seconds_by_phase": {p: _common.median([r["cpu_by_phase"][p] for r in rows])
                                 for p in rows[0].get("cpu_by_phase", {})},
        "offnode_bytes_per_step": float(np.mean([sum(b.get("sent_inter", 0) for b in
                                                     r["bytes"].values()) for r in rows])),
        "bytes_per_step": float(np.mean([sum(b.get("sent", 0) for b in r["bytes"].values())
                                         for r in rows])),
        "final_loss": rows[-1]["loss"],
        "steps_timed": [rows[0]["step"], rows[-1]["step"]],
        # each worker's CPU seconds over its step's wall seconds, the largest
        "cpu_busy_rank_max": max(max(r.get("cpu_busy") or [0.0]) for r in rows),
        # the machine's: all ranks' CPU seconds over cores x wall, the busiest step
        # (every rank is a worker here, so the workers' figures are all ranks')
        "cpu_busy_max": max(sum(r.get("cpu_busy") or [0.0]) / cores for r in rows),
        # the same inside each exchange phase (the ranks' work comes in bursts there)
        "cpu_busy_phase_max": phase_cpu_busy(rows, cores, args.time_dilation, comm_phases),
    }


#: phases shorter than this share of the step are left out of ``phase_cpu_busy``: their
#: wall seconds (the workers' mean) are too short to hold their CPU seconds' bookkeeping
MIN_PHASE_SHARE = 0.1


def phase_cpu_busy(rows, cores, dilation, phases):
    """Median over the steps of the busiest exchange phase's CPU demand: every worker's
    CPU seconds in the phase over cores x the phase's wall seconds (real: x dilation),
    phases of at least ``MIN_PHASE_SHARE`` of the step. Near 1, the phase waited for
    the cores, whatever the step's own busy fraction."""
    busiest = []
    for r in rows:
        demand = [r["cpu_by_phase"][p] / (cores * r["time"][p] * dilation)
                  for p in phases if r.get("cpu_by_phase", {}).get(p)
                  and r["time"].get(p, 0.0) >= MIN_PHASE_SHARE * r["seconds"]]
        if demand:
            busiest.append(max(demand))
    return round(_common.median(busiest), 4) if busiest else None


def plan_methods(run_dir):
    plan = json.load(open(os.path.join(run_dir, "plan.json")))
    entries = plan.get("variables", plan)
    if isinstance(entries, dict):
        entries = [{"name": k, **v} for k, v in entries.items()]
    return plan, {e["name"]: e for e in entries}


def predicted_bytes(trainer, plan_entries, args, first, last):
    """The protocol's off-node bytes for the plan and the exact lower bound, per timed step.

    Applied to the very ids of the timed steps: a ``ps`` row owned on another node
    costs ``2 x (8 + dim x 4)`` (pulled: index out, row back; pushed: index and
    row out), once per node with local aggregation, once per worker without;
    ``allgather``: each worker's unique rows of every allgather table to every
    worker on another node, padded to the largest worker's where hpcpax pads
    (:func:`hpcpax.comm.sparse_collectives.padded_block_bytes`);
    densified ``allreduce`` (the table and its 1-byte touched mask) and the dense
    part: the ring's off-node bytes. Hot-row trees (relays) are not in the
    formula: a plan that kept them differs by its relay bytes. The lower bound:
    each node's remote unique rows once."""
    from hpcpax.comm.accounting import ring_allreduce_bytes
    from hpcpax.comm.sparse_collectives import padded_block_bytes

    topo, model, reader = trainer.topology, trainer.model, trainer.reader
    workers = list(topo.worker_ranks)
    node_of = np.asarray(topo.node_of)
    nodes = int(node_of.max()) + 1
    specs = {s.name: s for s in model.sparse_specs()}
    dense_bytes = sum(int(np.prod(shape)) * 4 for shape in model.dense_shapes().values())
    dense = sum(ring_allreduce_bytes(node_of, workers, r, dense_bytes)[2] for r in workers)
    predicted, bound = [], []
    for step in range(first, last + 1):
        ids = [model.sparse_ids(reader.batch(step - 1, args.global_batch, w, len(workers)), step)
               for w in range(len(workers))]
        total_predicted, total_bound = float(dense), float(dense)
        gathered = np.zeros(len(workers), np.int64)  # each worker's allgather bytes
        for name, spec in specs.items():
            entry = plan_entries[name]
            row = INDEX_BYTES + spec.dim * 4
            per_worker = [np.unique(np.asarray(i[name]).ravel()) for i in ids]
            per_node = [np.unique(np.concatenate([per_worker[i] for i, w in enumerate(workers)
                                                  if node_of[w] == n])) for n in range(nodes)]
            owners = np.asarray(entry.get("owners") or workers)
            parts = int(entry.get("partitions") or len(owners))

            def remote(unique, node):  # rows owned on another node: pulled and pushed once
                return 2 * row * int(np.count_nonzero(node_of[owners[unique % parts]] != node))

            node_terms = sum(remote(u, n) for n, u in enumerate(per_node))
            total_bound += node_terms
            method = entry["method"]
            if method == "ps" and entry.get("local_aggregation", True):
                total_predicted += node_terms
            elif method == "ps":
                total_predicted += sum(remote(u, node_of[w])
                                       for u, w in zip(per_worker, workers))
            elif method == "allgather":  # one batched allgather for all: after the loop
                gathered = gathered + row * np.array([len(u) for u in per_worker], np.int64)
            else:  # densified allreduce
                table = spec.rows * spec.dim * 4 + spec.rows  # + the touched-rows mask
                total_predicted += sum(ring_allreduce_bytes(node_of, workers, r, table)[2]
                                       for r in workers)
        if gathered.any():  # padded to the largest block where hpcpax pads
            block = padded_block_bytes(gathered)
            for i, w in enumerate(workers):
                remote = sum(1 for v in workers if node_of[v] != node_of[w])
                total_predicted += (gathered[i] if block is None else block) * remote
        predicted.append(total_predicted)
        bound.append(total_bound)
    return float(np.mean(predicted)), float(np.mean(bound))


def run_torch_setup(args, comm):
    import torch
    import torch.distributed as dist

    import hpcpax
    import torch_lm

    torch.set_num_threads(1)
    topo = hpcpax.init(servers_per_node=0)
    node_of = topo.node_of.copy()
    topo.free()
    master = comm.bcast(_eth0_address() if comm.Get_rank() == 0 else None)
    port = comm.bcast(_common.free_port() if comm.Get_rank() == 0 else None)
    dist.init_process_group("gloo", init_method=f"tcp://{master}:{port}",
                            rank=comm.Get_rank(), world_size=comm.Get_size())
    sizes = {"vocab_size": args.vocab_size, "context": args.context, "emb_dim": args.emb_dim,
             "hidden": [args.hidden], "out_dim": args.out_dim, "num_sampled": args.num_sampled,
             "global_batch": args.global_batch}
    emulate_s = None
    if args.emulate_compute:
        from hpcpax.app.emulation import parse_emulate_compute

        model = parse_emulate_compute(args.emulate_compute, args.time_dilation)
        emulate_s = model.seconds(args.global_batch // comm.Get_size())
    return torch_lm.TorchSide(torch, dist, sizes, 0, node_of, emulate_s,
                              args.time_dilation), dist


def _eth0_address():
    import socket

    return socket.gethostbyname(socket.gethostname())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("vocab-size", 400_000), ("context", 4), ("emb-dim", 128),
                          ("hidden", 256), ("out-dim", 128), ("num-sampled", 4096),
                          ("global-batch", 1152), ("steps", 20), ("plan-steps", 5),
                          ("warmup", 2)):
        parser.add_argument(f"--{flag}", type=int, default=default)
    parser.add_argument("--methods", default="auto,allgather,ps,torch")
    parser.add_argument("--servers-per-node", type=int, default=0)
    parser.add_argument("--allreduce-steps", type=int, default=0,
                        help="steps of the densified allreduce, timed after one (0: --steps)")
    parser.add_argument("--fixed-steps", type=int, default=0,
                        help="steps of the other fixed plans and torch (0: --steps)")
    parser.add_argument("--emulate-compute", default=None)
    parser.add_argument("--time-dilation", type=float, default=1.0)
    args = parser.parse_args()
    from hpcpax.app.trainer import Trainer

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    meter = WireMeter(comm, local.Get_rank() == 0)
    methods = args.methods.split(",")
    torch_side = dist = None
    if "torch" in methods:
        torch_side, dist = run_torch_setup(args, comm)
    out = {"nodes": int(comm.allreduce(1 if local.Get_rank() == 0 else 0)),
           "ranks": comm.Get_size(), "order": methods, "methods": {}}
    scratch = comm.bcast(tempfile.mkdtemp(prefix="hpcpax-cluster-lm-") if comm.Get_rank() == 0
                         else None)
    for method in methods:
        run_dir = os.path.join(scratch, method)
        with_torch = method == "torch"
        hooks = [meter.mark] + ([torch_side.step, meter.mark] if with_torch else [])
        meter.marks = []
        meter.mark()
        # torch runs alone too: its steps ride on a PS run only for its batches and
        # sampled ids, and that run's own figures are dropped
        trainer = Trainer(lm_config(args, "ps" if with_torch else method, run_dir), comm=comm,
                          hooks=hooks)
        start = time.perf_counter()
        trainer.run()
        wall = time.perf_counter() - start
        # untimed steps; marks: 0 before step 1, then after each step
        first = first_timed(run_dir, args, method) - 1
        if with_torch:
            torch_wire = meter.deltas(2, offset=2 * first + 1)
            seconds = torch_side.seconds[first:]  # already the slowest worker's, each step
            if comm.Get_rank() == 0:
                out["methods"]["torch"] = {
                    "seconds_per_step": _common.median(seconds),
                    "seconds_per_step_all": [float(s) for s in seconds],
                    "samples_per_s": args.global_batch / _common.median(seconds),
                    "wire_bytes_per_step": float(np.mean(torch_wire)),
                    "compute_seconds": _common.median(torch_side.compute_seconds[first:]),
                    "cpu_busy_max": max(torch_side.cpu_busy[first:]),
                    "plan": "DDP: dense one bucket allreduce, sparse gloo sparse allreduce",
                    "emulated": torch_side.emulate_s is not None,
                    "layout": "DDP over gloo (TCP over eth0 between nodes), "
                              "nn.Embedding(sparse=True): sparse grads allgathered",
                }
            torch_side.seconds, torch_side.compute_seconds, torch_side.cpu_busy = [], [], []
            comm.Barrier()
            continue
        hp_wire = meter.deltas(1, offset=first)
        if comm.Get_rank() == 0:
            result = read_run(run_dir, args, method)
            summary = json.load(open(os.path.join(run_dir, "summary.json")))
            result["cpu_busy_ranks"] = summary.get("cpu_busy")
            result["startup_seconds"] = summary.get("startup_seconds")
            result["wait_within"] = (summary.get("wait") or {}).get("within")
            result["wire_bytes_per_step"] = float(np.mean(hp_wire)) if hp_wire else None
            result["wall_seconds"] = wall
            plan, entries = plan_methods(run_dir)
            result["plan"] = {n: e.get("method") for n, e in entries.items()
                              if e.get("kind", "sparse") == "sparse"}
            trial = plan.get("search", {}).get("hot_rows_trial")
            if trial:
                result["hot_rows_trial"] = {k: trial.get(k) for k in
                                            ("variables", "kept", "on_s", "off_s", "skipped")
                                            if k in trial}
            predicted, bound = predicted_bytes(trainer, entries, args,
                                               first + 1,
                                               steps_of(args, method))
            result["offnode_bytes_predicted"] = predicted
            if method == "auto":
                result["fabric"] = plan.get("fabric")
                result["measurements"] = plan.get("measurements")
                result["predicted_s"] = {n: e.get("predicted_s") for n, e in entries.items()}
                out["lower_bound_offnode_bytes"] = bound
            out["methods"][method] = result
        comm.Barrier()
    if dist is not None:
        dist.destroy_process_group()
    if comm.Get_rank() == 0:
        shutil.rmtree(scratch, ignore_errors=True)
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
