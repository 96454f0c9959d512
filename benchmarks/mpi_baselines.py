"""Plain-mpi4py baselines against hpcpax, one JSON line.

Dense (200 float32 tensors, log-uniform sizes, 8 MiB in all; quick: 20, 256 KiB):

- ``per_tensor``: one ``MPI_Allreduce`` per tensor;
- ``one_buffer``: pack into one buffer, one ``MPI_Allreduce``, unpack;
- ``hpcpax``: :class:`hpcpax.comm.allreduce.DenseAllreduce` (sum).

Sparse (the LM-like gradients of ``torch_sparse.py``: Zipf s=1.0 over
200,000 rows, dim 64, 4,096 ids per worker per step):

- ``allgatherv``: Horovod's method written in plain mpi4py: dedup locally,
  ``Allgatherv`` of counts, ids and rows, sum locally (sync only, no update);
- ``hpcpax_ps``: ``ParameterServer.pull_unique`` + ``push`` (local
  aggregation, owner-side SGD), layout ``servers_per_node=0``.

Interleaved A B C A B C ..., medians of the slowest rank. Bytes per step
summed over ranks; allgatherv by the direct-send formula of
:func:`_common.allgather_bytes`; hpcpax from its accounting; off-node lower
bound from :func:`_common.offnode_lower_bound`.
Run: ``mpirun -n N python -m mpi4py benchmarks/mpi_baselines.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

import hpcpax  # noqa: E402
from hpcpax.comm.accounting import ring_allreduce_bytes  # noqa: E402
from hpcpax.comm.allreduce import DenseAllreduce  # noqa: E402
from hpcpax.ops import dedup_sum  # noqa: E402
from hpcpax import ParameterServer, SparseVariableSpec  # noqa: E402
from hpcpax.ps.sparse_grad import SparseGrad  # noqa: E402


def dense_sizes(quick):
    rng = np.random.default_rng(0)
    count, total = (20, 256 << 10) if quick else (200, 8 << 20)
    sizes = np.exp(rng.uniform(np.log(256), np.log(total / 8), count))
    return [int(s) for s in np.maximum(1, np.round(sizes / sizes.sum() * total / 4))]


def allgatherv_sync(comm, ids, values):
    """Horovod-style sparse sync: every rank gets every rank's rows and sums them."""
    ids, values = dedup_sum(ids, values)
    counts = np.array(comm.allgather(len(ids)), np.int64)
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    dim = values.shape[1]
    all_ids = np.empty(int(counts.sum()), np.int64)
    all_values = np.empty((int(counts.sum()), dim), values.dtype)
    comm.Allgatherv([ids, MPI.INT64_T], [all_ids, (counts, displs), MPI.INT64_T])
    comm.Allgatherv([values, MPI.FLOAT], [all_values, (counts * dim, displs * dim), MPI.FLOAT])
    return dedup_sum(all_ids, all_values), len(ids)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 15)
    rows, dim, count = (20_000, 16, 512) if args.quick else (_common.ROWS, _common.DIM,
                                                            _common.IDS_PER_WORKER)
    topo = hpcpax.init(servers_per_node=0)
    comm, n = topo.workers, topo.num_workers
    ranks = list(range(topo.size))

    # Dense.
    sizes = dense_sizes(args.quick)
    grads = [np.ones(s, np.float32) for s in sizes]
    buffer = np.empty(sum(sizes), np.float32)
    dense = DenseAllreduce(topo, grads, op="sum")

    def per_tensor():
        for g in grads:
            comm.Allreduce(MPI.IN_PLACE, g)

    def one_buffer():
        np.concatenate(grads, out=buffer)
        comm.Allreduce(MPI.IN_PLACE, buffer)
        offset = 0
        for g in grads:
            g[...] = buffer[offset:offset + g.size]
            offset += g.size

    dense_times = _common.interleaved(comm, {"per_tensor": per_tensor, "one_buffer": one_buffer,
                                             "hpcpax": lambda: dense.allreduce(grads)}, repeats)
    nbytes = sum(g.nbytes for g in grads)
    ring = [ring_allreduce_bytes(topo.node_of, ranks, r, nbytes) for r in ranks]

    # Sparse.
    cdf = _common.zipf_cdf(rows)
    steps = [_common.sparse_step(7, k, topo.worker_index, count, dim, rows, cdf) for k in range(4)]
    ps = ParameterServer(topo, local_aggregation=True)
    ps.register([SparseVariableSpec("emb", rows, dim, optimizer="sgd",
                                    optimizer_params={"lr": 0.1})])
    counter = {"allgatherv": 0, "hpcpax_ps": 0}

    def allgatherv():
        ids, values = steps[counter["allgatherv"] % len(steps)]
        counter["allgatherv"] += 1
        allgatherv_sync(comm, ids, values)

    def hpcpax_ps():
        ids, values = steps[counter["hpcpax_ps"] % len(steps)]
        counter["hpcpax_ps"] += 1
        ps.pull_unique("emb", ids)
        ps.push("emb", SparseGrad(ids, values, rows))

    sparse_times = _common.interleaved(comm, {"allgatherv": allgatherv, "hpcpax_ps": hpcpax_ps},
                                       repeats)
    topo.accounting.reset()
    nnz = []
    for ids, values in steps:
        ps.pull_unique("emb", ids)
        ps.push("emb", SparseGrad(ids, values, rows))
        nnz.append(len(np.unique(ids)))
    reduced = topo.accounting.reduce(topo.comm)
    nnz_all = np.array(comm.allgather(nnz))
    unique = comm.gather([np.unique(ids) for ids, _ in steps], root=0)

    if topo.rank == 0:
        k = len(steps)
        var = ps.variables["emb"]
        node_of = topo.node_of[topo.worker_ranks]
        owner_node = lambda ids: topo.node_of[var.layout.dest_of(ids)]  # noqa: E731
        lower = [_common.offnode_lower_bound([unique[w][s] for w in range(n)], node_of,
                                             owner_node, dim) for s in range(k)]
        gathered = [_common.allgather_bytes(nnz_all[:, s], node_of, 8 + dim * 4) for s in range(k)]
        ps_bytes = _common.phase_bytes(reduced, ("pull", "push", "intra_node", "control"))
        dm = {m: _common.median(t) for m, t in dense_times.items()}
        sm = {m: _common.median(t) for m, t in sparse_times.items()}
        result = {
            "benchmark": "mpi_baselines", "ranks": topo.size, "num_nodes": topo.num_nodes,
            "ranks_per_node": topo.size // topo.num_nodes, "repeats": repeats,
            "dense_bytes": nbytes, "dense_tensors": len(sizes),
            **{f"dense_seconds_{m}": v for m, v in dm.items()},
            **{f"dense_algbw_GBps_{m}": nbytes / v / 1e9 for m, v in dm.items()},
            "dense_bytes_per_step_ring": sum(r[0] for r in ring),
            "dense_offnode_bytes_per_step_ring": sum(r[2] for r in ring),
            "ratio_dense_per_tensor_vs_hpcpax": _common.ratio(dm["per_tensor"], dm["hpcpax"]),
            "ratio_dense_one_buffer_vs_hpcpax": _common.ratio(dm["one_buffer"], dm["hpcpax"]),
            "sparse_rows": rows, "sparse_dim": dim, "sparse_ids_per_worker": count,
            **{f"sparse_seconds_{m}": v for m, v in sm.items()},
            "ratio_sparse_allgatherv_vs_hpcpax": _common.ratio(sm["allgatherv"], sm["hpcpax_ps"]),
            "sparse_bytes_per_step_allgatherv": sum(g["total"] for g in gathered) / k,
            "sparse_offnode_bytes_per_step_allgatherv": sum(g["offnode"] for g in gathered) / k,
            "sparse_bytes_per_step_hpcpax": ps_bytes["total"] / k,
            "sparse_offnode_bytes_per_step_hpcpax": ps_bytes["offnode"] / k,
            "sparse_offnode_lower_bound_per_step": sum(b["total"] for b in lower) / k,
            "sparse_offnode_lower_bound_push_per_step": sum(b["push"] for b in lower) / k,
        }
        result["ratio_offnode_allgatherv_vs_hpcpax"] = _common.ratio(
            result["sparse_offnode_bytes_per_step_allgatherv"],
            result["sparse_offnode_bytes_per_step_hpcpax"])
        result["ratio_offnode_hpcpax_vs_lower_bound"] = _common.ratio(
            result["sparse_offnode_bytes_per_step_hpcpax"],
            result["sparse_offnode_lower_bound_per_step"])
        _common.emit(result)
    topo.free()


if __name__ == "__main__":
    main()
