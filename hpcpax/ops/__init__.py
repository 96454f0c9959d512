"""Sparse kernels: dedup, row gather/scatter, partition packing, optimizers.

Each op dispatches on its input's device: CuPy arrays run the CUDA kernels
in ``kernels/*.cu`` (compiled on first use), NumPy arrays run Numba kernels
(or plain NumPy with ``HPCPAX_NUMBA=0``). Each has a ``*_reference`` twin in
plain NumPy that the tests use as the oracle. Importing this package imports
neither CuPy nor Numba and compiles nothing.
"""

from .dedup import dedup_sum, dedup_sum_reference
from .optimizers import OPTIMIZERS, SparseOptimizer, make_optimizer
from .packing import PackedPartitions, partition_pack, partition_pack_reference
from .rows import gather_rows, gather_rows_reference, scatter_add_rows, scatter_add_rows_reference

__all__ = [
    "dedup_sum",
    "dedup_sum_reference",
    "gather_rows",
    "gather_rows_reference",
    "scatter_add_rows",
    "scatter_add_rows_reference",
    "PackedPartitions",
    "partition_pack",
    "partition_pack_reference",
    "SparseOptimizer",
    "make_optimizer",
    "OPTIMIZERS",
]
