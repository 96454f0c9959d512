"""CUDA path of the sparse ops: kernel loading and one launcher per kernel.

Each ``kernels/*.cu`` file (text from ``_kernel_source``) becomes one
``cupy.RawModule`` compiled by NVRTC on first use and memoized per device,
with a hash of the kernel folder in its options and ``--fmad=false`` so no
multiply-add is fused: results stay bit-equal to the NumPy references.
Importing this module imports CuPy.

Launchers check dtype, contiguity and device (CuPy checks nothing) and pass
scalars as explicit NumPy scalar types.
"""

from __future__ import annotations

import numpy as np

from ..backend import cupy_module
from ._kernel_source import (
    NAME_EXPRESSIONS,
    compile_options,
    header_constant,
    kernel_sources,
    kernels_dir,
    module_code,
)

cp = cupy_module(required=True)

_BLOCK = 256
_MODULES: dict = {}
_SM_COUNT: dict = {}
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
#: Segments (rows of one id) longer than this go to ``segment_sum_long``.
LONG_SEGMENT = header_constant("HP_LONG_SEGMENT")
_LONG_COLS = header_constant("HP_LONG_COLS")
_LONG_THREADS = header_constant("HP_LONG_THREADS")


def get_function(filename: str, name_expression: str):
    """The compiled kernel ``name_expression`` of ``filename`` on the current device."""
    device = cp.cuda.Device().id
    key = (filename, device)
    module = _MODULES.get(key)
    if module is None:
        if filename not in kernel_sources():
            raise FileNotFoundError(f"kernel source must exist in {kernels_dir()}, not {filename}")
        module = cp.RawModule(
            code=module_code(filename),
            options=compile_options(),
            name_expressions=NAME_EXPRESSIONS[filename],
        )
        _MODULES[key] = module
    return module.get_function(name_expression)


def _check_arrays(**arrays) -> None:
    device = cp.cuda.Device().id
    for name, a in arrays.items():
        if not isinstance(a, cp.ndarray):
            raise TypeError(f"{name} must be a cupy.ndarray, not {type(a).__name__}")
        if not a.flags.c_contiguous:
            raise ValueError(f"{name} must be C-contiguous, not strided")
        if a.device.id != device:
            raise ValueError(f"{name} must be on the current device {device}, not {a.device.id}")


def _check_dtype(name, a, dtypes) -> None:
    if a.dtype not in dtypes:
        raise TypeError(f"{name} must be {' or '.join(str(np.dtype(d)) for d in dtypes)}, not {a.dtype}")


_INT64 = (np.dtype(np.int64),)
_FLOAT = tuple(_CTYPE)


