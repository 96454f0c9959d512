"""Helpers of the in-process training tests: one run directory for every rank,
a run, a value from the first worker, and parameters compared."""

import json
import os

import numpy as np

from hpcpax.app.trainer import Trainer


def shared_dir(comm, tmp_path, name):
    """A directory every rank sees: rank 0's tmp_path / name."""
    path = comm.bcast(str(tmp_path / name) if comm.Get_rank() == 0 else None, root=0)
    comm.Barrier()
    return path


def run_trainer(comm, config):
    """Train with ``config`` on ``comm`` (collecting the final parameters)."""
    trainer = Trainer(config, comm=comm, collect=True)
    trainer.run()
    return trainer


def first_worker(comm, trainer, value):
    """``value`` of the first worker, on every rank of ``comm``."""
    return comm.bcast(value, root=trainer.topology.worker_ranks[0])


def close(a, b, rtol=1e-10):
    """Whether two ``{"dense": ..., "sparse": ...}`` parameter sets agree to ``rtol``."""
    return all(np.allclose(a[part][k], b[part][k], rtol=rtol, atol=1e-12)
               for part in ("dense", "sparse") for k in a[part])


def metrics_lines(run_dir, key):
    """The lines of ``run_dir/metrics.jsonl`` that hold ``key``."""
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        return [r for r in map(json.loads, handle) if key in r]
