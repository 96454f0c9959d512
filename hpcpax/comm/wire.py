"""Reduced-precision wire types of the dense allreduce: float16 and bfloat16.

Floating tensors may travel rounded to float16 or bfloat16 (bfloat16
emulated on ``uint16`` bits, round to nearest even), summed by a
user-defined MPI op that adds in float32 and rounds back to the wire type
after every addition. With ``u = 2**-11`` (float16) or ``2**-8`` (bfloat16)
and ``n`` workers, each element of the sum satisfies
``|result - exact| <= n * u * sum_r |x_r|`` (:func:`wire_error_bound` adds
the subnormal floor); float16 overflows to inf beyond 65504.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module

__all__ = ["WIRE_DTYPES", "WIRE_TINY", "bfloat16_encode", "bfloat16_decode",
           "wire_error_bound", "wire_op"]

#: Unit roundoff of each reduced-precision wire type.
WIRE_DTYPES = {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}
_USER_OPS = {}


def bfloat16_encode(x):
    """float32 array -> ``uint16`` bfloat16 bits, round to nearest even (NumPy or CuPy)."""
    xp = array_module(x)
    bits = xp.ascontiguousarray(x, dtype=xp.float32).view(xp.uint32)
    rounding = ((bits >> 16) & 1) + xp.uint32(0x7FFF)
    out = ((bits + rounding) >> 16).astype(xp.uint16)
    return xp.where(xp.isnan(x), xp.uint16(0x7FC0), out)


def bfloat16_decode(bits):
    """``uint16`` bfloat16 bits -> float32 array (exact)."""
    xp = array_module(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


#: Half the spacing of the wire type's subnormals: the absolute error floor of one rounding.
WIRE_TINY = {"float16": 2.0 ** -25, "bfloat16": 2.0 ** -134}


def wire_error_bound(wire_dtype, num_ranks, abs_sum):
    """Documented bound on ``|result - exact|`` of a reduced-precision sum.

    ``num_ranks * (u * abs_sum + tiny)``: one rounding of each input and one
    per addition, each at most ``u`` times a partial sum bounded by
    ``abs_sum``, or ``tiny`` (half a subnormal step) near zero.

    Args:
        wire_dtype: ``"float16"`` or ``"bfloat16"``.
        num_ranks: ranks contributing.
        abs_sum: ``sum_r |x_r|`` elementwise (array or float).
    """
    return num_ranks * (WIRE_DTYPES[wire_dtype] * abs_sum + WIRE_TINY[wire_dtype])


def _sum_float16(inbuf, inoutbuf, datatype):
    a = np.frombuffer(inbuf, np.float16)
    b = np.frombuffer(inoutbuf, np.float16)
    np.add(a, b, out=b, dtype=np.float32)


def _sum_bfloat16(inbuf, inoutbuf, datatype):
    a = np.frombuffer(inbuf, np.uint16)
    b = np.frombuffer(inoutbuf, np.uint16)
    b[...] = bfloat16_encode(bfloat16_decode(a) + bfloat16_decode(b))


def wire_op(wire_dtype):
    """The MPI sum for ``uint16``-carried wire values, created once per process."""
    from mpi4py import MPI

    if wire_dtype is None:
        return MPI.SUM
    if wire_dtype not in _USER_OPS:
        function = _sum_float16 if wire_dtype == "float16" else _sum_bfloat16
        _USER_OPS[wire_dtype] = MPI.Op.Create(function, commute=True)
    return _USER_OPS[wire_dtype]
