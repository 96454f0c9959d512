"""Helpers shared by the model tests: tables, pulls as the library does them,
the library's dedup, and central finite differences."""

import numpy as np
import pytest


def full_tables(model, seed, scale):
    """Every sparse table of ``model``, U(-scale, scale)."""
    rng = np.random.default_rng(seed)
    return {spec.name: rng.uniform(-scale, scale, size=(spec.rows, spec.dim))
            for spec in model.sparse_specs()}


def pull(model, tables, batch, step, extra=3, full=False):
    """Rows as the library gives them: sorted unique ids, plus a few unused ones."""
    needed = model.sparse_ids(batch, step, full=full) if full else model.sparse_ids(batch, step)
    rows = {}
    for name, table in tables.items():
        ids = np.unique(np.concatenate([needed[name], np.arange(extra)]))
        rows[name] = (ids, table[ids].copy())
    return rows


def dedup(model, sparse_grads):
    """Sum raw per-occurrence grads into full-size tables (what the library does)."""
    out = {}
    for spec in model.sparse_specs():
        indices, values = sparse_grads[spec.name]
        total = np.zeros((spec.rows, spec.dim))
        np.add.at(total, indices, values)
        out[spec.name] = total
    return out


def central_difference(loss_now, array, index, eps=1e-6):
    """d loss / d array[index] by central differences; restores the entry."""
    keep = array[index]
    array[index] = keep + eps
    up = loss_now()
    array[index] = keep - eps
    down = loss_now()
    array[index] = keep
    return (up - down) / (2 * eps)


def check_dense_gradients(model, dense, rows, batch, step, result, rng, per_array=4):
    """A few entries of every dense gradient against central differences."""
    def loss_now():
        return model.forward_backward(dense, rows, batch, step).loss

    for name, param in dense.items():
        assert result.dense_grads[name].shape == param.shape
        for flat in rng.choice(param.size, size=min(per_array, param.size), replace=False):
            index = np.unravel_index(flat, param.shape)
            assert central_difference(loss_now, param, index) == pytest.approx(
                result.dense_grads[name][index], rel=1e-6, abs=1e-9)


def check_sparse_gradients(model, dense, rows, batch, step, result, rng, positions):
    """Pulled rows' gradients (deduplicated) against central differences.

    ``positions(ids)`` picks which pulled rows to perturb.
    """
    def loss_now():
        return model.forward_backward(dense, rows, batch, step).loss

    summed = dedup(model, result.sparse_grads)
    for name, (ids, table_rows) in rows.items():
        for position in positions(ids):
            column = rng.integers(table_rows.shape[1])
            expected = summed[name][ids[position], column]
            assert central_difference(loss_now, table_rows, (position, column)) == \
                pytest.approx(expected, rel=1e-6, abs=1e-9)


def check_halves_average_to_full(model, dense, rows, batch, step, full):
    """The mean of two half-batches' loss and gradients equals the full batch's."""
    n = len(next(iter(batch.values())))
    halves = [model.forward_backward(dense, rows, {k: v[part] for k, v in batch.items()}, step)
              for part in (slice(0, n // 2), slice(n // 2, n))]
    assert np.mean([half.loss for half in halves]) == pytest.approx(full.loss, abs=1e-12)
    for name in dense:
        mean = (halves[0].dense_grads[name] + halves[1].dense_grads[name]) / 2
        np.testing.assert_allclose(mean, full.dense_grads[name], rtol=0, atol=1e-10)
    full_sparse = dedup(model, full.sparse_grads)
    half_sparse = [dedup(model, half.sparse_grads) for half in halves]
    for name in full_sparse:
        np.testing.assert_allclose((half_sparse[0][name] + half_sparse[1][name]) / 2,
                                   full_sparse[name], rtol=0, atol=1e-10)
