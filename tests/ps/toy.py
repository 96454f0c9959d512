"""A toy model (embedding + dense layer) and its plain-NumPy reference run.

The oracle of the equivalence tests: training through hpcpax on any layout
must give the parameters of :func:`reference_run`, a single process that
never touches MPI.
"""

import numpy as np

from hpcpax.ps.initializers import init_rows
from hpcpax.ops.optimizers import make_optimizer
from hpcpax import SparseVariableSpec

ROWS, DIM, FIELDS, BATCH, STEPS = 97, 4, 3, 12, 20
SPEC = SparseVariableSpec("emb", rows=ROWS, dim=DIM, dtype="float64", optimizer="adagrad",
                          optimizer_params={"lr": 0.3}, init_scale=0.5)
DENSE_LR = 0.1


def batch(step):
    """Global batch of ``step``: Zipf-ish ids [BATCH, FIELDS], learnable targets [BATCH]."""
    rng = np.random.default_rng(1000 + step)
    ids = np.minimum(rng.zipf(1.3, (BATCH, FIELDS)) - 1, ROWS - 1).astype(np.int64)
    hidden = np.random.default_rng(42).normal(size=ROWS)
    return ids, hidden[ids].sum(axis=1)


def init_dense():
    return np.random.default_rng(7).normal(size=(FIELDS * DIM, 1)) * 0.3


def forward_backward(weight, ids, unique, rows, target):
    """Mean squared error; grads of the dense weight and raw embedding grads."""
    position = np.searchsorted(unique, ids)
    x = rows[position].reshape(len(ids), FIELDS * DIM)
    err = (x @ weight)[:, 0] - target
    loss = float(np.mean(err**2))
    dpred = (2.0 / len(ids)) * err[:, None]
    grad_w = x.T @ dpred
    grad_x = (dpred @ weight.T).reshape(len(ids) * FIELDS, DIM)
    return loss, grad_w, ids.reshape(-1), grad_x


def reference_run(steps=STEPS, seed=0):
    """Train single-process; returns (table, weight, losses)."""
    table = init_rows(SPEC.initializer, seed, SPEC.name, np.arange(ROWS), DIM, SPEC.dtype,
                      SPEC.init_scale)
    opt = make_optimizer(SPEC.optimizer, **SPEC.optimizer_params)
    state = opt.init_state(table.shape, table.dtype, np)
    weight = init_dense()
    losses = []
    for step in range(steps):
        ids, target = batch(step)
        unique = np.unique(ids)
        loss, grad_w, gid, gval = forward_backward(weight, ids, unique, table[unique], target)
        summed = np.zeros_like(table)
        np.add.at(summed, gid, gval)
        touched = np.unique(gid)
        opt.apply_rows_reference(table, state, touched, summed[touched])
        weight -= DENSE_LR * grad_w
        losses.append(loss)
    return table, weight, losses
