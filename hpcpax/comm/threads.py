"""Compute threads per rank: the node's cores shared among its ranks.

Several MPI ranks on one node, each with a BLAS (OpenBLAS/MKL) and a Numba
thread pool sized to the whole node, oversubscribe it many times over: on a
2-core machine with 4 ranks a 16-row matmul took 90 ms instead of 0.3 ms,
its threads spinning against each other and against MPI's polling.
:func:`limit_threads` gives each rank ``cores // ranks on the node`` threads
(at least 1), once, from :func:`hpcpax.init`; :func:`share_idle_cores`
divides them again among the ranks that have work, once a plan leaves some
ranks (servers holding no table) with none.

Environment:
    HPCPAX_THREADS: threads per rank; ``0`` leaves the pools alone.
"""

from __future__ import annotations

import os

from ..options import options

__all__ = ["limit_threads", "share_idle_cores", "thread_cap", "usable_cores"]

_LIMITER = None
_CAP = None


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def limit_threads(ranks_on_node: int) -> int | None:
    """Cap BLAS and Numba threads of this rank; returns the cap (None: left alone).

    Not collective. Uses threadpoolctl for the BLAS pool when it is installed.
    """
    global _LIMITER, _CAP
    threads = options.threads
    if threads == 0:
        return None
    if threads is None:
        threads = max(1, usable_cores() // max(1, int(ranks_on_node)))
    try:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        _LIMITER = threadpool_limits(limits=threads, user_api="blas")
    except ImportError:
        pass
    from ..ops import _numba  # noqa: PLC0415

    _numba.set_default_threads(threads)
    _CAP = threads
    return threads


def thread_cap() -> int | None:
    """The threads per rank :func:`limit_threads` set (None: none set, or ``HPCPAX_THREADS=0``);
    frameworks with pools of their own (PyTorch's) take the same cap."""
    return _CAP


def share_idle_cores(comm, busy: bool) -> int | None:
    """Divide this host's cores among its ranks that have work for the rest of the
    run; returns this rank's cap (None: left alone).

    **Collective** over ``comm``. A rank passing ``busy=False`` (a server whose
    fixed plan holds no table: it only sleeps in its wait policy) keeps its
    cap and stops counting; each busy rank gets ``cores // busy ranks on the
    host`` threads (BLAS, Numba, and PyTorch's through :func:`thread_cap`).
    With 1 server + 1 worker on 2 cores and every table replicated, the
    worker got 1 of the 2 cores while the other slept. ``HPCPAX_THREADS``
    (a number, or ``0``) is kept as set.
    """
    from mpi4py import MPI  # noqa: PLC0415

    shared = comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())
    try:
        busy_here = shared.allreduce(int(bool(busy)))
    finally:
        shared.Free()
    if not busy or options.threads is not None:
        return thread_cap()
    return limit_threads(max(1, busy_here))
