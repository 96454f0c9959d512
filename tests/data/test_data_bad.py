"""Every data problem raises DataError naming the file and the problem."""

import h5py
import numpy as np
import pytest

from hpcpax.data import CTRDataset, LMDataset, SyntheticLM, open_dataset, write_ctr, write_lm
from hpcpax.errors import DataError


def make_lm(path, tokens=(1, 2, 3, 1, 2, 3, 0, 1), vocab=("<unk>", "a", "b", "c"),
            format="hpcpax-lm/1", vocab_size=None, drop=None, token_dtype=np.int32):
    with h5py.File(path, "w") as h5file:
        if format is not None:
            h5file.attrs["format"] = format
        h5file.attrs["vocab_size"] = len(vocab) if vocab_size is None else vocab_size
        if drop != "tokens":
            h5file["tokens"] = np.asarray(tokens, dtype=token_dtype)
        if drop != "vocab":
            h5file.create_dataset("vocab", data=np.array(vocab, dtype=object),
                                  dtype=h5py.string_dtype("utf-8"))
    return path


def make_ctr(path, rows=6, label=None, dense=None, categorical=None, cardinality=(10, 10),
             drop=None):
    label = np.zeros(rows, np.float32) if label is None else label
    dense = np.ones((rows, 2), np.float32) if dense is None else dense
    categorical = np.ones((rows, 2), np.int64) if categorical is None else categorical
    with h5py.File(path, "w") as h5file:
        h5file.attrs.update({"format": "hpcpax-ctr/1", "n_dense": 2, "n_fields": 2})
        if cardinality is not None:
            h5file.attrs["cardinality"] = np.asarray(cardinality, np.int64)
        for key, value in (("label", label), ("dense", dense), ("categorical", categorical)):
            if key != drop:
                h5file[key] = value
    return path


def raises(match, function, *args, **kwargs):
    with pytest.raises(DataError, match=match) as info:
        function(*args, **kwargs)
    return str(info.value)


def test_missing_file_and_directory(tmp_path):
    for reader in (LMDataset, CTRDataset, open_dataset):
        assert str(tmp_path / "nope.h5") in raises("no such file", reader, tmp_path / "nope.h5")
    raises("directory", LMDataset, tmp_path)


@pytest.mark.parametrize("format, match", [
    (None, "no 'format' attribute"),
    ("hpcpax-lm/2", "unsupported version"),
    ("parquet", "format attribute is 'parquet'"),
    ("hpcpax-ctr/1", "not 'hpcpax-lm/1'"),
])
def test_wrong_format_attr(tmp_path, format, match):
    path = make_lm(tmp_path / "f.h5", format=format)
    assert "f.h5" in raises(match, LMDataset, path)


def test_kind_mismatch_in_open_dataset(tmp_path):
    path = make_lm(tmp_path / "f.h5")
    raises("kind 'ctr'", open_dataset, path, "ctr")
    assert open_dataset(path, context=2).kind == "lm"


@pytest.mark.parametrize("drop", ["tokens", "vocab"])
def test_missing_lm_dataset(tmp_path, drop):
    raises(f"missing dataset '{drop}'", LMDataset, make_lm(tmp_path / "f.h5", drop=drop))


@pytest.mark.parametrize("drop", ["label", "dense", "categorical"])
def test_missing_ctr_dataset(tmp_path, drop):
    raises(f"missing dataset '{drop}'", CTRDataset, make_ctr(tmp_path / "f.h5", drop=drop))


def test_wrong_dtypes(tmp_path):
    raises("'tokens' must be int32 or int64, not float32", LMDataset,
           make_lm(tmp_path / "a.h5", token_dtype=np.float32))
    raises("'label' must be float32, not float64", CTRDataset,
           make_ctr(tmp_path / "b.h5", label=np.zeros(6)))
    raises("'categorical' must be int64, not int32", CTRDataset,
           make_ctr(tmp_path / "c.h5", categorical=np.ones((6, 2), np.int32)))


def test_wrong_shapes_and_attrs(tmp_path):
    raises("shape \\(5, 2\\), expected \\(6, 2\\)", CTRDataset,
           make_ctr(tmp_path / "a.h5", dense=np.ones((5, 2), np.float32)))
    raises("vocab_size is 9", LMDataset, make_lm(tmp_path / "b.h5", vocab_size=9))
    raises("'cardinality' must be int64 \\[2\\]", CTRDataset,
           make_ctr(tmp_path / "c.h5", cardinality=(3, 3, 3)))
    raises("'tokens' is empty", LMDataset, make_lm(tmp_path / "d.h5", tokens=[]))
    raises("'label' must be 1-D and non-empty", CTRDataset, make_ctr(tmp_path / "e.h5", rows=0))


def test_too_few_tokens_for_context(tmp_path):
    raises("holds 8 tokens; context 8", LMDataset, make_lm(tmp_path / "f.h5"), context=8)


