"""``hpcpax.torch`` against plain PyTorch: DDP on N ranks, one process on 1.

The example scripts' own model, optimizer and batches
(``examples/torch_dlrm.py`` or ``examples/torch_lm.py``, imported), their own
``train_step``, three ways, in one ``mpirun`` job:

1. N ranks, interleaved step by step (A B A B ...) on the same global
   batches: A = the script through ``hpcpax.torch.distribute`` (``plan auto``,
   ``servers_per_node=0``: every rank is a worker hosting its share of the
   tables, as DDP's N workers); B = the same model in
   ``torch.nn.parallel.DistributedDataParallel`` over gloo
   (``nn.Embedding(sparse=True)``: gloo's sparse allreduce, an allgather),
   each rank taking the same share of each batch. Steps until the plan has
   decided (``plan_steps``) plus ``warmup`` are not timed.
   ``ratio_vs_torch_ddp`` = adapter samples/s / DDP samples/s (goal >= 1.3).
2. 1 rank (rank 0; the others wait without spinning), interleaved: the plain
   single-process script against the adapter on a one-rank world.
   ``overhead_1rank_vs_torch`` = plain samples/s / adapter samples/s
   (goal <= 1.15).

A step's time is the slowest rank's, between barriers; figures are medians
over the timed steps, with the spread (min, max). The plan the adapter used
is named per table. Bytes per step, summed over ranks: the adapter's from its
counters (measured); DDP's by formula (sparse tables: each rank's coalesced
rows, ``unique ids x (8 + dim x itemsize)``, reach every other rank;
dense: ring allreduce, :func:`hpcpax.comm.accounting.ring_allreduce_bytes`).

Run: ``HPCPAX_RANKS_PER_NODE=2 mpirun -n 4 python -m mpi4py benchmarks/torch_adapter.py
[--model dlrm|lm] [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))
import _common  # noqa: E402

FULL = {"dlrm": ["--steps", "60", "--batch", "2048", "--optimizer", "sgd"],
        "lm": ["--steps", "60", "--batch", "1024", "--vocab", "200000", "--optimizer", "sgd"]}
QUICK = {"dlrm": ["--steps", "24", "--batch", "256", "--rows-scale", "0.05", "--optimizer", "sgd"],
         "lm": ["--steps", "24", "--batch", "128", "--vocab", "20000", "--optimizer", "sgd"]}
PLAN_STEPS, WARMUP = 8, 3


def _example(name):
    import torch_dlrm
    import torch_lm

    return torch_dlrm if name == "dlrm" else torch_lm


def _wait_quietly(comm):
    """Barrier that sleeps instead of spinning (ranks idle while rank 0 runs alone)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(0.01)


