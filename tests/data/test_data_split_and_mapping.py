"""Held-out splits (readers and converters), tokenizers, memory-mapped reads, index blocks."""

import h5py
import numpy as np
import pytest

from hpcpax.data import (CTRDataset, LMDataset, SyntheticCTR, SyntheticLM, generate_lm,
                         sample_indices, write_lm)
from hpcpax.data import reading
from hpcpax.data.__main__ import main
from hpcpax.data.mapping import MappedRows, map_dataset
from hpcpax.data.synthetic import lm_vocab
from hpcpax.data.text import iter_words
from hpcpax.data.writing import Appender, atomic_h5, write_vocab


def _lm_file(path, tokens, chunked=False, compression=None):
    """An hpcpax-lm/1 file whose tokens are contiguous, chunked (1000) or compressed."""
    with atomic_h5(path) as h5file:
        h5file.attrs["format"] = "hpcpax-lm/1"
        write_vocab(h5file, lm_vocab(int(tokens.max()) + 1))
        if chunked or compression:
            h5file.create_dataset("tokens", data=tokens, chunks=(1000,), compression=compression)
        else:
            h5file.create_dataset("tokens", data=tokens)
    return path


@pytest.mark.parametrize("layout", ["contiguous", "chunked", "gzip"])
def test_shuffled_reads_equal_numpy_in_every_layout(tmp_path, layout):
    tokens = generate_lm(10_007, 300, seed=2).astype(np.int32)
    path = _lm_file(tmp_path / "t.h5", tokens, layout == "chunked",
                    "gzip" if layout == "gzip" else None)
    with LMDataset(path, context=3, shuffle=True, seed=4) as reader:
        assert isinstance(reader._tokens, MappedRows) == (layout != "gzip")
        for step in (0, 1, 50, 400):  # 400 is past the first epoch
            indices = reader.sample_indices(step, 60, 1, 3)
            got = reader.batch(step, 60, 1, 3)
            windows = tokens[indices[:, None] + np.arange(4)]
            assert np.array_equal(got["context"], windows[:, :3])
            assert np.array_equal(got["target"], windows[:, 3])
        assert reader.validate()["max_id"] == tokens.max()


def test_mapped_rows_slices_and_multi_column_chunks(tmp_path):
    values = np.arange(5003 * 7, dtype=np.float32).reshape(5003, 7)
    with h5py.File(tmp_path / "m.h5", "w") as h5file:
        h5file.create_dataset("big", data=values.astype(">f4"), chunks=(128, 7))
    with h5py.File(tmp_path / "m.h5", "r") as h5file:
        mapped = map_dataset(h5file["big"])
        assert mapped is not None and mapped.dtype == np.float32  # big-endian made native
        assert np.array_equal(mapped[100:1000], values[100:1000])
        assert np.array_equal(mapped[5000:], values[5000:])
        rows = np.array([5002, 0, 127, 128, 128, 3000])
        assert np.array_equal(mapped[rows], values[rows])
        with pytest.raises(IndexError):
            mapped.take([5003])


def test_chunks_past_the_end_of_the_file_fall_back_to_h5py(tmp_path, monkeypatch):
    from hpcpax.data import mapping

    tokens = np.arange(50_000, dtype=np.int32)
    path = _lm_file(tmp_path / "t.h5", tokens, chunked=True)
    size = path.stat().st_size
    with h5py.File(path, "r") as h5file:
        assert map_dataset(h5file["tokens"]) is not None
        # a file shorter than its chunk table says (HDF5 opened it before it shrank)
        monkeypatch.setattr(mapping.os.path, "getsize", lambda _: size - 1000)
        assert map_dataset(h5file["tokens"]) is None


def test_index_blocks_equal_step_by_step_indices(monkeypatch):
    reader = SyntheticCTR(num_samples=1000, n_dense=2, n_fields=2, shuffle=True, seed=3)
    monkeypatch.setattr(reading, "INDEX_BLOCK_SAMPLES", 64)
    for step in [0, 1, 2, 7, 30, 31, 33, 5, 1000, 2]:  # blocks of 64 // 12 = 5 steps
        for shard in range(3):
            expected = sample_indices(step, 36, shard, 3, 1000, True, 3)
            assert np.array_equal(reader.sample_indices(step, 36, shard, 3), expected)


@pytest.mark.parametrize("kind", ["lm", "ctr"])
def test_split_tail_holds_out_a_tail_never_read_by_the_head(kind):
    if kind == "lm":
        reader = SyntheticLM(num_tokens=1000, vocab_size=50, context=4, shuffle=True, seed=1)
        units = reader.tokens
    else:
        reader = SyntheticCTR(num_samples=1000, n_dense=2, n_fields=3, shuffle=True, seed=1)
        units = reader.arrays()[2]
    head, tail = reader.split_tail(0.25)
    assert head.span == (0, 750) and tail.span == (750, 1000)
    assert head.shuffle and tail.seed == 1 and "750:1000" in tail.name
    if kind == "lm":
        assert (head.num_samples, tail.num_samples) == (746, 246)
        # every head window lies in tokens [0, 750), every tail window in [750, 1000)
        for part, first in ((head, 0), (tail, 750)):
            batch = part.batch(3, part.num_samples)
            windows = np.column_stack([batch["context"], batch["target"]])
            starts = part.sample_indices(3, part.num_samples) + first
            assert np.array_equal(windows, units[starts[:, None] + np.arange(5)])
    else:
        assert (head.num_samples, tail.num_samples) == (750, 250)
        batch = tail.batch(0, 250)
        rows = tail.sample_indices(0, 250) + 750
        assert np.array_equal(batch["categorical"], units[rows])
        assert sorted(rows.tolist()) == list(range(750, 1000))
    with pytest.raises(ValueError, match="fraction must be a float in"):
        reader.split_tail(1.0)


