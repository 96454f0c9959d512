"""Parallax's partition search on the sparse benchmark workload.

Sweeps the partition count P over 1, 2, 4, ..., 32 (each P: repartition live,
time a few steps, median; the sweep is repeated in interleaved rounds), then
runs the live search (:func:`hpcpax.tune.live_search.search_partitions_live`)
from P0 = number of servers, and reports each P's step time, the chosen P and
its swept time relative to the best. Workload and layout as
``benchmarks/sparse_sync.py`` (PS with local aggregation); run
``mpirun -n 6 python benchmarks/partition_search.py``.

One JSON line; key ``ratio_chosen_vs_best`` (target <= 1.10).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from mpi4py import MPI

import hpcpax
from hpcpax.tune.live_search import search_partitions_live, time_steps
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad

sys.path.insert(0, str(Path(__file__).parent))
from sparse_sync import step_ids, zipf_sampler  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=4096)
    parser.add_argument("--max-partitions", type=int, default=32)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per measurement")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved sweep rounds")
    parser.add_argument("--ranks-per-node", type=int, default=3)
    parser.add_argument("--servers-per-node", type=int, default=1)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.ids, args.max_partitions, args.steps, args.rounds = 5000, 256, 4, 1, 1
    rpn = min(args.ranks_per_node, MPI.COMM_WORLD.Get_size())
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=args.servers_per_node)
    ps = ParameterServer(topo)
    if topo.is_server:
        ps.serve()
        topo.free()
        return
    spec = SparseVariableSpec("emb", args.rows, args.dim, optimizer="adagrad",
                              optimizer_params={"lr": 0.01})
    ps.register([spec])
    sample = zipf_sampler(args.rows)

    def step_fn(step):
        ids = step_ids(sample, topo.worker_index, step, args.ids)
        ps.pull_unique("emb", ids)
        ps.push("emb", SparseGrad(ids, np.full((len(ids), args.dim), 1e-3, np.float32),
                                  args.rows))

    candidates = [1 << k for k in range(args.max_partitions.bit_length())
                  if 1 << k <= args.max_partitions]
    swept = {p: [] for p in candidates}
    step = 0
    for _ in range(args.rounds):
        for p in candidates:
            ps.repartition("emb", p)
            swept[p].append(time_steps(topo, step_fn, step, args.steps, warmup=1))
            step += args.steps + 1
    sweep = {p: float(np.median(v)) for p, v in swept.items()}
    best = min(sweep, key=sweep.get)
    result, step = search_partitions_live(ps, "emb", step_fn, first_step=step, steps=args.steps,
                                          p_max=args.max_partitions)
    chosen = result.chosen
    chosen_time = sweep.get(chosen)
    if chosen_time is None:  # chosen off the sweep's powers of two: time it the same way
        ps.repartition("emb", chosen)
        chosen_time = time_steps(topo, step_fn, step, args.steps, warmup=1)
    ps.shutdown()
    if topo.rank == topo.worker_ranks[0]:
        print(json.dumps({
            "benchmark": "partition_search", "ranks": topo.size, "nodes": topo.num_nodes,
            "servers": len(topo.server_ranks), "workers": topo.num_workers,
            "step_seconds_by_partitions": {str(p): t for p, t in sweep.items()},
            "best_partitions": best, "best_seconds": sweep[best],
            "chosen_partitions": chosen, "chosen_seconds": chosen_time,
            "search": result.to_dict(),
            "ratio_chosen_vs_best": chosen_time / sweep[best],
        }), flush=True)
    topo.free()


if __name__ == "__main__":
    main()
