"""Atomic checkpoints: a rank dying mid-write leaves the previous one intact and
``--resume`` continues bit-identically; damaged files raise CheckpointError
naming the file; ``--keep-checkpoints`` keeps K; files follow the umask.

The crash test starts its own ``mpirun -n 4`` and runs in the serial suite only.
"""

import json
import os
import signal
import time
import stat

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.preemption import EXIT_PREEMPTED
from hpcpax.errors import CheckpointError
from hpcpax.app.trainer import Trainer
from reliability_jobs import TINY, Job, run_job, serial_only

STEPS = 40
SMALL = {"model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
         "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
         "plan": "ps", "quiet": True}


def checkpoint_arrays(path):
    """Every array of a checkpoint, sparse rows put in global-id order."""
    params, state = ckpt.load_dense(path)
    out = {f"dense/{k}": v for k, v in params.items()}
    out.update({f"opt/{k}/{s}": v for k, slots in state.items() for s, v in slots.items()})
    pieces = {}
    for name in sorted(os.listdir(path)):
        if name.startswith("sparse_rank"):
            with h5py.File(os.path.join(path, name), "r") as f:
                for var in f:
                    ids = f[var]["ids"][...]
                    pieces.setdefault(f"{var}/table", []).append((ids, f[var]["table"][...]))
                    for slot in f[var]["row_state"]:
                        pieces.setdefault(f"{var}/{slot}", []).append(
                            (ids, f[var]["row_state"][slot][...]))
    for key, parts in pieces.items():
        ids = np.concatenate([i for i, _ in parts])
        out[key] = np.concatenate([v for _, v in parts])[np.argsort(ids)]
    return out


def losses(run_dir):
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if "loss" in r}


def assert_identical(path_a, path_b):
    a, b = checkpoint_arrays(path_a), checkpoint_arrays(path_b)
    assert sorted(a) == sorted(b)
    for key in a:
        assert np.array_equal(a[key], b[key]), f"{key} differs"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """4 ranks, STEPS steps, a checkpoint every 4: the reference run directory."""
    serial_only()
    tmp = tmp_path_factory.mktemp("uninterrupted")
    status, text = run_job(4, ["--steps", str(STEPS), "--checkpoint-every", "4",
                               "--keep-checkpoints", "0", "--run-dir", str(tmp / "run"), *TINY],
                           tmp)
    assert status == 0, text
    return tmp / "run"


@pytest.mark.timeout(240)
def test_rank_killed_mid_checkpoint_then_resume_is_bit_identical(tmp_path, uninterrupted):
    serial_only()
    run_dir = tmp_path / "run"
    args = ["--steps", str(STEPS), "--checkpoint-every", "4", "--run-dir", str(run_dir), *TINY]
    status, text = run_job(4, args, tmp_path, RELIABILITY_CRASH_IN_CHECKPOINT="8")
    print(f"--- crashed job: exit {status}\n{text[-1500:]}")
    assert status != 0
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [4]
    ckpt.verify(ckpt.latest(run_dir))  # the previous checkpoint is intact
    leftovers = [n for n in os.listdir(run_dir / "checkpoints") if ".tmp-" in n]
    assert leftovers and leftovers[0].startswith("step_000008")
    status, text = run_job(4, args + ["--resume"], tmp_path)
    assert status == 0, text
    assert_identical(os.path.join(uninterrupted, "checkpoints", ckpt.checkpoint_name(STEPS)),
                     ckpt.latest(run_dir))
    reference, resumed = losses(uninterrupted), losses(run_dir)
    assert all(resumed[s] == reference[s] for s in range(5, STEPS + 1))


def _tiny_run(run_dir, **overrides):
    trainer = Trainer({**SMALL, "run_dir": str(run_dir), **overrides}, comm=MPI.COMM_SELF)
    trainer.run()
    return trainer


@pytest.fixture
def one_checkpoint(tmp_path):
    run_dir = tmp_path / "run"
    _tiny_run(run_dir, steps=2, checkpoint_every=2)
    return run_dir, ckpt.latest(run_dir)


def _rewrite_manifest(path):
    """Make the manifest match the files again (a consistent but wrong checkpoint)."""
    manifest = ckpt.read_manifest(path)
    for name in manifest["files"]:
        manifest["files"][name] = ckpt._file_entry(os.path.join(path, name))
    with open(os.path.join(path, ckpt.MANIFEST), "w") as handle:
        json.dump(manifest, handle)


def _truncate(path, name):
    with open(os.path.join(path, name), "r+b") as handle:
        handle.truncate(100)


def _flip(path, name):
    with open(os.path.join(path, name), "r+b") as handle:
        handle.seek(-32, os.SEEK_END)
        tail = handle.read(32)
        handle.seek(-32, os.SEEK_END)
        handle.write(bytes(b ^ 0xFF for b in tail))  # (zeros could equal the padding there)


def _garble_manifest(path, name):
    with open(os.path.join(path, name), "w") as handle:
        handle.write('{"format": "hpcpax-checkpoint/1", "files": {')


def _wrong_format(path, name):
    with open(os.path.join(path, name), "w") as handle:
        json.dump({"format": "something-else", "files": {}}, handle)


def _remove(path, name):
    os.remove(os.path.join(path, name))


