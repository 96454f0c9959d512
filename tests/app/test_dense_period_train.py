"""``--dense-period``: dense replicas refreshed every ``k`` steps under a relaxed model.

Oracles: with one worker, local updates are exactly what the server does
with that worker's pushes, so any period gives the parameters of period 1
(and the measured divergence is ~0, so ``auto`` raises ``k`` to its
maximum); with two workers every change of ``k`` is in ``metrics.jsonl``,
``plan.json`` and the summary alike, and a checkpoint keeps the controller.
"""

import json
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app import report
from hpcpax.app.config import resolve
from hpcpax.app.trainer import Trainer
from hpcpax.errors import ConfigError

from trainer_runs import metrics_lines as lines, shared_dir

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True, "plan": "ps",
}


def run(comm, **overrides):
    trainer = Trainer({**TINY, **overrides}, comm=comm, collect=True)
    trainer.run()
    leader = trainer.topology.worker_ranks[0]
    return comm.bcast((trainer.parameters, trainer.losses, trainer.summary), root=leader)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_one_worker_any_period_gives_the_parameters_of_period_one(comm, tmp_path, all_ok):
    """1 server + 1 worker, ssp:0: periods 1, 4 and auto:4 end with the same
    parameters; auto sees ~0 divergence and doubles k."""
    sub = comm.Split(0 if comm.rank < 2 else MPI.UNDEFINED)
    ok, changes = True, None
    if sub != MPI.COMM_NULL:
        runs = {p: run(sub, steps=16, consistency="ssp:0", dense_period=p,
                       run_dir=shared_dir(sub, tmp_path, f"p{p.replace(':', '_')}"))
                for p in ("1", "4", "auto:4")}
        base = runs["1"][0]
        for period in ("4", "auto:4"):
            got = runs[period][0]
            ok = ok and all(np.allclose(base[part][k], got[part][k], rtol=1e-5, atol=1e-6)
                            for part in ("dense", "sparse") for k in base[part])
        record = runs["auto:4"][2]["dense_period"]
        changes = record["changes"]
        # the first refresh after a local step measures ~0 and doubles k (a
        # refresh's cost is unknown at k = 1); later changes also weigh the
        # measured cost of a refresh, which is the machine's
        ok = ok and changes[0]["k_from"] == 1 and changes[0]["k_to"] == 2
        ok = ok and all(c["divergence"] < 1e-5 for c in changes)
        ok = ok and runs["1"][2]["dense_period"] is None  # period 1: no local updates
        ok = ok and runs["1"][1][-1] < runs["1"][1][0]    # and the run moved
        sub.Free()
    assert all_ok(ok), changes if comm.rank < 2 else None


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(300)
def test_changes_are_logged_everywhere_and_survive_a_resume(comm, tmp_path, all_ok):
    """ssp:2, dense period auto (threshold from the default): every worker's k is
    in each metrics line; the changes in metrics.jsonl, plan.json and the summary
    agree; a checkpoint holds each worker's controller and the resumed run keeps
    its history and k."""
    run_dir = shared_dir(comm, tmp_path, "auto")
    first = run(comm, steps=12, checkpoint_every=12, consistency="ssp:2",
                dense_period="auto", run_dir=run_dir)[2]
    meta = ckpt.read_meta(ckpt.latest(run_dir))
    second = run(comm, steps=24, consistency="ssp:2", dense_period="auto", resume=True,
                 run_dir=run_dir)[2]
    workers = comm.size - 1
    ok, checks = True, None
    if comm.rank == 0:
        steps = [r for r in lines(run_dir, "loss") if "dense_k" in r]
        changes = [r["dense_period"] for r in lines(run_dir, "dense_period")]
        with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as handle:
            planned = json.load(handle)["runtime"]["dense_period"]
        record = second["dense_period"]
        states = meta["dense_period"]
        before = first["dense_period"]["changes"]
        checks = {
            "k in every line": len(steps) >= 24 and all(len(r["dense_k"]) == r["workers"]
                                                        for r in steps),
            "plan.json": planned == record and record["setting"] == "auto",
            "checkpoint": [s["k"] for s in states] == first["dense_period"]["final_k"]
            and len(states) == workers,
            # the resumed run keeps the first run's changes (listed by worker) ...
            "history kept": all(c in record["changes"] for c in before),
            # ... and metrics.jsonl has every change of both runs, in the same words
            "metrics": sorted(map(json.dumps, changes)) == sorted(map(json.dumps,
                                                                     record["changes"])),
            "trained": second["final_loss"] < first["first_loss"],
            # python -m hpcpax.report plots k and names the plot
            "report": report.main([run_dir]) == 0
            and os.path.getsize(os.path.join(run_dir, "dense_period.png")) > 0
            and "dense refresh period (auto)" in report.summarize(run_dir)}
        ok = all(checks.values())
    assert all_ok(ok), (checks if comm.rank == 0 else None, first["dense_period"])


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_relaxed_trace_has_worker_steps_and_server_requests(comm, tmp_path, all_ok):
    """--trace under ssp:0 with a 10x straggler: every worker's relaxed steps, each
    server's handled requests, and pulls the server held back for the bound."""
    from hpcpax.app.timeline import load_trace

    run_dir = shared_dir(comm, tmp_path, "traced")
    path = os.path.join(run_dir, "trace.json")
    summary = run(comm, steps=10, consistency="ssp:0", straggler=f"{comm.size - 1}:10",
                  dense_period="auto", trace=path, run_dir=run_dir)[2]
    ok, checks = True, None
    if comm.rank == 0:
        tracks = load_trace(path)
        with open(path, encoding="utf-8") as handle:
            events = json.load(handle)["traceEvents"]
        workers = range(1, comm.size)  # rank 0 is the server
        steps = {(e["pid"], e["args"]["step"]) for e in events if e.get("name") == "compute"}
        pushes = [e for e in events if e.get("name") == "serve push"]
        checks = {
            "tracks": summary["trace"] == path and sorted(tracks) == list(range(comm.size)),
            "worker phases": all({"data", "pull", "compute", "push", "optimizer"} <= tracks[w]
                                 for w in workers),
            "every step": steps == {(w, s) for w in workers for s in range(1, 11)},
            "server": {"serve pull", "serve push"} <= tracks[0],
            # every worker's every push was served once
            "pushes": len(pushes) == 10 * len(workers)
            and sorted({e["args"]["from"] for e in pushes}) == list(workers),
            # the 10x straggler holds the others' pulls back at the bound
            "pull waits": "pull waits" in tracks[0],
            "times": all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")}
        ok = all(checks.values())
    assert all_ok(ok), checks if comm.rank == 0 else None


def test_config_checks_the_dense_period():
    assert resolve({"consistency": "asp", "dense_period": "auto:16"})["dense_period"] == "auto:16"
    for overrides, message in (({"consistency": "ssp:1", "dense_period": "0"}, "dense_period"),
                               ({"consistency": "asp", "dense_period": "often"}, "dense_period"),
                               ({"dense_period": "4"}, "needs a relaxed consistency"),
                               ({"consistency": "auto", "dense_period": "auto"}, "not auto")):
        with pytest.raises(ConfigError, match=message):
            resolve(overrides)
