"""Sparse gradient sync: torch.distributed (gloo) against hpcpax's parameter server.

The same LM-like sparse gradients on every method: Zipf(s=1.0) ids over
200,000 rows, dim 64, 4,096 ids per worker per step, float32 (a few distinct
steps, cycled). Methods, interleaved in one ``mpirun`` job (A B A B ...),
medians of the slowest rank's time per step:

- ``torch``: what a PyTorch user does with ``nn.Embedding(sparse=True)``
  gradients: ``torch.sparse_coo_tensor(ids, rows).coalesce()`` then
  ``dist.all_reduce`` on the gloo backend. gloo's sparse allreduce is an
  allgather of every rank's indices and values followed by a local sum.
  torch.distributed is set up with ``init_method="tcp://127.0.0.1:PORT"``
  (port chosen on rank 0, broadcast over MPI) and the MPI rank and size.
- ``hpcpax``: ``ParameterServer.pull_unique`` of the step's ids, then
  ``ParameterServer.push`` of the gradient (dedup, node-local aggregation,
  owner-side SGD), the PS path of one training step.

Layout: ``servers_per_node=0``: every rank is a worker and hosts one
partition, as torch's N workers; the same number of processes does the
gradient work on both sides. Virtual nodes come from
``HPCPAX_RANKS_PER_NODE``.

Bytes per step (summed over ranks, sent side, one untimed pass over the
distinct steps): hpcpax from ``topology.accounting`` (phases pull, push,
intra_node, control); torch by the allgather-equivalent formula: each rank's
coalesced block, ``nnz * (8 + dim * 4)`` bytes (int64 index + float32 row),
reaches each of the other ``N - 1`` ranks once; off-node: the copies that go
to ranks on another (virtual) node; gloo's few metadata bytes are left out.
Lower bound (off-node): see :func:`_common.offnode_lower_bound`.

Note: hpcpax's time also holds the pull and the owner-side optimizer update,
which torch's sync-only time does not (torch applies its update afterwards,
on every replica). Run: ``mpirun -n N python -m mpi4py benchmarks/torch_sparse.py``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import hpcpax  # noqa: E402
from hpcpax import ParameterServer, SparseVariableSpec  # noqa: E402
from hpcpax.ps.sparse_grad import SparseGrad  # noqa: E402

PS_PHASES = ("pull", "push", "intra_node", "control")


def init_torch(topo, threads):
    import torch
    import torch.distributed as dist

    torch.set_num_threads(threads)
    port = topo.comm.bcast(_common.free_port() if topo.rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=topo.rank, world_size=topo.size)
    return torch, dist


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--distinct-steps", type=int, default=4)
    args = parser.parse_args()
    rows, dim, count = (20_000, 16, 512) if args.quick else (_common.ROWS, _common.DIM,
                                                            _common.IDS_PER_WORKER)
    repeats = args.repeats or (3 if args.quick else 15)
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))

    topo = hpcpax.init(servers_per_node=0)
    torch, dist = init_torch(topo, threads)
    comm, worker, n = topo.comm, topo.worker_index, topo.num_workers

    cdf = _common.zipf_cdf(rows)
    steps = [_common.sparse_step(7, k, worker, count, dim, rows, cdf)
             for k in range(args.distinct_steps)]
    ps = ParameterServer(topo, local_aggregation=True)
    ps.register([SparseVariableSpec("emb", rows, dim, optimizer="sgd",
                                    optimizer_params={"lr": 0.1})])
    var = ps.variables["emb"]
    counter = {"hpcpax": 0, "torch": 0}
    split = {"pull": [], "push": []}

    def hpcpax_step():
        ids, values = steps[counter["hpcpax"] % len(steps)]
        counter["hpcpax"] += 1
        start = time.perf_counter()
        ps.pull_unique("emb", ids)
        middle = time.perf_counter()
        ps.push("emb", SparseGrad(ids, values, rows))
        split["pull"].append(middle - start)
        split["push"].append(time.perf_counter() - middle)

    def torch_coo(ids, values):
        index = torch.from_numpy(ids).unsqueeze(0)
        return torch.sparse_coo_tensor(index, torch.from_numpy(values), (rows, dim),
                                       check_invariants=False).coalesce()

    def torch_step():
        ids, values = steps[counter["torch"] % len(steps)]
        counter["torch"] += 1
        dist.all_reduce(torch_coo(ids, values))

    methods = {"torch": torch_step, "hpcpax": hpcpax_step}
    _common.interleaved(comm, methods, repeats=0, warmup=2)
    topo.accounting.reset()
    split["pull"].clear()
    split["push"].clear()
    times = _common.interleaved(comm, methods, repeats=repeats, warmup=0)
    timed = topo.accounting.reduce(comm)

    # Bytes: one untimed pass over the distinct steps.
    topo.accounting.reset()
    nnz = []
    for ids, values in steps:
        ps.pull_unique("emb", ids)
        ps.push("emb", SparseGrad(ids, values, rows))
        nnz.append(torch_coo(ids, values)._nnz())
    reduced = topo.accounting.reduce(comm)
    unique = comm.gather([np.unique(ids) for ids, _ in steps], root=0)
    nnz_all = np.array(comm.allgather(nnz))  # [ranks, steps]
    per_rank_pull = np.array(comm.allgather(float(np.median(split["pull"]))))
    per_rank_push = np.array(comm.allgather(float(np.median(split["push"]))))
    dist.destroy_process_group()

    if topo.rank == 0:
        k = len(steps)
        row = 8 + dim * 4
        node_of = topo.node_of[topo.worker_ranks]
        owner_node = lambda ids: topo.node_of[var.layout.dest_of(ids)]  # noqa: E731
        lower = [_common.offnode_lower_bound([unique[w][s] for w in range(n)], node_of,
                                             owner_node, dim) for s in range(k)]
        torch_bytes = [_common.allgather_bytes(nnz_all[:, s], node_of, row) for s in range(k)]
        ps_bytes = _common.phase_bytes(reduced, PS_PHASES)
        pull_push = _common.phase_bytes(reduced, ("pull", "push"))
        calls = max(1, counter["hpcpax"] - 2)
        seconds = {name: _common.median(t) for name, t in times.items()}
        result = {
            "benchmark": "torch_sparse",
            "ranks": topo.size,
            "num_nodes": topo.num_nodes,
            "ranks_per_node": topo.size // topo.num_nodes,
            "layout": "servers_per_node=0: all ranks are workers and host one partition each, "
                      "like torch's N workers",
            "rows": rows, "dim": dim, "ids_per_worker": count, "zipf_s": _common.ZIPF_S,
            "repeats": repeats, "threads_per_rank": threads,
            "seconds_per_step_torch": seconds["torch"],
            "seconds_per_step_hpcpax": seconds["hpcpax"],
            "seconds_pull_hpcpax": float(per_rank_pull.mean()),
            "seconds_push_hpcpax": float(per_rank_push.mean()),
            "seconds_by_phase_hpcpax": {p: e["seconds"] / topo.size / calls
                                        for p, e in timed["phases"].items()},
            "ratio_torch_vs_hpcpax": _common.ratio(seconds["torch"], seconds["hpcpax"]),
            "nnz_per_rank_mean": float(nnz_all.mean()),
            "bytes_per_step_hpcpax": ps_bytes["total"] / k,
            "offnode_bytes_per_step_hpcpax": ps_bytes["offnode"] / k,
            "offnode_bytes_per_step_hpcpax_pull_push": pull_push["offnode"] / k,
            "bytes_per_step_torch": sum(b["total"] for b in torch_bytes) / k,
            "offnode_bytes_per_step_torch": sum(b["offnode"] for b in torch_bytes) / k,
            "offnode_lower_bound_per_step": sum(b["total"] for b in lower) / k,
            "offnode_lower_bound_push_per_step": sum(b["push"] for b in lower) / k,
        }
        result["ratio_offnode_torch_vs_hpcpax"] = _common.ratio(
            result["offnode_bytes_per_step_torch"], result["offnode_bytes_per_step_hpcpax"])
        result["ratio_offnode_hpcpax_vs_lower_bound"] = _common.ratio(
            result["offnode_bytes_per_step_hpcpax"], result["offnode_lower_bound_per_step"])
        _common.emit(result)
    topo.free()


if __name__ == "__main__":
    main()