def _wrong_shape(path, name):
    with h5py.File(os.path.join(path, name), "r+") as f:
        first = sorted(f["params"])[0]
        shape = f["params"][first].shape
        del f["params"][first]
        f["params"].create_dataset(first, data=np.zeros(tuple(s + 1 for s in shape), "f4"))
    _rewrite_manifest(path)


def _wrong_dim(path, name):
    with h5py.File(os.path.join(path, name), "r+") as f:
        var = sorted(f)[0]
        table = f[var]["table"][...]
        del f[var]["table"]
        f[var].create_dataset("table", data=np.zeros((table.shape[0], table.shape[1] + 1), "f4"))
    _rewrite_manifest(path)


DAMAGE = {
    "truncated dense": (_truncate, "dense.h5", "truncated"),
    "corrupted sparse": (_flip, "sparse_rank0.h5", "sha256"),
    "missing file": (_remove, "dense.h5", "missing"),
    "garbled manifest": (_garble_manifest, ckpt.MANIFEST, "unreadable"),
    "foreign manifest": (_wrong_format, ckpt.MANIFEST, "not an hpcpax-checkpoint"),
    "missing meta": (_remove, "meta.json", "missing"),
    "wrong-shape dense dataset": (_wrong_shape, "dense.h5", "another shape"),
    "wrong-width sparse table": (_wrong_dim, "sparse_rank0.h5", "variable"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", DAMAGE, ids=list(DAMAGE))
def test_damaged_checkpoint_raises_naming_the_file(one_checkpoint, case):
    run_dir, path = one_checkpoint
    damage, victim, words = DAMAGE[case]
    damage(path, victim)
    with pytest.raises(CheckpointError, match=words) as info:
        ckpt.verify(path)  # what --resume checks first
        _resume_from(run_dir, path)
    assert victim in str(info.value) or "variable" in words, str(info.value)


def _resume_from(run_dir, path):
    """Resume through the trainer's own loading code."""
    original = ckpt.list_checkpoints
    ckpt.list_checkpoints = lambda _run_dir: [(1, path)]
    try:
        _tiny_run(run_dir, steps=3, resume=True)
    finally:
        ckpt.list_checkpoints = original


@pytest.mark.timeout(60)
@pytest.mark.parametrize("keep", [1, 2, 0])
def test_keep_checkpoints_keeps_k(tmp_path, keep):
    run_dir = tmp_path / "run"
    _tiny_run(run_dir, steps=5, checkpoint_every=1, keep_checkpoints=keep)
    steps = [s for s, _ in ckpt.list_checkpoints(run_dir)]
    assert steps == ([1, 2, 3, 4, 5][-keep:] if keep else [1, 2, 3, 4, 5])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("umask", [0o077, 0o022])
def test_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        run_dir = tmp_path / "run"
        _tiny_run(run_dir, steps=1, checkpoint_every=1)
    finally:
        os.umask(old)
    paths = [os.path.join(d, n) for d, dirs, files in os.walk(run_dir) for n in dirs + files]
    assert any(p.endswith(".h5") for p in paths)
    assert any(p.endswith("plan.json") for p in paths)
    for path in paths:
        mode = stat.S_IMODE(os.stat(path).st_mode)
        want = (0o777 if os.path.isdir(path) else 0o666) & ~umask  # what open/mkdir give
        assert mode == want, f"{path}: mode {oct(mode)} under umask {oct(umask)}"


@pytest.mark.timeout(240)
@pytest.mark.parametrize("signum", [signal.SIGUSR1, signal.SIGTERM, signal.SIGINT],
                         ids=["USR1", "TERM", "INT"])
def test_preemption_signal_to_every_rank_checkpoints_and_resumes(tmp_path, uninterrupted, signum):
    """As Slurm does (and Ctrl-C on mpirun): the signal reaches every rank, servers
    included; the run checkpoints and ends with the documented status 3."""
    serial_only()
    run_dir = tmp_path / "run"
    job = Job(4, ["--steps", "400", "--run-dir", str(run_dir), *TINY], tmp_path, limit=150)
    try:
        pids = job.pids()
        job.wait_for_step(run_dir, 3)
        for pid in pids.values():
            os.kill(pid, signum)
        sent = time.monotonic()
        status = job.wait(60)
        elapsed = time.monotonic() - sent
        text = job.output()
    finally:
        job.kill()
    print(f"--- {signal.Signals(signum).name}: exit {status} {elapsed:.1f} s after the signal")
    assert status == EXIT_PREEMPTED and elapsed < 30, (status, text)
    summary = json.loads((run_dir / "summary.json").read_text())
    stopped = summary["steps"]
    assert summary["preempted"] and summary["signal"] == signal.Signals(signum).name
    assert ckpt.latest(run_dir).endswith(ckpt.checkpoint_name(stopped))
    ckpt.verify(ckpt.latest(run_dir))
    if signum != signal.SIGUSR1 or stopped >= STEPS:
        return
    status, text = run_job(4, ["--steps", str(STEPS), "--checkpoint-every", "4", "--resume",
                               "--run-dir", str(run_dir), *TINY], tmp_path)
    assert status == 0, text
    assert_identical(os.path.join(uninterrupted, "checkpoints", ckpt.checkpoint_name(STEPS)),
                     ckpt.latest(run_dir))
