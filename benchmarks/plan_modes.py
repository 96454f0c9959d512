"""``--plan auto`` against ``hybrid``, ``ps``, ``allgather`` and ``allreduce`` on the built-in models.

For each model (``lm``, ``ctr``) and each plan mode, one training run in this
``mpirun`` job (modes in rounds, so noise hits all alike): samples/s over the
steps after the plan was applied (median), off-node and total bytes per step,
and the methods the plan chose. Run ``mpirun -n 4 python
benchmarks/plan_modes.py`` (``HPCPAX_RANKS_PER_NODE=2`` for 2 virtual nodes).
One JSON line; ``ratio_auto_vs_best`` is auto's samples/s over the best mode's.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np
from mpi4py import MPI

from hpcpax.app.trainer import Trainer

MODES = ("auto", "hybrid", "ps", "allgather", "allreduce")
MODELS = {
    "lm": {"model": "lm", "vocab_size": 50_000, "emb_dim": 64, "hidden": [128], "out_dim": 64,
           "num_sampled": 256, "global_batch": 384},
    "ctr": {"model": "ctr", "n_fields": 8, "table_rows": 50_000, "emb_dim": 16,
            "global_batch": 384},
}


def one_run(comm, base, mode, steps, plan_steps, workdir):
    run_dir = comm.bcast(tempfile.mkdtemp(dir=workdir) if comm.Get_rank() == 0 else None)
    trainer = Trainer({**base, "plan": mode, "steps": steps, "plan_steps": plan_steps,
                       "run_dir": run_dir, "quiet": True}, comm=comm)
    trainer.run()
    leader = trainer.topology.worker_ranks[0]
    result = None
    if comm.Get_rank() == leader:
        rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
        rows = [r for r in rows if "loss" in r and r["step"] > plan_steps + 2]
        offnode = [sum(p.get("sent_inter", 0) for p in r["bytes"].values()) for r in rows]
        total = [sum(p.get("sent", 0) for p in r["bytes"].values()) for r in rows]
        plan = json.load(open(os.path.join(run_dir, "plan.json")))
        entries = plan.get("variables", plan)
        entries = entries if isinstance(entries, dict) else {e["name"]: e for e in entries}
        result = {"samples_per_s": float(np.median([r["samples_per_s"] for r in rows])),
                  "offnode_bytes_per_step": float(np.mean(offnode)),
                  "worker_bytes_per_step": float(np.mean(total)),
                  "final_loss": rows[-1]["loss"],
                  "methods": {n: e.get("method") for n, e in entries.items()
                              if e.get("kind", "sparse") == "sparse"}}
    return comm.bcast(result, root=leader)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--plan-steps", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.plan_steps, args.rounds = 10, 3, 1
    comm = MPI.COMM_WORLD
    out = {"benchmark": "plan_modes", "ranks": comm.Get_size(),
           "ranks_per_node": os.environ.get("HPCPAX_RANKS_PER_NODE"), "steps": args.steps}
    with tempfile.TemporaryDirectory() as scratch:
        workdir = comm.bcast(scratch if comm.Get_rank() == 0 else None)
        for name, base in MODELS.items():
            if args.quick:
                base = {**base, "global_batch": 48}
            runs = {mode: [] for mode in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    runs[mode].append(one_run(comm, base, mode, args.steps, args.plan_steps,
                                              workdir))
            summary = {}
            for mode, results in runs.items():
                summary[mode] = {**results[-1], "samples_per_s": float(
                    np.median([r["samples_per_s"] for r in results]))}
            best = max(summary, key=lambda m: summary[m]["samples_per_s"])
            out[name] = summary
            out[f"{name}_best_mode"] = best
            out[f"{name}_ratio_auto_vs_best"] = (summary["auto"]["samples_per_s"]
                                                 / summary[best]["samples_per_s"])
    out["ratio_auto_vs_best"] = min(out["lm_ratio_auto_vs_best"], out["ctr_ratio_auto_vs_best"])
    if comm.Get_rank() == 0:
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
