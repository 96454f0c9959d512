"""Fused allreduce against the two naive ways, printed as one JSON line.

Workloads: (small) 1,000 float32 tensors of 8 KiB; (mixed) 200 float32
tensors of log-uniform sizes totalling 32 MiB. Methods, interleaved in the
same run (A B C A B C ...) so machine noise hits all alike, medians reported:

- ``hpcpax``: :class:`hpcpax.comm.allreduce.DenseAllreduce` (sum, autotuned buckets);
- ``per_tensor``: one ``MPI_Allreduce`` per tensor;
- ``one_buffer``: pack everything into one buffer, one ``MPI_Allreduce``, unpack.

algbw = bytes of all tensors / seconds (GB/s). Run under ``mpirun -n N``.
``--quick`` uses tiny sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from mpi4py import MPI

import hpcpax
from hpcpax.comm.allreduce import DenseAllreduce


def workloads(quick):
    rng = np.random.default_rng(0)
    count, total = (20, 1 << 20) if quick else (200, 32 << 20)
    sizes = np.exp(rng.uniform(np.log(256), np.log(total / 8), count))
    sizes = np.maximum(1, np.round(sizes / sizes.sum() * total / 4)).astype(int)
    return {
        "small": [2048] * (50 if quick else 1000),
        "mixed": [int(s) for s in sizes],
    }


def per_tensor(comm, grads):
    for g in grads:
        comm.Allreduce(MPI.IN_PLACE, g)


def one_buffer(comm, grads, buffer):
    offset = 0
    for g in grads:
        buffer[offset:offset + g.size] = g
        offset += g.size
    comm.Allreduce(MPI.IN_PLACE, buffer)
    offset = 0
    for g in grads:
        g[...] = buffer[offset:offset + g.size]
        offset += g.size


def run(topo, sizes, repeats):
    comm = topo.workers
    grads = [np.ones(s, np.float32) for s in sizes]
    nbytes = sum(g.nbytes for g in grads)
    dense = DenseAllreduce(topo, grads, op="sum")
    buffer = np.empty(sum(sizes), np.float32)
    methods = {
        "hpcpax": lambda: dense.allreduce(grads),
        "per_tensor": lambda: per_tensor(comm, grads),
        "one_buffer": lambda: one_buffer(comm, grads, buffer),
    }
    times = {name: [] for name in methods}
    for _ in range(2):  # warm-up
        for call in methods.values():
            call()
    for _ in range(repeats):
        for name, call in methods.items():
            comm.Barrier()
            start = time.perf_counter()
            call()
            times[name].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    algbw = {name: nbytes / float(np.median(t)) / 1e9 for name, t in times.items()}
    return algbw, dense.bucket_bytes, nbytes


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    topo = hpcpax.init(servers_per_node=0)
    repeats = args.repeats or (3 if args.quick else 15)
    result = {"benchmark": "allreduce", "ranks": topo.num_workers, "repeats": repeats}
    for name, sizes in workloads(args.quick).items():
        algbw, bucket, nbytes = run(topo, sizes, repeats)
        result[f"bytes_{name}"] = nbytes
        result[f"bucket_bytes_{name}"] = bucket
        for method, value in algbw.items():
            result[f"algbw_GBps_{method}_{name}"] = round(value, 3)
        best = max(algbw["per_tensor"], algbw["one_buffer"])
        result[f"ratio_vs_best_naive_{name}"] = round(algbw["hpcpax"] / best, 3)
    if topo.rank == 0:
        print(json.dumps(result), flush=True)
    topo.free()


if __name__ == "__main__":
    main()
