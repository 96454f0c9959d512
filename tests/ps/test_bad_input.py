"""Workers that call different parameter-server operations raise, not hang.

The rest of the bad-input cases (ids out of range, wrong width, dtype or
shape, NaN/Inf, the skip policy, mismatched specs, empty batches) are the
table-driven matrix in ``tests/reliability/test_bad_input_matrix.py``.
"""

import numpy as np
import pytest

import hpcpax
from hpcpax.errors import MismatchError
from hpcpax import ParameterServer, SparseVariableSpec

ROWS, DIM = 50, 3


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
