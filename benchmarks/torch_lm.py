"""The ``lm`` model: PyTorch DistributedDataParallel (gloo) against ``python -m hpcpax.train``.

One ``mpirun`` job runs both, interleaved step by step (A B A B ...) on the
same global batches: ``hpcpax.train.main`` (the CLI entry point, with the
flags below) trains the model, and after each of its steps a hook runs one
step of the same model written in PyTorch:

- ``nn.Embedding(sparse=True)`` for the input table ``embedding`` and for the
  output tables ``softmax_w`` and ``softmax_b`` (sparse bias);
- dense hidden layers (ReLU) and a linear projection to ``out_dim``;
- sampled softmax with the same ``num_sampled`` log-uniform negatives per
  step (hpcpax's own sampler, so the very same ids), logQ correction and
  accidental-hit masking;
- plain SGD on both sides (dense ``--lr``, sparse ``--sparse-lr``), mean of
  the workers' gradients (DDP averages; hpcpax's push and allreduce take the
  mean);
- DDP over gloo, set up with ``init_method="tcp://127.0.0.1:PORT"`` and the
  MPI rank and size. Its sparse gradients go through gloo's sparse
  allreduce (an allgather), its dense ones through gloo's ring allreduce.

Layout: hpcpax ``--servers-per-node 0``: all N ranks are workers and host
the partitions, as DDP's N workers. Both sides: ``OMP_NUM_THREADS`` threads
per rank.

Figures: samples/s = global batch / median step time after warm-up (hpcpax:
from ``RUN_DIR/metrics.jsonl``; torch: barrier-to-slowest-rank time of
forward + backward (with DDP's overlapped sync) + optimizer step). Bytes per
step summed over ranks: hpcpax from its metrics lines; torch by formula:
sparse tables: each rank's coalesced block, ``unique ids x (8 + dim x 4)``
bytes, reaches each of the other N - 1 ranks (allgather equivalent); dense
parameters: ring allreduce, ``2 (N-1)/N x bytes`` per rank
(``hpcpax.comm.accounting.ring_allreduce_bytes``, which also splits off-node).

Run: ``mpirun -n N python -m mpi4py benchmarks/torch_lm.py [--quick]``.
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

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

FULL = {"vocab_size": 200_000, "context": 4, "emb_dim": 64, "hidden": [256], "out_dim": 64,
        "num_sampled": 1024, "global_batch": 1024, "steps": 30, "warmup": 5}
QUICK = {"vocab_size": 5_000, "context": 4, "emb_dim": 16, "hidden": [32], "out_dim": 16,
         "num_sampled": 64, "global_batch": 64, "steps": 6, "warmup": 2}
LR, SPARSE_LR = 0.05, 0.1


def build_torch_model(torch, sizes):
    nn = torch.nn

    class TorchLM(nn.Module):
        def __init__(self):
            super().__init__()
            vocab, emb, out = sizes["vocab_size"], sizes["emb_dim"], sizes["out_dim"]
            self.embedding = nn.Embedding(vocab, emb, sparse=True)
            self.softmax_w = nn.Embedding(vocab, out, sparse=True)
            self.softmax_b = nn.Embedding(vocab, 1, sparse=True)
            for table, scale in ((self.embedding, emb ** -0.5), (self.softmax_w, out ** -0.5)):
                nn.init.uniform_(table.weight, -scale, scale)
            nn.init.zeros_(self.softmax_b.weight)
            layers, fan_in = [], sizes["context"] * emb
            for width in sizes["hidden"]:
                layers += [nn.Linear(fan_in, width), nn.ReLU()]
                fan_in = width
            layers.append(nn.Linear(fan_in, out))
            self.mlp = nn.Sequential(*layers)

        def forward(self, context, target, samples, log_q_true, log_q_sampled):
            batch = context.shape[0]
            output = self.mlp(self.embedding(context).reshape(batch, -1))
            true_logits = ((output * self.softmax_w(target)).sum(1)
                           + self.softmax_b(target)[:, 0] - log_q_true)
            sampled_logits = (output @ self.softmax_w(samples).T
                              + (self.softmax_b(samples)[:, 0] - log_q_sampled))
            hits = samples[None, :] == target[:, None]
            sampled_logits = sampled_logits.masked_fill(hits, -1e30)
            logits = torch.cat([true_logits[:, None], sampled_logits], 1)
            zeros = torch.zeros(batch, dtype=torch.int64)
            return torch.nn.functional.cross_entropy(logits, zeros)

    return TorchLM()


class TorchSide:
    """The DDP model, its optimizer, timings and byte counts; one step per hook call."""

    def __init__(self, torch, dist, sizes, seed, node_of, emulate_s=None, dilation=1.0):
        from hpcpax.models.lm import log_uniform_log_expected_count, log_uniform_sample

        self.torch, self.dist, self.sizes, self.seed = torch, dist, sizes, seed
        self.sample, self.log_q = log_uniform_sample, log_uniform_log_expected_count
        torch.manual_seed(seed)
        self.model = torch.nn.parallel.DistributedDataParallel(build_torch_model(torch, sizes))
        inner = self.model.module
        sparse = [inner.embedding.weight, inner.softmax_w.weight, inner.softmax_b.weight]
        dense = [p for p in inner.parameters() if all(p is not s for s in sparse)]
        self.dense_bytes = sum(p.numel() * 4 for p in dense)
        self.optimizer = torch.optim.SGD([{"params": dense, "lr": LR},
                                          {"params": sparse, "lr": SPARSE_LR}])
        self.node_of = node_of
        self.seconds, self.compute_seconds, self.nnz, self.cpu_busy = [], [], [], []
        #: emulated accelerator: forward+backward a sleep of this many (dilated)
        #: seconds; the step's times are reported divided by ``dilation``
        self.emulate_s, self.dilation = emulate_s, float(dilation)
        self.dense, self.sparse = dense, sparse

    def step(self, trainer, step):
        torch, sizes = self.torch, self.sizes
        topo = trainer.topology
        batch = trainer.reader.batch(step - 1, sizes["global_batch"], topo.worker_index,
                                     topo.num_workers)
        position = step - 1
        samples = self.sample(self.seed, position, sizes["num_sampled"], sizes["vocab_size"])
        context = torch.from_numpy(np.ascontiguousarray(batch["context"], np.int64))
        target = torch.from_numpy(np.ascontiguousarray(batch["target"], np.int64))
        samples_t = torch.from_numpy(samples)
        log_q_true = torch.from_numpy(self.log_q(np, batch["target"].astype(np.int64),
                                                 sizes["num_sampled"], sizes["vocab_size"],
                                                 np.float32))
        log_q_sampled = torch.from_numpy(self.log_q(np, samples, sizes["num_sampled"],
                                                    sizes["vocab_size"], np.float32))
        from mpi4py import MPI

        topo.workers.Barrier()
        start, cpu = time.perf_counter(), time.process_time()
        self.optimizer.zero_grad(set_to_none=True)
        if self.emulate_s is None:
            loss = self.model(context, target, samples_t, log_q_true, log_q_sampled)
            loss.backward()
            middle = time.perf_counter()
        else:
            middle = self.emulated_backward(context, torch.cat([target, samples_t]), start)
        self.optimizer.step()
        wall, cpu = time.perf_counter() - start, time.process_time() - cpu
        elapsed = topo.workers.allreduce(wall, op=MPI.MAX)
        # the machine's busy fraction: every rank's CPU seconds over cores x wall
        self.cpu_busy.append(topo.workers.allreduce(cpu, op=MPI.SUM)
                             / ((os.cpu_count() or 1) * elapsed))
        self.seconds.append(elapsed / self.dilation)
        self.compute_seconds.append((middle - start) / self.dilation)
        output_ids = np.concatenate([batch["target"].astype(np.int64), samples])
        unique_out = len(np.unique(output_ids))
        self.nnz.append((len(np.unique(batch["context"])), unique_out, unique_out))

    def emulated_backward(self, context, output_ids, start):
        """DDP's step with an emulated accelerator: the forward and backward a sleep
        holding no CPU, then the gradients autograd would give, of the real shapes
        (``nn.Embedding(sparse=True)``: one uncoalesced row per lookup; dense: full;
        every value hpcpax's emulated ``GRAD_VALUE``), reduced as DDP reduces them:
        the dense ones in one flat gloo allreduce (they fit DDP's 25 MiB bucket),
        each sparse one by gloo's sparse allreduce (an allgather of indices and
        values, summed), all started at once (``async_op``, as DDP's reducer
        launches its buckets) and then waited for, all divided by the world size. Returns the time the
        sleep ended (the communication counts as the step's, as DDP's does)."""
        from hpcpax.app.emulation import GRAD_VALUE

        torch, dist = self.torch, self.dist
        time.sleep(max(0.0, self.emulate_s - (time.perf_counter() - start)))
        middle = time.perf_counter()
        world = dist.get_world_size()
        for param in self.dense:
            param.grad = torch.full_like(param, GRAD_VALUE)
        for param, ids in zip(self.sparse, (context.reshape(-1), output_ids, output_ids)):
            values = torch.full((len(ids), param.shape[1]), GRAD_VALUE)
            param.grad = torch.sparse_coo_tensor(ids[None, :], values, tuple(param.shape))
        flat = torch.cat([p.grad.reshape(-1) for p in self.dense])
        works = [dist.all_reduce(flat, async_op=True)]
        works += [dist.all_reduce(param.grad, async_op=True) for param in self.sparse]
        for work in works:
            work.wait()
        flat /= world
        offset = 0
        for param in self.dense:
            param.grad.copy_(flat[offset:offset + param.numel()].view_as(param))
            offset += param.numel()
        for param in self.sparse:
            param.grad = param.grad / world
        return middle

    def bytes_per_step(self, comm, warmup):
        """Allgather-equivalent sparse bytes + ring dense bytes, summed over ranks."""
        from hpcpax.comm.accounting import ring_allreduce_bytes

        everyone = np.array(comm.allgather(self.nnz[warmup:]), np.int64)  # [rank, step, table]
        n = everyone.shape[0]
        widths = (self.sizes["emb_dim"], self.sizes["out_dim"], 1)
        total = offnode = 0.0
        ranks = list(range(n))
        for s in range(everyone.shape[1]):
            for t, width in enumerate(widths):
                b = _common.allgather_bytes(everyone[:, s, t], self.node_of, 8 + width * 4)
                total += b["total"]
                offnode += b["offnode"]
            for r in ranks:
                sent, _, sent_inter, _ = ring_allreduce_bytes(self.node_of, ranks, r,
                                                              self.dense_bytes)
                total += sent
                offnode += sent_inter
        steps = max(1, everyone.shape[1])
        return total / steps, offnode / steps


def hpcpax_argv(sizes, run_dir):
    return ["--model", "lm", "--steps", str(sizes["steps"]),
            "--global-batch", str(sizes["global_batch"]),
            "--vocab-size", str(sizes["vocab_size"]), "--context", str(sizes["context"]),
            "--emb-dim", str(sizes["emb_dim"]),
            "--hidden", ",".join(str(h) for h in sizes["hidden"]),
            "--out-dim", str(sizes["out_dim"]), "--num-sampled", str(sizes["num_sampled"]),
            "--optimizer", "sgd", "--lr", str(LR),
            "--sparse-optimizer", "sgd", "--sparse-lr", str(SPARSE_LR),
            "--servers-per-node", "0", "--synthetic-samples", str(max(200_000, 4 * sizes[
                "global_batch"] * 8)),
            "--run-dir", run_dir, "--quiet"]


def hpcpax_figures(run_dir, warmup):
    lines = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    steps = [line for line in lines if "samples_per_s" in line][warmup:]
    seconds = _common.median([s["seconds"] for s in steps])
    phases = {p: _common.median([s["time"][p] for s in steps]) for p in steps[0]["time"]}
    total = [sum(b["sent"] for b in s["bytes"].values()) for s in steps]
    inter = [sum(b["sent_inter"] for b in s["bytes"].values()) for s in steps]
    by_phase = {p: float(np.mean([s["bytes"].get(p, {}).get("sent", 0) for s in steps]))
                for p in sorted({p for s in steps for p in s["bytes"]})}
    return seconds, phases, float(np.mean(total)), float(np.mean(inter)), by_phase


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few steps")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    sizes = dict(QUICK if args.quick else FULL)
    if args.steps:
        sizes["steps"] = args.steps
    threads = int(os.environ.get("OMP_NUM_THREADS", "1"))

    import torch
    import torch.distributed as dist
    from mpi4py import MPI

    import hpcpax
    from hpcpax.train import main as hpcpax_train

    torch.set_num_threads(threads)
    world = MPI.COMM_WORLD
    rank, size = world.Get_rank(), world.Get_size()
    topo = hpcpax.init(servers_per_node=0)  # only to learn the (virtual) node of each rank
    node_of = topo.node_of.copy()
    num_nodes = topo.num_nodes
    topo.free()
    port = world.bcast(_common.free_port() if rank == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=size)
    run_dir = world.bcast(tempfile.mkdtemp(prefix="hpcpax-torch-lm-") if rank == 0 else None,
                          root=0)
    side = TorchSide(torch, dist, sizes, 0, node_of)
    status = hpcpax_train(hpcpax_argv(sizes, run_dir), hooks=[side.step])
    if status != 0:
        raise SystemExit(f"hpcpax.train exited with status {status}")
    warmup = sizes["warmup"]
    torch_bytes, torch_offnode = side.bytes_per_step(world, warmup)
    dist.destroy_process_group()
    if rank == 0:
        seconds, phases, hp_bytes, hp_offnode, hp_by_phase = hpcpax_figures(run_dir, warmup)
        torch_seconds = _common.median(side.seconds[warmup:])
        g = sizes["global_batch"]
        result = {
            "benchmark": "torch_lm",
            "ranks": size, "num_nodes": num_nodes, "ranks_per_node": size // num_nodes,
            "layout": "hpcpax servers_per_node=0 (all ranks workers, like DDP's N workers)",
            **{k: v for k, v in sizes.items() if k != "warmup"},
            "warmup_steps": warmup, "optimizer": "sgd (dense and sparse)",
            "threads_per_rank": threads,
            "samples_per_s_hpcpax": g / seconds,
            "samples_per_s_torch_ddp": g / torch_seconds,
            "seconds_per_step_hpcpax": seconds,
            "seconds_per_step_torch_ddp": torch_seconds,
            "seconds_by_phase_hpcpax": phases,
            "seconds_by_phase_torch_ddp": {
                "forward_backward_sync": _common.median(side.compute_seconds[warmup:]),
                "optimizer": torch_seconds - _common.median(side.compute_seconds[warmup:])},
            "ratio_hpcpax_vs_torch_ddp": _common.ratio(g / seconds, g / torch_seconds),
            "bytes_per_step_hpcpax": hp_bytes,
            "offnode_bytes_per_step_hpcpax": hp_offnode,
            "bytes_per_step_by_phase_hpcpax": hp_by_phase,
            "bytes_per_step_torch_ddp": torch_bytes,
            "offnode_bytes_per_step_torch_ddp": torch_offnode,
        }
        result["ratio_offnode_torch_vs_hpcpax"] = _common.ratio(torch_offnode, hp_offnode)
        _common.emit(result)
        shutil.rmtree(run_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
