"""Training with hot rows on: the same losses and parameters, relay bytes in metrics.jsonl."""

import os

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.app.metrics import read_metrics
from hpcpax.app.trainer import Trainer

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True, "steps": 5, "plan": "ps",
    "ranks_per_node": 1, "servers_per_node": 0,
}


def train(comm, run_dir):
    trainer = Trainer({**TINY, "run_dir": run_dir}, comm=comm, collect=True)
    trainer.run()
    root = trainer.topology.worker_ranks[0]
    return comm.bcast((trainer.losses, trainer.parameters), root=root)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_training_with_hot_rows_is_bitwise_today(comm, tmp_path):
    base = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    today = train(comm, os.path.join(base, "today"))
    hpcpax.options.hot_rows = 2
    hpcpax.options.hot_rows_min_bytes = 0
    try:
        trees = train(comm, os.path.join(base, "trees"))
    finally:
        del hpcpax.options.hot_rows, hpcpax.options.hot_rows_min_bytes
    ok = today[0] == trees[0]
    ok &= all(np.array_equal(today[1][part][k], trees[1][part][k])
              for part in ("dense", "sparse") for k in today[1][part])
    records = [r for r in read_metrics(os.path.join(base, "trees", "metrics.jsonl"))
               if "step" in r and "bytes" in r]
    ok &= sum(r["bytes"].get("relay", {}).get("sent", 0) for r in records) > 0
    ok &= all("relay" not in r.get("bytes", {})
              for r in read_metrics(os.path.join(base, "today", "metrics.jsonl")))
    assert comm.allreduce(bool(ok), op=MPI.LAND)
