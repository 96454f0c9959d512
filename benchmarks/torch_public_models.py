"""Public PyTorch models a user would bring, through ``hpcpax.torch``, against plain torch and DDP.

The models come from PyPI packages (``pip install -e ".[bench]"``), their
classes unchanged; nothing of theirs is copied here:

- ``deepfm``: DeepCTR-Torch's ``DeepFM`` (26 categorical fields, each an
  ``nn.Embedding`` for the FM/DNN part and one for the linear part, 13 dense
  fields, DNN 64-32), Criteo-shaped synthetic data, its ``fit`` loop's shape
  (a float input whose id columns the model casts, ``reduction='sum'`` BCE);
  it needed ``l2_reg_embedding=0`` and ``l2_reg_linear=0`` (its default
  regularizers read whole tables every step: refused, named) and
  ``loss_reduction="sum"``.
- ``bert``: Hugging Face ``transformers``' ``BertForMaskedLM`` from a small
  config (vocabulary 20,000, hidden 64, 2 layers; untied output layer; no
  dropout, so that runs can be compared), no downloaded weights; labels on
  every position (a per-sample mean); gradients clipped to norm 1 as
  transformers' ``Trainer`` does by default (``clip_max_rel_diff_f64``).

Both train with ``torch.optim.SGD`` in the usual loop (``zero_grad``,
forward, loss, ``backward``, ``step``), on the default plan (``auto``).

One ``mpirun -n 4`` job measures, per model:

1. exactness: the parameters after 40 steps on 4 ranks (1 server + 3
   workers) against one process on the same global batches, float32 and
   float64 (``max_rel_diff_*``: the largest ``max|a-b| / max(max|a|, 1)``
   over the parameters);
2. speed, interleaved in each of 3 rounds (A B C D E, A B C D E, ...):
   A plain torch, one process (rank 0; the others sleep) and B the adapter on
   a one-rank world, step by step in turns (A B A B ...); C the adapter on 2 ranks (1 server + 1 worker); D on 4
   ranks (1 server + 3 workers); E ``DistributedDataParallel`` (gloo, 4
   ranks, one torch thread per rank as torchrun sets; DeepFM's embeddings
   ``sparse=True``, BERT's dense since it clips). ``distribute`` sets
   torch's threads to the rank's share of the host's cores. A step's time is the
   slowest rank's; samples/s = global batch / median step time of a phase;
   each ratio is the median over the rounds of that round's ratio, with its
   spread (min, max).

Prints one JSON line: the worst model per top-level key, each model's
figures under ``models`` (with the plan each adapter run used).

Run: ``mpirun -n 4 python -m mpi4py benchmarks/torch_public_models.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
# Python put benchmarks/ first on sys.path: its kernels.py would shadow the
# `kernels` package transformers looks for
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def _load_common():
    """benchmarks/_common.py, without putting benchmarks/ on sys.path."""
    import importlib.util

    path = os.path.join(HERE, "_common.py")
    spec = importlib.util.spec_from_file_location("_hpcpax_bench_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_common = _load_common()

FIELDS, DENSE_FIELDS = 26, 13


# ----------------------------------------------------------------- the models
class DeepFMCase:
    """DeepCTR-Torch's DeepFM on Criteo-shaped synthetic data."""

    name, global_batch, lr = "deepfm", 512, 0.05
    distribute_options = {"loss_reduction": "sum"}
    ddp_options = {}

    def __init__(self, quick):
        from deepctr_torch.inputs import DenseFeat, SparseFeat, get_feature_names

        self.vocab = [max(4, int(20000 * 0.7 ** (i % 12))) for i in range(FIELDS)]
        self.columns = ([SparseFeat(f"C{i}", v, embedding_dim=8) for i, v in enumerate(self.vocab)]
                        + [DenseFeat(f"I{i}", 1) for i in range(DENSE_FIELDS)])
        self.names = get_feature_names(self.columns)

    def build(self, dtype):
        import torch
        from deepctr_torch.models import DeepFM

        model = DeepFM(self.columns, self.columns, dnn_hidden_units=(64, 32),
                       l2_reg_embedding=0, l2_reg_linear=0, seed=1024, task="binary")
        model = model.to(dtype)
        return model, torch.optim.SGD(model.parameters(), lr=self.lr)

    def batches(self, count, dtype, seed=7):
        import torch

        rng = np.random.default_rng(seed)
        out = []
        for _ in range(count):
            ids = [np.minimum(rng.zipf(1.2, self.global_batch) - 1, v - 1) for v in self.vocab]
            dense = rng.random((self.global_batch, DENSE_FIELDS))
            # DeepCTR's fit: one float matrix, columns in feature order
            X = np.concatenate([np.stack(ids, 1), dense], 1)
            y = (rng.random(self.global_batch) < 0.25).astype(np.float64)
            out.append((torch.tensor(X, dtype=dtype), torch.tensor(y, dtype=dtype)))
        return out

    @staticmethod
    def step(model, optimizer, batch):
        import torch.nn.functional as F

        x, y = batch
        y_pred = model(x).squeeze(-1)
        optimizer.zero_grad()
        loss = F.binary_cross_entropy(y_pred, y, reduction="sum")
        loss.backward()
        optimizer.step()

    @staticmethod
    def sparse_for_ddp(model):
        """DDP with sparse gradients: the model's embeddings made ``sparse=True``."""
        import torch

        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                module.sparse = True


