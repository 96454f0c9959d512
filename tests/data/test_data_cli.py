"""``python -m hpcpax.data``: each subcommand round-trips through the readers."""

import subprocess
import sys
import zlib

import numpy as np
import pytest

from hpcpax.data import CTRDataset, LMDataset, SyntheticCTR, SyntheticLM
from hpcpax.data.__main__ import main
from hpcpax.data.tabular import hash_value


def test_text_round_trip(tmp_path, capsys):
    (tmp_path / "a.txt").write_text("The cat sat\non the mat\n", encoding="utf-8")
    (tmp_path / "b.txt").write_text("the dog  sat\tthe END é é", encoding="utf-8")
    out = tmp_path / "lm.h5"
    assert main(["text", str(tmp_path / "a.txt"), str(tmp_path / "b.txt"), "-o", str(out),
                 "--vocab-size", "5", "--lowercase"]) == 0
    line = capsys.readouterr().out
    assert "13 tokens" in line and "vocab_size 5" in line and "bytes" in line
    with LMDataset(out, context=2) as reader:
        # counts: the 4, sat 2, é 2, then ties at 1 broken alphabetically: cat < dog < end ...
        assert reader.vocab == ["<unk>", "the", "sat", "é", "cat"]
        ids = {word: i for i, word in enumerate(reader.vocab)}
        words = "the cat sat on the mat the dog sat the end é é".split()
        expected = [ids.get(word, 0) for word in words]
        batch = reader.batch(0, 11)  # all 13 - 2 samples
        stream = np.concatenate([batch["context"][0], batch["target"]])
        assert stream.tolist() == expected
        reader.validate(vocab_size=5)


def test_text_tie_break_is_alphabetical_and_case_kept(tmp_path):
    (tmp_path / "a.txt").write_text("b B a c b a", encoding="utf-8")
    assert main(["text", str(tmp_path / "a.txt"), "-o", str(tmp_path / "o.h5"),
                 "--vocab-size", "10"]) == 0
    with LMDataset(tmp_path / "o.h5", context=1) as reader:
        assert reader.vocab == ["<unk>", "a", "b", "B", "c"]  # vocab_size shrinks to words+1


def test_text_words_across_block_boundary(tmp_path, monkeypatch):
    from hpcpax.data import text
    monkeypatch.setattr(text, "_BLOCK_CHARS", 4)
    (tmp_path / "a.txt").write_text("alpha beta  gamma\ndelta", encoding="utf-8")
    assert list(text.iter_words(tmp_path / "a.txt")) == ["alpha", "beta", "gamma", "delta"]


def test_text_errors(tmp_path, capsys):
    (tmp_path / "bad.txt").write_bytes(b"ok \xff\xfe")
    (tmp_path / "empty.txt").write_text("  \n")
    assert main(["text", str(tmp_path / "bad.txt"), "-o", str(tmp_path / "o.h5"),
                 "--vocab-size", "4"]) == 1
    assert "bad.txt: not valid UTF-8" in capsys.readouterr().err
    assert main(["text", str(tmp_path / "empty.txt"), "-o", str(tmp_path / "o.h5"),
                 "--vocab-size", "4"]) == 1
    assert "no words found" in capsys.readouterr().err
    assert main(["text", str(tmp_path / "x.txt"), "-o", str(tmp_path / "o.h5"),
                 "--vocab-size", "4"]) == 1
    assert "x.txt: no such file" in capsys.readouterr().err
    assert not (tmp_path / "o.h5").exists()


def write_csv(path):
    path.write_text("click,site,device,price,age\n"
                    "1,news,phone,1.5,30\n"
                    "0,shop,,,\n"
                    "1,news,tablet,2,41\n", encoding="utf-8")
    return path


def test_csv_round_trip(tmp_path, capsys):
    source = write_csv(tmp_path / "t.csv")
    out = tmp_path / "ctr.h5"
    assert main(["csv", str(source), "--label", "click", "--categorical", "site,device",
                 "--dense", "price,age", "-o", str(out), "--hash-buckets", "97"]) == 0
    assert "3 samples" in capsys.readouterr().out
    with CTRDataset(out) as reader:
        batch = reader.batch(0, 3)
        reader.validate(table_rows=97)
        assert reader.cardinality.tolist() == [97, 97]
    assert batch["label"].tolist() == [1.0, 0.0, 1.0]
    assert batch["dense"].tolist() == [[1.5, 30.0], [0.0, 0.0], [2.0, 41.0]]
    expected = [[hash_value(site, "site", 97), hash_value(device, "device", 97)]
                for site, device in [("news", "phone"), ("shop", ""), ("news", "tablet")]]
    assert batch["categorical"].tolist() == expected
    # The hash is the documented one, salted per column: stable across runs and machines.
    assert expected[0][0] == zlib.crc32(b"news", zlib.crc32(b"site\0")) % 97
    assert hash_value("news", "site", 2**20) != hash_value("news", "device", 2**20)


