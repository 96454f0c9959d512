"""CUDA path of the sparse ops: kernel loading and one launcher per kernel.

Each ``kernels/*.cu`` file (text from ``_kernel_source``) becomes one
``cupy.RawModule`` compiled by NVRTC on first use and memoized per device,
with a hash of the kernel folder in its options and ``--fmad=false`` so no
multiply-add is fused: results stay bit-equal to the NumPy references.
Importing this module imports CuPy.

Launchers check dtype, contiguity and device (CuPy checks nothing) and pass
scalars as explicit NumPy scalar types. Row kernels run one team of lanes
per row (``group`` lanes, a power of two <= 32, about one per VEC elements of
the row) with VEC elements per access (16 bytes at most, where the row width
and every array's address allow): whole-row, coalesced transactions.

Sums (``dedup_sum``, ``scatter_add_rows``) never use atomics: a stable sort
of the ids, run-length segments, one team per segment of at most
``SUM_CHUNK`` rows, chunked long segments and their fixed tree; the order of
:mod:`hpcpax.ops.summation`, so the results are bit-equal to the NumPy twins.
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
from .summation import SUM_CHUNK, SUM_CHUNK_SHIFT

cp = cupy_module(required=True)

_BLOCK = header_constant("HP_ROW_THREADS")
_TREE_THREADS = header_constant("HP_TREE_THREADS")
#: Below this many ids dedup_sum sorts the int64 ids as they are; above, it
#: spends one sync on their range to sort 32-bit keys (half the radix passes).
NARROW_SORT_MIN = 1 << 16
_MODULES: dict = {}
_SM_COUNT: dict = {}
_LOOKUPS: dict = {}
_CTYPE = {np.dtype(np.float32): "float", np.dtype(np.float64): "double"}
_INT64 = (np.dtype(np.int64),)
_FLOAT = tuple(_CTYPE)


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


def _check_rows(name, a, rows, dim) -> None:
    if a.ndim != 2 or a.shape[1] != dim or (rows is not None and a.shape[0] != rows):
        want = f"({'rows' if rows is None else rows}, {dim})"
        raise ValueError(f"{name} must have shape {want}, not {tuple(a.shape)}")


def row_layout(dtype, dim, *arrays) -> tuple:
    """``(vec, nvec, group)`` of a row kernel over ``[.., dim]`` rows of ``dtype``.

    ``vec``: elements per access, the widest of 4, 2, 1 within 16 bytes that
    divides ``dim`` and every array's address; ``nvec = dim // vec``; ``group``:
    lanes per row, the power of two >= ``nvec`` (at most 32).
    """
    itemsize = np.dtype(dtype).itemsize
    vec = 1
    for width in (4, 2):
        if width * itemsize <= 16 and dim % width == 0 and all(
                a.data.ptr % (width * itemsize) == 0 for a in arrays):
            vec = width
            break
    nvec = dim // vec
    return vec, nvec, min(32, 1 << max(0, nvec - 1).bit_length())


def _sms() -> int:
    device = cp.cuda.Device().id
    sms = _SM_COUNT.get(device)
    if sms is None:
        sms = _SM_COUNT[device] = cp.cuda.runtime.getDeviceProperties(device)["multiProcessorCount"]
    return sms


def _launch(filename, name_expression, threads, args) -> None:
    """``threads`` work-items of a grid-stride kernel, ``_BLOCK`` threads a block."""
    if threads == 0:
        return
    kernel = get_function(filename, name_expression)
    grid = int(min((threads + _BLOCK - 1) // _BLOCK, _sms() * 32))
    kernel((grid,), (_BLOCK,), args)


# -- launchers: one per kernel ------------------------------------------------


def launch_mark_segment_heads(sorted_ids, flags) -> None:
    _check_arrays(sorted_ids=sorted_ids, flags=flags)
    _check_dtype("sorted_ids", sorted_ids, _INT64)
    _check_dtype("flags", flags, (np.dtype(np.int32),))
    n = sorted_ids.size
    _launch("dedup_sum.cu", "mark_segment_heads", n, (sorted_ids, np.int64(n), flags))


def _check_segments(values, order, starts, out, out_rows):
    _check_arrays(values=values, order=order, starts=starts, out=out, out_rows=out_rows)
    _check_dtype("values", values, _FLOAT)
    _check_dtype("out", out, (values.dtype,))
    for name, a in (("order", order), ("starts", starts), ("out_rows", out_rows)):
        _check_dtype(name, a, _INT64)
    _check_rows("out", out, None, values.shape[1])
    if starts.ndim != 1 or starts.size < 1 or order.size != values.shape[0]:
        raise ValueError(f"order must have one entry per row of values ({values.shape[0]}) and "
                         f"starts at least 1, not {order.size} and {starts.size}")


def launch_segment_sum_short(values, order, starts, out, out_rows=None) -> None:
    """Segments of at most ``SUM_CHUNK`` rows into ``out`` (row s, or added
    into row ``out_rows[s]`` when given); longer ones are left untouched."""
    rows = starts if out_rows is None else out_rows
    _check_segments(values, order, starts, out, rows)
    n_unique = starts.size - 1
    if out_rows is not None and out_rows.size != n_unique:
        raise ValueError(f"out_rows must have one row per segment ({n_unique}), not {out_rows.size}")
    vec, nvec, group = row_layout(values.dtype, values.shape[1], values, out)
    _launch("dedup_sum.cu", f"segment_sum_short<{_CTYPE[values.dtype]}, {vec}>", n_unique * group,
            (values, order, starts, np.int64(n_unique), np.int64(nvec), np.int32(group),
             np.int32(out_rows is not None), rows, out))


def launch_long_segments(values, order, starts, long_segments, out, out_rows=None) -> None:
    """Segments ``long_segments`` (each longer than ``SUM_CHUNK`` rows; ``-1``
    entries are padding): chunk sums, then the fixed tree, into ``out`` as
    :func:`launch_segment_sum_short`. Sized from the host shapes alone: no sync."""
    rows = starts if out_rows is None else out_rows
    _check_segments(values, order, starts, out, rows)
    _check_arrays(long_segments=long_segments)
    _check_dtype("long_segments", long_segments, _INT64)
    n_long, dim = long_segments.size, values.shape[1]
    if n_long == 0 or dim == 0:
        return
    real = long_segments >= 0
    segment = cp.maximum(long_segments, 0)
    chunks = cp.where(real, (starts[segment + 1] - starts[segment] + SUM_CHUNK - 1) >> SUM_CHUNK_SHIFT, 0)
    long_first = cp.cumsum(chunks) - chunks
    # at most n / SUM_CHUNK + n_long chunks: sized without asking the device
    max_chunks = values.shape[0] // SUM_CHUNK + n_long
    chunk_owner = cp.full(max_chunks, -1, cp.int64)
    _launch("dedup_sum.cu", "long_chunk_map", n_long,
            (long_segments, long_first, starts, np.int64(n_long), chunk_owner))
    vec, nvec, group = row_layout(values.dtype, dim, values, out)
    partial = cp.empty((max_chunks, dim), values.dtype)
    ctype, accumulate = _CTYPE[values.dtype], np.int32(out_rows is not None)
    _launch("dedup_sum.cu", f"segment_chunk_sums<{ctype}, {vec}>", max_chunks * group,
            (values, order, starts, long_segments, long_first, chunk_owner, np.int64(max_chunks),
             np.int64(nvec), np.int32(group), accumulate, rows, out, partial))
    tree = get_function("dedup_sum.cu", f"segment_tree<{ctype}, {vec}>")
    tree((int(min(n_long, _sms() * 32)),), (_TREE_THREADS,),
         (partial, long_segments, long_first, starts, np.int64(n_long), np.int64(nvec), accumulate,
          rows, out))


def launch_gather_rows(table, ids, out) -> None:
    _check_arrays(table=table, ids=ids, out=out)
    _check_dtype("table", table, _FLOAT)
    _check_dtype("out", out, (table.dtype,))
    _check_dtype("ids", ids, _INT64)
    _check_rows("out", out, ids.size, table.shape[1])
    n, dim = out.shape
    vec, nvec, group = row_layout(table.dtype, dim, table, out)
    _launch("gather_rows.cu", f"gather_rows<{_CTYPE[table.dtype]}, {vec}>", n * group,
            (table, ids, np.int64(n), np.int64(nvec), np.int32(group), out))


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
    _check_rows("packed_values", packed_values, n, dim)
    vec, nvec, group = row_layout(values.dtype, dim, values, packed_values)
    _launch("partition_pack.cu", f"pack_rows<{_CTYPE[values.dtype]}, {vec}>", n * group,
            (ids, values, order, np.int64(n), np.int64(nvec), np.int32(group), packed_ids,
             packed_values))


def launch_optimizer_rows(name, param, slots, rows, grads, scalars, extra=()) -> None:
    """``{name}_rows<T, VEC>`` of sparse_optimizers.cu; ``slots`` in kernel order."""
    arrays = {"param": param, "rows": rows, "grads": grads}
    arrays.update({f"slot{i}": s for i, s in enumerate(slots)})
    _check_arrays(**arrays)
    _check_dtype("param", param, _FLOAT)
    _check_dtype("rows", rows, _INT64)
    for key, a in arrays.items():
        if key != "rows":
            _check_dtype(key, a, (param.dtype,))
    n, dim = rows.size, param.shape[1]
    _check_rows("grads", grads, n, dim)
    vec, nvec, group = row_layout(param.dtype, dim, param, grads, *slots)
    scalar_type = param.dtype.type
    args = (param, *slots, rows, grads, np.int64(n), np.int64(nvec), np.int32(group),
            *(scalar_type(s) for s in scalars), *(np.int32(e) for e in extra))
    _launch("sparse_optimizers.cu", f"{name}_rows<{_CTYPE[param.dtype]}, {vec}>", n * group, args)


# -- op bodies (arguments already validated by the public functions) ----------


def _sort_keys(indices, bound):
    """Keys whose stable sort orders ``indices``: 32-bit where the range allows.

    ``bound``: ids are known to lie in ``[0, bound)`` (no device sync needed),
    or None: the range is read from the device for large inputs only.
    """
    if bound is None:
        if indices.size < NARROW_SORT_MIN:
            return indices
        low, high = (int(v) for v in cp.stack([indices.min(), indices.max()]).get())
        if high - low >= 2**31:
            return indices
        return (indices - low).astype(cp.int32)
    return indices.astype(cp.int32) if bound <= 2**31 else indices


def _group_sorted(indices, bound=None):
    """Stable sort of ids: (order, starts[n_unique + 1], unique ids)."""
    n = indices.size
    order = cp.argsort(_sort_keys(indices, bound))  # stable (a radix sort)
    sorted_ids = indices[order]
    flags = cp.empty(n, cp.int32)
    launch_mark_segment_heads(sorted_ids, flags)
    heads = cp.flatnonzero(flags)
    starts = cp.empty(heads.size + 1, cp.int64)
    starts[:-1] = heads
    starts[-1] = n
    return order, starts, sorted_ids[heads]


def _long_segments(starts, n):
    """The segments longer than ``SUM_CHUNK`` rows, in order, then ``-1`` up to
    ``n // (SUM_CHUNK + 1)`` entries (no more can be that long): no device sync."""
    bound = n // (SUM_CHUNK + 1)
    n_unique = starts.size - 1
    is_long = (starts[1:] - starts[:-1]) > SUM_CHUNK
    # the k-th long segment goes to slot k, every other one to a discarded last slot
    slot = cp.where(is_long, cp.cumsum(is_long) - 1, bound)
    found = cp.full(bound + 1, -1, cp.int64)
    found[slot] = cp.arange(n_unique, dtype=cp.int64)
    return found[:bound]


