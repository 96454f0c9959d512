"""Torch tensors as NumPy or CuPy arrays and back, without copies.

CPU tensors share memory with NumPy through ``Tensor.numpy()`` and
``torch.from_numpy``; CUDA tensors with CuPy through DLPack
(``cupy.from_dlpack`` / ``torch.from_dlpack``). hpcpax's kernels, exchanges
and the dense allreduce then read and write the tensors' own memory.
"""

from __future__ import annotations

import numpy as np
import torch

from ..backend import cupy_module, is_device_array

__all__ = ["as_array", "as_tensor", "numpy_dtype", "SUPPORTED_DTYPES"]

#: Torch dtypes the adapter syncs (dense gradients and tables).
SUPPORTED_DTYPES = {torch.float16: np.float16, torch.float32: np.float32,
                    torch.float64: np.float64}


def numpy_dtype(dtype) -> np.dtype:
    """The NumPy dtype of torch ``dtype`` (a supported one)."""
    return np.dtype(SUPPORTED_DTYPES[dtype])


def as_array(tensor):
    """A NumPy (CPU) or CuPy (CUDA) array sharing ``tensor``'s memory."""
    if tensor.is_cpu and not tensor.requires_grad:  # the push converts every table's
        return tensor.numpy()                       # gradient every step: no detach
    tensor = tensor.detach()
    if tensor.device.type == "cpu":
        return tensor.numpy()
    if tensor.device.type == "cuda":
        return cupy_module(required=True).from_dlpack(tensor)
    raise TypeError(f"tensors must be on the CPU or a CUDA device, not {tensor.device}")


def as_tensor(array):
    """A torch tensor sharing ``array``'s memory (NumPy -> CPU, CuPy -> CUDA)."""
    if is_device_array(array):
        return torch.from_dlpack(array)
    return torch.from_numpy(np.asarray(array))