@pytest.mark.parametrize("argv, message", [
    (["--label", "clicked", "--categorical", "site"], "label column(s) ['clicked']"),
    (["--label", "click", "--categorical", "site,os"], "categorical column(s) ['os']"),
    (["--label", "click", "--categorical", "site", "--dense", "cost"], "dense column(s)"),
])
def test_csv_missing_columns_list_available(tmp_path, capsys, argv, message):
    source = write_csv(tmp_path / "t.csv")
    assert main(["csv", str(source), "-o", str(tmp_path / "o.h5"), *argv]) == 1
    err = capsys.readouterr().err
    assert message in err and "available columns: ['click', 'site', 'device', 'price', 'age']" \
        in err
    assert not (tmp_path / "o.h5").exists()


@pytest.mark.parametrize("body, message", [
    ("1,news,phone,abc,3\n", "line 2, column 'price': 'abc' is not a number"),
    ("2,news,phone,1,3\n", "label 2.0 is not in [0, 1]"),
    ("1,news\n", "line 2 has 2 fields, the header has 5"),
    ("", "no data rows"),
])
def test_csv_bad_rows(tmp_path, capsys, body, message):
    source = tmp_path / "t.csv"
    source.write_text("click,site,device,price,age\n" + body)
    assert main(["csv", str(source), "--label", "click", "--categorical", "site",
                 "--dense", "price", "-o", str(tmp_path / "o.h5")]) == 1
    assert message in capsys.readouterr().err
    assert [path.name for path in tmp_path.iterdir()] == ["t.csv"]  # no output, no temporary


def test_csv_without_dense_columns(tmp_path):
    source = write_csv(tmp_path / "t.csv")
    assert main(["csv", str(source), "--label", "click", "--categorical", "device",
                 "-o", str(tmp_path / "o.h5")]) == 0
    with CTRDataset(tmp_path / "o.h5", shuffle=True) as reader:
        batch = reader.batch(1, 3)
        assert batch["dense"].shape == (3, 0) and batch["categorical"].shape == (3, 1)
        assert reader.validate()["n_dense"] == 0


def test_synth_files_equal_in_memory_generators(tmp_path, capsys):
    assert main(["synth", "lm", "-o", str(tmp_path / "lm.h5"), "--samples", "3000",
                 "--vocab-size", "80", "--seed", "5"]) == 0
    assert main(["synth", "ctr", "-o", str(tmp_path / "ctr.h5"), "--samples", "400",
                 "--fields", "3", "--dense", "2", "--cardinality", "40", "--seed", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "3000 tokens" in lines[0] and "400 samples" in lines[1]
    memory = SyntheticLM(num_tokens=3000, vocab_size=80, context=4, seed=5)
    with LMDataset(tmp_path / "lm.h5", context=4) as reader:
        assert reader.vocab == memory.vocab
        a, b = memory.batch(7, 30, 2, 3), reader.batch(7, 30, 2, 3)
        assert all(np.array_equal(a[key], b[key]) for key in a)
    memory = SyntheticCTR(num_samples=400, n_dense=2, n_fields=3, cardinality=40, seed=5)
    with CTRDataset(tmp_path / "ctr.h5") as reader:
        assert reader.cardinality.tolist() == [40, 40, 40]
        a, b = memory.batch(3, 40, 1, 2), reader.batch(3, 40, 1, 2)
        assert all(np.array_equal(a[key], b[key]) for key in a)


def test_check_subcommand(tmp_path, capsys):
    assert main(["synth", "lm", "-o", str(tmp_path / "lm.h5"), "--samples", "500"]) == 0
    assert main(["check", str(tmp_path / "lm.h5"), "--context", "4"]) == 0
    assert "ok, lm" in capsys.readouterr().out
    assert main(["check", str(tmp_path / "lm.h5"), "--vocab-size", "5"]) == 1
    assert "not below the given vocab_size 5" in capsys.readouterr().err
    assert main(["check", str(tmp_path / "missing.h5")]) == 1
    assert "missing.h5: no such file" in capsys.readouterr().err


def test_module_runs_as_subprocess(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "hpcpax.data", "synth", "ctr", "-o", str(tmp_path / "c.h5"),
         "--samples", "50", "--fields", "2", "--dense", "1"],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("\n") == 1 and "hpcpax-ctr/1, 50 samples" in result.stdout
    with CTRDataset(tmp_path / "c.h5") as reader:
        assert reader.num_samples == 50
