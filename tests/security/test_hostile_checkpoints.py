"""Hostile checkpoint files (issue 70, item 4): refused, named, the older checkpoint used.

Anyone who can write a run directory can rewrite a checkpoint's files and
hash ``MANIFEST.json`` again, so the hashes pass. Each case here does that
to the newest of two checkpoints (in-process, with h5py, the manifest
hashed as :mod:`hpcpax.app.checkpoint_files` does), then ``--resume``s a
one-rank run in-process: the damaged checkpoint must be skipped with one
line naming what is wrong, and the run must continue from the older one.
"""

import json
import os
import shutil

import h5py
import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.trainer import Trainer

SMALL = {"model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
         "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
         "plan": "ps", "quiet": True}
#: The host file an external dataset points at (what the issue's attacker read).
HOST_FILE = "/etc/passwd"


def _run(run_dir, **overrides):
    trainer = Trainer({**SMALL, "run_dir": str(run_dir), **overrides}, comm=MPI.COMM_SELF)
    trainer.run()
    return trainer


@pytest.fixture(scope="module")
def two_checkpoints(tmp_path_factory):
    """A run directory with the checkpoints of steps 2 and 4 (adam dense, adagrad rows)."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("in-process one-rank runs; serial suite only")
    run_dir = tmp_path_factory.mktemp("pristine") / "run"
    _run(run_dir, steps=4, checkpoint_every=2)
    assert [s for s, _ in ckpt.list_checkpoints(run_dir)] == [2, 4]
    return run_dir


def rehash(path):
    """Make ``path``'s manifest match its files again, as the checkpoint writer does."""
    manifest = ckpt.read_manifest(path)
    manifest["files"] = {name: ckpt._file_entry(os.path.join(path, name))
                         for name in manifest["files"]}
    with open(os.path.join(path, ckpt.MANIFEST), "w", encoding="utf-8") as handle:
        json.dump(manifest, handle)


def _replace(path, file_name, dataset, make):
    """Replace ``dataset`` of ``file_name`` by ``make(group, name, old values)``."""
    with h5py.File(os.path.join(path, file_name), "r+") as f:
        group_name, _, name = dataset.rpartition("/")
        group = f[group_name]
        old = group[name][...]
        del group[name]
        make(group, name, old)


def external_storage(path):
    """The sparse table's values are the host's password file (external raw storage)."""
    def make(group, name, old):
        group.create_dataset(name, shape=old.shape, dtype=old.dtype,
                             external=[(HOST_FILE, 0, h5py.h5f.UNLIMITED)])
    _replace(path, "sparse_rank0.h5", "embedding/table", make)


def virtual_dataset(path):
    """The sparse table is a virtual dataset reading another HDF5 file."""
    other = os.path.join(os.path.dirname(os.path.dirname(path)), "elsewhere.h5")

    def make(group, name, old):
        with h5py.File(other, "w") as source:
            source["rows"] = np.full(old.shape, 7.0, old.dtype)
        layout = h5py.VirtualLayout(shape=old.shape, dtype=old.dtype)
        layout[...] = h5py.VirtualSource(other, "rows", shape=old.shape)
        group.create_virtual_dataset(name, layout)
    _replace(path, "sparse_rank0.h5", "embedding/table", make)


def dense_slot_broadcastable(path):
    """Adam's ``m`` of a (24, 16) weight stored as (16,): numpy would broadcast it."""
    _replace(path, "dense.h5", "optimizer/hidden_0_weight/m",
             lambda group, name, old: group.create_dataset(name, data=old[0]))


def sparse_slot_one_column(path):
    """Adagrad's accumulator of (N, 8) rows stored as (N, 1): numpy would broadcast it."""
    _replace(path, "sparse_rank0.h5", "embedding/row_state/accumulator",
             lambda group, name, old: group.create_dataset(name, data=old[:, :1]))


def sparse_slot_fewer_rows(path):
    """The accumulator holds one row fewer than the table (was an IndexError)."""
    _replace(path, "sparse_rank0.h5", "embedding/row_state/accumulator",
             lambda group, name, old: group.create_dataset(name, data=old[:-1]))


def sparse_slot_of_three(path):
    """The accumulator is of shape (3,) (was a ValueError)."""
    _replace(path, "sparse_rank0.h5", "embedding/row_state/accumulator",
             lambda group, name, old: group.create_dataset(name, data=old.ravel()[:3]))


def table_of_another_dtype(path):
    """The float32 table stored as float64."""
    _replace(path, "sparse_rank0.h5", "embedding/table",
             lambda group, name, old: group.create_dataset(name, data=old.astype("f8")))


def _write_meta(path, meta):
    with open(os.path.join(path, "meta.json"), "w", encoding="utf-8") as handle:
        json.dump(meta, handle)


def meta_a_list(path):
    """``meta.json`` is a JSON list (was an AttributeError)."""
    _write_meta(path, [1, 2, 3])


def meta_step_in_words(path):
    """``meta.json`` says ``"step": "sixty"`` (was a ValueError)."""
    with open(os.path.join(path, "meta.json"), encoding="utf-8") as handle:
        meta = json.load(handle)
    _write_meta(path, {**meta, "step": "sixty"})


