"""The Trainer end to end, in-process: learning, resume, BSP equivalence, checkpoints.

Run serially (1 rank) or under ``mpirun -n 4 python -m mpi4py -m pytest
--with-mpi``; every run uses a tiny model so the module takes seconds.
"""

import os
import shutil

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.errors import CheckpointError
from hpcpax.app.trainer import Trainer
from trainer_runs import run_trainer, shared_dir

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True,
}


def run(comm, **overrides):
    return run_trainer(comm, {**TINY, **overrides})


def final_parameters(comm, trainer):
    """The first worker's final parameters, on every rank of ``comm``."""
    return comm.bcast(trainer.parameters, root=trainer.topology.worker_ranks[0])


def same(a, b, exact=True, rtol=1e-5):
    compare = np.array_equal if exact else (lambda x, y: np.allclose(x, y, rtol=rtol, atol=1e-7))
    return all(compare(a[part][k], b[part][k]) for part in ("dense", "sparse") for k in a[part])


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """30 steps without a break; its parameters on every rank."""
    comm = MPI.COMM_WORLD
    trainer = run(comm, steps=30, run_dir=shared_dir(comm, tmp_path_factory.mktemp("a"), "a"))
    return final_parameters(comm, trainer), comm.bcast(trainer.losses, root=trainer.topology.worker_ranks[0])


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_loss_falls(comm, uninterrupted):
    losses = uninterrupted[1]
    assert len(losses) == 30
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


@pytest.fixture(scope="module")
def stopped_at_15(tmp_path_factory):
    """A run stopped after step 15 with a checkpoint; two copies of its run directory."""
    comm = MPI.COMM_WORLD
    base = shared_dir(comm, tmp_path_factory.mktemp("b"), "b")
    run(comm, steps=15, checkpoint_every=15, run_dir=base)
    if comm.Get_rank() == 0:
        shutil.copytree(base, base + "-copy")
    comm.Barrier()
    return base, base + "-copy"


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_resume_is_bit_identical(comm, stopped_at_15, uninterrupted):
    run_dir = stopped_at_15[0]
    assert ckpt.latest(run_dir).endswith("step_000015")
    resumed = run(comm, steps=30, resume=True, run_dir=run_dir)
    assert comm.allreduce(resumed.summary.get("start_step", 16) == 16, op=MPI.LAND)
    # the measured plan came from plan.json: no calibration (a fresh auto run has one)
    fresh = run(comm, steps=1, run_dir=run_dir + "-fresh")
    holds_plan = resumed.topology.is_server or resumed.engine.planning.plan is not None
    assert comm.allreduce(resumed.engine.planning.params is None and holds_plan
                          and fresh.engine.planning.params is not None, op=MPI.LAND)
    assert same(final_parameters(comm, resumed), uninterrupted[0], exact=True)
    if comm.Get_rank() == 0:  # metrics.jsonl holds each step once
        from hpcpax.app.metrics import read_metrics

        steps = [r["step"] for r in read_metrics(os.path.join(run_dir, "metrics.jsonl"))]
        assert steps == list(range(1, 31))


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_resume_with_other_server_count(comm, stopped_at_15, uninterrupted):
    """Rows are restored by global id: 1 server per node -> none, other partitions."""
    resumed = run(comm, steps=30, resume=True, run_dir=stopped_at_15[1], servers_per_node=0,
                  plan={"embedding": {"method": "ps", "partitions": 3}})
    assert same(final_parameters(comm, resumed), uninterrupted[0], exact=False)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_one_rank_equals_n_ranks(comm, tmp_path):
    """Same global batch, float64: the world run equals a 1-rank run on COMM_SELF."""
    config = {"steps": 6, "dtype": "float64"}
    world = run(comm, run_dir=shared_dir(comm, tmp_path, "world"), **config)
    world_losses = comm.bcast(world.losses, root=world.topology.worker_ranks[0])
    single = run(MPI.COMM_SELF, run_dir=str(tmp_path / f"self{comm.Get_rank()}"),
                 servers_per_node=0, **config)
    assert comm.allreduce(bool(np.allclose(single.losses, world_losses, rtol=1e-10)),
                          op=MPI.LAND)
    assert same(single.parameters, final_parameters(comm, world), exact=False, rtol=1e-9)


