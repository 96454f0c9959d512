"""File readers return exactly NumPy slicing of the full arrays, reading only their slice."""

import time

import h5py
import numpy as np
import pytest

from hpcpax.data import (CTRDataset, LMDataset, SyntheticCTR, SyntheticLM, generate_ctr,
                         generate_lm, open_dataset, sample_indices, write_ctr, write_lm)
from hpcpax.data import reading
from hpcpax.data.synthetic import lm_vocab


class RecordingArray:
    """Wraps an h5py dataset and records the rows of every read from it."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, []

    dtype = property(lambda self: self.dataset.dtype)
    shape = property(lambda self: self.dataset.shape)

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, key):
        if isinstance(key, slice):
            self.reads.append(np.arange(key.start, key.stop))
        else:
            key = np.asarray(key)
            assert key.ndim == 1 and (np.diff(key) > 0).all(), "h5py needs increasing indices"
            self.reads.append(key)
        return self.dataset[key]

    def rows(self):
        return np.concatenate(self.reads)


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm") / "lm.h5"
    tokens = generate_lm(5000, 300, seed=4)
    write_lm(path, tokens, lm_vocab(300))
    return path, tokens


@pytest.fixture(scope="module")
def ctr_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ctr") / "ctr.h5"
    label, dense, categorical, cardinality = generate_ctr(3000, 5, 7, 50, seed=2)
    write_ctr(path, label, dense, categorical, cardinality)
    return path, (label, dense, categorical)


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_lm_batches_equal_numpy_slicing(lm_file, shuffle, num_shards):
    path, tokens = lm_file
    context = 6
    with LMDataset(path, context=context, shuffle=shuffle, seed=8) as reader:
        assert reader.num_samples == len(tokens) - context
        for step in (0, 1, 83):  # 83 * 60 positions pass the end: wraps
            for shard in range(num_shards):
                got = reader.batch(step, 60, shard, num_shards)
                indices = sample_indices(step, 60, shard, num_shards, reader.num_samples,
                                         shuffle, 8)
                windows = tokens[indices[:, None] + np.arange(context + 1)].astype(np.int64)
                assert got["context"].dtype == np.int64 and got["target"].dtype == np.int64
                assert np.array_equal(got["context"], windows[:, :context])
                assert np.array_equal(got["target"], windows[:, context])


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("num_shards", [1, 2, 3, 4])
def test_ctr_batches_equal_numpy_slicing(ctr_file, shuffle, num_shards):
    path, (label, dense, categorical) = ctr_file
    with CTRDataset(path, shuffle=shuffle, seed=8) as reader:
        assert (reader.n_dense, reader.n_fields, reader.num_samples) == (5, 7, 3000)
        for step in (0, 2, 61):
            for shard in range(num_shards):
                got = reader.batch(step, 48, shard, num_shards)
                indices = sample_indices(step, 48, shard, num_shards, 3000, shuffle, 8)
                assert got["dense"].dtype == np.float32 and got["label"].dtype == np.float32
                assert got["categorical"].dtype == np.int64
                assert np.array_equal(got["dense"], dense[indices])
                assert np.array_equal(got["categorical"], categorical[indices])
                assert np.array_equal(got["label"], label[indices])


def test_unshuffled_rank_reads_one_slice_of_its_windows(lm_file):
    path, _ = lm_file
    with LMDataset(path, context=4) as reader:
        reader._tokens = recorder = RecordingArray(reader._tokens)
        reader.batch(3, 40, shard=2, num_shards=4)  # samples 140..149 -> tokens 140..153
        assert len(recorder.reads) == 1 and recorder.rows().tolist() == list(range(140, 154))


@pytest.mark.parametrize("context", [4, 40])  # short windows: one fancy read; long: slices
def test_shuffled_rank_reads_only_near_its_windows(lm_file, monkeypatch, context):
    path, tokens = lm_file
    gap = 4  # tokens: shrink the coalescing gap so 5000 tokens hold far-apart windows
    monkeypatch.setattr(reading, "COALESCE_BYTES", gap * tokens.dtype.itemsize)
    with LMDataset(path, context=context, shuffle=True, seed=1) as reader:
        reader._tokens = recorder = RecordingArray(reader._tokens)
        indices = reader.sample_indices(0, 64, shard=1, num_shards=4)
        reader.batch(0, 64, shard=1, num_shards=4)
        rows = recorder.rows()
        assert len(np.unique(rows)) == len(rows)  # nothing read twice
        needed = np.unique(indices[:, None] + np.arange(context + 1))
        assert np.isin(needed, rows).all()
        # Beyond the windows themselves only gaps shorter than the coalescing gap are read.
        assert len(rows) <= len(needed) + len(indices) * gap
        assert len(rows) < len(tokens) // 2


def test_shuffled_ctr_reads_only_its_rows(ctr_file):
    path, _ = ctr_file
    with CTRDataset(path, shuffle=True, seed=2) as reader:
        recorders = {}
        for key in ("_label", "_dense", "_categorical"):
            recorders[key] = RecordingArray(getattr(reader, key))
            setattr(reader, key, recorders[key])
        indices = reader.sample_indices(5, 30, shard=2, num_shards=3)
        reader.batch(5, 30, shard=2, num_shards=3)
        gap = reading.COALESCE_BYTES // (4 + 4 * 5 + 8 * 7)
        for recorder in recorders.values():
            rows = recorder.rows()
            assert np.isin(indices, rows).all()
            assert len(rows) <= len(indices) * (gap + 1)


def test_file_written_from_synthetic_reads_like_synthetic(tmp_path):
    memory = SyntheticLM(num_tokens=2000, vocab_size=50, context=3, seed=7, shuffle=True)
    write_lm(tmp_path / "s.h5", memory.tokens, memory.vocab)
    with open_dataset(tmp_path / "s.h5", context=3, shuffle=True, seed=7) as reader:
        for step in (0, 5, 400):
            a, b = memory.batch(step, 16, 1, 2), reader.batch(step, 16, 1, 2)
            assert all(np.array_equal(a[key], b[key]) for key in a)


def test_validate_good_files(lm_file, ctr_file):
    with LMDataset(lm_file[0]) as reader:
        summary = reader.validate(vocab_size=300)
        assert summary["num_tokens"] == 5000 and summary["max_id"] < 300
        assert reader.vocab[:2] == ["<unk>", "w1"]
    with CTRDataset(ctr_file[0]) as reader:
        summary = reader.validate(table_rows=50)
        assert max(summary["max_id"]) < 50 and 0.05 < summary["positive_rate"] < 0.95
        assert reader.cardinality.tolist() == [50] * 7


def test_synthetic_is_deterministic():
    a, b, c = (SyntheticLM(5000, 100, seed=s).tokens for s in (1, 1, 2))
    assert np.array_equal(a, b) and not np.array_equal(a, c)
    x, y, z = (SyntheticCTR(500, 3, 4, 20, seed=s).arrays() for s in (1, 1, 2))
    assert all(np.array_equal(p, q) for p, q in zip(x, y))
    assert not np.array_equal(x[2], z[2]) and not np.array_equal(x[1], z[1])


def test_synthetic_lm_is_cheap_zipf_and_learnable():
    start = time.perf_counter()
    tokens = SyntheticLM(num_tokens=200_000, vocab_size=5000, seed=0).tokens
    assert time.perf_counter() - start < 1.0
    assert tokens.min() >= 1 and tokens.max() < 5000
    counts = np.bincount(tokens, minlength=5000)
    assert counts[1] > counts[10] > counts[100]  # frequency falls with rank
    # The previous token predicts the next far better than the unigram does.
    top_next = {}
    for prev, nxt in zip(tokens[:-1].tolist(), tokens[1:].tolist()):
        top_next.setdefault(prev, []).append(nxt)
    hits = sum(np.bincount(v).max() for v in top_next.values()) / (len(tokens) - 1)
    assert hits > 2 * counts.max() / len(tokens)


def test_synthetic_ctr_label_depends_on_features():
    reader = SyntheticCTR(num_samples=20_000, n_dense=4, n_fields=6, cardinality=30, seed=3)
    label, dense, categorical = reader.arrays()
    assert dense.dtype == np.float32 and categorical.dtype == np.int64
    assert (categorical < 30).all() and (categorical >= 0).all()
    rate_by_id = [label[categorical[:, 0] == i].mean() for i in range(3)]
    assert max(rate_by_id) - min(rate_by_id) > 0.05  # ids carry signal
    assert len(np.unique(np.round(rate_by_id, 3))) > 1


def test_files_use_umask_and_no_leftover_temporaries(tmp_path):
    import os
    write_lm(tmp_path / "x.h5", [1, 2, 0], ["<unk>", "a", "b"])
    umask = os.umask(0)
    os.umask(umask)
    assert os.stat(tmp_path / "x.h5").st_mode & 0o777 == 0o666 & ~umask
    assert sorted(os.listdir(tmp_path)) == ["x.h5"]
    with h5py.File(tmp_path / "x.h5") as h5file:
        assert h5file.attrs["format"] == "hpcpax-lm/1"
        assert h5file["tokens"].dtype == np.int32