#: case: (damage, what the skipped-checkpoint line must say)
CASES = {
    "external storage": (external_storage,
                         f"dataset 'embedding/table' keeps its values in external file "
                         f"'{HOST_FILE}'"),
    "virtual dataset": (virtual_dataset, "dataset 'embedding/table' is a virtual dataset "
                                         "reading '"),
    "dense slot (16,) for (24, 16)": (dense_slot_broadcastable,
                                      "optimizer slot 'm' of 'hidden_0_weight' has another "
                                      "shape or dtype: float32 (16,), expected float32 (24, 16)"),
    "sparse slot (N, 1) for (N, 8)": (sparse_slot_one_column,
                                      "optimizer slot 'accumulator' (shaped like the table) has "
                                      "another shape or dtype: float32 (39, 1), expected "
                                      "float32 (39, 8)"),
    "sparse slot with fewer rows": (sparse_slot_fewer_rows,
                                    "optimizer slot 'accumulator' (shaped like the table) has "
                                    "another shape or dtype: float32 (38, 8), expected "
                                    "float32 (39, 8)"),
    "sparse slot of shape (3,)": (sparse_slot_of_three,
                                  "optimizer slot 'accumulator' (shaped like the table) has "
                                  "another shape or dtype: float32 (3,), expected float32 (39, 8)"),
    "table of another dtype": (table_of_another_dtype,
                               "variable 'embedding': the table is float64 (39, 8) with 39 ids, "
                               "expected float32 (39, 8)"),
    "meta.json a list": (meta_a_list, "meta.json: a JSON list, not an object"),
    "meta.json step 'sixty'": (meta_step_in_words,
                               "meta.json: step 'sixty' is not a number of steps"),
}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_hostile_checkpoint_is_refused_named_and_the_older_one_used(tmp_path, two_checkpoints,
                                                                     capsys, case):
    damage, words = CASES[case]
    run_dir = tmp_path / "run"
    shutil.copytree(two_checkpoints, run_dir)
    newest = str(run_dir / "checkpoints" / ckpt.checkpoint_name(4))
    damage(newest)
    rehash(newest)
    ckpt.verify(newest)  # the hashes pass: only reading the files can tell
    capsys.readouterr()

    resumed = _run(run_dir, steps=5, checkpoint_every=2, resume=True)

    out = capsys.readouterr().out
    older = str(run_dir / "checkpoints" / ckpt.checkpoint_name(2))
    assert resumed.checkpoints.resumed_from == older
    assert resumed.summary["start_step"] == 3 and resumed.summary["steps"] == 5
    skipped = [line for line in out.splitlines() if "skipping damaged checkpoint" in line]
    assert skipped == [line for line in skipped if line.startswith(
        f"resume: WARNING: skipping damaged checkpoint {newest}: ")] and len(skipped) == 1, out
    assert words in skipped[0], skipped[0]
    assert f"resumed from {older}: continuing at step 3" in out
    assert "Traceback" not in out
    if damage is external_storage:  # nothing of the host file reached the tables
        with open(HOST_FILE, "rb") as handle:
            host = handle.read(16)
        with h5py.File(os.path.join(ckpt.latest(run_dir), "sparse_rank0.h5"), "r") as f:
            assert host not in f["embedding/table"][...].tobytes()


@pytest.mark.timeout(120)
def test_torch_load_refuses_a_broadcastable_optimizer_slot(tmp_path):
    """``hpcpax.torch.load`` reads the same files: Adagrad's ``sum`` of a (3, 8) weight
    stored as (8,) is refused naming it, before any parameter is overwritten."""
    torch = pytest.importorskip("torch")
    import hpcpax
    import hpcpax.torch
    from hpcpax.errors import CheckpointError

    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("one process; serial suite only")

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(30, 8, sparse=True)
            self.lin = torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.lin(self.emb(ids).mean(1)).sum(1)

    torch.manual_seed(0)
    ids = torch.randint(0, 30, (6, 2))
    model = Tiny()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1)
    topology = hpcpax.init(servers_per_node=0)
    model, optimizer, data = hpcpax.torch.distribute(model, optimizer, [(ids,)] * 2, plan="ps",
                                                     topology=topology, quiet=True,
                                                     on_server="return")
    try:
        for (batch,) in data:
            optimizer.zero_grad()
            model(batch).pow(2).mean().backward()
            optimizer.step()
        path = hpcpax.torch.save(model, tmp_path / "run", 2)
        _replace(path, "dense.h5", "optimizer/lin.weight/sum",
                 lambda group, name, old: group.create_dataset(name, data=old[0]))
        rehash(path)
        before = model.lin.weight.detach().clone()
        with torch.no_grad():
            model.lin.weight.add_(1.0)
        changed = model.lin.weight.detach().clone()
        with pytest.raises(CheckpointError, match=r"optimizer slot 'sum' of 'lin.weight' is "
                                                  r"float32 \(8,\), the parameter is float32 "
                                                  r"\(3, 8\)"):
            hpcpax.torch.load(model, path)
        assert torch.equal(model.lin.weight, changed) and not torch.equal(changed, before)
    finally:
        hpcpax.torch.finish()
        topology.free()
