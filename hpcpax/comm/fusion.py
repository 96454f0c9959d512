"""Tensor fusion of the dense allreduce: buckets, their buffers, packing.

Tensors are grouped, in registration order, into fusion buckets of about
``bucket_bytes`` per wire dtype (:func:`build_buckets`); a tensor at least
``direct_bytes`` large (and exact on the wire) is its own *direct* bucket,
reduced in place. :class:`FusionBuffers` holds one buffer per bucket and
device, and packs tensors into it and back (rounding to the reduced wire
type when one is set, :mod:`hpcpax.comm.wire`).
"""

from __future__ import annotations

import numpy as np

from .wire import bfloat16_decode, bfloat16_encode

__all__ = ["SUPPORTED_DTYPES", "parse_tensors", "build_buckets", "FusionBuffers"]

SUPPORTED_DTYPES = ("float16", "float32", "float64", "int32", "int64")


def parse_tensors(tensors):
    """-> (names, shapes, dtypes) from a dict or a list of (shape, dtype) or arrays."""
    if isinstance(tensors, dict):
        items = list(tensors.items())
    elif isinstance(tensors, (list, tuple)):
        items = [(str(i), spec) for i, spec in enumerate(tensors)]
    else:
        raise TypeError(f"tensors must be a dict or a list, not {type(tensors).__name__}")
    names, shapes, dtypes = [], [], []
    for name, spec in items:
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, not {type(name).__name__}")
        if hasattr(spec, "shape") and hasattr(spec, "dtype"):
            shape, dtype = spec.shape, spec.dtype
        elif isinstance(spec, (list, tuple)) and len(spec) == 2:
            shape, dtype = spec
        else:
            raise TypeError(f"tensor {name!r} must be (shape, dtype) or an array, not {spec!r}")
        shape = (shape,) if isinstance(shape, (int, np.integer)) else tuple(shape)
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise ValueError(f"shape of tensor {name!r} must be non-negative ints, not {shape}")
        try:
            dtype = np.dtype(dtype)
        except TypeError:
            raise TypeError(f"dtype of tensor {name!r} must be a NumPy dtype, not {dtype!r}") from None
        if dtype.name not in SUPPORTED_DTYPES:
            raise TypeError(f"dtype of tensor {name!r} must be one of {SUPPORTED_DTYPES}, "
                            f"not {dtype.name}")
        names.append(name)
        shapes.append(tuple(int(d) for d in shape))
        dtypes.append(dtype)
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    return names, shapes, dtypes


def build_buckets(dtypes, sizes, wire_dtype, bucket_bytes, direct_bytes) -> list:
    """Group tensors by wire dtype, in registration order, up to ``bucket_bytes``.

    Returns bucket dicts: ``wire`` dtype, ``reduced`` (rounded on the wire),
    ``elements``, ``members`` ``[(tensor index, offset, size)]``, ``first``
    tensor index and ``direct``.
    """
    open_buckets, buckets = {}, []
    for index, (dtype, size) in enumerate(zip(dtypes, sizes)):
        if size == 0:
            continue
        reduced = wire_dtype is not None and dtype.kind == "f"
        wire = np.dtype(np.uint16) if reduced else dtype
        if not reduced and size * dtype.itemsize >= direct_bytes:
            buckets.append({"wire": wire, "reduced": False, "elements": size,
                            "members": [(index, 0, size)], "first": index, "direct": True})
            continue
        key = "wire" if reduced else dtype.name
        bucket = open_buckets.get(key)
        if bucket is not None and (bucket["elements"] + size) * wire.itemsize > bucket_bytes:
            bucket = None
        if bucket is None:
            bucket = {"wire": wire, "reduced": reduced, "elements": 0, "members": [],
                      "first": index, "direct": False}
            open_buckets[key] = bucket
            buckets.append(bucket)
        bucket["members"].append((index, bucket["elements"], size))
        bucket["elements"] += size
    return sorted(buckets, key=lambda b: b["first"])


class FusionBuffers:
    """Grow-once fusion buffers per device, and packing in and out of them.

    Args:
        buckets: from :func:`build_buckets`.
        shapes: every registered tensor's shape.
        wire_dtype: None, ``"float16"`` or ``"bfloat16"``.
    """

    def __init__(self, buckets, shapes, wire_dtype):
        self._buckets, self.shapes, self.wire_dtype = buckets, shapes, wire_dtype
        self._buffers = {}

    def buffers(self, xp, on_device):
        """Fusion buffers for this device, and each tensor's reshaped view into them."""
        key = "gpu" if on_device else "cpu"
        if on_device:
            key += str(xp.cuda.Device().id)
        if key not in self._buffers:
            buffers, views = [], []
            for bucket in self._buckets:
                if bucket["direct"]:
                    buffers.append(None)
                    views.append(None)
                    continue
                buffer = xp.empty(bucket["elements"], bucket["wire"])
                buffers.append(buffer)
                views.append([buffer[offset:offset + size].reshape(self.shapes[index])
                              for index, offset, size in bucket["members"]])
            self._buffers[key] = (buffers, views)
        return self._buffers[key]

    def direct(self, bucket, arrays, xp):
        """The tensor itself as a flat buffer, or a contiguous copy of it."""
        array = arrays[bucket["members"][0][0]]
        if not array.flags.c_contiguous:
            array = xp.ascontiguousarray(array)  # copied back in _unpack
        return array.reshape(-1)

    def pack(self, bucket, buffer, views, arrays, xp):
        """Copy ``bucket``'s member arrays into ``buffer`` (as float16/bfloat16 on a reduced wire)."""
        members = bucket["members"]
        if not bucket["reduced"]:
            if len(members) > 1:  # one C call instead of one copy per tensor
                xp.concatenate([arrays[index].reshape(-1) for index, _, _ in members], out=buffer)
            else:
                xp.copyto(views[0], arrays[members[0][0]])
            return
        for (index, offset, size), view in zip(members, views):
            if self.wire_dtype == "float16":
                xp.copyto(view.view(xp.float16), arrays[index], casting="unsafe")
            else:
                buffer[offset:offset + size] = bfloat16_encode(
                    arrays[index].reshape(-1).astype(xp.float32, copy=False))

    def unpack(self, bucket, buffer, views, arrays, xp, divisor=None):
        """Write a reduced buffer back into the tensors, divided by ``divisor`` if given."""
        divide = divisor is not None
        if bucket["direct"]:
            target = arrays[bucket["members"][0][0]]
            if divide:
                buffer /= divisor
            if not xp.shares_memory(buffer, target):
                xp.copyto(target, buffer.reshape(target.shape))
            return
        if divide and not bucket["reduced"]:
            buffer /= divisor  # once per bucket, not once per tensor
            divide = False
        for (index, _, _), view in zip(bucket["members"], views):
            if bucket["reduced"]:
                view = (view.view(xp.float16) if self.wire_dtype == "float16"
                        else bfloat16_decode(view))
            target = arrays[index]
            xp.copyto(target, view, casting="unsafe")
            if divide:
                target /= divisor
