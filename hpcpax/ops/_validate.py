"""Argument checks shared by the sparse ops ("X must be T, not U")."""

from __future__ import annotations

import numpy as np

from ..backend import array_module, is_device_array
from ..errors import SparseIndexError

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def device_name(x) -> str:
    return "cupy" if is_device_array(x) else "numpy"


def check_index_array(name: str, ids):
    """Return ``ids`` as a contiguous int64 vector on its own device."""
    if not hasattr(ids, "dtype") or not hasattr(ids, "ndim"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, not {type(ids).__name__}")
    if ids.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array, not {ids.dtype}")
    if ids.ndim != 1:
        raise ValueError(f"{name} must be 1-D, not {ids.ndim}-D with shape {tuple(ids.shape)}")
    xp = array_module(ids)
    if ids.dtype == np.uint64 and ids.size and int(ids.max()) > np.iinfo(np.int64).max:
        raise SparseIndexError(f"{name} must fit in int64, not {int(ids.max())}")
    return xp.ascontiguousarray(ids.astype(xp.int64, copy=False))


def check_float_matrix(name: str, values, rows: int | None = None, dim: int | None = None):
    """Check a 2-D float32/float64 array; return it C-contiguous."""
    if not hasattr(values, "dtype") or not hasattr(values, "ndim"):
        raise TypeError(f"{name} must be a NumPy or CuPy array, not {type(values).__name__}")
    if values.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float32 or float64, not {values.dtype}")
    if values.ndim != 2:
        raise ValueError(f"{name} must be 2-D, not {values.ndim}-D with shape {tuple(values.shape)}")
    if rows is not None and values.shape[0] != rows:
        raise ValueError(f"{name} must have {rows} rows, not {values.shape[0]}")
    if dim is not None and values.shape[1] != dim:
        raise ValueError(f"{name} must have {dim} columns, not {values.shape[1]}")
    return array_module(values).ascontiguousarray(values)


def check_same_device(name: str, x, reference_name: str, reference) -> None:
    if is_device_array(x) != is_device_array(reference):
        raise TypeError(
            f"{name} must be on the same device as {reference_name} "
            f"({device_name(reference)}), not {device_name(x)}"
        )


def check_same_dtype(name: str, x, reference_name: str, reference) -> None:
    if x.dtype != reference.dtype:
        raise TypeError(f"{name} must have the dtype of {reference_name} ({reference.dtype}), not {x.dtype}")


def check_bounds(name: str, ids, num_rows: int) -> None:
    """Raise :class:`SparseIndexError` unless ``0 <= ids < num_rows``.

    One min and one max reduction; for CuPy both come back in one transfer.
    """
    if ids.size == 0:
        return
    if is_device_array(ids):
        xp = array_module(ids)
        low, high = (int(v) for v in xp.stack([ids.min(), ids.max()]).get())
    else:
        low, high = int(ids.min()), int(ids.max())
    if low < 0 or high >= num_rows:
        bad = low if low < 0 else high
        raise SparseIndexError(f"{name} must be in [0, {num_rows}), not {bad}")