def test_lm_ids_out_of_range(tmp_path):
    reader = LMDataset(make_lm(tmp_path / "big.h5", tokens=[1, 2, 7, 1]), context=1)
    assert "big.h5" in raises("token id 7 at position 2 is not below the file's vocab_size 4",
                              reader.validate)
    reader = LMDataset(make_lm(tmp_path / "neg.h5", tokens=[1, -3, 2]), context=1)
    raises("negative token id -3 \\(first at position 1\\)", reader.validate)
    reader = LMDataset(make_lm(tmp_path / "ok.h5"), context=1)
    raises("token id 3 at position 2 is not below the given vocab_size 3", reader.validate,
           vocab_size=3)
    reader = LMDataset(make_lm(tmp_path / "unk.h5", vocab=("a", "<unk>", "b", "c")), context=1)
    raises("vocab\\[0\\] is 'a'", reader.validate)


def test_validate_scans_in_chunks_and_reports_global_positions(tmp_path, monkeypatch):
    from hpcpax.data import reading
    monkeypatch.setattr(reading, "SCAN_BYTES", 16)  # 4 int32 tokens per chunk
    reader = LMDataset(make_lm(tmp_path / "f.h5", tokens=[1, 2, 3, 1, 2, 3, 1, 2, 3, 9, 1]),
                       context=1)
    raises("token id 9 at position 9 is not below", reader.validate)
    categorical = np.ones((6, 2), np.int64)
    categorical[5, 0] = 12
    reader = CTRDataset(make_ctr(tmp_path / "g.h5", categorical=categorical))
    raises("id 12 at row 5, field 0", reader.validate)


def test_ctr_values_out_of_range(tmp_path):
    categorical = np.ones((6, 2), np.int64)
    categorical[4, 1] = 10
    reader = CTRDataset(make_ctr(tmp_path / "a.h5", categorical=categorical))
    raises("id 10 at row 4, field 1 is not below cardinality 10", reader.validate)
    categorical[4, 1] = -1
    reader = CTRDataset(make_ctr(tmp_path / "b.h5", categorical=categorical))
    raises("id -1 at row 4, field 1 is negative", reader.validate)
    reader = CTRDataset(make_ctr(tmp_path / "c.h5", cardinality=None))
    raises("id 1 at row 0, field 0 is not below table_rows 1", reader.validate, table_rows=1)
    label = np.array([0, 1, 2, 0, 0, 0], np.float32)
    raises("label 2.0 at row 2", CTRDataset(make_ctr(tmp_path / "d.h5", label=label)).validate)
    dense = np.ones((6, 2), np.float32)
    dense[3, 1] = np.nan
    raises("dense value nan at row 3, column 1",
           CTRDataset(make_ctr(tmp_path / "e.h5", dense=dense)).validate)


def test_random_bytes_file(tmp_path):
    path = tmp_path / "noise.h5"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    assert "noise.h5" in raises("not a readable HDF5 file", LMDataset, path)


@pytest.mark.parametrize("keep", [0.0, 0.1, 0.5, 0.95])
def test_truncated_file(tmp_path, keep):
    path = tmp_path / "cut.h5"
    write_lm(path, np.arange(20000) % 50, ["<unk>"] + [f"w{i}" for i in range(1, 50)])
    data = path.read_bytes()
    path.write_bytes(data[:int(len(data) * keep)])
    with pytest.raises(DataError, match="cut.h5"):  # on open, or at the latest on a read
        with LMDataset(path, context=4) as reader:
            reader.validate()
            reader.batch(0, 10_000)


def test_reader_geometry_errors():
    reader = SyntheticLM(num_tokens=100, vocab_size=10, context=4)
    raises("global batch 10 does not divide evenly by num_shards 4", reader.batch, 0, 10, 0, 4)
    raises("leaves shard 1 empty", reader.batch, 0, 0, 1, 2)
    raises("holds 96 samples, fewer than one global batch of 128", reader.batch, 0, 128)


def test_open_dataset_arguments(tmp_path):
    assert open_dataset("synthetic", "ctr", num_samples=10, n_fields=2).num_samples == 10
    with pytest.raises(ValueError, match="kind must be 'lm' or 'ctr'"):
        open_dataset("synthetic")
    with pytest.raises(ValueError, match="kind must be 'lm' or 'ctr', not 'img'"):
        open_dataset(tmp_path / "x.h5", "img")
    with pytest.raises(ValueError, match="seed must be"):
        SyntheticLM(num_tokens=50, vocab_size=5, seed=-1)
    with pytest.raises(ValueError, match="context must be >= 1"):
        LMDataset(make_lm(tmp_path / "f.h5"), context=0)


def test_writers_reject_bad_arrays(tmp_path):
    raises("token ids must lie in \\[0, 2\\)", write_lm, tmp_path / "a.h5", [0, 2], ["<unk>", "x"])
    raises("must start with '<unk>'", write_lm, tmp_path / "b.h5", [0], ["x"])
    raises("categorical ids must be >= 0", write_ctr, tmp_path / "c.h5", [0], [[1.0]], [[-1]])
    raises("cardinality", write_ctr, tmp_path / "d.h5", [0], [[1.0]], [[5]], cardinality=[3])
    assert not list(tmp_path.iterdir())
