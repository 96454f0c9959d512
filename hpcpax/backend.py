"""Array backends: NumPy on CPUs, CuPy on GPUs, chosen once per process.

Importing this module imports no CuPy; :func:`cupy_module` does it lazily and
only once. Code dispatches on the array's own module (:func:`array_module`),
so the same function serves host and device arrays.

Environment:
    HPCPAX_DEVICE: ``cpu`` (default when no GPU), ``gpu`` or ``auto``.
"""

from __future__ import annotations


import numpy as np

from .errors import ConfigError, DependencyError
from .options import options

__all__ = [
    "cupy_module",
    "has_gpu",
    "array_module",
    "is_device_array",
    "to_host",
    "synchronize",
    "select_device",
    "Device",
]

_CUPY = None
_CUPY_TRIED = False


def cupy_module(required: bool = False):
    """Return the ``cupy`` module, or ``None`` when it is not importable.

    Args:
        required: raise :class:`DependencyError` instead of returning None.
    """
    global _CUPY, _CUPY_TRIED
    if not _CUPY_TRIED:
        _CUPY_TRIED = True
        try:
            import cupy  # noqa: PLC0415  (lazy on purpose)

            _CUPY = cupy
        except Exception:  # ImportError, or a CUDA driver error at import
            _CUPY = None
    if _CUPY is None and required:
        raise DependencyError(
            "CuPy is needed for the GPU path: pip install hpcpax[gpu]"
        )
    return _CUPY


def has_gpu() -> bool:
    """True when CuPy imports and sees at least one CUDA device."""
    cp = cupy_module()
    if cp is None:
        return False
    try:
        return cp.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def is_device_array(x) -> bool:
    """True when ``x`` is a CuPy array (lives on a GPU)."""
    return type(x).__module__.startswith("cupy")


def array_module(x):
    """The module (numpy or cupy) that owns array ``x``."""
    if is_device_array(x):
        return cupy_module(required=True)
    return np


def to_host(x) -> np.ndarray:
    """Copy ``x`` to a NumPy array (no copy when it already is one)."""
    if is_device_array(x):
        return x.get()
    return np.asarray(x)


def synchronize(x=None) -> None:
    """Wait for the current CuPy stream, so MPI may read a device buffer.

    A no-op for NumPy arrays and when CuPy is absent.
    """
    if x is not None and not is_device_array(x):
        return
    cp = cupy_module()
    if cp is not None:
        cp.cuda.get_current_stream().synchronize()


class Device:
    """The compute device chosen for this process.

    Attributes:
        kind: ``"cpu"`` or ``"gpu"``.
        index: CUDA device ordinal, or -1 on the CPU.
        xp: the array module (numpy or cupy).
    """

    def __init__(self, kind: str, index: int = -1):
        self.kind = kind
        self.index = index
        self.xp = cupy_module(required=True) if kind == "gpu" else np

    def __repr__(self) -> str:
        return f"Device(kind={self.kind!r}, index={self.index})"


def select_device(local_worker_rank: int = 0, choice: str | None = None) -> Device:
    """Choose NumPy or CuPy once, and the GPU as ``local_worker_rank % count``.

    Args:
        local_worker_rank: this worker's index among the workers of its node.
        choice: ``cpu``, ``gpu`` or ``auto``; default ``hpcpax.options.device``
            (``$HPCPAX_DEVICE``, else auto).

    Not collective. Server ranks should pass ``choice="cpu"``.
    """
    if choice is None:
        choice = options.device
    elif str(choice).lower() not in ("cpu", "gpu", "auto"):
        raise ConfigError(f"device must be cpu, gpu or auto, not {choice!r}")
    choice = choice.lower()
    if choice == "cpu" or (choice == "auto" and not has_gpu()):
        return Device("cpu")
    cp = cupy_module(required=True)
    count = cp.cuda.runtime.getDeviceCount()
    if count == 0:
        raise ConfigError("HPCPAX_DEVICE=gpu but CuPy sees no CUDA device")
    index = local_worker_rank % count
    cp.cuda.Device(index).use()
    return Device("gpu", index)
