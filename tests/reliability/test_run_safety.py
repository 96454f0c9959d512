"""Nothing lost, nothing silently wrong: run directories, disks, damaged and linked checkpoints.

Each test reproduces a case of issue 12 in-process (one rank, ``COMM_SELF``).
"""

import json
import os
import shutil
import signal
import stat
import subprocess

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.metrics import read_metrics
from hpcpax.app.trainer import Trainer
from hpcpax.data import write_lm
from hpcpax.errors import CheckpointError, ConfigError, DataError, MismatchError

SMALL = {"model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
         "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
         "plan": "ps", "quiet": True}


def run(run_dir, **config):
    trainer = Trainer({**SMALL, "run_dir": str(run_dir), **config}, comm=MPI.COMM_SELF)
    trainer.run()
    return trainer


# ---------------------------------------------------------------- 1. run dirs
def test_a_run_directory_holding_a_run_is_never_restarted(tmp_path):
    run_dir = tmp_path / "run"
    run(run_dir, steps=3, checkpoint_every=3)
    lines = (run_dir / "metrics.jsonl").read_text()
    with pytest.raises(ConfigError, match=r"already holds a run \(metrics up to step 3, "
                                          r"checkpoints up to step 3, summary.json\); pass "
                                          r"--resume to continue it, --overwrite"):
        run(run_dir, steps=5)
    assert (run_dir / "metrics.jsonl").read_text() == lines  # untouched
    resumed = run(run_dir, steps=5, resume=True)
    assert resumed.summary["start_step"] == 4
    assert (run_dir / "metrics.jsonl").read_text().startswith(lines)  # appended, never cut
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1, 2, 3, 4, 5]


def test_resume_without_a_checkpoint_is_refused_and_overwrite_keeps_the_old_run(tmp_path):
    run_dir = tmp_path / "run"
    run(run_dir, steps=2)  # no checkpoint_every: metrics, no checkpoint
    with pytest.raises(ConfigError, match=r"resume: run directory .* holds a run \(metrics up "
                                          r"to step 2, summary.json\) but no complete "
                                          r"checkpoint to continue from"):
        run(run_dir, steps=4, resume=True)
    run(run_dir, steps=1, overwrite=True)
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("run.replaced-")]
    assert len(kept) == 1 and len(read_metrics(kept[0] / "metrics.jsonl")) == 2
    assert [r["step"] for r in read_metrics(run_dir / "metrics.jsonl")] == [1]
    with pytest.raises(ConfigError, match="resume and overwrite exclude each other"):
        run(run_dir, resume=True, overwrite=True)


def test_a_new_run_directory_with_resume_starts_at_step_1(tmp_path):
    assert run(tmp_path / "fresh", steps=2, resume=True).summary["start_step"] == 1


def test_resumed_metrics_supersede_the_steps_after_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.0},
        {"resumed_at": 2}, {"step": 3, "loss": 1.5}]))
    assert [(r["step"], r["loss"]) for r in read_metrics(path)] == [(1, 3.0), (2, 2.0), (3, 1.5)]
    assert len(read_metrics(path, raw=True)) == 5


# ----------------------------------------------------------- 2. signal in set-up
def test_a_signal_during_set_up_is_honoured_at_the_first_step(tmp_path, monkeypatch):
    import hpcpax.app.trainer as trainer_module

    opened = trainer_module.open_data

    def signal_while_opening(model, config):  # the last set-up phase
        os.kill(os.getpid(), signal.SIGUSR1)
        return opened(model, config)

    monkeypatch.setattr(trainer_module, "open_data", signal_while_opening)
    trainer = run(tmp_path / "run", steps=20)
    assert trainer.preempted and trainer.summary["steps"] == 1
    assert ckpt.latest(tmp_path / "run").endswith("step_000001")


