"""Many tables per step: batched PS exchanges against one exchange per table.

A DLRM-like step touches many small embedding tables (Criteo has 26
categorical fields). Pulling and pushing them one by one costs each table a
header, two count exchanges and four ``Alltoallv`` (with local aggregation);
:meth:`ParameterServer.pull_unique_many` / :meth:`~ParameterServer.push_many`
send every table of a phase in one exchange. Same ids, same gradients, same
bytes; interleaved repeats (A B A B ...), medians of the slowest rank.

    HPCPAX_RANKS_PER_NODE=3 mpirun -n 6 python benchmarks/ps_batching.py
    python benchmarks/ps_batching.py --quick      # CI smoke, any rank count

Keys: ``ratio_one_by_one_vs_batched`` (step seconds, > 1 = batching wins),
``calls_per_step`` of each (collective calls on one worker), and
``bytes_equal`` (the per-table byte counters agree exactly).
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad

BYTE_FIELDS = ("sent_bytes", "recv_bytes", "sent_inter_bytes", "recv_inter_bytes")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tables", type=int, default=26)
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--ids", type=int, default=512, help="ids per table per worker per step")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tables, args.rows, args.ids, args.repeats = 6, 2000, 64, 3
    servers = 1 if MPI.COMM_WORLD.Get_size() >= 3 else 0
    topo = hpcpax.init(servers_per_node=servers)
    specs = [SparseVariableSpec(f"t{k}", args.rows, args.dim, optimizer="adagrad",
                                optimizer_params={"lr": 0.01}) for k in range(args.tables)]
    cdf = _common.zipf_cdf(args.rows)
    ps = ParameterServer(topo, seed=1)  # both modes train the same tables, alternately
    modes = ("one_by_one", "batched")
    result = {"benchmark": "ps_batching", "ranks": topo.size, "servers": len(topo.server_ranks),
              "nodes": topo.num_nodes, "tables": args.tables, "rows": args.rows,
              "dim": args.dim, "ids_per_table": args.ids}
    if topo.is_server:
        ps.serve()
    else:
        ps.register(specs)
        step = [0]

        def work(mode):
            rng = np.random.default_rng([topo.worker_index, step[0]])
            ids = {s.name: _common.zipf_ids(rng, args.ids, cdf) for s in specs}
            grads = {s.name: SparseGrad(ids[s.name], rng.standard_normal(
                (args.ids, args.dim), dtype=np.float32), args.rows) for s in specs}
            if mode == "batched":
                ps.pull_unique_many(ids)
                ps.push_many(grads)
            else:
                for s in specs:
                    ps.pull_unique(s.name, ids[s.name])
                for s in specs:
                    ps.push(s.name, grads[s.name])

        counters = {}

        def one_step(mode):
            def call():
                topo.accounting.reset()
                work(mode)
                counters[mode] = topo.accounting.as_dict()
                if mode == "batched":
                    step[0] += 1
            return call

        times = _common.interleaved(topo.workers, {m: one_step(m) for m in modes},
                                    args.repeats, warmup=2)
        ps.shutdown()
        for mode in modes:
            result[f"{mode}_s"] = _common.median(times[mode])
            result[f"{mode}_calls_per_step"] = sum(p["calls"] for name, p in
                                                   counters[mode]["phases"].items()
                                                   if name != "control")
        same = all(counters["one_by_one"]["variables"][s.name][f]
                   == counters["batched"]["variables"][s.name][f]
                   for s in specs for f in BYTE_FIELDS)
        result["bytes_equal"] = bool(topo.workers.allreduce(same, op=MPI.LAND))
        result["ratio_one_by_one_vs_batched"] = _common.ratio(result["one_by_one_s"],
                                                              result["batched_s"])
        _common.emit(result, topo.workers.Get_rank())
    topo.free()


if __name__ == "__main__":
    main()