def _launch(filename, name_expression, total, args) -> None:
    if total == 0:
        return
    kernel = get_function(filename, name_expression)
    device = cp.cuda.Device().id
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = _SM_COUNT[device] = cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    grid = int(min((total + _BLOCK - 1) // _BLOCK, sms * 32))
    kernel((grid,), (_BLOCK,), args)


# -- launchers: one per kernel ------------------------------------------------


def launch_mark_segment_heads(sorted_ids, flags) -> None:
    _check_arrays(sorted_ids=sorted_ids, flags=flags)
    _check_dtype("sorted_ids", sorted_ids, _INT64)
    _check_dtype("flags", flags, (np.dtype(np.int32),))
    n = sorted_ids.size
    _launch("dedup_sum.cu", "mark_segment_heads", n, (sorted_ids, np.int64(n), flags))


def launch_segment_sum_sorted(values, order, starts, out, max_len=LONG_SEGMENT) -> None:
    """Segments of at most ``max_len`` rows; longer ones are left untouched."""
    _check_arrays(values=values, order=order, starts=starts, out=out)
    _check_dtype("values", values, _FLOAT)
    _check_dtype("out", out, (values.dtype,))
    _check_dtype("order", order, _INT64)
    _check_dtype("starts", starts, _INT64)
    n_unique, dim = out.shape
    _launch("dedup_sum.cu", f"segment_sum_sorted<{_CTYPE[values.dtype]}>", n_unique * dim,
            (values, order, starts, np.int64(n_unique), np.int64(dim), np.int64(max_len), out))


def launch_segment_sum_long(values, order, starts, segments, out_rows, out, accumulate) -> None:
    """Segments ``segments`` into rows ``out_rows`` of ``out`` (added to them if ``accumulate``)."""
    _check_arrays(values=values, order=order, starts=starts, segments=segments, out_rows=out_rows, out=out)
    _check_dtype("values", values, _FLOAT)
    _check_dtype("out", out, (values.dtype,))
    for name, a in (("order", order), ("starts", starts), ("segments", segments), ("out_rows", out_rows)):
        _check_dtype(name, a, _INT64)
    if segments.size != out_rows.size:
        raise ValueError(f"out_rows must have one row per segment ({segments.size}), not {out_rows.size}")
    dim = out.shape[1]
    if segments.size == 0 or dim == 0:
        return
    kernel = get_function("dedup_sum.cu", f"segment_sum_long<{_CTYPE[values.dtype]}>")
    grid = (int(segments.size), int((dim + _LONG_COLS - 1) // _LONG_COLS))
    kernel(grid, (_LONG_THREADS,), (values, order, starts, segments, out_rows, np.int64(dim),
                                    np.int32(1 if accumulate else 0), out))


def launch_gather_rows(table, ids, out) -> None:
    _check_arrays(table=table, ids=ids, out=out)
    _check_dtype("table", table, _FLOAT)
    _check_dtype("out", out, (table.dtype,))
    _check_dtype("ids", ids, _INT64)
    n, dim = out.shape
    _launch("gather_scatter.cu", f"gather_rows<{_CTYPE[table.dtype]}>", n * dim,
            (table, ids, np.int64(n), np.int64(dim), out))


def launch_scatter_add_sorted(table, values, order, starts, unique_ids, max_len=LONG_SEGMENT) -> None:
    """Segments of at most ``max_len`` rows; longer ones are left untouched."""
    _check_arrays(table=table, values=values, order=order, starts=starts, unique_ids=unique_ids)
    _check_dtype("table", table, _FLOAT)
    _check_dtype("values", values, (table.dtype,))
    for name, a in (("order", order), ("starts", starts), ("unique_ids", unique_ids)):
        _check_dtype(name, a, _INT64)
    n_unique, dim = unique_ids.size, table.shape[1]
    _launch("gather_scatter.cu", f"scatter_add_sorted<{_CTYPE[table.dtype]}>", n_unique * dim,
            (table, values, order, starts, unique_ids, np.int64(n_unique), np.int64(dim), np.int64(max_len)))


def launch_partition_of(ids, partitioning, parts) -> None:
    _check_arrays(ids=ids, parts=parts)
    _check_dtype("ids", ids, _INT64)
    _check_dtype("parts", parts, _INT64)
    n = ids.size
    kind = np.int32(1 if partitioning.kind == "range" and partitioning.num_parts > 1 else 0)
    _launch("partition_pack.cu", "partition_of", n,
            (ids, np.int64(n), kind, np.int64(partitioning.num_parts),
             np.int64(partitioning.base), np.int64(partitioning.remainder), parts))


def launch_pack_rows(ids, values, order, packed_ids, packed_values) -> None:
    _check_arrays(ids=ids, values=values, order=order, packed_ids=packed_ids, packed_values=packed_values)
    _check_dtype("values", values, _FLOAT)
    _check_dtype("packed_values", packed_values, (values.dtype,))
    for name, a in (("ids", ids), ("order", order), ("packed_ids", packed_ids)):
        _check_dtype(name, a, _INT64)
    n, dim = values.shape
    _launch("partition_pack.cu", f"pack_rows<{_CTYPE[values.dtype]}>", n * dim,
            (ids, values, order, np.int64(n), np.int64(dim), packed_ids, packed_values))


def launch_optimizer_rows(name, param, slots, rows, grads, scalars, extra=()) -> None:
    """``{name}_rows<T>`` of sparse_optimizers.cu; ``slots`` in kernel order."""
    arrays = {"param": param, "rows": rows, "grads": grads}
    arrays.update({f"slot{i}": s for i, s in enumerate(slots)})
    _check_arrays(**arrays)
    _check_dtype("param", param, _FLOAT)
    _check_dtype("rows", rows, _INT64)
    for key, a in arrays.items():
        if key != "rows":
            _check_dtype(key, a, (param.dtype,))
    scalar_type = param.dtype.type
    n, dim = rows.size, param.shape[1]
    args = (param, *slots, rows, grads, np.int64(n), np.int64(dim),
            *(scalar_type(s) for s in scalars), *(np.int32(e) for e in extra))
    _launch("sparse_optimizers.cu", f"{name}_rows<{_CTYPE[param.dtype]}>", n * dim, args)


# -- op bodies (arguments already validated by the public functions) ----------


def _group_sorted(indices):
    """Stable sort of ids: (order, starts[n_unique + 1], unique ids)."""
    n = indices.size
    order = cp.argsort(indices)  # thrust stable sort
    sorted_ids = indices[order]
    flags = cp.empty(n, cp.int32)
    launch_mark_segment_heads(sorted_ids, flags)
    heads = cp.flatnonzero(flags)
    starts = cp.empty(heads.size + 1, cp.int64)
    starts[:-1] = heads
    starts[-1] = n
    return order, starts, sorted_ids[heads]


def _long_segments(starts):
    """Indices of the segments longer than ``LONG_SEGMENT`` rows (int64)."""
    return cp.flatnonzero((starts[1:] - starts[:-1]) > LONG_SEGMENT).astype(cp.int64, copy=False)


def dedup_sum(indices, values):
    dim = values.shape[1]
    if indices.size == 0:
        return cp.empty(0, cp.int64), cp.empty((0, dim), values.dtype)
    order, starts, unique = _group_sorted(indices)
    out = cp.empty((unique.size, dim), values.dtype)
    launch_segment_sum_sorted(values, order, starts, out)
    long = _long_segments(starts)
    launch_segment_sum_long(values, order, starts, long, long, out, accumulate=False)
    return unique, out


def gather_rows(table, ids, out):
    if out is None:
        out = cp.empty((ids.size, table.shape[1]), table.dtype)
    launch_gather_rows(table, ids, out)
    return out


def scatter_add_rows(table, ids, values):
    if ids.size:
        order, starts, unique = _group_sorted(ids)
        launch_scatter_add_sorted(table, values, order, starts, unique)
        long = _long_segments(starts)
        launch_segment_sum_long(values, order, starts, long, unique[long], table, accumulate=True)
    return table


def partition_pack(indices, values, partitioning, dest_of_part, num_dest):
    n = indices.size
    parts = cp.empty(n, cp.int64)
    launch_partition_of(indices, partitioning, parts)
    # destination of each row: a lookup on the device, no host round trip
    keys = parts if dest_of_part is None else cp.asarray(dest_of_part, cp.int64)[parts]
    order = cp.argsort(keys)  # stable: input order kept within a destination
    counts = cp.bincount(keys, minlength=num_dest).get().astype(np.int64)
    if values is None or values.shape[1] == 0:
        packed_ids = indices[order]
        packed_values = None if values is None else cp.empty_like(values)
    else:
        packed_ids = cp.empty(n, cp.int64)
        packed_values = cp.empty_like(values)
        launch_pack_rows(indices, values, order, packed_ids, packed_values)
    return counts, packed_ids, packed_values, order
