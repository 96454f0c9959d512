"""The lm model: gradients by finite differences, determinism, sharding, training."""

import numpy as np
import pytest

from hpcpax.errors import ConfigError, SparseIndexError
from hpcpax.models import LanguageModel, log_uniform_log_expected_count, log_uniform_sample
from hpcpax.models.layers import logsumexp

import model_checks
from model_checks import (check_dense_gradients, check_halves_average_to_full,
                          check_sparse_gradients, dedup, pull)

STEP = 7


def small_model(**flags):
    sizes = dict(vocab_size=40, context=3, emb_dim=4, hidden=(5,), out_dim=4, num_sampled=12,
                 activation="tanh", seed=3, dtype="float64")
    sizes.update(flags)
    return LanguageModel(**sizes)


def full_tables(model, seed=11):
    return model_checks.full_tables(model, seed, 0.5)


def test_finite_difference_dense_and_sparse():
    model = small_model()
    batch = model.example_batch(6, seed=1)
    dense = model.init_dense()
    rows = pull(model, full_tables(model), batch, STEP)
    result = model.forward_backward(dense, rows, batch, STEP)
    assert set(result.dense_grads) == set(dense)
    rng = np.random.default_rng(0)
    check_dense_gradients(model, dense, rows, batch, STEP, result, rng)
    # an unused pulled row (position 0: grad 0) and several used ones
    check_sparse_gradients(model, dense, rows, batch, STEP, result, rng,
                           lambda ids: list(rng.choice(len(ids), size=4, replace=False)) + [0])


def test_finite_difference_relu_two_hidden_layers():
    model = small_model(activation="relu", hidden=(6, 5), remove_accidental_hits=False)
    batch = model.example_batch(5, seed=2)
    dense = model.init_dense()
    rows = pull(model, full_tables(model), batch, STEP)
    result = model.forward_backward(dense, rows, batch, STEP)
    eps = 1e-6
    for name, param in dense.items():
        index = (0,) * param.ndim
        keep = param[index]
        param[index] = keep + eps
        up = model.forward_backward(dense, rows, batch, STEP).loss
        param[index] = keep - eps
        down = model.forward_backward(dense, rows, batch, STEP).loss
        param[index] = keep
        assert (up - down) / (2 * eps) == pytest.approx(result.dense_grads[name][index], rel=1e-5, abs=1e-9)


def test_sampled_loss_matches_brute_force():
    model = small_model(hidden=())
    batch = model.example_batch(5, seed=4)
    dense = model.init_dense()
    tables = full_tables(model)
    rows = pull(model, tables, batch, STEP)
    loss = model.forward_backward(dense, rows, batch, STEP).loss
    samples = model.sampled_ids(STEP)
    vocab = model.vocab_size
    expected = []
    for context, target in zip(batch["context"], batch["target"]):
        hidden = tables["embedding"][context].reshape(-1) @ dense["projection_weight"] + dense["projection_bias"]
        candidates = np.concatenate([[target], samples])
        probability = np.log((candidates + 2) / (candidates + 1)) / np.log(vocab + 1)
        logits = tables["softmax_w"][candidates] @ hidden + tables["softmax_b"][candidates, 0]
        logits -= np.log(model.num_sampled * probability)
        logits[1:][samples == target] = -np.inf
        expected.append(np.log(np.exp(logits - logits.max()).sum()) + logits.max() - logits[0])
    assert loss == pytest.approx(np.mean(expected), rel=1e-12)


def test_determinism_and_negatives_depend_on_seed_and_step_only():
    first, second = small_model(), small_model()
    for name in first.init_dense():
        np.testing.assert_array_equal(first.init_dense()[name], second.init_dense()[name])
    batch = first.example_batch(6)
    rows = pull(first, full_tables(first), batch, STEP)
    loss_first = first.forward_backward(first.init_dense(), rows, batch, STEP).loss
    loss_second = second.forward_backward(second.init_dense(), rows, batch, STEP).loss
    assert loss_first == loss_second
    np.testing.assert_array_equal(first.sampled_ids(STEP), log_uniform_sample(3, STEP, 12, 40))
    assert not np.array_equal(first.sampled_ids(STEP), first.sampled_ids(STEP + 1))
    assert not np.array_equal(first.sampled_ids(STEP), small_model(seed=4).sampled_ids(STEP))
    assert not np.array_equal(first.init_dense()["projection_weight"], small_model(seed=4).init_dense()["projection_weight"])


