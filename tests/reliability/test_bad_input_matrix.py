"""One table of bad inputs: each gives a clear error (or the documented skip) on
every rank, never a hang, and leaves the parameter tables unchanged.

Runs serially and under ``mpirun -n 2/3/4`` (one worker sends the bad value,
or every rank reads the same bad file or config).
"""

import os

import h5py
import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.app.config import resolve
from hpcpax.data import write_lm
from hpcpax.errors import ConfigError, DataError, MismatchError, NonFiniteError, SparseIndexError
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad
from hpcpax.app.trainer import Trainer

ROWS, DIM = 40, 3
SPEC = SparseVariableSpec("emb", ROWS, DIM, num_partitions=3)
ONES = np.ones((2, DIM), np.float32)
TINY = {"model": "lm", "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
        "num_sampled": 8, "global_batch": 12, "plan": "ps", "quiet": True, "steps": 2}


def _grad(ids, values=ONES):
    return SparseGrad(np.asarray(ids), values, ROWS)


#: name -> (operation, bad argument, error, words the offender's message holds)
PS_CASES = {
    "id out of range": ("push", _grad([0, ROWS]), SparseIndexError, "out of range"),
    "negative id": ("push", _grad([-1, 2]), SparseIndexError, "negative"),
    "NaN gradient": ("push", _grad([0, 1], np.full((2, DIM), np.nan, np.float32)),
                     NonFiniteError, "NaN"),
    "Inf gradient": ("push", _grad([0, 1], np.full((2, DIM), np.inf, np.float32)),
                     NonFiniteError, "Inf"),
    "wrong dtype": ("push", _grad([0, 1], np.ones((2, DIM))), TypeError, "float64"),
    "wrong dim": ("push", _grad([0, 1], np.ones((2, DIM + 2), np.float32)), ValueError,
                  str(DIM + 2)),
    "wrong shape": ("push", _grad([0, 1, 2]), ValueError, "shape"),
    "not a SparseGrad": ("push", np.ones((2, DIM), np.float32), TypeError, "SparseGrad"),
    "pull id out of range": ("pull", np.array([1, ROWS + 5]), SparseIndexError, str(ROWS + 5)),
    "pull negative id": ("pull", np.array([-3, 1]), SparseIndexError, "negative"),
}


def _session(body, **ps_args):
    topo = hpcpax.init(servers_per_node=1 if MPI.COMM_WORLD.Get_size() > 1 else 0)
    ps = ParameterServer(topo, **ps_args)
    try:
        if topo.is_server:
            ps.serve()
            return True
        ps.register([SPEC])
        try:
            return body(topo, ps)
        finally:
            ps.shutdown()
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", PS_CASES, ids=list(PS_CASES))
def test_bad_sparse_input(comm, case):
    op, bad, error, words = PS_CASES[case]

    def body(topo, ps):
        offender = topo.worker_index == topo.num_workers - 1
        before = ps.read_table("emb")
        with pytest.raises(error) as info:
            if op == "push":
                ps.push("emb", bad if offender else _grad([0, 1]))
            else:
                ps.pull("emb", bad if offender else np.array([0, 1]))
        message = str(info.value)
        ok = words in message if offender else "rank" in message
        ok &= np.array_equal(before, ps.read_table("emb"))
        ps.push("emb", _grad([0, 1]))  # the next good step still applies
        return ok and not np.array_equal(before, ps.read_table("emb"))

    assert comm.allreduce(_session(body), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_nonfinite_skip_is_the_documented_skip(comm):
    def body(topo, ps):
        before = ps.read_table("emb")
        nan = _grad([0, 1], np.full((2, DIM), np.nan, np.float32))
        applied = ps.push("emb", nan if topo.worker_index == 0 else _grad([0, 1]))
        return applied is False and np.array_equal(before, ps.read_table("emb"))

    assert comm.allreduce(_session(body, nonfinite="skip"), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_rank_with_an_empty_batch(comm):
    """A worker with no ids pulls nothing and pushes nothing; the others go ahead."""
    def body(topo, ps):
        empty = topo.worker_index == topo.num_workers - 1
        ids = np.zeros(0, np.int64) if empty else np.array([0, 1])
        rows = ps.pull("emb", ids)
        before = ps.read_table("emb")
        ps.push("emb", _grad(ids, np.ones((len(ids), DIM), np.float32)))
        after = ps.read_table("emb")
        everyone_empty = topo.num_workers == 1
        changed = not np.array_equal(before, after)
        return rows.shape == (len(ids), DIM) and changed != everyone_empty

    assert comm.allreduce(_session(body), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_mismatched_specs_raise_everywhere(comm):
    topo = hpcpax.init(servers_per_node=0)
    try:
        ps = ParameterServer(topo)
        spec = SparseVariableSpec("emb", ROWS + (topo.rank == topo.size - 1), DIM)
        if topo.size == 1:
            ps.register([spec])
            return
        with pytest.raises(MismatchError, match="rows"):
            ps.register([spec])
    finally:
        topo.free()


def _shared(comm, tmp_path):
    return comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)


def _truncated(path):
    write_lm(path, np.arange(6000) % 50, ["<unk>"] + [f"w{i}" for i in range(1, 50)])
    data = open(path, "rb").read()
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 3])


