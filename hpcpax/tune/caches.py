"""Cold caches for the calibration: a step's other work between two timed calls.

A step's pull and push move other data between two computes, and its
compute moves other data between a pull and a push: a call timed back to
back with itself finds its code and data in the core's caches, which a step
does not. :func:`evict_caches` (untimed, before each timed call) writes
scratch memory to push them out: :mod:`hpcpax.tune.operation_costs` runs it
before the operations that follow the worker's own work.
"""

from __future__ import annotations

import numpy as np

__all__ = ["evict_caches", "private_cache_bytes"]

_EVICT = {}


def private_cache_bytes(cpu: int = 0) -> int:
    """Bytes of the largest cache private to one core (Linux sysfs; 2 MiB if unknown)."""
    import glob
    import os

    best = 0
    for index in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/cache/index*"):
        try:
            with open(os.path.join(index, "shared_cpu_list"), encoding="ascii") as handle:
                shared = handle.read().strip()
            with open(os.path.join(index, "size"), encoding="ascii") as handle:
                size = handle.read().strip()
        except OSError:
            continue
        if "," in shared or "-" in shared:
            continue  # shared between cores
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        best = max(best, int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return best or (2 << 20)


def evict_caches(nbytes: int | None = None) -> None:
    """Write ``nbytes`` of scratch memory (default 4 x :func:`private_cache_bytes`),
    pushing other data out of the core's private caches, as a step's pull and push
    do between two computes. Local."""
    nbytes = int(nbytes or 4 * private_cache_bytes())
    buf = _EVICT.get(nbytes)
    if buf is None:
        buf = _EVICT[nbytes] = np.zeros(nbytes // 8, np.float64)
    buf += 1.0