# -------------------------------------------------------------------- 3. disks
def _mount_tmpfs(path, options):
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    path.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def _umount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def test_a_read_only_checkpoint_directory_is_found_at_start_up(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    _mount_tmpfs(run_dir / "checkpoints", "size=1m,ro")
    try:
        with pytest.raises(CheckpointError, match=r"cannot write checkpoints into .*checkpoints: "
                                                  r"Read-only file system"):
            run(run_dir, steps=3)
        assert not (run_dir / "metrics.jsonl").exists()  # refused before the first step
    finally:
        _umount(run_dir / "checkpoints")


def test_no_room_for_a_checkpoint_is_found_at_start_up(tmp_path):
    run_dir = tmp_path / "run"
    _mount_tmpfs(run_dir, "size=64k")
    try:
        with pytest.raises(CheckpointError, match=r"no room for a checkpoint in .*: one needs "
                                                  r"about .* the file system has .* free"):
            run(run_dir, steps=3, vocab_size=20000)  # ~2 MB of sparse rows and state
    finally:
        _umount(run_dir)


def test_a_failed_write_is_one_clear_error_and_keeps_the_previous_checkpoint(tmp_path,
                                                                              monkeypatch):
    run_dir = tmp_path / "run"
    run(run_dir, steps=2, checkpoint_every=2)
    write = ckpt._write_sparse

    def disk_full(path, variables):
        write(path, variables)
        raise RuntimeError("Can't write data (file write failed: errno = 28, No space left)")

    monkeypatch.setattr(ckpt, "_write_sparse", disk_full)
    with pytest.raises(CheckpointError, match=r"^checkpoint after step 4 not written: rank 0 "
                                              r"could not write .*step_000004.tmp-.*/sparse_"
                                              r"rank0.h5: Can't write data .*; the previous "
                                              r"checkpoint is intact$"):
        run(run_dir, steps=4, checkpoint_every=2, resume=True)
    monkeypatch.setattr(ckpt, "_write_sparse", write)
    ckpt.verify(ckpt.latest(run_dir))
    assert ckpt.latest(run_dir).endswith("step_000002")
    stale = [n for n in os.listdir(run_dir / "checkpoints") if ".tmp-" in n]
    assert stale  # what a crashed save leaves; the next start removes it
    trainer = run(run_dir, steps=4, checkpoint_every=2, resume=True)
    assert trainer.summary["start_step"] == 3
    assert not [n for n in os.listdir(run_dir / "checkpoints") if ".tmp-" in n]


# ------------------------------------------------------- 4. damaged checkpoints
def test_a_damaged_newest_checkpoint_falls_back_to_the_previous_one(tmp_path, capsys):
    run_dir = tmp_path / "run"
    run(run_dir, steps=4, checkpoint_every=2, keep_checkpoints=0)
    newest = ckpt.latest(run_dir)
    with open(os.path.join(newest, "dense.h5"), "r+b") as handle:
        handle.seek(-32, os.SEEK_END)
        handle.write(b"\xff" * 32)
    trainer = run(run_dir, steps=6, resume=True, quiet=False)
    assert trainer.summary["start_step"] == 3
    out = capsys.readouterr().out
    assert f"resume: WARNING: skipping damaged checkpoint {newest}" in out and "dense.h5" in out


# ----------------------------------------------------------------- 7. links
def _reseal(path):
    """Recompute the manifest's sums, as an attacker able to write the directory would."""
    manifest = json.loads((path / ckpt.MANIFEST).read_text())
    for name in manifest["files"]:
        manifest["files"][name] = ckpt._file_entry(path / name)
    (path / ckpt.MANIFEST).write_text(json.dumps(manifest))


def test_links_in_a_checkpoint_are_refused_even_with_a_matching_manifest(tmp_path):
    run_dir = tmp_path / "run"
    run(run_dir, steps=2, checkpoint_every=2)
    path = tmp_path / "run" / "checkpoints" / "step_000002"
    other = tmp_path / "other.h5"
    with h5py.File(path / "dense.h5", "r") as f:
        name = next(iter(f["params"]))
        with h5py.File(other, "w") as g:
            g["w"] = np.full(f["params"][name].shape, 7.0, f["params"][name].dtype)
    with h5py.File(path / "dense.h5", "r+") as f:
        del f["params"][name]
        f["params"][name] = h5py.ExternalLink(str(other), "w")
    _reseal(path)
    ckpt.verify(path)  # the sums match: only the link is hashed
    with pytest.raises(CheckpointError, match=rf"dense.h5: 'params/{name}' is a ExternalLink "
                                              rf"to .*other.h5"):
        ckpt.load_dense(path)


def test_a_sparse_file_the_manifest_does_not_list_is_never_read(tmp_path):
    run_dir = tmp_path / "run"
    run(run_dir, steps=2, checkpoint_every=2)
    path = tmp_path / "run" / "checkpoints" / "step_000002"
    victim = sorted(p for p in path.iterdir() if p.name.startswith("sparse_rank"))[0]
    held, rows, _, _ = ckpt.load_matching(path, "embedding", lambda ids: ids >= 0)
    shutil.copy(victim, path / "sparse_rank99.h5")  # the same rows again, unlisted
    ids, table, _, _ = ckpt.load_matching(path, "embedding", lambda ids: ids >= 0)  # else "twice"
    assert len(held) > 0 and np.array_equal(ids, held) and np.array_equal(table, rows)


# --------------------------------------------------------------- 9. data moved
def test_resume_follows_the_data_file_content_not_its_path(tmp_path):
    rng = np.random.default_rng(0)
    vocab = ["<unk>"] + [f"w{i}" for i in range(299)]
    first = tmp_path / "a.h5"
    write_lm(first, rng.integers(0, 300, 5000), vocab)
    run_dir = tmp_path / "run"
    config = {**SMALL, "data": str(first)}
    config.pop("synthetic_samples")
    Trainer({**config, "run_dir": str(run_dir), "steps": 2, "checkpoint_every": 2},
            comm=MPI.COMM_SELF).run()
    moved = tmp_path / "moved.h5"
    os.rename(first, moved)
    resumed = Trainer({**config, "data": str(moved), "run_dir": str(run_dir), "steps": 3,
                       "resume": True}, comm=MPI.COMM_SELF)
    resumed.run()
    assert resumed.summary["start_step"] == 3
    write_lm(moved, rng.integers(0, 300, 5000), vocab)  # same path, other content
    with pytest.raises(MismatchError, match=r"data file .*moved.h5 has other content"):
        Trainer({**config, "data": str(moved), "run_dir": str(run_dir), "steps": 4,
                 "resume": True}, comm=MPI.COMM_SELF).run()


def test_resume_with_other_flags_names_each_setting_as_given(tmp_path):
    """A changed flag is named with both values; a flag not given reads as unset."""
    config = {k: v for k, v in SMALL.items() if k != "emb_dim"}
    run_dir = tmp_path / "run"
    Trainer({**config, "run_dir": str(run_dir), "steps": 2, "checkpoint_every": 2},
            comm=MPI.COMM_SELF).run()
    for changed, message in (({"emb_dim": 8}, r"emb_dim=unset \(its default\) "
                                               r"there, 8 now"),
                             ({"hidden": [32]}, r"hidden=\[16\] there, \[32\] now")):
        with pytest.raises(MismatchError, match=message):
            Trainer({**config, **changed, "run_dir": str(run_dir), "steps": 3,
                     "resume": True}, comm=MPI.COMM_SELF).run()


def test_plan_json_follows_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        run(tmp_path / "run", steps=1)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "plan.json").st_mode) == 0o644


