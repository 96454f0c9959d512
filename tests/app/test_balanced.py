"""Balanced BSP (``--batch-shares``): uneven shares of the same global batch train like BSP.

Run serially or under ``mpirun -n N python -m mpi4py tests/mpi_pytest.py``;
each run is a tiny float64 model, so the module takes seconds.
"""

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app.trainer import Trainer
from hpcpax.errors import ConfigError
from trainer_runs import close, first_worker, run_trainer, shared_dir

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True, "dtype": "float64", "shuffle": True,
    "servers_per_node": 0,
}

#: Uneven shares of 12 samples for 1..4 workers (every worker reads a different count).
SHARES = {1: "12", 2: "9,3", 3: "7,3,2", 4: "6,3,2,1"}


def run(comm, **overrides):
    return run_trainer(comm, {**TINY, **overrides})


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("plan", ["ps", "allreduce"])
def test_forced_shares_equal_plain_bsp(comm, tmp_path, plan):
    """float64: fixed uneven shares give plain BSP's losses and parameters (round-off)."""
    config = {"steps": 6, "plan": plan}
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    shares = SHARES[comm.Get_size()]
    balanced = run(comm, run_dir=shared_dir(comm, tmp_path, "balanced"), batch_shares=shares,
                   **config)
    assert balanced.balance.shares == [int(s) for s in shares.split(",")]
    ok = (np.allclose(balanced.losses, plain.losses, rtol=1e-10)
          and close(balanced.parameters, plain.parameters))
    # and not by accident: a different global batch (other samples) trains differently
    other = run(comm, run_dir=shared_dir(comm, tmp_path, "other"), seed=7, **config)
    ok = ok and not np.allclose(other.losses, plain.losses, rtol=1e-6)
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(180)
def test_forced_shares_under_ssp0_equal_plain_bsp(comm, tmp_path):
    """Fixed shares under a relaxed model (the relaxed PS on a server rank): each
    worker reads its share and its gradient is weighted by it, so ``ssp:0`` (BSP's
    updates) with uneven shares gives plain BSP's parameters (float64 round-off)."""
    config = {"steps": 6, "plan": "ps", "servers_per_node": 1, "ranks_per_node": None}
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    shares = SHARES[comm.Get_size() - 1]
    relaxed = run(comm, run_dir=shared_dir(comm, tmp_path, "ssp0"), batch_shares=shares,
                  consistency="ssp:0", **config)
    ok = (relaxed.topology.is_server
          or relaxed.balance.shares == [int(s) for s in shares.split(",")])
    ok = ok and close(first_worker(comm, relaxed, relaxed.parameters),
                      first_worker(comm, plain, plain.parameters))
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_speed_shares_follow_a_straggler(comm, tmp_path):
    """--batch-shares speed with a 30x straggler (its compute is a small part of this tiny
    model's step: a smaller factor is lost in the noise of a loaded machine): the last
    worker's share shrinks, the run still equals plain BSP, and the decision is in
    metrics.jsonl and the checkpoint."""
    run_dir = shared_dir(comm, tmp_path, "speed")
    last = comm.Get_size() - 1
    config = {"steps": 8, "checkpoint_every": 8, "global_batch": 48}
    balanced = run(comm, run_dir=run_dir, batch_shares="speed", rebalance_every=3,
                   straggler=f"{last}:30", **config)
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    shares = balanced.balance.shares
    even = 48 // comm.Get_size()
    ok = shares[-1] < even and sum(shares) == 48 and len(balanced.balance.history) >= 1
    ok = ok and np.allclose(balanced.losses, plain.losses, rtol=1e-10)
    ok = ok and close(balanced.parameters, plain.parameters)
    if comm.Get_rank() == 0:
        with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
            decisions = [r["batch_shares"] for r in map(json.loads, handle)
                         if "batch_shares" in r]
        ok = ok and decisions and decisions[-1]["to"] == shares and all(d["step"] % 3 == 0 for d in decisions)
        from hpcpax.app.checkpoint_files import latest, read_meta
        ok = ok and read_meta(latest(run_dir))["batch_shares"]["shares"] == shares
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_shares_are_refused(comm, tmp_path):
    with pytest.raises(ConfigError, match="batch_shares must be"):
        Trainer({**TINY, "batch_shares": "4,x"}, comm=comm)
    with pytest.raises(ConfigError, match="batch_shares speed needs consistency bsp"):
        Trainer({**TINY, "batch_shares": "speed", "consistency": "ssp:2"}, comm=comm)
    with pytest.raises(ConfigError, match="batch_shares and consistency auto exclude"):
        Trainer({**TINY, "batch_shares": "speed", "consistency": "auto"}, comm=comm)
    with pytest.raises(ConfigError, match="summing to the global batch"):
        run(comm, run_dir=shared_dir(comm, tmp_path, "bad"), batch_shares="1," * 12 + "1",
            steps=1)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(180)
