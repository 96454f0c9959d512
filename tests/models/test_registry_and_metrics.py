"""build_model, the Model interface shared by both models, and roc_auc."""

import dataclasses
import math
import pathlib
import subprocess
import sys

import numpy as np
import pytest

import hpcpax.models as models
from hpcpax.errors import ConfigError
from hpcpax.models import CTRModel, LanguageModel, Model, SparseSpec, build_model, roc_auc


def brute_force_auc(labels, scores):
    positives = scores[labels == 1]
    negatives = scores[labels == 0]
    wins = (positives[:, None] > negatives[None, :]).sum() + 0.5 * (positives[:, None] == negatives[None, :]).sum()
    return wins / (len(positives) * len(negatives))


@pytest.mark.parametrize("seed", range(5))
def test_auc_matches_pairwise_count_with_ties(seed):
    rng = np.random.default_rng(seed)
    labels = (rng.random(200) < 0.3).astype(np.float32)
    scores = np.round(rng.normal(size=200) + labels, 1)  # rounding makes many ties
    assert len(np.unique(scores)) < 200
    assert roc_auc(labels, scores) == pytest.approx(brute_force_auc(labels, scores), abs=1e-12)


def test_auc_edge_cases():
    assert roc_auc(np.array([0, 1]), np.array([0.1, 0.9])) == 1.0
    assert roc_auc(np.array([1, 0]), np.array([0.1, 0.9])) == 0.0
    assert roc_auc(np.array([1, 0, 1, 0]), np.zeros(4)) == 0.5
    assert math.isnan(roc_auc(np.ones(3), np.arange(3.0)))
    with pytest.raises(ValueError, match="one shape"):
        roc_auc(np.ones(3), np.ones(4))


def test_build_model_registry():
    assert isinstance(build_model("lm", vocab_size=100), LanguageModel)
    model = build_model("ctr", n_fields=2, table_rows=[3, 4], dtype="float64")
    assert isinstance(model, CTRModel) and model.dtype == np.float64
    assert build_model(model.name, **model.config()).config() == model.config()
    with pytest.raises(ConfigError, match="model must be one of"):
        build_model("bert")
    with pytest.raises(ConfigError, match="unexpected keyword"):
        build_model("lm", vocab=10)
    assert set(models.__all__) <= set(dir(models))


@pytest.mark.parametrize("name", ["lm", "ctr"])
def test_interface_shapes(name):
    model = build_model(name, seed=5)
    assert isinstance(model, Model)
    specs = model.sparse_specs()
    assert all(isinstance(spec, SparseSpec) for spec in specs)
    assert len({spec.name for spec in specs}) == len(specs)
    dense = model.init_dense()
    assert {key: value.shape for key, value in dense.items()} == model.dense_shapes()
    assert all(isinstance(value, np.ndarray) and value.dtype == np.float32 for value in dense.values())
    batch = model.example_batch(8)
    ids = model.sparse_ids(batch, 0)
    assert set(ids) == {spec.name for spec in specs}
    for spec in specs:
        assert ids[spec.name].dtype == np.int64
        assert ids[spec.name].min() >= 0 and ids[spec.name].max() < spec.rows
    with pytest.raises(dataclasses.FrozenInstanceError):
        specs[0].rows = 1


def test_import_pulls_in_no_cupy():
    code = "import sys, hpcpax.models; assert 'cupy' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=pathlib.Path(__file__).parents[2])