def _ddp_bytes(model, batches, node_of, steps):
    """DDP's bytes per step by formula, summed over ranks: ``(total, off-node)``."""
    import torch

    from hpcpax.comm.accounting import ring_allreduce_bytes

    tables = [m for m in model.modules()
              if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    table_weights = {id(m.weight) for m in tables}
    dense_bytes = sum(p.numel() * p.element_size() for p in model.parameters()
                      if id(p) not in table_weights)
    ranks = list(range(len(node_of)))
    total = offnode = 0
    for step_ids in steps:  # step_ids[rank][table] = unique ids that rank touched
        for t, table in enumerate(tables):
            row = 8 + table.embedding_dim * table.weight.element_size()
            b = _common.allgather_bytes([ids[t] for ids in step_ids], node_of, row)
            total += b["total"]
            offnode += b["offnode"]
        for r in ranks:
            sent, _, sent_inter, _ = ring_allreduce_bytes(node_of, ranks, r, dense_bytes)
            total += sent
            offnode += sent_inter
    count = max(1, len(steps))
    return total / count, offnode / count


def _unique_per_table(model, batch, example):
    """Unique ids each table of ``model`` sees in ``batch`` (a counting forward pass)."""
    import torch

    seen = []
    hooks = [m.register_forward_pre_hook(
        lambda module, inputs: seen.append(int(torch.unique(inputs[0]).numel())))
        for m in model.modules() if isinstance(m, (torch.nn.Embedding, torch.nn.EmbeddingBag))]
    with torch.no_grad():
        if example.__name__ == "torch_dlrm":
            model(*batch[:3])
        else:
            model(*batch)
    for h in hooks:
        h.remove()
    return seen


def ranks_phase(example, argv, comm, topo_args):
    """Adapter (plan auto) vs DDP on every rank, interleaved; figures on rank 0."""
    import torch
    import torch.distributed as dist

    import hpcpax
    import hpcpax.torch
    from hpcpax.torch.data import share

    rank, size = comm.Get_rank(), comm.Get_size()
    args = example.parse_args(argv)
    model_a, opt_a, loader_a = example.build(args)
    model_b, opt_b, loader_b = example.build(args)
    topology = hpcpax.init(**topo_args)
    node_of = topology.node_of.copy()
    num_nodes = topology.num_nodes
    model_a, opt_a, loader_a = hpcpax.torch.distribute(
        model_a, opt_a, loader_a, plan="auto", plan_steps=PLAN_STEPS, topology=topology,
        quiet=True, stdout="all", on_server="return")
    port = comm.bcast(_common.free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    ddp = torch.nn.parallel.DistributedDataParallel(model_b)
    opts_a = opt_a if isinstance(opt_a, list) else [opt_a]
    opts_b = opt_b if isinstance(opt_b, list) else [opt_b]
    acct = topology.accounting
    seconds_a, seconds_b, bytes_a, inter_a, ddp_ids = [], [], [], [], []
    first_timed = PLAN_STEPS + WARMUP
    for step, (batch_a, batch_b) in enumerate(zip(loader_a, loader_b)):
        start, stop = share(len(batch_b[0]), rank, size)
        batch_b = [t[start:stop] for t in batch_b]
        acct.reset()
        comm.Barrier()
        begin = time.perf_counter()
        example.train_step(model_a, opts_a, batch_a)
        elapsed_a = comm.allreduce(time.perf_counter() - begin, op=_max())
        totals = acct.totals()
        sent = comm.allreduce(totals["sent_bytes"])
        sent_inter = comm.allreduce(totals["sent_inter_bytes"])
        comm.Barrier()
        begin = time.perf_counter()
        example.train_step(ddp, opts_b, batch_b)
        elapsed_b = comm.allreduce(time.perf_counter() - begin, op=_max())
        if step >= first_timed:
            seconds_a.append(elapsed_a)
            seconds_b.append(elapsed_b)
            bytes_a.append(sent)
            inter_a.append(sent_inter)
            ddp_ids.append(comm.allgather(_unique_per_table(model_b, batch_b, example)))
    methods = model_a._hpcpax_session.sync.methods()
    ddp_total, ddp_offnode = _ddp_bytes(model_b, None, node_of, ddp_ids)
    hpcpax.torch.finish()
    dist.destroy_process_group()
    batch = args.batch
    return {
        "ranks": size, "num_nodes": num_nodes, "timed_steps": len(seconds_a),
        "plan": methods, "plan_picks_ps": any(m == "ps" for m in methods.values()),
        "samples_per_s_adapter": batch / _common.median(seconds_a),
        "samples_per_s_torch_ddp": batch / _common.median(seconds_b),
        "samples_per_s_adapter_spread": [batch / max(seconds_a), batch / min(seconds_a)],
        "samples_per_s_torch_ddp_spread": [batch / max(seconds_b), batch / min(seconds_b)],
        "ratio_vs_torch_ddp": _common.ratio(_common.median(seconds_b),
                                            _common.median(seconds_a)),
        "bytes_per_step_adapter": float(np.mean(bytes_a)),
        "offnode_bytes_per_step_adapter": float(np.mean(inter_a)),
        "bytes_per_step_torch_ddp": ddp_total,
        "offnode_bytes_per_step_torch_ddp": ddp_offnode,
    }


def one_rank_phase(example, argv, comm):
    """Plain torch vs the adapter on a one-rank world (rank 0 alone); figures on rank 0."""
    from mpi4py import MPI

    import hpcpax
    import hpcpax.torch

    if comm.Get_rank() != 0:
        _wait_quietly(comm)
        return None
    args = example.parse_args(argv)
    model_p, opt_p, loader_p = example.build(args)
    model_a, opt_a, loader_a = example.build(args)
    topology = hpcpax.init(comm=MPI.COMM_SELF, servers_per_node=0)
    model_a, opt_a, loader_a = hpcpax.torch.distribute(
        model_a, opt_a, loader_a, plan="auto", topology=topology, quiet=True, stdout="all")
    opts_p = opt_p if isinstance(opt_p, list) else [opt_p]
    opts_a = opt_a if isinstance(opt_a, list) else [opt_a]
    seconds_p, seconds_a = [], []
    for step, (batch_p, batch_a) in enumerate(zip(loader_p, loader_a)):
        begin = time.perf_counter()
        example.train_step(model_p, opts_p, batch_p)
        middle = time.perf_counter()
        example.train_step(model_a, opts_a, batch_a)
        end = time.perf_counter()
        if step >= WARMUP:
            seconds_p.append(middle - begin)
            seconds_a.append(end - middle)
    methods = model_a._hpcpax_session.sync.methods()
    hpcpax.torch.finish()
    topology.free()
    _wait_quietly(comm)
    batch = args.batch
    return {
        "plan_1rank": methods,
        "samples_per_s_plain_1rank": batch / _common.median(seconds_p),
        "samples_per_s_adapter_1rank": batch / _common.median(seconds_a),
        "samples_per_s_plain_1rank_spread": [batch / max(seconds_p), batch / min(seconds_p)],
        "samples_per_s_adapter_1rank_spread": [batch / max(seconds_a), batch / min(seconds_a)],
        "overhead_1rank_vs_torch": _common.ratio(_common.median(seconds_a),
                                                 _common.median(seconds_p)),
    }


def _max():
    from mpi4py import MPI

    return MPI.MAX


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("dlrm", "lm"), default="lm")
    parser.add_argument("--quick", action="store_true", help="small sizes, few steps")
    args = parser.parse_args()
    import torch
    from mpi4py import MPI

    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))
    torch.set_num_threads(threads)
    comm = MPI.COMM_WORLD
    example = _example(args.model)
    argv = (QUICK if args.quick else FULL)[args.model]
    result = {"benchmark": "torch_adapter", "model": args.model, "example_args": " ".join(argv),
              "threads_per_rank": threads, "plan_steps": PLAN_STEPS, "warmup_steps": WARMUP,
              "layout": "servers_per_node=0 (every rank a worker, as DDP's)"}
    result.update(ranks_phase(example, argv, comm, {"servers_per_node": 0}))
    one = one_rank_phase(example, argv, comm)
    if comm.Get_rank() == 0:
        result.update(one)
        _common.emit(result)


if __name__ == "__main__":
    main()