def dedup_sum(indices, values):
    dim = values.shape[1]
    if indices.size == 0:
        return cp.empty(0, cp.int64), cp.empty((0, dim), values.dtype)
    order, starts, unique = _group_sorted(indices)
    out = cp.empty((unique.size, dim), values.dtype)
    launch_segment_sum_short(values, order, starts, out)
    launch_long_segments(values, order, starts, _long_segments(starts, indices.size), out)
    return unique, out


def gather_rows(table, ids, out):
    if out is None:
        out = cp.empty((ids.size, table.shape[1]), table.dtype)
    launch_gather_rows(table, ids, out)
    return out


def scatter_add_rows(table, ids, values):
    if ids.size:
        order, starts, unique = _group_sorted(ids, bound=table.shape[0])
        launch_segment_sum_short(values, order, starts, table, unique)
        launch_long_segments(values, order, starts, _long_segments(starts, ids.size), table, unique)
    return table


def _device_lookup(table):
    """``table`` (a small host int array) on the current device, uploaded once."""
    key = (cp.cuda.Device().id, table.tobytes())
    found = _LOOKUPS.get(key)
    if found is None:
        if len(_LOOKUPS) >= 64:  # a handful of layouts per job; drop the oldest
            _LOOKUPS.pop(next(iter(_LOOKUPS)))
        found = _LOOKUPS[key] = cp.asarray(table, cp.int64)
    return found


def partition_pack(indices, values, partitioning, dest_of_part, num_dest):
    n = indices.size
    parts = cp.empty(n, cp.int64)
    launch_partition_of(indices, partitioning, parts)
    # destination of each row: a lookup on the device, the table uploaded once per layout
    keys = parts if dest_of_part is None else _device_lookup(dest_of_part)[parts]
    order = cp.argsort(keys)  # stable: input order kept within a destination
    # rows per destination from the sorted keys: no max to read back, as bincount would
    edges = cp.searchsorted(keys[order], cp.arange(num_dest + 1, dtype=cp.int64))
    counts = (edges[1:] - edges[:-1]).get().astype(np.int64)  # the one sync: MPI needs them
    if values is None or values.shape[1] == 0:
        packed_ids = indices[order]
        packed_values = None if values is None else cp.empty_like(values)
    else:
        packed_ids = cp.empty(n, cp.int64)
        packed_values = cp.empty_like(values)
        launch_pack_rows(indices, values, order, packed_ids, packed_values)
    return counts, packed_ids, packed_values, order
