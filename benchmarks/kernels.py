"""Sparse-kernel benchmark: prints one JSON line.

CPU (default): ``dedup_sum`` of Zipf(s=1) ids over 1M rows x 64 float32
(hpcpax dispatch, i.e. Numba, against ``np.unique`` + ``np.add.at``), and a
server-side Adagrad update of 200k unique rows of a 1M x 64 table (Numba
against the NumPy reference), each against the memory-copy bandwidth
measured in the same run. Repeats are interleaved; figures are medians.

    python benchmarks/kernels.py            # full size
    python benchmarks/kernels.py --quick    # tiny sizes (CI smoke)
    python benchmarks/kernels.py --gpu      # CuPy kernels at 1M and 10M Zipf(1.05) ids

Keys: ``ratio_vs_add_at`` (add_at time / hpcpax time, target >= 5) and
``fraction_of_copy_bw`` (input bytes / hpcpax time over the copy bandwidth,
target >= 0.5). Numba uses all cores (``threads`` in the output). ``--gpu``:
``kernel_fraction_of_copy_bw`` (per kernel, the worst over the sizes; goals
dedup_sum and scatter_add_rows >= 0.5, gather_rows >= 0.7) and
``bit_equal_to_twin`` (each CUDA op against its NumPy twin at the first size).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from hpcpax.ops import dedup_sum, gather_rows, make_optimizer, partition_pack, scatter_add_rows
from hpcpax.ops.partitioning import Partitioning


def zipf_ids(n: int, num_rows: int, s: float, rng, xp=np):
    """``n`` ids with P(rank k) ~ 1/k**s over ``num_rows`` rows, hot rows shuffled.

    Drawn on ``xp``'s device (NumPy or CuPy) from the NumPy generator's seed.
    """
    weights = 1.0 / xp.arange(1, num_rows + 1, dtype=xp.float64) ** s
    cdf = xp.cumsum(weights)
    cdf /= cdf[-1]
    uniform = xp.asarray(rng.random(n)) if xp is np else xp.random.default_rng(
        int(rng.integers(2**31))).random(n)
    ranks = xp.minimum(xp.searchsorted(cdf, uniform), num_rows - 1)
    return xp.asarray(rng.permutation(num_rows))[ranks].astype(xp.int64)


def _median_times(funcs: dict, repeats: int) -> dict:
    """Interleaved repeats of every function; median seconds of each."""
    times = {k: [] for k in funcs}
    for _ in range(repeats):
        for name, fn in funcs.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {k: statistics.median(v) for k, v in times.items()}


def cpu_benchmark(quick: bool, repeats: int) -> dict:
    import numba  # noqa: PLC0415

    rng = np.random.default_rng(0)
    num_rows, n, dim = (10_000, 20_000, 16) if quick else (1_000_000, 1_000_000, 64)
    ids = zipf_ids(n, num_rows, 1.0, rng)
    values = rng.standard_normal((n, dim), dtype=np.float32)
    copy_ids, copy_values = np.empty_like(ids), np.empty_like(values)

    def add_at():
        unique, inverse = np.unique(ids, return_inverse=True)
        out = np.zeros((unique.size, dim), values.dtype)
        np.add.at(out, inverse, values)
        return unique, out

    def copy():
        np.copyto(copy_ids, ids)
        np.copyto(copy_values, values)

    unique, summed = dedup_sum(ids, values)  # compile / warm caches
    reference = add_at()
    # ids past SUM_CHUNK repeats are summed in chunks (hpcpax.ops.summation): equal to rounding
    magnitude = np.zeros_like(summed)
    np.add.at(magnitude, np.searchsorted(unique, ids), np.abs(values))
    assert np.array_equal(unique, reference[0])
    assert np.all(np.abs(summed - reference[1]) <= 1e-5 * magnitude)
    t = _median_times({"hpcpax": lambda: dedup_sum(ids, values), "add_at": add_at, "copy": copy},
                      repeats)
    input_bytes = ids.nbytes + values.nbytes
    copy_bw = input_bytes / t["copy"]
    dedup = {
        "n": n, "num_rows": num_rows, "dim": dim, "n_unique": int(unique.size),
        "hpcpax_s": t["hpcpax"], "add_at_s": t["add_at"], "copy_s": t["copy"],
        "copy_gbps": copy_bw / 1e9,
        "ratio_vs_add_at": t["add_at"] / t["hpcpax"],
        "fraction_of_copy_bw": (input_bytes / t["hpcpax"]) / copy_bw,
    }

    # Server-side Adagrad on 200k unique rows of a 1M x 64 table.
    table_rows, touched = (10_000, 2_000) if quick else (1_000_000, 200_000)
    opt = make_optimizer("adagrad", lr=0.01)
    params = {k: rng.standard_normal((table_rows, dim), dtype=np.float32) for k in ("numba", "numpy")}
    states = {k: opt.init_state((table_rows, dim), np.float32) for k in params}
    rows = rng.choice(table_rows, touched, replace=False).astype(np.int64)
    grads = rng.standard_normal((touched, dim), dtype=np.float32)
    opt.apply_rows(params["numba"], states["numba"], rows, grads)  # compile
    opt.apply_rows_reference(params["numpy"], states["numpy"], rows, grads)
    t2 = _median_times({
        "numba": lambda: opt.apply_rows(params["numba"], states["numba"], rows, grads),
        "numpy": lambda: opt.apply_rows_reference(params["numpy"], states["numpy"], rows, grads),
        "copy": copy,
    }, repeats)
    # read param, accumulator, grads; write param, accumulator (touched rows only)
    moved = touched * dim * 4 * 5 + rows.nbytes
    copy_moved_bw = 2 * input_bytes / t2["copy"]
    adagrad = {
        "table_rows": table_rows, "rows": touched, "dim": dim,
        "numba_s": t2["numba"], "numpy_s": t2["numpy"],
        "speedup_vs_numpy": t2["numpy"] / t2["numba"],
        "gbps": moved / t2["numba"] / 1e9,
        "fraction_of_copy_bw": (moved / t2["numba"]) / copy_moved_bw,
    }
    return {
        "threads": numba.get_num_threads(), "cpus": os.cpu_count(),
        "ratio_vs_add_at": dedup["ratio_vs_add_at"],
        "fraction_of_copy_bw": dedup["fraction_of_copy_bw"],
        "dedup_sum": dedup, "adagrad_rows": adagrad,
    }


#: Zipf exponent of the GPU kernels' ids (issue 47's workload).
GPU_ZIPF = 1.05
#: Kernels whose fraction of copy bandwidth the GPU run summarizes (worst over sizes).
GPU_KERNELS = ("dedup_sum", "scatter_add_rows", "gather_rows", "partition_pack", "adagrad_rows")


def _bit_equal_to_twins(cp, ids, values, table, part) -> dict:
    """Each CUDA op against its NumPy twin on the same input, bit for bit."""
    from hpcpax.ops import (dedup_sum_reference, gather_rows_reference,  # noqa: PLC0415
                            partition_pack_reference, scatter_add_rows_reference)

    host_ids, host_values, host_table = ids.get(), values.get(), table.get()
    unique, summed = dedup_sum(ids, values)
    want_unique, want_summed = dedup_sum_reference(host_ids, host_values)
    scattered = table.copy()
    scatter_add_rows(scattered, ids, values)
    packed = partition_pack(ids, values, part)
    want_packed = partition_pack_reference(host_ids, host_values, part)
    opt = make_optimizer("adagrad", lr=0.01)
    rows = want_unique[: min(len(want_unique), 100_000)]
    grads = want_summed[: len(rows)]
    device_param, host_param = table.copy(), host_table.copy()
    device_state = opt.init_state(table.shape, table.dtype, cp)
    host_state = opt.init_state(table.shape, table.dtype, np)
    opt.apply_rows(device_param, device_state, cp.asarray(rows), cp.asarray(grads))
    opt.apply_rows_reference(host_param, host_state, rows, grads)
    same = lambda a, b: bool(np.array_equal(a.view(np.uint32), b.view(np.uint32)))  # noqa: E731
    return {
        "dedup_sum": bool(np.array_equal(unique.get(), want_unique)) and same(summed.get(), want_summed),
        "scatter_add_rows": same(scattered.get(), scatter_add_rows_reference(host_table.copy(),
                                                                            host_ids, host_values)),
        "gather_rows": same(gather_rows(table, ids).get(), host_table[host_ids]),
        "partition_pack": bool(np.array_equal(packed.order.get(), want_packed.order))
        and same(packed.values.get(), want_packed.values),
        "adagrad_rows": same(device_param.get(), host_param),
    }


def gpu_benchmark(quick: bool, repeats: int) -> dict:
    """CuPy kernels at 1M and 10M Zipf(1.05) ids x 64 and x 128 float32 (``quick``: 100k x 64)."""
    from hpcpax.backend import cupy_module  # noqa: PLC0415

    cp = cupy_module(required=True)
    name = cp.cuda.runtime.getDeviceProperties(0)["name"]
    name = name.decode() if isinstance(name, bytes) else name

    def timed(fn) -> float:
        samples = []
        for _ in range(repeats):
            start, stop = cp.cuda.Event(), cp.cuda.Event()
            start.record()
            fn()
            stop.record()
            stop.synchronize()
            samples.append(cp.cuda.get_elapsed_time(start, stop) / 1e3)
        return statistics.median(samples)

    rng = np.random.default_rng(0)
    num_rows = 1_000_000
    sizes = [(100_000, 64)] if quick else [(1_000_000, 64), (1_000_000, 128), (10_000_000, 64), (10_000_000, 128)]
    results, bit_equal = [], None
    part = Partitioning("mod", num_rows, 8)
    opt = make_optimizer("adagrad", lr=0.01)
    for n, dim in sizes:
        ids = zipf_ids(n, num_rows, GPU_ZIPF, rng, xp=cp)
        values = cp.random.default_rng(n + dim).standard_normal((n, dim), dtype=cp.float32)
        table = cp.random.default_rng(dim).standard_normal((num_rows, dim), dtype=cp.float32)
        copy_dst = cp.empty_like(values)
        if bit_equal is None:
            bit_equal = _bit_equal_to_twins(cp, ids, values, table, part)
        unique, summed = dedup_sum(ids, values)  # compile
        state = opt.init_state(table.shape, table.dtype, cp)
        gather_rows(table, ids)
        scatter_add_rows(table, ids, values)
        partition_pack(ids, values, part)
        opt.apply_rows(table, state, unique, summed)
        t = {
            "copy": timed(lambda: cp.copyto(copy_dst, values)),
            "dedup_sum": timed(lambda: dedup_sum(ids, values)),
            "gather_rows": timed(lambda: gather_rows(table, ids)),
            "scatter_add_rows": timed(lambda: scatter_add_rows(table, ids, values)),
            "partition_pack": timed(lambda: partition_pack(ids, values, part)),
            "adagrad_rows": timed(lambda: opt.apply_rows(table, state, unique, summed)),
        }
        copy_bw = 2 * values.nbytes / t["copy"]  # read + write
        row_bytes = values.nbytes
        moved = {  # bytes read + written by each op's data (ids counted once)
            "dedup_sum": row_bytes + ids.nbytes + summed.nbytes,
            "gather_rows": 2 * row_bytes + ids.nbytes,
            "scatter_add_rows": row_bytes + ids.nbytes + 2 * summed.nbytes,
            "partition_pack": 2 * row_bytes + 2 * ids.nbytes,
            # param and accumulator read and written, gradients read, row ids
            "adagrad_rows": 5 * summed.nbytes + unique.nbytes,
        }
        entry = {"n": n, "dim": dim, "n_unique": int(unique.size), "copy_gbps": copy_bw / 1e9}
        for op, nbytes in moved.items():
            entry[op] = {"s": t[op], "gbps": nbytes / t[op] / 1e9,
                         "fraction_of_copy_bw": (nbytes / t[op]) / copy_bw}
        results.append(entry)
        del ids, values, table, copy_dst, unique, summed, state
        cp.get_default_memory_pool().free_all_blocks()
    worst = {op: min(e[op]["fraction_of_copy_bw"] for e in results) for op in GPU_KERNELS}
    return {"gpu_name": name, "zipf": GPU_ZIPF, "kernel_fraction_of_copy_bw": worst,
            "bit_equal_to_twin": bit_equal, "gpu": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (CI smoke test)")
    parser.add_argument("--gpu", action="store_true", help="benchmark the CuPy/CUDA kernels instead")
    parser.add_argument("--repeats", type=int, default=None, help="interleaved repeats (median)")
    args = parser.parse_args()
    repeats = args.repeats or (3 if args.quick else 7)
    out = {"benchmark": "kernels", "host": platform.node(), "quick": args.quick, "repeats": repeats}
    out.update(gpu_benchmark(args.quick, repeats) if args.gpu else cpu_benchmark(args.quick, repeats))
    print(json.dumps(out, sort_keys=False))


if __name__ == "__main__":
    main()