def test_trace_has_a_track_for_the_server(comm, tmp_path):
    """--trace with a server rank (--plan ps): the server's track holds the pulls and
    pushes it served, one of each per step and variable batch, inside the run."""
    from hpcpax.app.timeline import load_trace

    run_dir = shared_dir(comm, tmp_path, "served")
    path = os.path.join(run_dir, "trace.json")
    trainer = run(comm, run_dir=run_dir, steps=4, trace=path, servers_per_node=1, plan="ps")
    ok = True
    if comm.Get_rank() == 0:
        tracks = load_trace(path)
        with open(path, encoding="utf-8") as handle:
            events = json.load(handle)["traceEvents"]
        server = trainer.topology.server_ranks[0]
        served = [e for e in events if e["pid"] == server and e["ph"] == "X"]
        pulls = [e for e in served if e["name"].startswith("serve pull")]
        pushes = [e for e in served if e["name"].startswith("serve push")]
        ok = (sorted(tracks) == list(range(comm.Get_size()))
              and all({"data", "pull", "compute"} <= tracks[w]
                      for w in trainer.topology.worker_ranks)
              and len(pulls) >= 4 and len(pulls) == len(pushes)
              and all(e["dur"] >= 0 and e["ts"] >= 0 for e in served))
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(180)
def test_trace_holds_every_rank_phases(comm, tmp_path):
    """--trace: valid trace-event JSON with each worker's phases and barrier waits, one
    track per rank, and the balancing decision as an instant event; the report names it."""
    from hpcpax.app.report import summarize
    from hpcpax.app.timeline import PHASE_ORDER, load_trace

    run_dir = shared_dir(comm, tmp_path, "traced")
    path = os.path.join(run_dir, "trace.json")
    trainer = run(comm, run_dir=run_dir, steps=6, trace=path, batch_shares="speed",
                  rebalance_every=3, straggler=f"{comm.Get_size() - 1}:8")
    ok = True
    if comm.Get_rank() == 0:
        tracks = load_trace(path)
        with open(path, encoding="utf-8") as handle:
            events = json.load(handle)["traceEvents"]
        ok = sorted(tracks) == list(range(comm.Get_size()))
        ok = ok and all({"data", "pull", "compute", "dense", "optimizer"} <= names
                        for names in tracks.values())
        steps = {(e["pid"], e["args"]["step"]) for e in events if e.get("name") == "compute"}
        ok = ok and steps == {(r, s) for r in range(comm.Get_size()) for s in range(1, 7)}
        ok = ok and all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
        # each change of shares is an instant event on every worker's track (timing decides
        # whether there is one: test_speed_shares_follow_a_straggler checks that there is)
        instants = [(e["pid"], e["args"]["step"]) for e in events if e["ph"] == "i"]
        ok = ok and sorted(instants) == sorted(
            (r, d["step"]) for r in range(comm.Get_size()) for d in trainer.balance.history)
        ok = ok and set(PHASE_ORDER) >= {"data", "pull", "compute"}
        ok = ok and f"timeline: {path}" in summarize(run_dir)
    assert comm.allreduce(bool(ok), op=MPI.LAND)