# ------------------------------------------------------------- 5. invalid data
CTR = {"model": "ctr", "n_dense": 2, "n_fields": 2, "emb_dim": 4, "global_batch": 8,
       "plan": "ps", "quiet": True, "shuffle": False}


def _ctr_file(path, categorical=None, label=None, cardinality=(50, 50), rows=64):
    """An ``hpcpax-ctr/1`` file written with h5py (the converters refuse bad values)."""
    rng = np.random.default_rng(1)
    categorical = rng.integers(0, 50, (rows, 2)) if categorical is None else categorical
    label = rng.integers(0, 2, rows).astype(np.float32) if label is None else label
    with h5py.File(path, "w") as f:
        f.attrs.update({"format": "hpcpax-ctr/1", "n_dense": 2, "n_fields": 2,
                        "cardinality": np.asarray(cardinality, np.int64)})
        f["label"] = np.asarray(label, np.float32)
        f["dense"] = rng.normal(size=(rows, 2)).astype(np.float32)
        f["categorical"] = np.asarray(categorical, np.int64)
    return str(path)


def _train_ctr(tmp_path, data, **config):
    return Trainer({**CTR, "data": data, "run_dir": str(tmp_path / f"ctr{len(os.listdir(tmp_path))}"),
                    "steps": 6, **config}, comm=MPI.COMM_SELF).run()


@pytest.mark.parametrize("where, value, words", [
    ((13, 1), -3, r"categorical id -3 at row 13, field 1 is negative"),
    ((21, 0), 50, r"categorical id 50 at row 21, field 0 is not below the file's cardinality 50"),
])
def test_bad_ctr_ids_are_data_errors_naming_file_row_and_field(tmp_path, where, value, words):
    categorical = np.ones((64, 2), np.int64)
    categorical[where] = value
    with pytest.raises(DataError, match=r"bad.h5: " + words):
        _train_ctr(tmp_path, _ctr_file(tmp_path / "bad.h5", categorical))


