"""Training on data files (issue 11): held-out eval, shuffle default, config errors,
steady-state throughput, the report. One process each (COMM_SELF)."""

import json
import math

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import report
from hpcpax.app.config import build_parser, load_toml, parse_args, resolve
from hpcpax.app.throughput import steady_throughput, unsteady_steps
from hpcpax.app.trainer import Trainer
from hpcpax.data import generate_lm, write_lm
from hpcpax.data import lm as lm_module
from hpcpax.data.__main__ import main as data_main
from hpcpax.data.synthetic import lm_vocab
from hpcpax.errors import ConfigError
from hpcpax.train import main as train_main

TINY = {"model": "lm", "context": 3, "emb_dim": 6, "hidden": [8], "out_dim": 6,
        "num_sampled": 10, "global_batch": 12, "quiet": True, "plan": "ps"}


@pytest.fixture(scope="module")
def lm_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "lm.h5"
    write_lm(path, generate_lm(3000, 300, seed=2), lm_vocab(300))
    return path


def run(tmp_path, **overrides):
    """A one-process run in a new run directory (a run directory is never reused)."""
    earlier = len(list(tmp_path.glob("run*")))
    run_dir = tmp_path / (f"run{earlier}" if earlier else "run")  # the first one is "run"
    trainer = Trainer({**TINY, "run_dir": str(run_dir), **overrides}, comm=MPI.COMM_SELF)
    trainer.run()
    return trainer


# ---------------------------------------------------------------- held-out eval
def test_eval_fraction_holds_out_a_tail_training_never_reads(tmp_path, lm_file, monkeypatch):
    read = []  # (reader span, first token, last token) of every batch read
    original = lm_module._LMReader._read

    def recording(self, indices):
        starts = indices + self.span[0]
        read.append((self.span, int(starts.min()), int(starts.max()) + self.context))
        return original(self, indices)

    monkeypatch.setattr(lm_module._LMReader, "_read", recording)
    trainer = run(tmp_path, data=str(lm_file), steps=400, eval_every=200, eval_fraction=0.1,
                  eval_batches=100)
    assert trainer.reader.span == (0, 2700) and trainer.eval_set.reader.span == (2700, 3000)
    train = [r for r in read if r[0] == (0, 2700)]
    held = [r for r in read if r[0] == (2700, 3000)]
    assert len(train) == 400  # 400 steps: more than one epoch of the 2697 training samples
    assert max(last for _, _, last in train) < 2700 <= min(first for _, first, _ in held)
    evals = [json.loads(line)["eval"] for line in open(tmp_path / "run" / "metrics.jsonl")
             if '"eval"' in line]
    # at most the whole held-out set: 297 samples hold 24 global batches of 12
    assert [e["samples"] for e in evals] == [288, 288]


def test_eval_data_file_from_the_converter(tmp_path):
    words = " ".join(f"w{i % 37} w{i % 11}." for i in range(3000))
    (tmp_path / "a.txt").write_text(words, encoding="utf-8")
    assert data_main(["text", str(tmp_path / "a.txt"), "-o", str(tmp_path / "t.h5"),
                      "--vocab-size", "100", "--tokenizer", "words",
                      "--eval-output", str(tmp_path / "e.h5")]) == 0
    trainer = run(tmp_path, data=str(tmp_path / "t.h5"), eval_data=str(tmp_path / "e.h5"),
                  steps=2, eval_every=2)
    assert trainer.eval_set.held_out and trainer.eval_set.reader.name == str(tmp_path / "e.h5")
    assert trainer.model.vocab_size == 39  # '<unk>', w0..w36 and '.': the file's vocabulary
    evals = [json.loads(line)["eval"] for line in open(tmp_path / "run" / "metrics.jsonl")
             if '"eval"' in line]
    assert evals[0]["samples"] == 24 and math.isclose(evals[0]["perplexity"],
                                                      math.exp(evals[0]["loss"]))


def test_eval_data_of_another_vocabulary_is_refused(tmp_path, lm_file):
    write_lm(tmp_path / "other.h5", generate_lm(500, 300, seed=1), ["<unk>"] + [
        f"x{i}" for i in range(299)])
    with pytest.raises(ConfigError) as info:
        run(tmp_path, data=str(lm_file), eval_data=str(tmp_path / "other.h5"), steps=1)
    assert str(info.value) == (
        f"--eval-data: {tmp_path / 'other.h5'} was encoded with another vocabulary than "
        f"{lm_file} (id 1 differs); make both with one `python -m hpcpax.data text ... "
        f"--eval-output` run")


def test_held_out_set_smaller_than_a_global_batch_is_refused(tmp_path, lm_file):
    with pytest.raises(ConfigError, match=r"has 7 samples, fewer than one global batch of 12"):
        run(tmp_path, data=str(lm_file), eval_fraction=0.0034, eval_every=1, steps=1)
    with pytest.raises(ConfigError, match="eval_data and eval_fraction both name a held-out"):
        resolve({"eval_data": "x.h5", "eval_fraction": 0.1})