class BertCase:
    """transformers' BertForMaskedLM from a small config, untied, no dropout."""

    name, global_batch, lr = "bert", 24, 0.1
    distribute_options = {}
    ddp_options = {"find_unused_parameters": True}  # DDP's error names a parameter without grad
    vocab, length = 20000, 16

    def __init__(self, quick):
        import transformers

        self.config = transformers.BertConfig(
            vocab_size=self.vocab, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0, tie_word_embeddings=False)

    def build(self, dtype):
        import torch
        import transformers

        torch.manual_seed(0)
        model = transformers.BertForMaskedLM(self.config).to(dtype)
        return model, torch.optim.SGD(model.parameters(), lr=self.lr)

    def batches(self, count, dtype, seed=8):
        import torch

        g = torch.Generator().manual_seed(seed)
        return [(torch.randint(1, self.vocab, (self.global_batch, self.length), generator=g),
                 torch.randint(1, self.vocab, (self.global_batch, self.length), generator=g))
                for _ in range(count)]

    @staticmethod
    def step(model, optimizer, batch):
        import torch

        ids, labels = batch
        optimizer.zero_grad()
        model(input_ids=ids, labels=labels).loss.backward()
        # as transformers' Trainer does by default (max_grad_norm=1.0): the norm
        # includes the word embeddings' gradient
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    @staticmethod
    def sparse_for_ddp(model):
        """Nothing: clipping needs dense gradients (torch cannot take a sparse one's norm)."""


CASES = {"deepfm": DeepFMCase, "bert": BertCase}


# ------------------------------------------------------------------- helpers
def _params(model) -> dict:
    return {k: v.detach().double().numpy().copy() for k, v in model.state_dict().items()}


def _max_rel_diff(a, b) -> float:
    """Largest ``max|a-b| / max(max|a|, 1)`` over the tensors (the tests' measure: a
    parameter that stays near 0, as BERT's attention key biases do, whose
    gradient is rounding noise, is compared in absolute terms)."""
    return max(float(np.abs(a[k] - b[k]).max() / max(np.abs(a[k]).max(), 1.0)) for k in a)


def _methods(model) -> dict:
    """``{method: number of tables}`` of a distributed model's plan in force."""
    counts = {}
    for method in model._hpcpax_session.sync.methods().values():
        counts[method] = counts.get(method, 0) + 1
    return counts


def _sub(comm, ranks):
    """A communicator of ``ranks`` of ``comm`` (None on the others)."""
    from mpi4py import MPI

    sub = comm.Split(0 if comm.Get_rank() in ranks else MPI.UNDEFINED, comm.Get_rank())
    return None if sub == MPI.COMM_NULL else sub