@pytest.mark.parametrize("value", [1.5, float("nan")])
def test_a_bad_label_is_a_data_error_not_a_nonfinite_gradient(tmp_path, value):
    label = np.zeros(64, np.float32)
    label[30] = value
    with pytest.raises(DataError, match=rf"label {value} at row 30 is not in \[0, 1\]"):
        _train_ctr(tmp_path, _ctr_file(tmp_path / "label.h5", label=label))


def test_the_files_cardinality_sizes_the_tables_and_is_never_folded_silently(tmp_path):
    data = _ctr_file(tmp_path / "wide.h5", cardinality=(1_048_576, 50))
    trainer = Trainer({**CTR, "data": data, "run_dir": str(tmp_path / "a"), "steps": 2},
                      comm=MPI.COMM_SELF)
    trainer.run()
    assert list(trainer.model.table_rows) == [1_048_576, 50]  # the file's id spaces
    with pytest.raises(ConfigError, match=r"wide.h5 has ids up to 1048575 in field 0 "
                                          r"\(cardinality 1048576\), but --table-rows gives it "
                                          r"10000 rows: .* or --hash-ids"):
        _train_ctr(tmp_path, data, table_rows=[10_000])
    folded = _train_ctr(tmp_path, data, table_rows=[10_000], hash_ids=True)
    assert folded["final_loss"] is not None


def test_an_lm_token_out_of_range_names_the_file_and_position(tmp_path):
    tokens = np.arange(400) % 300
    vocab = ["<unk>"] + [f"w{i}" for i in range(299)]
    write_lm(tmp_path / "lm.h5", tokens, vocab)
    with h5py.File(tmp_path / "lm.h5", "r+") as f:  # the converters refuse to write this
        f["tokens"][157] = 300  # the file says vocab_size 300
    config = {**SMALL, "data": str(tmp_path / "lm.h5"), "shuffle": False}
    config.pop("synthetic_samples")
    with pytest.raises(DataError, match=r"lm.h5: token id 300 at position 157 is not in "
                                        r"\[0, 300\)"):
        Trainer({**config, "run_dir": str(tmp_path / "run"), "steps": 20},
                comm=MPI.COMM_SELF).run()


def test_a_link_in_a_data_file_is_refused_at_open(tmp_path):
    tokens = np.arange(400) % 300
    vocab = ["<unk>"] + [f"w{i}" for i in range(299)]
    write_lm(tmp_path / "other.h5", tokens, vocab)
    write_lm(tmp_path / "lm.h5", tokens, vocab)
    with h5py.File(tmp_path / "lm.h5", "r+") as f:
        del f["tokens"]
        f["tokens"] = h5py.ExternalLink(str(tmp_path / "other.h5"), "tokens")
    from hpcpax.data import open_dataset

    with pytest.raises(DataError, match=r"lm.h5: 'tokens' is a ExternalLink to .*other.h5:"
                                        r"tokens'; data files hold plain datasets only"):
        open_dataset(str(tmp_path / "lm.h5"), "lm", context=3)


# ---------------------------------------------------------- 6. dense memory
def test_dense_layers_above_the_replica_budget_are_refused_before_allocation(tmp_path,
                                                                              monkeypatch):
    from hpcpax.app.build import check_dense_memory

    # float32 layers of 1,000,000 + 1,000 values; adagrad: 1 slot -> params, grads and
    # slot = 3 x 4,004,000 B, plus a fusion buffer for b1 only (w1 is >= DIRECT_BYTES,
    # reduced in place): 12,016,000 B
    shapes = {"w1": (1000, 1000), "b1": (1000,)}
    monkeypatch.setenv("HPCPAX_REPLICA_MEMORY", "12016000")
    check_dense_memory(shapes, "float32", 1)  # exactly fits
    monkeypatch.setenv("HPCPAX_REPLICA_MEMORY", "12015999")
    with pytest.raises(ConfigError, match=r"dense layers need 11\.5 MiB on every worker .*"
                                          r"1 optimizer slots.*largest: w1 \(1000, 1000\)"):
        check_dense_memory(shapes, "float32", 1)
    # the trainer refuses a huge --context (here the largest one) before it allocates anything
    monkeypatch.setenv("HPCPAX_REPLICA_MEMORY", "64M")
    with pytest.raises(ConfigError, match=r"dense layers need .* above HPCPAX_REPLICA_MEMORY "
                                          r"\(64\.0 MiB\): reduce --hidden/--context"):
        run(tmp_path / "run", steps=1, context=65_536, emb_dim=8, hidden=[64])
