"""The ctr model: gradients by finite differences, hashing, sharding, training."""

import numpy as np
import pytest

from hpcpax.errors import ConfigError
from hpcpax.models import CTRModel
from hpcpax.models.layers import sigmoid, softplus

import model_checks
from model_checks import (check_dense_gradients, check_halves_average_to_full,
                          check_sparse_gradients, dedup)

STEP = 2


def small_model(**flags):
    sizes = dict(n_dense=4, n_fields=3, table_rows=(7, 11, 5), emb_dim=3, bottom=(5, 3), top=(6,),
                 seed=1, dtype="float64")
    sizes.update(flags)
    return CTRModel(**sizes)


def full_tables(model, seed=12):
    return model_checks.full_tables(model, seed, 0.8)


def pull(model, tables, batch, step):
    return model_checks.pull(model, tables, batch, step, extra=1)  # row 0 may be unused


def reference_logits(model, dense, tables, batch):
    """Plain per-example NumPy forward, written independently of the model."""
    logits = []
    for features, ids in zip(batch["dense"], batch["categorical"]):
        hidden = features
        for i in range(len(model.bottom)):
            hidden = np.maximum(hidden @ dense[f"bottom_{i}_weight"] + dense[f"bottom_{i}_bias"], 0)
        vectors = [hidden] + [tables[f"emb_{i}"][ids[i] % model.table_rows[i]] for i in range(model.n_fields)]
        pairs = [vectors[i] @ vectors[j] for i in range(len(vectors)) for j in range(i + 1, len(vectors))]
        top = np.concatenate([hidden, pairs])
        for i in range(len(model.top)):
            top = np.maximum(top @ dense[f"top_{i}_weight"] + dense[f"top_{i}_bias"], 0)
        logits.append((top @ dense["output_weight"] + dense["output_bias"])[0])
    return np.array(logits)


def test_forward_matches_reference_and_ids_are_hashed():
    model = small_model()
    batch = model.example_batch(9, seed=3)
    batch["categorical"][0, 1] = -4  # negative raw ids hash into range too
    ids = model.sparse_ids(batch, STEP)
    for i, rows in enumerate(model.table_rows):
        np.testing.assert_array_equal(ids[f"emb_{i}"], batch["categorical"][:, i] % rows)
        assert ids[f"emb_{i}"].min() >= 0 and ids[f"emb_{i}"].max() < rows
    dense = model.init_dense()
    tables = full_tables(model)
    rows = pull(model, tables, batch, STEP)
    logits = reference_logits(model, dense, tables, batch)
    np.testing.assert_allclose(model.predict(dense, rows, batch), logits, rtol=1e-12)
    expected = np.mean(np.logaddexp(0, logits) - batch["label"] * logits)
    assert model.forward_backward(dense, rows, batch, STEP).loss == pytest.approx(expected, rel=1e-12)


def test_finite_difference_dense_and_sparse():
    model = small_model()
    batch = model.example_batch(8, seed=4)
    dense = model.init_dense()
    # Non-zero biases so the ReLU kinks sit away from exact zeros.
    rng = np.random.default_rng(0)
    for name in dense:
        if name.endswith("_bias"):
            dense[name] += rng.uniform(0.05, 0.2, size=dense[name].shape)
    rows = pull(model, full_tables(model), batch, STEP)
    result = model.forward_backward(dense, rows, batch, STEP)
    assert set(result.dense_grads) == set(dense)
    check_dense_gradients(model, dense, rows, batch, STEP, result, rng)
    check_sparse_gradients(model, dense, rows, batch, STEP, result, rng,
                           lambda ids: range(len(ids)))


def test_two_half_batches_average_to_full_batch_and_determinism():
    model = small_model()
    batch = model.example_batch(10, seed=5)
    dense = model.init_dense()
    rows = pull(model, full_tables(model), batch, STEP)
    full = model.forward_backward(dense, rows, batch, STEP)
    again = small_model().forward_backward(small_model().init_dense(), rows, batch, STEP)
    assert again.loss == full.loss
    check_halves_average_to_full(model, dense, rows, batch, STEP, full)


def test_logistic_loss_is_stable_for_huge_logits():
    logits = np.array([-800.0, -30.0, 0.0, 30.0, 800.0])
    np.testing.assert_allclose(softplus(np, logits), np.logaddexp(0, logits), rtol=1e-12)
    np.testing.assert_allclose(sigmoid(np, logits), [0.0, 1 / (1 + np.exp(30)), 0.5, 1 / (1 + np.exp(-30)), 1.0])
    assert np.all(np.isfinite(sigmoid(np, logits)))


def test_sgd_training_lowers_loss_and_raises_auc():
    model = small_model(n_dense=6, n_fields=3, table_rows=20, emb_dim=4, bottom=(8, 4), top=(8,))
    batch = model.example_batch(64, seed=6)
    dense = model.init_dense()
    rng = np.random.default_rng(0)
    tables = {spec.name: rng.uniform(-spec.init_scale, spec.init_scale, (spec.rows, spec.dim))
              for spec in model.sparse_specs()}
    before = model.evaluate(dense, pull(model, tables, batch, 0), batch, 0)
    for step in range(60):
        result = model.forward_backward(dense, pull(model, tables, batch, step), batch, step)
        for name, grad in result.dense_grads.items():
            dense[name] -= 0.3 * grad
        for name, summed in dedup(model, result.sparse_grads).items():
            tables[name] -= 0.3 * summed
    after = model.evaluate(dense, pull(model, tables, batch, 0), batch, 0)
    assert after["loss"] < 0.7 * before["loss"]
    assert after["auc"] > max(before["auc"], 0.85)


def test_float32_is_kept():
    model = small_model(dtype="float32")
    batch = model.example_batch(5)
    dense = model.init_dense()
    tables = {name: table.astype(np.float32) for name, table in full_tables(model).items()}
    result = model.forward_backward(dense, pull(model, tables, batch, STEP), batch, STEP)
    assert all(value.dtype == np.float32 for value in dense.values())
    assert all(grad.dtype == np.float32 for grad in result.dense_grads.values())
    assert all(values.dtype == np.float32 and indices.dtype == np.int64
               for indices, values in result.sparse_grads.values())


def test_bad_flags():
    with pytest.raises(ConfigError, match="last bottom width must equal emb_dim"):
        small_model(bottom=(5, 4))
    with pytest.raises(ConfigError, match="table_rows must be one int or 3 ints"):
        small_model(table_rows=(5, 5))
    with pytest.raises(ConfigError, match="table_rows must be positive"):
        small_model(table_rows=0)
    assert small_model(table_rows=9).table_rows == (9, 9, 9)
    model = small_model()
    batch = model.example_batch(4)
    with pytest.raises(ValueError, match=r"batch\['dense'\] must be"):
        model.sparse_ids({"dense": batch["dense"][:, :2], "categorical": batch["categorical"]}, STEP)
