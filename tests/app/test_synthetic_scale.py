"""Synthetic data at 10^10 ids (issue 49): a run starts in bounded memory, and data that
cannot fit is refused in one line before anything is made."""

import subprocess
import sys

import pytest

from hpcpax.app.config import parse_args
from hpcpax.app.datasets import check_full_eval_memory, check_synthetic_memory
from hpcpax.data.synthetic import ctr_bytes, lm_bytes
from hpcpax.errors import ConfigError
from hpcpax.models import build_model

#: Runs one command and prints its peak RSS in KiB on the last line (Linux ru_maxrss).
PEAK_RSS = ("import resource, subprocess, sys; "
            "status = subprocess.run(sys.argv[1:]).returncode; "
            "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss); sys.exit(status)")


def peak_rss_run(tmp_path, *flags):
    """``python -m hpcpax.train FLAGS`` in one process: (status, stderr, peak RSS bytes)."""
    command = [sys.executable, "-c", PEAK_RSS, sys.executable, "-m", "hpcpax.train",
               "--quiet", "--run-dir", str(tmp_path / "run"), *flags]
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    return done.returncode, done.stderr, int(done.stdout.split()[-1]) * 1024


@pytest.mark.parametrize("flags, vocabulary_bytes", [
    (("--vocab-size", "10000000000", "--emb-dim", "4096"), 16 * 10**10),
    (("--model", "ctr", "--table-rows", "10000000000"), 16 * 10**10),
], ids=["lm", "ctr"])
def test_a_ten_billion_row_synthetic_run_trains_in_bounded_memory(tmp_path, flags,
                                                                  vocabulary_bytes):
    status, stderr, peak = peak_rss_run(tmp_path, *flags, "--steps", "2", "--plan", "ps",
                                        "--global-batch", "24")
    assert status == 0, stderr
    # the CDF of 10^10 ids and its weights took 160 GB; the run takes well under 1 GiB
    assert peak < 1 << 30, peak
    assert peak < vocabulary_bytes / 100


@pytest.mark.parametrize("flags, start, end", [
    (("--synthetic-samples", str(10**13)),
     "--synthetic-samples 10000000000000: synthetic lm data needs about 654.8 TiB per worker, "
     "654.8 TiB for the 1 worker of this node, more than the ",
     " available; give a smaller --synthetic-samples or a --data file"),
    # the full-softmax evaluation of 10^8 words took 23 GB and 593 s before the OOM killer
    (("--vocab-size", str(10**8), "--eval-every", "2"),
     "--eval-every 2: lm evaluation scores the full softmax, pulling every row of softmax_w "
     "and softmax_b (100000000 x 33) to each worker: about 13.8 GiB, above "
     "HPCPAX_REPLICA_MEMORY (4.0 GiB)",
     "; leave --eval-every at 0, give a smaller --vocab-size, or raise HPCPAX_REPLICA_MEMORY"),
], ids=["synthetic_samples", "full_eval"])
def test_what_cannot_fit_is_refused_in_one_line(tmp_path, flags, start, end):
    status, stderr, peak = peak_rss_run(tmp_path, *flags, "--steps", "2")
    lines = stderr.strip().splitlines()
    assert status == 1 and len(lines) == 1, stderr
    assert lines[0].startswith("hpcpax.train: error on rank 0: " + start)
    assert lines[0].endswith(end)
    assert peak < 1 << 30, peak  # refused before anything vocabulary-sized was made


def test_the_full_eval_check_holds_lm_evaluation_to_the_replica_memory(monkeypatch):
    monkeypatch.setenv("HPCPAX_REPLICA_MEMORY", "148M")  # 1 Mi words x (16 + 33 x 4) bytes
    config = parse_args(["--eval-every", "5"])
    check_full_eval_memory(build_model("lm", vocab_size=1 << 20), config)
    with pytest.raises(ConfigError, match=r"\(1048577 x 33\) to each worker: about 148.0 MiB"):
        check_full_eval_memory(build_model("lm", vocab_size=(1 << 20) + 1), config)
    check_full_eval_memory(build_model("lm", vocab_size=10**9), parse_args([]))  # no eval
    check_full_eval_memory(build_model("ctr", table_rows=10**9), config)  # ctr: batch rows only


def test_the_check_compares_every_worker_of_the_node_with_memavailable(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       4000000 kB\nMemAvailable:    1048576 kB\n")  # 1 GiB
    config = parse_args(["--synthetic-samples", "5000000"])
    model = build_model("lm", vocab_size=10_000)
    need = lm_bytes(5_000_000, 10_000)  # 72 bytes a token, the tables, 2 MiB: 346.4 MiB
    assert 3 * need > 1 << 30 > 2 * need
    check_synthetic_memory(model, config, 2, str(meminfo))
    with pytest.raises(ConfigError) as info:
        check_synthetic_memory(model, config, 3, str(meminfo))
    assert str(info.value) == (
        "--synthetic-samples 5000000: synthetic lm data needs about 346.4 MiB per worker, "
        "1.0 GiB for the 3 workers of this node, more than the 1.0 GiB available; give a "
        "smaller --synthetic-samples or a --data file")
    ctr = build_model("ctr", n_dense=13, n_fields=26, table_rows=10**10)
    config = parse_args(["--model", "ctr", "--synthetic-samples", "2000000"])
    assert 2 * ctr_bytes(2_000_000, 13, 26, [10**10] * 26) > 1 << 30
    with pytest.raises(ConfigError, match="synthetic ctr data needs about 826.0 MiB per worker"):
        check_synthetic_memory(ctr, config, 2, str(meminfo))
    check_synthetic_memory(ctr, {**config, "data": "file.h5"}, 2, str(meminfo))  # not synthetic
    check_synthetic_memory(ctr, config, 2, str(tmp_path / "missing"))  # no meminfo: no check
