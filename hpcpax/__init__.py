"""hpcpax: sparsity-aware hybrid data parallelism (Parallax) for MPI codes.

Importing the package imports no CuPy and compiles nothing.
"""

from .accounting import Accounting
from .consistency import check_same
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
from .topology import Topology, init

__version__ = "0.1.0"

__all__ = [
    "Accounting",
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
]
