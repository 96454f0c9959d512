"""Bad sparse input raises on every worker, before data moves, tables intact.

One worker (the last) sends the bad value; every worker must raise (the
offender with the precise message), the servers keep serving, the table is
unchanged, and the next good step works.
"""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.errors import MismatchError, NonFiniteError, SparseIndexError
from hpcpax.ps import ParameterServer, SparseVariableSpec
from hpcpax.sparse_grad import SparseGrad

ROWS, DIM = 50, 3
SPEC = SparseVariableSpec("emb", ROWS, DIM, num_partitions=3)


def good_grad():
    ids = np.array([1, 2, 2, 49])
    return SparseGrad(ids, np.ones((4, DIM), np.float32), ROWS)


def bad_pushes():
    ones = np.ones((2, DIM), np.float32)
    return {
        "index too large": (SparseGrad(np.array([0, ROWS]), ones, ROWS), SparseIndexError,
                            f"index {ROWS} is out of range"),
        "negative index": (SparseGrad(np.array([-1, 3]), ones, ROWS), SparseIndexError,
                           "index -1 is negative"),
        "wrong dim": (SparseGrad(np.array([0, 1]), np.ones((2, DIM + 1), np.float32), ROWS),
                      ValueError, f"not {DIM + 1}"),
        "wrong dtype": (SparseGrad(np.array([0, 1]), np.ones((2, DIM)), ROWS), TypeError,
                        "float64"),
        "wrong length": (SparseGrad(np.array([0, 1, 2]), ones, ROWS), ValueError, "shape"),
        "float indices": (SparseGrad(np.array([0.0, 1.0]), ones, ROWS), TypeError, "integer"),
        "nan": (SparseGrad(np.array([0, 1]), np.array([[np.nan] * DIM] * 2, np.float32), ROWS),
                NonFiniteError, "NaN"),
    }


def _session(body, servers=1, **ps_args):
    topo = hpcpax.init(servers_per_node=servers if MPI.COMM_WORLD.Get_size() > 1 else 0)
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
def test_bad_push_raises_on_every_worker_and_keeps_table(comm):
    def body(topo, ps):
        ok = True
        offender = topo.worker_index == topo.num_workers - 1
        for label, (grad, error, words) in bad_pushes().items():
            before = ps.read_table("emb")
            with pytest.raises(error) as info:
                ps.push("emb", grad if offender else good_grad())
            if offender:
                ok &= words in str(info.value)
            else:
                ok &= "rank" in str(info.value)
            ok &= np.array_equal(before, ps.read_table("emb"))
        before = ps.read_table("emb")
        ps.push("emb", good_grad())
        ok &= not np.array_equal(before, ps.read_table("emb"))
        return ok

    assert comm.allreduce(_session(body), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_bad_pull_raises_on_every_worker(comm):
    def body(topo, ps):
        offender = topo.worker_index == 0
        ids = np.array([3, ROWS + 7]) if offender else np.array([3])
        with pytest.raises(SparseIndexError) as info:
            ps.pull("emb", ids)
        good = ps.pull("emb", np.array([3, 3, 0]))
        return (not offender or str(ROWS + 7) in str(info.value)) and good.shape == (3, DIM)

    assert comm.allreduce(_session(body), op=MPI.LAND)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_nonfinite_skip_policy_skips_everywhere(comm):
    def body(topo, ps):
        before = ps.read_table("emb")
        grad = good_grad()
        if topo.worker_index == 0:
            grad.values[0, 0] = np.inf
        applied = ps.push("emb", grad)
        return (not applied) and np.array_equal(before, ps.read_table("emb")) \
            and ps.skipped_pushes == 1

    assert comm.allreduce(_session(body, nonfinite="skip"), op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_mismatched_specs_raise_on_every_rank(comm):
    topo = hpcpax.init(servers_per_node=0)
    ps = ParameterServer(topo)
    try:
        rows = ROWS + (1 if topo.rank == topo.size - 1 else 0)
        with pytest.raises(MismatchError) as info:
            ps.register([SparseVariableSpec("emb", rows, DIM)])
        assert "rows" in str(info.value) and f"[{topo.size - 1}]" in str(info.value)
    finally:
        topo.free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_workers_calling_different_ops_raise_instead_of_hanging(comm):
    topo = hpcpax.init(servers_per_node=0)
    ps = ParameterServer(topo)
    try:
        ps.register([SparseVariableSpec("a", ROWS, DIM), SparseVariableSpec("b", ROWS, DIM)])
        name = "a" if topo.rank == 0 else "b"
        with pytest.raises(MismatchError):
            ps.pull(name, np.array([1]))
    finally:
        topo.free()
