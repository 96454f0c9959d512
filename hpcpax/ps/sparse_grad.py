"""`SparseGrad`: a gradient that touches some rows of a table.

What an embedding lookup's backward gives: one value row per looked-up id,
duplicates allowed. hpcpax deduplicates and sums them (``dedup_sum``) before
anything leaves the worker.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..backend import array_module
from ..errors import NonFiniteError, SparseIndexError

__all__ = ["SparseGrad"]


@dataclass
class SparseGrad:
    """Rows ``indices`` of a ``num_rows``-row table receive ``values``.

    Attributes:
        indices: 1-D integer array (NumPy or CuPy), duplicates allowed.
        values: 2-D array ``[len(indices), dim]`` on the same device.
        num_rows: number of rows of the variable.
        agreed: the gradient is already the workers' mean and expected to be the
            same on every worker (``hpcpax.torch`` sets it for a table whose
            ``.grad`` the script read, e.g. to clip): a replicated variable then
            checks that it is (one small allreduce of a hash) and applies it
            without exchanging it again; where a worker's differs, it is
            exchanged as usual.
    """

    indices: object
    values: object
    num_rows: int
    agreed: bool = False

    def validate(self, name: str, dim: int, dtype, bounds: bool = True) -> None:
        """Check shapes, dtype and (``bounds``) index range; raise naming ``name``.

        Not collective. Raises ``TypeError``/``ValueError``
        (:class:`~hpcpax.errors.SparseIndexError` for a bad index).
        ``bounds=False`` is for callers that check the range themselves.
        """
        if type(self.indices) is not np.ndarray or type(self.values) is not np.ndarray:
            if array_module(self.values) is not array_module(self.indices):
                raise TypeError(f"{name}: indices and values must be on the same device")
        if self.indices.ndim != 1 or self.indices.dtype.kind not in "iu":
            raise TypeError(
                f"{name}: indices must be a 1-D integer array, not "
                f"{self.indices.ndim}-D {self.indices.dtype}"
            )
        if self.values.ndim != 2 or self.values.shape[0] != self.indices.shape[0]:
            raise ValueError(
                f"{name}: values must have shape ({self.indices.shape[0]}, {dim}), "
                f"not {tuple(self.values.shape)}"
            )
        if self.values.shape[1] != dim:
            raise ValueError(f"{name}: values width must be the variable's dim {dim}, "
                             f"not {self.values.shape[1]}")
        if np.dtype(self.values.dtype) != np.dtype(dtype):
            raise TypeError(f"{name}: values dtype must be {np.dtype(dtype)}, "
                            f"not {self.values.dtype}")
        if bounds:
            check_indices(name, self.indices, self.num_rows)


def check_indices(name: str, ids, num_rows: int) -> None:
    """Raise :class:`SparseIndexError` if any id is < 0 or >= ``num_rows``."""
    if ids.shape[0] == 0:
        return
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0:
        raise SparseIndexError(f"{name}: index {lo} is negative")
    if hi >= num_rows:
        raise SparseIndexError(f"{name}: index {hi} is out of range for {num_rows} rows")


def prepare_push(spec, grad):
    """Validate ``grad`` for the variable of ``spec``; its deduplicated ``(ids, values)``.

    Local (no communication); the arrays stay on ``grad``'s device.

    Raises:
        TypeError: ``grad`` is not a :class:`SparseGrad`.
        ValueError, SparseIndexError: wrong row count, width, dtype or ids.
        NonFiniteError: the summed gradient holds NaN or Inf.
    """
    from ..ops import dedup_sum

    name = spec.name
    if not isinstance(grad, SparseGrad):
        raise TypeError(f"{name}: push needs a SparseGrad, not {type(grad).__name__}")
    if grad.num_rows != spec.rows:
        raise ValueError(f"{name}: SparseGrad.num_rows must be {spec.rows}, not {grad.num_rows}")
    grad.validate(name, spec.dim, spec.dtype)
    xp = array_module(grad.indices)
    ids, values = dedup_sum(grad.indices.astype(xp.int64, copy=False), grad.values)
    if not bool(xp.isfinite(values).all()):
        raise NonFiniteError(f"{name}: gradient holds NaN or Inf "
                             f"(set nonfinite='skip' to skip such steps)")
    return ids, values