def _adapter(case, dtype, comm, servers, batches, steps_before):
    """The case's model distributed on ``comm`` (plan auto); returns
    ``(model, optimizer, local batches, topology)`` (model None on servers)."""
    import hpcpax
    import hpcpax.torch

    model, optimizer = case.build(dtype)
    topology = hpcpax.init(comm=comm, servers_per_node=servers)
    model, optimizer, local = hpcpax.torch.distribute(
        model, optimizer, batches, topology=topology, quiet=True, on_server="return",
        stdout="all", plan_steps=steps_before, **case.distribute_options)
    return (model if topology.is_worker else None), optimizer, local, topology


def _timed(comm, step, batches, warm):
    """Seconds of each step after ``warm`` (the slowest rank's, between barriers)."""
    from mpi4py import MPI

    seconds = []
    for i, batch in enumerate(batches):
        comm.Barrier()
        begin = time.perf_counter()
        step(batch)
        elapsed = comm.allreduce(time.perf_counter() - begin, op=MPI.MAX)
        if i >= warm:
            seconds.append(elapsed)
    return seconds


def _timed_pairs(step_a, batches_a, step_b, batches_b, warm):
    """Seconds of each step after ``warm`` of two one-process loops run in turns
    (a step of A, a step of B, ...)."""
    a, b = [], []
    for i, (batch_a, batch_b) in enumerate(zip(batches_a, batches_b)):
        begin = time.perf_counter()
        step_a(batch_a)
        middle = time.perf_counter()
        step_b(batch_b)
        end = time.perf_counter()
        if i >= warm:
            a.append(middle - begin)
            b.append(end - middle)
    return a, b


# ------------------------------------------------------------------- phases
def exactness(case, world, dtype, steps):
    """max_rel_diff of the parameters after ``steps`` on every rank vs one process."""
    import hpcpax.torch

    batches = case.batches(steps, dtype)
    expected = plan = got = None
    if world.Get_rank() == 0:
        model, optimizer = case.build(dtype)
        for batch in batches:
            case.step(model, optimizer, batch)
        expected = _params(model)
    _common.idle_wait(world)
    expected = world.bcast(expected, root=0)
    model, optimizer, local, topology = _adapter(case, dtype, world, 1, batches, 5)
    try:
        if model is not None:
            for batch in local:
                case.step(model, optimizer, batch)
            got = _params(model)
            plan = _methods(model)
    finally:
        hpcpax.torch.finish()
        topology.free()
    diff = _max_rel_diff(expected, got) if got is not None else 0.0
    worst = world.allreduce(diff, op=_max())
    first_worker = world.bcast(plan if world.Get_rank() == 1 else None, root=1)
    return worst, first_worker


def _max():
    from mpi4py import MPI

    return MPI.MAX


