"""A DLRM-style click-through-rate model in plain PyTorch, on synthetic data.

Single process (plain PyTorch; hpcpax is imported but not used)::

    python examples/torch_dlrm.py --single-process

N ranks (the same script; the two lines marked ``# hpcpax`` are the difference)::

    mpirun -n 4 python -m mpi4py examples/torch_dlrm.py
    HPCPAX_RANKS_PER_NODE=2 mpirun -n 4 python -m mpi4py examples/torch_dlrm.py --plan auto

Model: a bottom MLP over 13 dense features; one embedding table per
categorical field (``nn.Embedding(sparse=True)``) and one multi-hot field
(``nn.EmbeddingBag``, mean of 4 ids); pairwise dot-product interactions;
a top MLP; binary cross-entropy. Data: ids drawn from a Zipf law over each
table, labels from a hidden logistic model, shuffled by a seeded generator
(every rank draws the same batches). ``--dump FILE`` writes the final
parameters (``model.state_dict()``, tables gathered) as ``.npz``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn

import hpcpax.torch  # hpcpax: the import

TABLE_ROWS = (200_000, 50_000, 20_000, 5_000, 1_000, 100)
BAG_ROWS, BAG_IDS = 100_000, 4
N_DENSE = 13


class DLRM(nn.Module):
    """Bottom MLP, embeddings, pairwise interactions, top MLP."""

    def __init__(self, table_rows, bag_rows, dim, dtype):
        super().__init__()
        self.bottom = nn.Sequential(nn.Linear(N_DENSE, 64), nn.ReLU(), nn.Linear(64, dim),
                                    nn.ReLU())
        self.tables = nn.ModuleList(nn.Embedding(rows, dim, sparse=True) for rows in table_rows)
        self.bag = nn.EmbeddingBag(bag_rows, dim, mode="mean", sparse=True)
        vectors = len(table_rows) + 2
        self.top = nn.Sequential(nn.Linear(dim + vectors * (vectors - 1) // 2, 64), nn.ReLU(),
                                 nn.Linear(64, 1))
        for table in list(self.tables) + [self.bag]:
            nn.init.uniform_(table.weight, -dim ** -0.5, dim ** -0.5)
        self.to(dtype)

    def forward(self, dense, fields, bag):
        x = self.bottom(dense)
        vectors = [x] + [table(fields[:, i]) for i, table in enumerate(self.tables)]
        vectors.append(self.bag(bag))
        stacked = torch.stack(vectors, 1)
        dots = stacked @ stacked.transpose(1, 2)
        upper = torch.triu_indices(stacked.shape[1], stacked.shape[1], offset=1)
        return self.top(torch.cat([x, dots[:, upper[0], upper[1]]], 1)).squeeze(1)


def zipf_ids(generator, count, rows, exponent=1.05):
    """``count`` ids over ``rows`` rows, id 0 the most frequent (a Zipf law)."""
    weights = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    return torch.multinomial(weights, count, replacement=True, generator=generator)


def make_data(samples, table_rows, bag_rows, dtype, seed=0):
    """A TensorDataset of (dense, fields, bag, label), labels from a hidden model."""
    g = torch.Generator().manual_seed(seed)
    dense = torch.randn(samples, N_DENSE, generator=g, dtype=torch.float64)
    fields = torch.stack([zipf_ids(g, samples, rows) for rows in table_rows], 1)
    bag = zipf_ids(g, samples * BAG_IDS, bag_rows).reshape(samples, BAG_IDS)
    hidden = [torch.randn(rows, generator=g, dtype=torch.float64) for rows in table_rows]
    logit = dense[:, :4].sum(1) * 0.5 + sum(h[fields[:, i]] for i, h in enumerate(hidden))
    label = (torch.rand(samples, generator=g, dtype=torch.float64) < torch.sigmoid(logit))
    return torch.utils.data.TensorDataset(dense.to(dtype), fields, bag, label.to(dtype))


def build(args):
    """Model, optimizer and loader, exactly as a single-process script makes them."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    rows = [max(2, int(r * args.rows_scale)) for r in TABLE_ROWS]
    bag_rows = max(2, int(BAG_ROWS * args.rows_scale))
    model = DLRM(rows, bag_rows, args.dim, dtype)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    elif args.optimizer == "adagrad":
        # a positive initial accumulator keeps the first step of a row from
        # being lr * sign(g), which float32 rounding of a near-zero g can flip
        optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr,
                                        initial_accumulator_value=0.1)
    else:  # adam: SparseAdam for the tables, Adam for the rest
        tables = [p for m in model.modules() if isinstance(m, (nn.Embedding, nn.EmbeddingBag))
                  for p in m.parameters()]
        dense = [p for p in model.parameters() if all(p is not t for t in tables)]
        optimizer = [torch.optim.SparseAdam(tables, lr=args.lr),
                     torch.optim.Adam(dense, lr=args.lr)]
    data = make_data(args.batch * args.steps, rows, bag_rows, dtype, args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True,
                                         drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    return model, optimizer, loader


def train_step(model, optimizers, batch, loss_fn=nn.BCEWithLogitsLoss()):
    """One step of the training loop; returns the loss."""
    dense, fields, bag, label = batch
    for optimizer in optimizers:
        optimizer.zero_grad()
    loss = loss_fn(model(dense, fields, bag), label)
    loss.backward()
    for optimizer in optimizers:
        optimizer.step()
    return loss.item()


def dump(model, path):
    """Write ``model.state_dict()`` as ``.npz`` (atomically: several ranks may write it)."""
    state = {k: v.detach().cpu().numpy() for k, v in model.state_dict().items()}
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "wb") as handle:
        np.savez(handle, **state)
    os.replace(temporary, path)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=1024, help="global batch")
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--rows-scale", type=float, default=1.0, help="scale every table's rows")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad", "adam"), default="adagrad")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", default="auto", help="hpcpax plan: auto, ps, allgather, ...")
    parser.add_argument("--log-every", type=int, default=50)
    parser.add_argument("--dump", help="write the final parameters to this .npz file")
    parser.add_argument("--single-process", action="store_true",
                        help="plain PyTorch: skip hpcpax.torch.distribute")
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    model, optimizer, loader = build(args)
    if not args.single_process:
        model, optimizer, loader = hpcpax.torch.distribute(model, optimizer, loader,  # hpcpax
                                                           plan=args.plan)
    optimizers = optimizer if isinstance(optimizer, list) else [optimizer]
    start, losses = time.perf_counter(), []
    for step, batch in enumerate(loader, 1):
        losses.append(train_step(model, optimizers, batch))
        if step % args.log_every == 0 or step == len(loader):
            print(f"step {step:4d}  loss {np.mean(losses[-args.log_every:]):.4f}", flush=True)
    seconds = time.perf_counter() - start
    print(f"{len(losses) * args.batch / seconds:,.0f} samples/s over {len(losses)} steps",
          flush=True)
    if args.dump:
        dump(model, args.dump)


if __name__ == "__main__":
    main()