def _wrong_layout(path):
    with h5py.File(path, "w") as f:
        f["something"] = np.arange(10)


def _wrong_dtype(path):
    with h5py.File(path, "w") as f:
        f.attrs["format"] = "hpcpax-lm/1"
        f.attrs["vocab_size"] = 4
        f["tokens"] = np.linspace(0, 3, 100)
        f.create_dataset("vocab", data=np.array(["<unk>", "a", "b", "c"], dtype=object),
                         dtype=h5py.string_dtype("utf-8"))


DATA_CASES = {"missing file": None, "truncated file": _truncated,
              "wrong layout": _wrong_layout, "wrong dtype": _wrong_dtype}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", DATA_CASES, ids=list(DATA_CASES))
def test_bad_data_file_raises_on_every_rank(comm, tmp_path, case):
    root = _shared(comm, tmp_path)
    path = os.path.join(root, "data.h5")
    if comm.Get_rank() == 0 and DATA_CASES[case] is not None:
        DATA_CASES[case](path)
    comm.Barrier()
    message = ""
    try:
        Trainer({**TINY, "data": path, "run_dir": os.path.join(root, "run")}, comm=comm).run()
    except DataError as exc:
        message = str(exc)
    assert comm.allreduce("data.h5" in message, op=MPI.LAND), message


CONFIG_CASES = {
    "unknown key": ({"learning_rate": 0.1}, "unknown config key 'learning_rate'"),
    "bad int": ({"steps": "ten"}, "steps must be int"),
    "negative": ({"steps": -1}, "steps must be >= 1"),
    "bad choice": ({"optimizer": "lbfgs"}, "optimizer must be one of"),
    "bad bool": ({"shuffle": "maybe"}, "shuffle must be bool"),
    "other model's flag": ({"model": "ctr", "vocab_size": 10}, "vocab_size is a flag of model"),
    "bad timeout": ({"timeout": -5}, "timeout must be >= 0"),
    "bad memory budget": ({"server_memory_budget": "lots"}, "server_memory_budget must be"),
    "resume without run dir": ({"resume": True}, "resume needs run_dir"),
}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("case", CONFIG_CASES, ids=list(CONFIG_CASES))
def test_bad_config_raises_before_any_communication(comm, tmp_path, case):
    overrides, words = CONFIG_CASES[case]
    with pytest.raises(ConfigError, match=words):
        config = resolve({**TINY, **overrides})
        Trainer(config, comm=comm).run()


def test_unknown_toml_key_names_file(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("steps = 3\nlearnig_rate = 0.1\n")
    with pytest.raises(ConfigError, match="c.toml.*learnig_rate"):
        resolve(config_file=path)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatched_config_names_field_and_ranks(comm, tmp_path):
    """One rank with another --lr: MismatchError on every rank, naming lr and the ranks."""
    root = _shared(comm, tmp_path)
    last = comm.Get_size() - 1
    lr = 0.5 if comm.Get_rank() == last else 0.003
    message = ""
    try:
        Trainer({**TINY, "lr": lr, "run_dir": os.path.join(root, "run")}, comm=comm).run()
    except MismatchError as exc:
        message = str(exc)
    others = list(range(last))
    expected = ["field 'lr' differs", f"ranks {others} have 0.003", f"ranks [{last}] have 0.5"]
    assert comm.allreduce(all(w in message for w in expected), op=MPI.LAND), message
