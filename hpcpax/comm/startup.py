"""Start-up and departure under a timeout: a rank that never arrives is named, the job ends;
no rank leaves before every rank is done.

The watchdog (:mod:`hpcpax.comm.watchdog`) can only watch once every rank
has created it, which is itself collective. A rank stuck before that (in
imports, in a slow or hung file system, stopped by a signal) would leave the
others waiting in their first collective forever. :func:`check_arrival` runs
before any collective: every rank tells rank 0 it has arrived with a small
point-to-point message, rank 0 waits for all of them up to the timeout and
then answers; whoever waits too long prints which ranks are missing (rank 0)
or that rank 0 is (the others) and aborts the job.

:func:`leave_together` is the other end: before ``MPI_Finalize`` every rank
agrees on one exit status and waits until every rank got there. A launcher
may stop the ranks still running as soon as one exits non-zero (``srun
--kill-on-bad-exit``), so a rank that left while another was still writing
its outputs turned the preemption status 3 into a killed job.
"""

from __future__ import annotations

import json
import math
import os
import socket
import sys
import time

import numpy as np

from .deathwatch import abort_job
from .watchdog import resolve_timeout

__all__ = ["check_arrival", "leave_together"]

_TAG_ARRIVE, _TAG_GO = 7311, 7312
_POLL_SECONDS = 0.02


def _wait(requests, deadline) -> list:
    """Indices of ``requests`` still pending at ``deadline`` (polling, no spinning)."""
    pending = list(range(len(requests)))
    while pending and time.monotonic() < deadline:
        pending = [i for i in pending if not requests[i].Test()]
        if pending:
            time.sleep(_POLL_SECONDS)
    return pending


def check_arrival(comm=None, timeout=None, *, abort=None) -> float:
    """Wait until every rank of ``comm`` has started; **collective** over ``comm``.

    Point-to-point only (no collective that a missing rank could hang).

    Args:
        comm: the job's communicator (default ``MPI.COMM_WORLD``).
        timeout: seconds; None = ``hpcpax.options.timeout``; 0 waits without a limit
            (the ranks still meet: one whose timeout is 0 and one whose is not,
            a setting :func:`hpcpax.init` then refuses, must not wait for each
            other in different places).
        abort: called with the report instead of ``comm.Abort(1)`` (tests).

    Returns:
        Seconds waited.
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    timeout = resolve_timeout(timeout)
    rank, size = comm.Get_rank(), comm.Get_size()
    if size == 1:
        return 0.0
    start = time.monotonic()
    deadline = start + timeout if timeout else math.inf
    me = json.dumps({"rank": rank, "host": socket.gethostname(), "pid": os.getpid()})
    if rank == 0:
        boxes = [bytearray(256) for _ in range(size)]
        requests = [comm.Irecv([boxes[r], MPI.BYTE], source=r, tag=_TAG_ARRIVE)
                    for r in range(1, size)]
        missing = [i + 1 for i in _wait(requests, deadline)]
        if missing:
            return _give_up(comm, abort, f"hpcpax start-up: ranks {missing} of {size} did not "
                            f"arrive within {timeout:g} s (stuck in imports, in MPI_Init or "
                            f"before hpcpax started; HPCPAX_TIMEOUT); rank 0 is {me}", requests)
        go = np.ones(1, np.int64)
        MPI.Request.Waitall([comm.Isend([go, MPI.INT64_T], dest=r, tag=_TAG_GO)
                             for r in range(1, size)])
        return time.monotonic() - start
    payload = bytearray(me.encode()[:256].ljust(256))
    sent = comm.Isend([payload, MPI.BYTE], dest=0, tag=_TAG_ARRIVE)
    go = np.zeros(1, np.int64)
    received = comm.Irecv([go, MPI.INT64_T], source=0, tag=_TAG_GO)
    if _wait([received], deadline):
        return _give_up(comm, abort, f"hpcpax start-up: rank {rank} ({me}) waited {timeout:g} s "
                        "for rank 0 to see every rank arrive; rank 0 is stuck or some rank "
                        "never started (HPCPAX_TIMEOUT)", [sent, received])
    sent.Wait()
    return time.monotonic() - start


def _give_up(comm, abort, report, requests):
    print(report, file=sys.stderr, flush=True)
    if abort is not None:
        for request in requests:
            if request:  # still pending (a completed request is null)
                request.Cancel()
        abort(report)
        return -1.0
    time.sleep(0.5)  # let the launcher forward the line before the abort
    abort_job(1, comm)
    return -1.0  # pragma: no cover - Abort does not return


def leave_together(status, comm=None, timeout=None, *, abort=None) -> int:
    """The exit status every rank of ``comm`` leaves with, once all got here; **collective**.

    One non-blocking ``Allreduce`` (the highest status wins), polled without
    spinning, so it is also the last barrier before ``MPI_Finalize``.

    Args:
        status: this rank's exit status.
        comm: the job's communicator (default ``MPI.COMM_WORLD``).
        timeout: seconds to wait for the others; None = ``hpcpax.options.timeout``;
            0 waits without limit.
        abort: called with the report instead of ``comm.Abort(status)`` (tests).

    Returns:
        The agreed status (``status`` itself on a one-rank communicator).
    """
    from mpi4py import MPI

    comm = comm if comm is not None else MPI.COMM_WORLD
    timeout = resolve_timeout(timeout)
    if comm.Get_size() == 1:
        return int(status)
    mine = np.array([int(status)], np.int64)
    agreed = np.zeros(1, np.int64)
    request = comm.Iallreduce([mine, MPI.INT64_T], [agreed, MPI.INT64_T], op=MPI.MAX)
    deadline = time.monotonic() + timeout if timeout else float("inf")
    if _wait([request], deadline):
        report = (f"hpcpax: rank {comm.Get_rank()} ({socket.gethostname()}) finished, but "
                  f"not every rank did within {timeout:g} s (HPCPAX_TIMEOUT); ending the job "
                  f"with status {int(status)}")
        print(report, file=sys.stderr, flush=True)
        if abort is not None:
            abort(report)
            return int(status)
        time.sleep(0.5)  # let the launcher forward the line before the abort
        abort_job(status, comm)
    return int(agreed[0])
