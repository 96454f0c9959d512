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


def relay_bytes(run_dir):
    return sum(r["bytes"].get("relay", {}).get("sent", 0)
               for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))
               if "step" in r and "bytes" in r)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_the_plan_decides_and_shows_hot_rows(comm, tmp_path):
    from hpcpax.plan import Plan
    from hpcpax.plan.hot_rows_cost import decide

    base = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    today = train(comm, os.path.join(base, "today"))
    # a plan file turns trees on for one variable: every group of 2 nodes (0 bytes)
    given = {"min_nodes": 2, "min_saved_bytes": [None, None, 0], "reason": "given"}
    plan = {"embedding": {"method": "ps", "hot_rows": given}}
    trainer = Trainer({**TINY, "plan": plan, "run_dir": os.path.join(base, "given")},
                      comm=comm, collect=True)
    trainer.run()
    root = trainer.topology.worker_ranks[0]
    trees = comm.bcast((trainer.losses, trainer.parameters), root=root)
    ok = today[0] == trees[0] and all(np.array_equal(today[1][p][k], trees[1][p][k])
                                      for p in ("dense", "sparse") for k in today[1][p])
    ok &= relay_bytes(os.path.join(base, "given")) > 0
    shown = Plan.load(os.path.join(base, "given", "plan.json")).variables
    ok &= shown["embedding"].hot_rows == given and shown["softmax_w"].hot_rows is None
    # --hot-rows off wins over HPCPAX_HOT_ROWS
    hpcpax.options.hot_rows, hpcpax.options.hot_rows_min_bytes = 2, 0
    try:
        Trainer({**TINY, "hot_rows": "off", "run_dir": os.path.join(base, "off")},
                comm=comm).run()
    finally:
        del hpcpax.options.hot_rows, hpcpax.options.hot_rows_min_bytes
    # hybrid: the cost model decides on the measured fabric, plan.json shows it
    Trainer({**TINY, "plan": "hybrid", "plan_steps": 2, "run_dir": os.path.join(base, "auto")},
            comm=comm).run()
    ok &= relay_bytes(os.path.join(base, "off")) == 0
    shown = Plan.load(os.path.join(base, "off", "plan.json")).variables
    ok &= all(v.hot_rows["min_nodes"] == 0 for v in shown.values() if v.kind == "sparse")
    auto = Plan.load(os.path.join(base, "auto", "plan.json"))
    nodes = comm.Get_size()  # one rank per node, every one a worker
    record = auto.search.get("hot_rows_trial", {"model": {}, "kept": False})
    for v in auto.variables.values():
        if v.kind == "sparse" and v.method == "ps":
            model = decide(nodes, v.shape[1] * np.dtype(v.dtype).itemsize, auto.fabric, nodes)
            # the model's trees are in force only where the trial kept them
            kept = record["kept"] and v.name in record["model"]
            ok &= ((v.hot_rows == model) if not model["min_nodes"] or kept
                   else (v.hot_rows["min_nodes"] == 0 and record["model"][v.name] == model))
            # a pair with the owner's node never pays: no tree on 2 nodes
            ok &= nodes > 2 or v.hot_rows["min_nodes"] == 0
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_the_trial_times_trees_on_and_off_and_keeps_the_faster(comm, tmp_path):
    """Plan hybrid with trees on (the fixed rule): 3 pairs of timed steps with and
    without them, the faster kept; the steps are ordinary training steps."""
    from hpcpax.plan import Plan

    base = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    steps = {"steps": 16, "plan": "hybrid", "plan_steps": 2}
    hpcpax.options.hot_rows, hpcpax.options.hot_rows_min_bytes = 2, 0
    try:
        seen = []
        trainer = Trainer({**TINY, **steps, "run_dir": os.path.join(base, "trial")},
                          comm=comm, collect=True, hooks=[lambda t, step: seen.append(step)])
        trainer.run()
        # the user's hooks see every step, the trial's too
        ok_hooks = not trainer.topology.is_worker or seen == list(range(1, 17))
        root = trainer.topology.worker_ranks[0]
        trial = comm.bcast((trainer.losses, trainer.parameters), root=root)
        short = Trainer({**TINY, **steps, "steps": 8, "run_dir": os.path.join(base, "short")},
                        comm=comm)
        short.run()  # 6 steps after the plan: one round of 4 steps fits, not 3
        tiny = Trainer({**TINY, **steps, "steps": 5, "run_dir": os.path.join(base, "tiny")},
                       comm=comm)
        tiny.run()  # 3 steps after the plan: no round fits, the trees are turned off
    finally:
        del hpcpax.options.hot_rows, hpcpax.options.hot_rows_min_bytes
    plain = Trainer({**TINY, **steps, "hot_rows": "off",
                     "run_dir": os.path.join(base, "off")}, comm=comm, collect=True)
    plain.run()
    plain = comm.bcast((plain.losses, plain.parameters), root=root)
    ok = ok_hooks and trial[0] == plain[0] and len(trial[0]) == 16
    ok &= all(np.array_equal(trial[1][p][k], plain[1][p][k])
              for p in ("dense", "sparse") for k in trial[1][p])
    plan = Plan.load(os.path.join(base, "trial", "plan.json"))
    record = plan.search["hot_rows_trial"]
    ok &= len(record["on_s"]) == len(record["off_s"]) == 3 and record["steps"] == [3, 14]
    ok &= record["kept"] == (np.median(record["on_s"]) < np.median(record["off_s"]))
    entry = plan.variables["embedding"].hot_rows  # what is in force after the trial
    ok &= (entry["min_nodes"] == 2) == record["kept"]
    short = Plan.load(os.path.join(base, "short", "plan.json"))
    ok &= short.search["hot_rows_trial"]["steps"] == [3, 6]
    ok &= len(short.search["hot_rows_trial"]["on_s"]) == 1
    tiny = Plan.load(os.path.join(base, "tiny", "plan.json"))
    ok &= tiny.search["hot_rows_trial"]["kept"] is False
    ok &= "3 steps left" in tiny.search["hot_rows_trial"]["skipped"]
    ok &= tiny.variables["embedding"].hot_rows["min_nodes"] == 0
    ok &= tiny.search["hot_rows_trial"]["model"]["embedding"]["min_nodes"] == 2
    # unverified trees never ran: no step after the plan relayed a row
    ok &= not any(r["bytes"].get("relay") for r in read_metrics(
        os.path.join(base, "tiny", "metrics.jsonl")) if r.get("step", 0) > 2 and "bytes" in r)
    # the trial's "on" steps relayed rows, its "off" steps did not
    lines = {r["step"]: r for r in read_metrics(os.path.join(base, "trial", "metrics.jsonl"))
             if "bytes" in r}
    relayed = [bool(lines[s]["bytes"].get("relay")) for s in range(3, 15)]
    ok &= relayed == [True, True, False, False] * 3
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_hot_rows_relays_from_the_flag_train_as_today(comm, tmp_path):
    """``--hot-rows relays``: the plan's entries take the relays' route, rows are relayed,
    and losses and parameters equal a run with hot rows off, bit for bit."""
    from hpcpax.plan import Plan

    base = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    steps = {"steps": 6, "plan": "hybrid", "plan_steps": 2, "hot_rows_trial": 0}
    hpcpax.options.hot_rows_relay_share = 0
    try:
        relays = Trainer({**TINY, **steps, "hot_rows": "relays",
                          "run_dir": os.path.join(base, "relays")}, comm=comm, collect=True)
        relays.run()
    finally:
        del hpcpax.options.hot_rows_relay_share
    root = relays.topology.worker_ranks[0]
    relays = comm.bcast((relays.losses, relays.parameters), root=root)
    plain = Trainer({**TINY, **steps, "hot_rows": "off", "run_dir": os.path.join(base, "off")},
                    comm=comm, collect=True)
    plain.run()
    plain = comm.bcast((plain.losses, plain.parameters), root=root)
    ok = relays[0] == plain[0] and len(relays[0]) == 6
    ok &= all(np.array_equal(relays[1][p][k], plain[1][p][k])
              for p in ("dense", "sparse") for k in relays[1][p])
    plan = Plan.load(os.path.join(base, "relays", "plan.json"))
    entry = plan.variables["embedding"].hot_rows
    ok &= entry["route"] == "relays" and entry["min_nodes"] == 2
    ok &= relay_bytes(os.path.join(base, "relays")) > 0
    ok &= relay_bytes(os.path.join(base, "off")) == 0
    assert comm.allreduce(bool(ok), op=MPI.LAND)