def test_words_tokenizer_splits_punctuation(tmp_path):
    (tmp_path / "a.txt").write_text("\"Don't stop,\" she said -- well-known_words!\nEnd.",
                                    encoding="utf-8")
    words = list(iter_words(tmp_path / "a.txt", lowercase=True, tokenizer="words"))
    assert words == ['"', "don't", "stop", ",", '"', "she", "said", "-", "-", "well-known",
                     "_", "words", "!", "end", "."]
    assert list(iter_words(tmp_path / "a.txt")) == ['"Don\'t', 'stop,"', "she", "said", "--",
                                                    "well-known_words!", "End."]


def test_text_split_shares_a_vocabulary_counted_on_the_training_part(tmp_path, capsys):
    text = "a b a c a b a d a b . e e e e e e"  # 17 tokens; the last 4 are held out
    (tmp_path / "a.txt").write_text(text, encoding="utf-8")
    assert main(["text", str(tmp_path / "a.txt"), "-o", str(tmp_path / "train.h5"),
                 "--vocab-size", "10", "--tokenizer", "words",
                 "--eval-output", str(tmp_path / "eval.h5"), "--eval-fraction", "0.25"]) == 0
    line = capsys.readouterr().out
    assert "13 tokens" in line and "held out" in line and "4 tokens (0 <unk>)" in line
    with LMDataset(tmp_path / "train.h5", context=1) as train, \
            LMDataset(tmp_path / "eval.h5", context=1) as held:
        # 'e' counts 2 in the training part (not 6): it ranks after a, b
        assert train.vocab == held.vocab == ["<unk>", "a", "b", "e", ".", "c", "d"]
        ids = {word: i for i, word in enumerate(train.vocab)}
        words = text.split()
        assert np.array_equal(np.asarray(train._tokens[:]), [ids[w] for w in words[:13]])
        assert np.array_equal(np.asarray(held._tokens[:]), [ids[w] for w in words[13:]])
        assert isinstance(train._tokens, MappedRows)  # written contiguous: mapped


def test_csv_and_synth_split(tmp_path, capsys):
    rows = "\n".join(f"{i % 2},{i},x{i % 3}" for i in range(10))
    (tmp_path / "d.csv").write_text("y,f,c\n" + rows + "\n", encoding="utf-8")
    assert main(["csv", str(tmp_path / "d.csv"), "-o", str(tmp_path / "t.h5"), "--label", "y",
                 "--dense", "f", "--categorical", "c", "--eval-output", str(tmp_path / "e.h5"),
                 "--eval-fraction", "0.3"]) == 0
    assert "7 samples" in capsys.readouterr().out
    with CTRDataset(tmp_path / "t.h5") as train, CTRDataset(tmp_path / "e.h5") as held:
        assert train.batch(0, 7)["dense"][:, 0].tolist() == list(range(7))
        assert held.batch(0, 3)["dense"][:, 0].tolist() == [7, 8, 9]
        assert isinstance(held._dense, MappedRows)
    assert main(["synth", "lm", "-o", str(tmp_path / "s.h5"), "--samples", "1000",
                 "--vocab-size", "30", "--eval-output", str(tmp_path / "se.h5")]) == 0
    assert "900 tokens" in capsys.readouterr().out
    whole = SyntheticLM(num_tokens=1000, vocab_size=30, context=1, seed=0).tokens
    with LMDataset(tmp_path / "se.h5", context=1) as held:
        assert np.array_equal(np.asarray(held._tokens[:]), whole[900:])
    assert main(["csv", str(tmp_path / "d.csv"), "-o", str(tmp_path / "t.h5"), "--label", "y",
                 "--categorical", "c", "--eval-fraction", "0.3"]) == 1
    assert "--eval-fraction needs --eval-output" in capsys.readouterr().err


def test_streamed_appender_of_known_length_is_contiguous_and_checked(tmp_path):
    with atomic_h5(tmp_path / "a.h5") as h5file:
        appender = Appender(h5file, "x", "int32", total_rows=5)
        appender.append([1, 2, 3])
        appender.append([4, 5])
        assert appender.finish().chunks is None
    with pytest.raises(Exception, match="6 rows written, 5 counted|more than the 5 rows"):
        with atomic_h5(tmp_path / "b.h5") as h5file:
            appender = Appender(h5file, "x", "int32", total_rows=5)
            appender.append(np.arange(6))
    write_lm(tmp_path / "w.h5", np.arange(10), lm_vocab(10))
    with LMDataset(tmp_path / "w.h5", context=2) as reader:
        assert isinstance(reader._tokens, MappedRows)


def test_unigram_baseline_by_hand(tmp_path, capsys):
    write_lm(tmp_path / "t.h5", np.array([1, 1, 2, 0]), ["<unk>", "a", "b"])
    write_lm(tmp_path / "e.h5", np.array([2, 1, 2, 1]), ["<unk>", "a", "b"])
    # add-one: p = (counts + 1) / (4 + 3) = 2/7, 3/7, 2/7; targets after context 2: b, a
    assert main(["unigram", str(tmp_path / "t.h5"), str(tmp_path / "e.h5"),
                 "--context", "2"]) == 0
    expected = np.exp(-(np.log(2 / 7) + np.log(3 / 7)) / 2)
    assert f"unigram perplexity {expected:.2f} " in capsys.readouterr().out