def speed_round(case, world, steps, warm):
    """One round A..E (see the module); samples/s per phase on rank 0 and plans."""
    import torch

    import hpcpax.torch
    from hpcpax.torch.data import share

    rank = world.Get_rank()
    dtype = torch.float32
    batches = case.batches(steps + warm, dtype, seed=11)
    out, plans = {}, {}
    cores = len(os.sched_getaffinity(0))

    # A: plain torch, one process; B: the adapter on a one-rank world
    if rank == 0:
        from mpi4py import MPI

        torch.set_num_threads(cores)
        plain, plain_opt = case.build(dtype)
        model, optimizer, local, topology = _adapter(case, dtype, MPI.COMM_SELF, 0, batches,
                                                     warm // 2)
        # step by step, A B A B ...: the VM's load drifts within a phase
        out["plain"], out["adapter_1rank"] = _timed_pairs(
            lambda b: case.step(plain, plain_opt, b), batches,
            lambda b: case.step(model, optimizer, b), list(local), warm)
        plans["adapter_1rank"] = _methods(model)
        hpcpax.torch.finish()
        topology.free()
    _common.idle_wait(world)

    # C: 2 ranks (1 server + 1 worker); D: 4 ranks (1 server + 3 workers)
    for label, ranks in (("adapter_2ranks", [0, 1]), ("adapter_4ranks", list(range(4)))):
        sub = _sub(world, ranks)
        if sub is not None:
            model, optimizer, local, topology = _adapter(case, dtype, sub, 1, batches,
                                                         warm // 2)
            if model is not None:
                workers = topology.workers
                seconds = _timed(workers, lambda b: case.step(model, optimizer, b), local,
                                 warm)
                if topology.worker_index == 0:
                    world.send((seconds, _methods(model)), dest=0,
                               tag=7)
            hpcpax.torch.finish()
            topology.free()
            sub.Free()
        if rank == 0:
            out[label], plans[label] = world.recv(source=1, tag=7)
        _common.idle_wait(world)

    # E: DDP, 4 ranks, sparse gradients, one thread per rank
    torch.set_num_threads(1)
    model, optimizer = case.build(dtype)
    case.sparse_for_ddp(model)
    ddp = torch.nn.parallel.DistributedDataParallel(model, **case.ddp_options)
    start, stop = share(case.global_batch, rank, world.Get_size())
    mine = [tuple(t[start:stop] for t in batch) for batch in batches]
    out["ddp_4ranks"] = _timed(world, lambda b: case.step(ddp, optimizer, b), mine, warm)
    del ddp
    return ({k: case.global_batch / _common.median(v) for k, v in out.items()}
            if rank == 0 else None), plans


def measure(case, world, args):
    """Every figure of one model (rank 0)."""
    import torch

    result = {}
    for dtype, key in ((torch.float32, "max_rel_diff_f32"), (torch.float64, "max_rel_diff_f64")):
        result[key], result["plan_exactness"] = exactness(case, world, dtype, args.exact_steps)
    rounds, plans = [], {}
    for _ in range(args.rounds):
        rates, plans = speed_round(case, world, args.steps, args.warm)
        rounds.append(rates)
    if world.Get_rank() != 0:
        return None
    rates = {k: _common.median([r[k] for r in rounds]) for k in rounds[0]}

    def ratio(a, b):
        values = [r[a] / r[b] for r in rounds]
        return _common.median(values), [min(values), max(values)]

    for key, (a, b) in {"ratio_adapter_vs_plain_1rank": ("adapter_1rank", "plain"),
                        "ratio_adapter_2ranks_vs_plain": ("adapter_2ranks", "plain"),
                        "ratio_adapter_4ranks_vs_plain": ("adapter_4ranks", "plain"),
                        "ratio_adapter_vs_ddp_4ranks": ("adapter_4ranks", "ddp_4ranks")}.items():
        result[key], result[key + "_spread"] = ratio(a, b)
    result["samples_per_s"] = rates
    result["plans"] = plans
    result["global_batch"] = case.global_batch
    return result


def main():
    import torch.distributed as dist
    from mpi4py import MPI

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="deepfm,bert")
    parser.add_argument("--quick", action="store_true", help="1 round, few steps (smoke)")
    args = parser.parse_args()
    args.rounds, args.steps, args.warm, args.exact_steps = (
        (1, 4, 4, 6) if args.quick else (3, 30, 10, 40))
    world = MPI.COMM_WORLD
    if world.Get_size() != 4:
        raise SystemExit("run with mpirun -n 4 (1 server + 3 workers, and the 1 and 2 rank "
                         "phases inside the job)")
    missing = []
    for package in ("deepctr_torch", "transformers"):
        try:
            __import__(package)
        except ImportError:
            missing.append(package)
    if missing:
        _common.emit({"skipped": f"missing {', '.join(missing)}: pip install -e \".[bench]\""},
                     world.Get_rank())
        return
    port = world.bcast(_common.free_port() if world.Get_rank() == 0 else None, root=0)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=world.Get_rank(), world_size=world.Get_size())
    models = {}
    for name in args.models.split(","):
        models[name] = measure(CASES[name](args.quick), world, args)
    dist.destroy_process_group()
    if world.Get_rank() == 0:
        worst = {"max_rel_diff_f32": max, "max_rel_diff_f64": max,
                 "ratio_adapter_vs_plain_1rank": min, "ratio_adapter_2ranks_vs_plain": min,
                 "ratio_adapter_vs_ddp_4ranks": min}
        line = {key: pick(m[key] for m in models.values()) for key, pick in worst.items()}
        if "bert" in models:  # the model that clips
            line["clip_max_rel_diff_f64"] = models["bert"]["max_rel_diff_f64"]
        line.update({"quick": args.quick, "rounds": args.rounds, "timed_steps": args.steps,
                     "models": models})
        _common.emit(line)


if __name__ == "__main__":
    main()
