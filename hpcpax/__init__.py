"""hpcpax: sparsity-aware hybrid data parallelism (Parallax) for MPI codes.

The primitives a user's own mpi4py program needs are here: :func:`init`
(topology), :class:`ParameterServer` with :class:`SparseVariableSpec` and
:class:`SparseGrad` (sparse push/pull; :class:`RelaxedParameterServer` for
ssp/asp/psp), :class:`DenseAllreduce` (fused dense
allreduce), the kernels in :mod:`hpcpax.ops`; :data:`options` holds every
``HPCPAX_*`` setting. :class:`ModelSync` is the step API for a NumPy or CuPy
training loop (one call each to pull rows, push sparse gradients and
allreduce dense ones, with the plan applied); :mod:`hpcpax.torch` makes a
PyTorch script data-parallel with one call. ``python -m hpcpax.train`` is the
ready-made trainer. Importing the package imports no CuPy, Numba or torch and
compiles nothing.
"""

from .app.model_sync import ModelSync
from .comm.accounting import Accounting
from .comm.allreduce import DenseAllreduce
from .comm.agreement import check_same
from .errors import (
    CheckpointError,
    CommTimeoutError,
    ConfigError,
    DataError,
    DependencyError,
    HpcpaxError,
    MismatchError,
    NonFiniteError,
    SparseIndexError,
    TopologyError,
)
from .options import options
from .ps.relaxed import RelaxedParameterServer
from .ps.server import ParameterServer
from .ps.spec import SparseVariableSpec
from .ps.sparse_grad import SparseGrad
from .sync.replicated import ReplicatedTable
from .comm.topology import Topology, init

__version__ = "0.1.0"

__all__ = [
    "Accounting",
    "DenseAllreduce",
    "ModelSync",
    "ParameterServer",
    "RelaxedParameterServer",
    "ReplicatedTable",
    "SparseGrad",
    "SparseVariableSpec",
    "CheckpointError",
    "CommTimeoutError",
    "ConfigError",
    "DataError",
    "DependencyError",
    "HpcpaxError",
    "MismatchError",
    "NonFiniteError",
    "SparseIndexError",
    "Topology",
    "TopologyError",
    "check_same",
    "init",
    "options",
]
