"""Sparse gradient sync: bytes and seconds per step for every method.

LM-like synthetic workload: Zipf(s=1.0) ids over 200,000 rows, dim 64,
4,096 ids per worker per step, float32. Default layout: 6 ranks as 2 virtual
nodes of 3 (1 server + 2 workers each); run ``mpirun -n 6 python
benchmarks/sparse_sync.py``. Bytes do not depend on oversubscription, times do.

Methods, interleaved step by step (A B C D A B C D ...), medians reported:

- ``allgather``: Horovod's sparse path (every worker gets every gradient);
- ``allreduce``: densify and allreduce (Horovod's sparse_as_dense);
- ``ps``: the parameter server, each worker talking to the owners;
- ``ps_la``: the parameter server with local aggregation.

Lower bound (off-node): every node must get each of its unique rows from an
owner on another node once (id out, row back) and send each summed gradient
row there once (id + row): ``sum over nodes of |unique rows of the node owned
off-node| x 2 x (8 + 4 dim)``. Lower bound (total) counts every unique row of
every node the same way, wherever its owner is.

One JSON line; keys ``ratio_ps_la_vs_lower_bound`` and
``ratio_allgather_vs_ps_la`` compare off-node bytes.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad
from hpcpax.sync.replicated import ReplicatedTable

METHODS = ("allgather", "allreduce", "ps", "ps_la")


def zipf_sampler(num_rows, s=1.0):
    """Inverse-CDF sampler of a bounded Zipf(s) over ``num_rows`` ids."""
    cdf = np.cumsum(1.0 / np.arange(1, num_rows + 1) ** s)
    cdf /= cdf[-1]
    return lambda rng, n: np.minimum(np.searchsorted(cdf, rng.random(n)), num_rows - 1)


def step_ids(sample, worker, step, n):
    return sample(np.random.default_rng([worker, step]), n).astype(np.int64)


def lower_bound(topo, var, ids_of_worker, row_bytes):
    """(off-node, total) bytes that any scheme must move for one step."""
    off, total = 0, 0
    for node in range(topo.num_nodes):
        members = topo.workers_on_node(node)
        if not members:
            continue
        union = np.unique(np.concatenate([ids_of_worker[w] for w in members]))
        owners = var.layout.dest_of(union)
        per_row = 2 * (8 + row_bytes)
        off += int((topo.node_of[owners] != node).sum()) * per_row
        total += len(union) * per_row
    return off, total


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--ids", type=int, default=4096, help="ids per worker per step")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ranks-per-node", type=int, default=3)
    parser.add_argument("--servers-per-node", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.ids, args.steps, args.warmup = 5000, 256, 3, 1
    rpn = min(args.ranks_per_node, MPI.COMM_WORLD.Get_size())
    topo = hpcpax.init(ranks_per_node=rpn, servers_per_node=args.servers_per_node)
    spec = SparseVariableSpec("emb", args.rows, args.dim, optimizer="sgd",
                              optimizer_params={"lr": 0.01})
    ps = ParameterServer(topo)
    if topo.is_server:
        ps.serve()
    else:
        ps.register([spec])
        ps.shutdown()  # releases the servers' first serve(), which took the registration
    tables = ({m: ReplicatedTable(topo, spec, method=m) for m in ("allgather", "allreduce")}
              if topo.is_worker else {})
    sample = zipf_sampler(args.rows)
    acct = topo.accounting

    def one_step(method, step):
        ids = step_ids(sample, topo.worker_index, step, args.ids)
        grad = SparseGrad(ids, np.full((len(ids), args.dim), 1e-3, np.float32), args.rows)
        if method.startswith("ps"):
            ps.local_aggregation = method == "ps_la"
            ps.pull_unique("emb", ids)
            ps.push("emb", grad)
        else:
            tables[method].pull_unique(ids)
            tables[method].push(grad)

    # Pass 1, bytes: each method alone for `steps` steps, every rank's
    # counters (servers included) summed over the world afterwards.
    measured = args.warmup + np.arange(args.steps)
    offnode, total, bound_off, bound_total = {}, {}, [], []
    for method in METHODS:
        if topo.is_server:
            if method.startswith("ps"):
                ps.serve()
        else:
            for step in measured:
                one_step(method, step)
            if method.startswith("ps"):
                ps.shutdown()
        summed = acct.reduce(topo.comm)["total"]
        acct.reset()
        offnode[method] = summed["sent_inter_bytes"] / args.steps
        total[method] = summed["sent_bytes"] / args.steps
    var = ps.variables["emb"]
    for step in measured:
        ids_of = {w: step_ids(sample, i, step, args.ids) for i, w in enumerate(topo.worker_ranks)}
        off, tot = lower_bound(topo, var, ids_of, spec.row_bytes)
        bound_off.append(off)
        bound_total.append(tot)

    # Pass 2, seconds: methods interleaved step by step, medians.
    seconds = {m: [] for m in METHODS}
    phases = {m: {} for m in METHODS}
    if topo.is_server:
        ps.serve()
    else:
        comm = topo.workers
        for step in range(args.warmup + args.steps):
            for method in METHODS:
                acct.reset()
                comm.Barrier()
                start = time.perf_counter()
                one_step(method, 10_000 + step)
                elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
                if step >= args.warmup:
                    seconds[method].append(elapsed)
                    for name, entry in acct.as_dict()["phases"].items():
                        phases[method].setdefault(name, []).append(entry["seconds"])
        ps.shutdown()
    if not topo.is_worker or topo.rank != topo.worker_ranks[0]:
        topo.free()
        return
    result = {
        "benchmark": "sparse_sync", "ranks": topo.size, "nodes": topo.num_nodes,
        "workers": topo.num_workers, "servers": len(topo.server_ranks),
        "rows": args.rows, "dim": args.dim, "ids_per_worker": args.ids, "steps": args.steps,
        "lower_bound_offnode_bytes": float(np.mean(bound_off)),
        "lower_bound_total_bytes": float(np.mean(bound_total)),
    }
    for method in METHODS:
        result[f"{method}_seconds"] = float(np.median(seconds[method]))
        result[f"{method}_offnode_bytes"] = float(offnode[method])
        result[f"{method}_total_bytes"] = float(total[method])
        result[f"{method}_phase_seconds"] = {
            k: float(np.median(v)) for k, v in phases[method].items()}
    result["ratio_ps_la_vs_lower_bound"] = (result["ps_la_offnode_bytes"]
                                            / result["lower_bound_offnode_bytes"])
    result["ratio_allgather_vs_ps_la"] = (result["allgather_offnode_bytes"]
                                          / result["ps_la_offnode_bytes"])
    result["ratio_ps_vs_ps_la"] = result["ps_offnode_bytes"] / result["ps_la_offnode_bytes"]
    print(json.dumps(result), flush=True)
    topo.free()


if __name__ == "__main__":
    main()
