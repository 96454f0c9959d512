"""Physical limits of this machine, one JSON line: memory copy and MPI_Allreduce bandwidth.

- memory copy: ``np.copyto`` of a 256 MiB float32 array (quick: 16 MiB) on
  every rank at once; GB/s per rank = bytes / seconds (read + write move 2x
  that through memory);
- ``MPI_Allreduce`` (sum, float32, ``MPI.COMM_WORLD``) of 1, 16 and 64 MiB
  (quick: 64 KiB, 1 MiB): algbw = bytes / seconds, busbw = algbw x 2 (n-1)/n
  (the bandwidth each link must carry in a ring; comparable across n).

Sizes are timed interleaved (copy, 1, 16, 64 MiB, copy, ...), medians of
the slowest rank. Run: ``mpirun -n N python -m mpi4py benchmarks/limits.py``.
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, few repeats")
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    n, rank = comm.Get_size(), comm.Get_rank()
    repeats = args.repeats or (3 if args.quick else 7)
    copy_bytes = (16 << 20) if args.quick else (256 << 20)
    mib = [1 / 16, 1] if args.quick else [1, 16, 64]
    source = np.ones(copy_bytes // 4, np.float32)
    target = np.empty_like(source)
    buffers = {m: np.ones(int(m * (1 << 20)) // 4, np.float32) for m in mib}

    def allreduce(m):
        return lambda: comm.Allreduce(MPI.IN_PLACE, buffers[m], op=MPI.SUM)

    methods = {"copy": lambda: np.copyto(target, source)}
    methods.update({f"allreduce_{m:g}MiB": allreduce(m) for m in mib})
    times = _common.interleaved(comm, methods, repeats, warmup=1)
    result = {"benchmark": "limits", "ranks": n, "repeats": repeats,
              "copy_bytes": copy_bytes,
              "memcpy_GBps_per_rank": copy_bytes / _common.median(times["copy"]) / 1e9}
    for m in mib:
        seconds = _common.median(times[f"allreduce_{m:g}MiB"])
        algbw = buffers[m].nbytes / seconds / 1e9
        result[f"allreduce_{m:g}MiB_seconds"] = seconds
        result[f"allreduce_{m:g}MiB_algbw_GBps"] = algbw
        result[f"allreduce_{m:g}MiB_busbw_GBps"] = algbw * 2 * (n - 1) / n if n > 1 else None
    _common.emit(result, rank)


if __name__ == "__main__":
    main()
