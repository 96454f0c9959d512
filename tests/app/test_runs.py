"""One-process runs: the CLI in a subprocess, SIGUSR1 preemption, ctr, the report.

These run serially; under mpirun each rank runs them alone on COMM_SELF.
"""

import json
import os
import signal
import subprocess
import sys

import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.preemption import EXIT_PREEMPTED
from hpcpax.app import report
from hpcpax.train import main
from hpcpax.app.trainer import Trainer

TINY = ["--vocab-size", "200", "--context", "3", "--emb-dim", "8", "--hidden", "16",
        "--out-dim", "8", "--num-sampled", "8", "--global-batch", "8",
        "--synthetic-samples", "3000", "--quiet"]


def test_cli_subprocess_writes_metrics(tmp_path):
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("a child MPI process cannot start inside an mpirun rank")
    run_dir = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    done = subprocess.run([sys.executable, "-m", "hpcpax.train", "--steps", "5",
                           "--run-dir", str(run_dir), *TINY], capture_output=True, text=True,
                          timeout=120, env=env)
    assert done.returncode == 0, done.stderr
    lines = [json.loads(t) for t in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [1, 2, 3, 4, 5]
    assert all(r["loss"] > 0 and r["samples_per_s"] > 0 and "time" in r for r in lines)
    for name in ("config.json", "plan.json", "summary.json"):
        assert (run_dir / name).is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps"] == 5 and summary["final_loss"] == lines[-1]["loss"]


def test_cli_bad_flag_value_exits_2(tmp_path, capsys):
    assert main(["--steps", "zero"], comm=MPI.COMM_SELF) == 2
    assert "steps" in capsys.readouterr().err or MPI.COMM_WORLD.Get_rank() != 0


def test_sigusr1_checkpoints_and_exits_with_the_preempted_status(tmp_path):
    def signal_at_3(trainer, step):
        if step == 3:
            os.kill(os.getpid(), signal.SIGUSR1)

    run_dir = tmp_path / "preempt"
    status = main(["--steps", "20", "--run-dir", str(run_dir), *TINY], comm=MPI.COMM_SELF,
                  hooks=[signal_at_3])
    assert status == EXIT_PREEMPTED == 3
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["preempted"] and summary["signal"] == "SIGUSR1" and summary["steps"] == 4
    assert ckpt.latest(run_dir).endswith("step_000004")
    ckpt.verify(ckpt.latest(run_dir))
    # the handler is gone again: the default SIGUSR1 action is back
    assert signal.getsignal(signal.SIGUSR1) in (signal.SIG_DFL, None)
    resumed = Trainer({"run_dir": str(run_dir), "resume": True, "steps": 6, "vocab_size": 200,
                       "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
                       "num_sampled": 8, "global_batch": 8, "synthetic_samples": 3000,
                       "quiet": True}, comm=MPI.COMM_SELF)
    assert resumed.run()["start_step"] == 5


def test_ctr_with_eval_and_report(tmp_path, capsys):
    run_dir = tmp_path / "ctr"
    trainer = Trainer({"model": "ctr", "n_fields": 3, "n_dense": 4, "table_rows": 50,
                       "emb_dim": 4, "steps": 6, "global_batch": 16, "eval_every": 3,
                       "synthetic_samples": 2000, "run_dir": str(run_dir), "quiet": True},
                      comm=MPI.COMM_SELF)
    trainer.run()
    records = [json.loads(t) for t in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [r["eval"] for r in records if "eval" in r]
    assert len(evals) == 2 and "auc" in evals[0] and "loss" in evals[0]
    assert report.main([str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert "loss: first" in out and "last eval" in out
    for name in ("loss.png", "throughput.png", "bytes.png"):
        assert (run_dir / name).stat().st_size > 1000
