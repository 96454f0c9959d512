"""Whether the Numba CPU fast path is on, and lazy access to its kernels.

Importing this module imports no Numba; :func:`kernels` imports
``_numba_kernels`` (and so Numba) on first use. ``hpcpax.options.numba =
False`` (``HPCPAX_NUMBA=0``) forces the plain NumPy path, for example to
compare the two.
"""

from __future__ import annotations

import os
import threading
from contextlib import contextmanager

import numpy as np

from ..options import options

_KERNELS = None
_TRIED = False
_DEFAULT_THREADS = None
_SCRATCH = threading.local()  # each thread's zeroed counting table (see dense_unique)
#: Counting-table entries kept between :func:`dense_unique` calls (5 bytes each);
#: a larger table is allocated for its call only.
SCRATCH_KEEP = 1 << 22

# Variables through which launchers tell each process how many ranks share its node.
_LOCAL_SIZE_VARIABLES = ("MPI_LOCALNRANKS", "OMPI_COMM_WORLD_LOCAL_SIZE",
                         "MV2_COMM_WORLD_LOCAL_SIZE", "SLURM_NTASKS_PER_NODE")


def enabled() -> bool:
    """True when Numba is importable and ``hpcpax.options.numba`` is on."""
    if not options.numba:
        return False
    return kernels() is not None


def kernels():
    """The ``_numba_kernels`` module, or None when Numba cannot be imported."""
    global _KERNELS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _own_thread_pool()
            from . import _numba_kernels  # noqa: PLC0415  (lazy: numba is slow to import)

            _KERNELS = _Kernels(_numba_kernels)
        except ImportError:
            _KERNELS = None
    return _KERNELS


class _Either:
    """A parallel kernel and its serial twin (the same code compiled without
    threads), called as :func:`threads_for` says: launching a parallel region,
    even on one thread, cost about 0.2 ms a call here, more than gathering a
    thousand rows takes. Both give bit-equal results (the kernels' loops are
    split by output row, never by summand)."""

    __slots__ = ("parallel", "serial")

    def __init__(self, parallel):
        import types

        import numba  # noqa: PLC0415

        self.parallel = parallel
        py = parallel.py_func
        twin = types.FunctionType(py.__code__, py.__globals__, py.__name__ + "_serial",
                                  py.__defaults__, py.__closure__)
        twin.__qualname__ = py.__qualname__ + "_serial"  # its own cache file
        twin.__module__, twin.__doc__ = py.__module__, py.__doc__
        options_ = {k: v for k, v in parallel.targetoptions.items()
                    if k in ("nogil", "boundscheck") and v is not None}
        from ._numba_cache import guard  # noqa: PLC0415

        self.serial = guard(numba.njit(cache=True, **options_)(twin))

    def __call__(self, *args):
        return (self.serial if _SERIAL[-1] else self.parallel)(*args)


class _Kernels:
    """The kernels module, its parallel kernels as :class:`_Either`."""

    def __init__(self, module):
        self._module = module
        for name, value in vars(module).items():
            if getattr(value, "targetoptions", {}).get("parallel"):
                setattr(self, name, _Either(value))

    def __getattr__(self, name):
        return getattr(self._module, name)


#: Stack of "serial now?" flags set by :func:`threads_for` (the last one rules).
_SERIAL = [False]


def _own_thread_pool() -> None:
    """Run Numba's parallel kernels on its own ``workqueue`` pool, not OpenMP's.

    Numba's ``omp`` layer shares the process's OpenMP runtime with PyTorch,
    so each ``numba.set_num_threads`` became torch's thread count too: after
    a few adapter steps a worker started with ``OMP_NUM_THREADS=1`` ran torch
    on 2 threads, and a one-rank DLRM step took 34-228 ms instead of 3 ms.
    A layer the user chose (``NUMBA_THREADING_LAYER``) is kept.
    """
    import numba  # noqa: PLC0415

    if "NUMBA_THREADING_LAYER" not in os.environ and \
            numba.config.THREADING_LAYER == "default":
        numba.config.THREADING_LAYER = "workqueue"


def default_threads() -> int:
    """Numba threads per process: ``hpcpax.options.numba_threads``, else the
    cores this process may use divided by the ranks on its node (so ranks on
    one node do not oversubscribe it)."""
    global _DEFAULT_THREADS
    if _DEFAULT_THREADS is None:
        if options.numba_threads is not None:
            _DEFAULT_THREADS = options.numba_threads
        else:
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
                else (os.cpu_count() or 1)
            local = 1
            for name in _LOCAL_SIZE_VARIABLES:
                value = os.environ.get(name, "").split("(")[0]
                if value.isdigit() and int(value) > 0:
                    local = int(value)
                    break
            _DEFAULT_THREADS = max(1, cores // local)
        import numba  # noqa: PLC0415

        _DEFAULT_THREADS = min(_DEFAULT_THREADS, numba.config.NUMBA_NUM_THREADS)
    return _DEFAULT_THREADS


def set_default_threads(threads: int) -> None:
    """Set :func:`default_threads` (e.g. from the MPI layout, by :func:`hpcpax.init`)."""
    global _DEFAULT_THREADS
    _DEFAULT_THREADS = max(1, int(threads))


@contextmanager
def threads_for(work: int):
    """Run the Numba kernels in this block on 1 thread for small ``work``,
    else on :func:`default_threads`."""
    import numba  # noqa: PLC0415

    # below this much work a parallel region costs more than it saves, and on a
    # shared or oversubscribed node it can stall on a thread that is not scheduled
    wanted = 1 if work < options.numba_serial_below else min(default_threads(),
                                                             numba.config.NUMBA_NUM_THREADS)
    _SERIAL.append(wanted == 1)  # one thread: the serial twins, no parallel region at all
    previous = numba.get_num_threads()
    try:
        if wanted == previous or wanted == 1:
            yield
            return
        numba.set_num_threads(wanted)
        try:
            yield
        finally:
            numba.set_num_threads(previous)
    finally:
        _SERIAL.pop()


def num_chunks(work_items: int, per_thread: int = 4) -> int:
    """Chunks for a parallel loop: a few per Numba thread, never more than items."""
    import numba  # noqa: PLC0415

    threads = 1 if _SERIAL[-1] else numba.get_num_threads()
    return max(1, min(work_items, threads * per_thread))


def dense_unique(ids, low, span):
    """Sorted unique ``ids`` (all in ``[low, low + span)``), the inverse and the
    counts, by the Numba counting-table kernel, on this thread's scratch table
    (kept zeroed between calls, up to :data:`SCRATCH_KEEP` entries). Local."""
    padded = (int(span) + 7) & ~7
    scratch = getattr(_SCRATCH, "tables", None)
    _SCRATCH.tables = None  # taken: a failure inside leaves no dirty table behind
    if scratch is None or scratch[0].size < padded:
        scratch = (np.zeros(padded, np.int32), np.zeros(padded, np.uint8))
    result = kernels().dense_unique(ids, low, span, *scratch)
    if scratch[0].size <= SCRATCH_KEEP:
        _SCRATCH.tables = scratch
    return result
