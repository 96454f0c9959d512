"""The machine's kernel rates, timed on the kernels hpcpax runs.

Each kernel of a step is timed at a small and a large size and fitted to
``seconds = call_s + units * unit_s`` (a fixed cost per call plus a rate),
the same least squares as the links' alpha-beta fit:

* ``unique``: ``np.unique`` of a worker's ids (per id; pull requests);
* ``dedup``: :func:`hpcpax.ops.dedup_sum` (per byte of input rows; pushes,
  local aggregation, the allgather sum);
* ``gather``: :func:`hpcpax.ops.gather_rows` (per byte of output rows; a
  server answering a pull, a replica read);
* ``apply``: the sparse optimizer's ``apply_rows`` (per byte of updated rows);
* ``dense_optimizer``: the dense optimizer's ``apply_dense`` (per byte).

Local and not collective (no MPI): the timing runs in this process, so on
a machine with more ranks than cores call it while the other ranks are busy
too (``hpcpax.tune.calibrate`` does) to get the rates a step really sees.
Results are cached per process and options.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["KERNELS", "measure_kernel_rates", "median_seconds"]

KERNELS = ("unique", "dedup", "gather", "apply", "dense_optimizer")
_SIZES = (256, 8192)
_CACHE = {}


def median_seconds(call, repeats) -> float:
    """The median wall seconds of ``repeats`` calls of ``call()`` (local)."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def _fit(units, seconds):
    per = max((seconds[1] - seconds[0]) / (units[1] - units[0]), 0.0)
    call = max(seconds[0] - per * units[0], 0.0)
    return {"call_s": call, "unit_s": per}


def measure_kernel_rates(dim: int = 64, dtype: str = "float32", sparse_optimizer: str = "adagrad",
                         dense_optimizer: str = "adam", repeats: int = 7, cache: bool = True) -> dict:
    """``{kernel: {"call_s", "unit_s"}}`` for :data:`KERNELS`, timed here and now.

    Not collective. Takes about 0.1-0.5 s (the first call also compiles the
    Numba kernels, outside the timing).
    """
    from ..ops import dedup_sum, gather_rows
    from ..ops.optimizers import make_optimizer

    key = (dim, dtype, sparse_optimizer, dense_optimizer)
    if cache and key in _CACHE:
        return dict(_CACHE[key])
    rng = np.random.default_rng(0)
    table_rows = 4 * max(_SIZES)
    table = rng.standard_normal((table_rows, dim)).astype(dtype)
    sparse = make_optimizer(sparse_optimizer, lr=0.01)
    state = sparse.init_state(table.shape, table.dtype, np)
    dense = make_optimizer(dense_optimizer, lr=0.001)
    row_bytes = dim * np.dtype(dtype).itemsize
    out = {name: [] for name in KERNELS}
    for n in _SIZES:
        ids = rng.integers(0, table_rows, n).astype(np.int64)
        values = rng.standard_normal((n, dim)).astype(dtype)
        unique = np.unique(ids)
        grads = values[:unique.size]
        param = rng.standard_normal(n * dim).astype(dtype)
        dense_state = dense.init_state(param.shape, param.dtype, np)
        calls = {
            "unique": (lambda: np.unique(ids), n),
            "dedup": (lambda: dedup_sum(ids, values), n * row_bytes),
            "gather": (lambda: gather_rows(table, unique), unique.size * row_bytes),
            "apply": (lambda: sparse.apply_rows(table, state, unique, grads),
                      unique.size * row_bytes),
            "dense_optimizer": (lambda: dense.apply_dense(param, dense_state, param * 0.0),
                                param.nbytes),
        }
        for name, (call, units) in calls.items():
            call()  # warm up (and compile)
            out[name].append((units, median_seconds(call, repeats)))
    rates = {name: _fit(*zip(*points)) for name, points in out.items()}
    if cache:
        _CACHE[key] = rates
    return dict(rates)
