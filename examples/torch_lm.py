"""A word-level language model with sampled softmax, in plain PyTorch, on synthetic text.

Single process (plain PyTorch; hpcpax is imported but not used)::

    python examples/torch_lm.py --single-process

N ranks (the same script; the two lines marked ``# hpcpax`` are the difference)::

    mpirun -n 4 python -m mpi4py examples/torch_lm.py
    HPCPAX_RANKS_PER_NODE=2 mpirun -n 4 python -m mpi4py examples/torch_lm.py --plan auto

Model: the ``context`` previous tokens' input embeddings (``nn.Embedding``,
``sparse=True``), concatenated, through a two-layer MLP to a ``dim`` vector;
its score against the next token and ``negatives`` sampled tokens, each an
output embedding row plus a bias row (``nn.Embedding(vocab, 1)``, rows of a
sparse bias); cross-entropy over those candidates (the true token first).
Only the rows of the batch's tokens are touched each step: the tables are
sparse, the MLP dense. Data: a token stream where each token follows from the
previous one by a fixed rule plus Zipf-distributed noise, and per-sample
negatives drawn from the same Zipf law; batches shuffled by a seeded
generator. ``--dump FILE`` writes ``model.state_dict()`` as ``.npz``.
"""

from __future__ import annotations

import argparse
import os
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

import hpcpax.torch  # hpcpax: the import


class SampledSoftmaxLM(nn.Module):
    """Context embeddings -> MLP -> scores of the true and the sampled next tokens."""

    def __init__(self, vocab, dim, context, hidden, dtype):
        super().__init__()
        self.embedding = nn.Embedding(vocab, dim, sparse=True)
        self.mlp = nn.Sequential(nn.Linear(context * dim, hidden), nn.ReLU(),
                                 nn.Linear(hidden, dim))
        self.softmax_w = nn.Embedding(vocab, dim, sparse=True)
        self.softmax_b = nn.Embedding(vocab, 1, sparse=True)
        nn.init.uniform_(self.embedding.weight, -dim ** -0.5, dim ** -0.5)
        nn.init.uniform_(self.softmax_w.weight, -dim ** -0.5, dim ** -0.5)
        nn.init.zeros_(self.softmax_b.weight)
        self.to(dtype)

    def forward(self, context, candidates):
        """Scores ``[batch, 1 + negatives]`` of ``candidates`` (true token first)."""
        h = self.mlp(self.embedding(context).flatten(1))
        w = self.softmax_w(candidates)                  # [batch, k, dim]
        b = self.softmax_b(candidates).squeeze(2)       # [batch, k]
        return (w @ h.unsqueeze(2)).squeeze(2) + b


def zipf_ids(generator, count, rows, exponent=1.1):
    weights = torch.arange(1, rows + 1, dtype=torch.float64) ** -exponent
    return torch.multinomial(weights, count, replacement=True, generator=generator)


def make_data(samples, vocab, context, negatives, seed=0):
    """A TensorDataset of (context, candidates): the next token, then negatives."""
    g = torch.Generator().manual_seed(seed)
    length = samples + context
    noise = zipf_ids(g, length, vocab).tolist()
    tokens = [0] * length
    for i in range(1, length):  # the rule the model can learn, plus noise
        tokens[i] = (tokens[i - 1] * 7 + 3 + noise[i]) % vocab
    tokens = torch.tensor(tokens, dtype=torch.int64)
    windows = tokens.unfold(0, context + 1, 1)[:samples]
    sampled = zipf_ids(g, samples * negatives, vocab).reshape(samples, negatives)
    return torch.utils.data.TensorDataset(windows[:, :context].contiguous(),
                                          torch.cat([windows[:, context:], sampled], 1))


def build(args):
    """Model, optimizer and loader, exactly as a single-process script makes them."""
    dtype = getattr(torch, args.dtype)
    torch.manual_seed(args.seed)
    model = SampledSoftmaxLM(args.vocab, args.dim, args.context, args.hidden, dtype)
    if args.optimizer == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    elif args.optimizer == "adagrad":
        # a positive initial accumulator keeps the first step of a row from
        # being lr * sign(g), which float32 rounding of a near-zero g can flip
        optimizer = torch.optim.Adagrad(model.parameters(), lr=args.lr,
                                        initial_accumulator_value=0.1)
    else:  # adam: SparseAdam for the tables, Adam for the MLP
        tables = [model.embedding.weight, model.softmax_w.weight, model.softmax_b.weight]
        optimizer = [torch.optim.SparseAdam(tables, lr=args.lr),
                     torch.optim.Adam(model.mlp.parameters(), lr=args.lr)]
    data = make_data(args.batch * args.steps, args.vocab, args.context, args.negatives,
                     args.seed)
    loader = torch.utils.data.DataLoader(data, batch_size=args.batch, shuffle=True,
                                         drop_last=True,
                                         generator=torch.Generator().manual_seed(args.seed))
    return model, optimizer, loader


def train_step(model, optimizers, batch):
    """One step of the training loop; returns the loss."""
    context, candidates = batch
    for optimizer in optimizers:
        optimizer.zero_grad()
    scores = model(context, candidates)
    loss = F.cross_entropy(scores, torch.zeros(len(scores), dtype=torch.int64))
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
    parser.add_argument("--batch", type=int, default=512, help="global batch")
    parser.add_argument("--vocab", type=int, default=100_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--negatives", type=int, default=32, help="sampled tokens per sample")
    parser.add_argument("--optimizer", choices=("sgd", "adagrad", "adam"), default="adagrad")
    parser.add_argument("--lr", type=float, default=0.1)
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
