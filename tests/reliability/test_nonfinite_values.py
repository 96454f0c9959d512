"""A NaN or Inf is named where it is read (issue 49): in ctr dense features (file, row,
column), in a checkpoint's table, optimizer slot or dense parameter (file, variable, row).
Before, both ended steps later as ``emb_0: gradient holds NaN or Inf``."""

import json
import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.trainer import Trainer
from hpcpax.data import CTRDataset, generate_ctr, write_ctr
from hpcpax.errors import CheckpointError, DataError

CTR = {"model": "ctr", "n_dense": 4, "n_fields": 3, "emb_dim": 4, "bottom": [8, 4],
       "top": [8], "global_batch": 16, "plan": "ps", "quiet": True, "shuffle": False}


def ctr_file(path, bad_row, bad_column, value):
    label, dense, categorical, cardinality = generate_ctr(64, 4, 3, 50, seed=1)
    dense[bad_row, bad_column] = value
    write_ctr(path, label, dense, categorical, cardinality)
    return path


def run(run_dir, **overrides):
    trainer = Trainer({**CTR, "run_dir": str(run_dir), **overrides}, comm=MPI.COMM_SELF)
    trainer.run()
    return trainer


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_a_nonfinite_dense_feature_names_file_row_and_column(tmp_path, value):
    path = ctr_file(tmp_path / "ctr.h5", 37, 2, value)
    reader = CTRDataset(path)
    reader.batch(0, 16)  # rows 0-15: clean
    expected = f"{path}: dense value {np.float32(value)} at row 37, column 2 is not finite"
    with pytest.raises(DataError) as info:
        reader.batch(2, 16, shard=1, num_shards=2)  # rows 32-47, this shard 40-47: clean
        reader.batch(2, 16, shard=0, num_shards=2)  # rows 32-39
    assert str(info.value) == expected
    with pytest.raises(DataError, match="at row 37, column 2 is not finite"):
        reader.batch_range(2, 16, 4, 8)  # rows 36-39
    # the same words as a full scan of the file
    with pytest.raises(DataError) as info:
        reader.validate()
    assert str(info.value) == expected


def test_training_on_a_nan_feature_stops_at_its_row_not_at_a_gradient(tmp_path):
    path = ctr_file(tmp_path / "ctr.h5", 50, 0, np.nan)
    with pytest.raises(DataError) as info:
        run(tmp_path / "run", data=str(path), steps=6)
    assert str(info.value) == f"{path}: dense value nan at row 50, column 0 is not finite"


def _rewrite_manifest(path):
    """The manifest made to match the edited files: a consistent checkpoint, bad values."""
    manifest = ckpt.read_manifest(path)
    for name in manifest["files"]:
        manifest["files"][name] = ckpt._file_entry(os.path.join(path, name))
    with open(os.path.join(path, ckpt.MANIFEST), "w") as handle:
        json.dump(manifest, handle)


def _poke(path, file_name, dataset, index, value=np.nan):
    """Write ``value`` at ``index`` of ``dataset``; returns that row's global id (sparse)."""
    with h5py.File(os.path.join(path, file_name), "r+") as f:
        f[dataset][index] = value
        variable = dataset.split("/")[0]
        row = int(f[variable]["ids"][index[0]]) if "ids" in f.get(variable, {}) else None
    _rewrite_manifest(path)
    return row


@pytest.fixture
def two_checkpoints(tmp_path):
    run_dir = tmp_path / "run"
    run(run_dir, steps=4, checkpoint_every=2, sparse_optimizer="adagrad")
    return run_dir, [path for _, path in ckpt.list_checkpoints(run_dir)]


def test_a_nan_table_row_names_file_variable_and_row(two_checkpoints):
    run_dir, (older, newest) = two_checkpoints
    row = _poke(newest, "sparse_rank0.h5", "emb_1/table", (5, 3))
    sparse = os.path.join(newest, "sparse_rank0.h5")
    with pytest.raises(CheckpointError) as info:
        ckpt.load_matching(newest, "emb_1", lambda ids: np.ones(len(ids), bool), dim=4)
    assert str(info.value) == (f"{sparse}: variable 'emb_1': table value nan at row {row}, "
                               "column 3 is not finite")
    # a resume skips it, naming it, for the older checkpoint
    trainer = run(run_dir, steps=6, checkpoint_every=2, sparse_optimizer="adagrad",
                  resume=True)
    assert trainer.checkpoints.resumed_from == older
    rows = ckpt.load_matching(ckpt.latest(run_dir), "emb_1", lambda ids: np.ones(len(ids), bool))
    assert ckpt.latest(run_dir).endswith("step_000006") and np.isfinite(rows[1]).all()


def test_a_nan_optimizer_slot_or_dense_parameter_is_named(two_checkpoints):
    run_dir, (older, newest) = two_checkpoints
    row = _poke(newest, "sparse_rank0.h5", "emb_0/row_state/accumulator", (2, 1), np.inf)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_matching(newest, "emb_0", lambda ids: np.ones(len(ids), bool))
    assert str(info.value).endswith(f"sparse_rank0.h5: variable 'emb_0': optimizer slot "
                                    f"'accumulator' value inf at row {row}, column 1 is "
                                    "not finite")
    _poke(older, "dense.h5", "params/top_0_weight", (1, 2))
    with pytest.raises(CheckpointError) as info:
        ckpt.load_dense(older)
    assert str(info.value) == (f"{os.path.join(older, 'dense.h5')}: parameter 'top_0_weight' "
                               "value nan at index (1, 2) is not finite")
    # both damaged: the resume refuses, with the oldest one's reason
    with pytest.raises(CheckpointError) as info:
        run(run_dir, steps=6, checkpoint_every=2, sparse_optimizer="adagrad", resume=True)
    assert "every checkpoint" in str(info.value)
    assert "parameter 'top_0_weight' value nan at index (1, 2)" in str(info.value)