# ---------------------------------------------------------------------- shuffle
def test_shuffle_is_the_default_and_no_shuffle_turns_it_off(tmp_path, lm_file):
    assert resolve({})["shuffle"] is True and parse_args([])["shuffle"] is True
    assert parse_args(["--no-shuffle"])["shuffle"] is False
    trainer = run(tmp_path, data=str(lm_file), steps=1)
    assert trainer.reader.shuffle and trainer.reader.seed == 0
    first = trainer.reader.sample_indices(0, 12)
    assert not np.array_equal(first, np.arange(12))  # not file order
    # the same global batch for any worker count, and again for the same seed and epoch
    for workers in (2, 3, 4):
        shards = [trainer.reader.sample_indices(0, 12, r, workers) for r in range(workers)]
        assert np.array_equal(np.concatenate(shards), first)
    assert np.array_equal(run(tmp_path, data=str(lm_file), steps=1, seed=0)
                          .reader.sample_indices(0, 12), first)
    assert not np.array_equal(run(tmp_path, data=str(lm_file), steps=1, seed=1)
                              .reader.sample_indices(0, 12), first)


# ---------------------------------------------------------------- config errors
@pytest.mark.parametrize("argv, message", [
    (["--lr", "0"], "hpcpax.train: error: --lr must be > 0, not 0.0"),
    (["--sparse-lr", "0"], "hpcpax.train: error: --sparse-lr must be > 0, not 0.0"),
    (["--sparse-lr", "-1"], "hpcpax.train: error: --sparse-lr must be > 0, not -1.0"),
    (["--eval-fraction", "1"], "hpcpax.train: error: --eval-fraction must be < 1, not 1.0"),
])
def test_bad_learning_rates_are_refused_by_the_config_layer(argv, message, capsys):
    assert train_main(argv, comm=MPI.COMM_SELF) == 2
    assert capsys.readouterr().err.strip() == message


def test_learning_rate_errors_name_the_toml_key_and_config_key(tmp_path):
    (tmp_path / "run.toml").write_text("sparse_lr = 0\n")
    with pytest.raises(ConfigError) as info:
        load_toml(tmp_path / "run.toml")
    assert str(info.value) == f"{tmp_path / 'run.toml'}: sparse_lr must be > 0, not 0.0"
    with pytest.raises(ConfigError) as info:
        resolve({"lr": 0})
    assert str(info.value) == "lr must be > 0, not 0.0"


def test_vocab_size_below_the_file_vocabulary_is_refused_before_training(tmp_path, lm_file):
    with pytest.raises(ConfigError) as info:
        run(tmp_path, data=str(lm_file), vocab_size=100, steps=1)
    assert str(info.value) == (
        f"--data: {lm_file} has a vocabulary of 300 words (ids 0..299), more than "
        f"--vocab-size 100; leave --vocab-size out to take the file's, or give at least 300")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step ran


def test_help_shows_each_default_once():
    text = build_parser().format_help()
    assert "(default: the data file's, else 10000)" in " ".join(text.split())
    lines = " ".join(text.split()).split("--")
    assert not [line for line in lines if line.count("default") > 1]
    assert "(default None)" not in text and "(default: None)" not in text


def test_text_help_says_how_text_is_tokenized(capsys):
    with pytest.raises(SystemExit):
        data_main(["text", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert ("Tokenization: --tokenizer whitespace (the default) splits on runs of whitespace "
            "(str.split()), so punctuation stays attached to words") in text
    assert "For natural text use: --tokenizer words --lowercase." in text


# ------------------------------------------------------------ throughput, report
def test_steady_throughput_leaves_out_warm_up_and_plan_steps():
    records = [{"step": s, "seconds": 2.0 if s == 1 else (0.5 if s <= 6 else 0.1)}
               for s in range(1, 11)]
    unsteady = unsteady_steps({"plan": "auto", "plan_steps": 5, "steps": 10}, 1)
    result = steady_throughput(records, 100, unsteady)
    assert result["steps"] == "7-10" and result["num_steps"] == 4
    assert math.isclose(result["samples_per_s"], 1000.0)
    assert result["excluded"] == {"warm-up (first step of the run)": "1",
                                  "plan auto: measuring, then the first step on the plan": "2-6"}
    assert math.isclose(result["all_steps_samples_per_s"], 1000 / 4.9)  # 2 + 5 x 0.5 + 4 x 0.1 s


def test_summary_reports_steady_state_throughput_and_its_steps(tmp_path):
    trainer = run(tmp_path, steps=8, plan="auto", plan_steps=3, fabric_seconds=0.05)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    steady = [r for r in records if r["step"] >= 5]  # 1: warm-up, 1-3 measured, 4 first on plan
    assert summary["throughput"]["steps"] == "5-8"
    assert math.isclose(summary["mean_samples_per_s"],
                        12 * len(steady) / sum(r["seconds"] for r in steady))
    assert summary["mean_samples_per_s"] == trainer.summary["throughput"]["samples_per_s"]


def test_report_takes_perplexity_from_the_mean_loss(tmp_path, capsys):
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps({"step": 1, "loss": 7.0, "samples_per_s": 100.0, "seconds": 1.0}) + "\n"
        + json.dumps({"step": 1, "eval": {"loss": 6.227, "perplexity": 577.0}}) + "\n")
    (tmp_path / "config.json").write_text(json.dumps({"model": "lm", "global_batch": 100}))
    assert report.main([str(tmp_path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert f"last eval (step 1): loss=6.2270, perplexity={math.exp(6.227):.4f}" in out