def test_log_uniform_sampler_distribution():
    vocab, count = 10, 40_000
    samples = log_uniform_sample(0, 1, count, vocab)
    assert samples.dtype == np.int64 and samples.min() >= 0 and samples.max() < vocab
    observed = np.bincount(samples, minlength=vocab) / count
    expected = np.exp(log_uniform_log_expected_count(np, np.arange(vocab), 1, vocab, np.float64))
    assert expected.sum() == pytest.approx(1.0)
    np.testing.assert_allclose(observed, expected, atol=0.01)


def test_two_half_batches_average_to_full_batch():
    model = small_model()
    batch = model.example_batch(8, seed=5)
    dense = model.init_dense()
    rows = pull(model, full_tables(model), batch, STEP)
    full = model.forward_backward(dense, rows, batch, STEP)
    check_halves_average_to_full(model, dense, rows, batch, STEP, full)


def test_full_evaluation_matches_numpy_softmax():
    model = small_model()
    batch = model.example_batch(7, seed=6)
    dense = model.init_dense()
    tables = full_tables(model)
    rows = pull(model, tables, batch, STEP, full=True)
    metrics = model.evaluate(dense, rows, batch, STEP, full=True)
    hidden = np.tanh(tables["embedding"][batch["context"]].reshape(7, -1) @ dense["hidden_0_weight"]
                     + dense["hidden_0_bias"])
    output = hidden @ dense["projection_weight"] + dense["projection_bias"]
    logits = output @ tables["softmax_w"].T + tables["softmax_b"][:, 0]
    expected = np.mean(logsumexp(np, logits, axis=1) - logits[np.arange(7), batch["target"]])
    assert metrics["loss"] == pytest.approx(expected, rel=1e-12)
    assert metrics["perplexity"] == pytest.approx(np.exp(expected), rel=1e-12)
    sampled_rows = pull(model, tables, batch, STEP)
    sampled = model.evaluate(dense, sampled_rows, batch, STEP)
    assert sampled["loss"] == pytest.approx(model.forward_backward(dense, sampled_rows, batch, STEP).loss)
    with pytest.raises(ValueError, match="full evaluation needs"):
        model.evaluate(dense, sampled_rows, batch, STEP, full=True)


def test_sgd_training_lowers_full_loss():
    model = small_model(vocab_size=30, emb_dim=8, hidden=(16,), out_dim=8, num_sampled=10)
    batch = model.example_batch(32, seed=7)
    dense = model.init_dense()
    rng = np.random.default_rng(0)
    tables = {spec.name: rng.uniform(-spec.init_scale, spec.init_scale, (spec.rows, spec.dim))
              for spec in model.sparse_specs()}
    evaluation_rows = lambda: pull(model, tables, batch, 0, full=True)  # noqa: E731
    before = model.evaluate(dense, evaluation_rows(), batch, 0, full=True)["loss"]
    for step in range(60):
        result = model.forward_backward(dense, pull(model, tables, batch, step), batch, step)
        for name, grad in result.dense_grads.items():
            dense[name] -= 0.5 * grad
        for name, summed in dedup(model, result.sparse_grads).items():
            tables[name] -= 0.5 * summed
    after = model.evaluate(dense, evaluation_rows(), batch, 0, full=True)["loss"]
    assert after < 0.6 * before


def test_float32_is_kept():
    model = small_model(dtype="float32")
    batch = model.example_batch(4)
    dense = model.init_dense()
    assert all(value.dtype == np.float32 for value in dense.values())
    tables = {name: table.astype(np.float32) for name, table in full_tables(model).items()}
    result = model.forward_backward(dense, pull(model, tables, batch, STEP), batch, STEP)
    assert all(grad.dtype == np.float32 for grad in result.dense_grads.values())
    assert all(values.dtype == np.float32 and indices.dtype == np.int64
               for indices, values in result.sparse_grads.values())
    assert np.isfinite(result.loss)


def test_bad_flags_and_missing_rows():
    with pytest.raises(ConfigError, match="dtype must be"):
        small_model(dtype="float16")
    with pytest.raises(ConfigError, match="activation must be"):
        small_model(activation="gelu")
    with pytest.raises(ConfigError, match="vocab_size must be positive"):
        small_model(vocab_size=0)
    model = small_model()
    assert model.hidden == (5,) and small_model(hidden="7, 3").hidden == (7, 3)
    batch = model.example_batch(4)
    rows = pull(model, full_tables(model), batch, STEP)
    ids, table_rows = rows["embedding"]
    keep = np.isin(ids, batch["context"][0, 0], invert=True)
    rows["embedding"] = (ids[keep], table_rows[keep])
    with pytest.raises(SparseIndexError, match="'embedding'"):
        model.forward_backward(model.init_dense(), rows, batch, STEP)
    with pytest.raises(ValueError, match=r"batch\['context'\] must be"):
        model.sparse_ids({"context": batch["context"][:, :2], "target": batch["target"]}, STEP)