def repartition_at_2(trainer, step):
    if step == 2:
        trainer.repartition("softmax_w", 5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan", ["allgather", "allreduce", "repartition"])
def test_sync_methods_train_alike(comm, tmp_path, uninterrupted, plan):
    """allgather / allreduce methods and a live repartition give the ps run's losses."""
    hooks = [repartition_at_2] if plan == "repartition" else []
    trainer = Trainer({**TINY, "steps": 6, "run_dir": shared_dir(comm, tmp_path, plan),
                       "plan": "ps" if plan == "repartition" else plan}, comm=comm, hooks=hooks)
    trainer.run()
    losses = comm.bcast(trainer.losses, root=trainer.topology.worker_ranks[0])
    assert np.allclose(losses, uninterrupted[1][:6], rtol=1e-5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_corrupted_checkpoint_names_the_file(comm, tmp_path):
    run_dir = shared_dir(comm, tmp_path, "d")
    run(comm, steps=2, checkpoint_every=1, keep_checkpoints=1, run_dir=run_dir)
    found = ckpt.list_checkpoints(run_dir)
    assert [step for step, _ in found] == [2]  # keep_checkpoints=1 pruned step 1
    path = found[-1][1]
    victim = sorted(f for f in os.listdir(path) if f.startswith("sparse_rank"))[0]
    comm.Barrier()
    if comm.Get_rank() == 0:
        with open(os.path.join(path, victim), "r+b") as handle:
            handle.seek(-64, os.SEEK_END)
            handle.write(b"\xff" * 64)
    comm.Barrier()
    with pytest.raises(CheckpointError, match=victim):
        run(comm, steps=3, resume=True, run_dir=run_dir)
    comm.Barrier()
    if comm.Get_rank() == 0:  # a truncated file and a missing manifest
        with open(os.path.join(path, "dense.h5"), "r+b") as handle:
            handle.truncate(100)
        with pytest.raises(CheckpointError, match="dense.h5"):
            ckpt.verify(path)
        os.remove(os.path.join(path, ckpt.MANIFEST))
        assert ckpt.latest(run_dir) is None
    comm.Barrier()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_cpu_seconds_are_reported_per_worker_and_per_rank(comm, tmp_path):
    """metrics.jsonl: each worker's CPU seconds of each step (and busy fraction);
    summary.json: every rank's CPU seconds over the run, servers included."""
    import json

    from hpcpax.app.metrics import read_metrics

    run_dir = shared_dir(comm, tmp_path, "cpu")
    trainer = run(comm, steps=6, run_dir=run_dir)
    ok = True
    if trainer.is_leader:
        workers = trainer.topology.num_workers
        steps = [r for r in read_metrics(os.path.join(run_dir, "metrics.jsonl")) if "loss" in r]
        ok = len(steps) == 6 and all(
            len(r["cpu_seconds"]) == workers and len(r["cpu_busy"]) == workers
            and all(0 < c < 10 * r["seconds"] + 1 for c in r["cpu_seconds"])
            and all(b == pytest.approx(c / r["seconds"], rel=1e-3, abs=1e-4)
                    for b, c in zip(r["cpu_busy"], r["cpu_seconds"])) for r in steps)
        with open(os.path.join(run_dir, "summary.json")) as f:
            summary = json.load(f)
        ok = ok and len(summary["cpu_seconds"]) == comm.Get_size() and \
            all(c > 0 for c in summary["cpu_seconds"]) and \
            summary["cpu_busy"][0] == pytest.approx(summary["cpu_seconds"][0]
                                                    / summary["wall_seconds"], rel=1e-2)
    assert comm.allreduce(bool(ok), op=MPI.LAND)
