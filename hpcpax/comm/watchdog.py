"""No silent hang: a per-rank watchdog that names the ranks a job waits for.

A rank that dies or stops answering leaves every other rank blocked in its
next collective, forever. :class:`Watchdog` runs a daemon thread on every
rank; the main thread wraps each operation that must finish in bounded time
in :meth:`Watchdog.guard` (the trainer guards each set-up phase and every
step, the parameter server every served operation). When a guarded operation runs longer than
the timeout, that rank's thread asks every other rank, on a private
duplicate of the communicator, what it is doing, waits a short grace period
for the answers, prints **one** report to stderr and aborts the whole job::

    hpcpax watchdog: rank 2 stuck 31.0 s in 'step 17' (HPCPAX_TIMEOUT=30);
    no answer from ranks [3] (dead or stopped?) on host node2 (unreachable?);
    ranks [0, 1] in 'step 17'; ranks [] behind

Answers come from the other ranks' threads, so a rank busy in a blocking
MPI call still answers; a killed or stopped process does not, which is how
it is named. The thread needs ``MPI_THREAD_MULTIPLE`` (mpi4py's default).

Timeout: the ``timeout`` argument, else ``$HPCPAX_TIMEOUT`` seconds, else
600; 0 disables the watchdog (no thread, :meth:`guard` does nothing).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from ..errors import ConfigError
from .deathwatch import abort_job, start_death_watch
from ..options import options

__all__ = ["Watchdog", "DEFAULT_TIMEOUT", "resolve_timeout"]

#: Seconds a guarded operation may take when neither argument nor environment says.
DEFAULT_TIMEOUT = 600.0
_TAG_QUERY, _TAG_ANSWER = 7301, 7302
_ANSWER_BYTES = 512
_POLL_SECONDS = 0.1
_FORWARD_SECONDS = 0.5


def resolve_timeout(timeout=None) -> float:
    """``timeout``, else ``hpcpax.options.timeout`` (``$HPCPAX_TIMEOUT``, default 600 s; 0 = off)."""
    if timeout is None:
        return float(options.timeout)
    try:
        value = float(timeout)
    except (TypeError, ValueError):
        raise ConfigError(f"timeout must be a number of seconds, not {timeout!r}") from None
    if not value >= 0:
        raise ConfigError(f"timeout must be >= 0 seconds, not {timeout!r}")
    return value


class Watchdog:
    """Abort the job with a report when a guarded operation exceeds ``timeout``.

    **Collective** to create (duplicates ``comm``) and to :meth:`close`.

    Args:
        comm: the job's communicator (every rank of it must create one).
        timeout: seconds; None = ``$HPCPAX_TIMEOUT`` or 600; 0 disables.
        grace: seconds to collect the other ranks' answers before aborting.
        abort: called instead of ``MPI.COMM_WORLD.Abort(1)`` (tests).
        role: what this rank is ("worker", "server"), for the report of a rank that
            died (:mod:`hpcpax.comm.deathwatch`, started here the first time).
    """

    def __init__(self, comm, timeout=None, *, grace=3.0, abort=None, role=None):
        self.timeout = resolve_timeout(timeout)
        self.grace = float(grace)
        self.rank = comm.Get_rank()
        self.size = comm.Get_size()
        self.ops_completed = 0
        self.last_op = None
        self.report = None
        self._abort = abort
        self._current = None  # (name, start time) of the guarded operation
        self._activity = None  # (name, the guarded operation it runs in) of activity()
        self._idle_since = time.monotonic()
        self._stop = threading.Event()
        self._thread = None
        self._comm = None
        self._sends = []
        # a killed rank is named by a watcher that outlives the launcher's clean-up
        self._death_watch = start_death_watch(comm, role)
        if self.timeout == 0:
            return
        self._comm = comm.Dup()
        # host of every rank, so that a report names the node a silent rank is on
        self._hosts = self._comm.allgather(_mpi().Get_processor_name())
        self._query = np.zeros(1, np.int64)
        self._query_request = self._comm.Irecv([self._query, _mpi().INT64_T],
                                               source=_mpi().ANY_SOURCE, tag=_TAG_QUERY)
        self._thread = threading.Thread(target=self._watch, name="hpcpax-watchdog", daemon=True)
        self._thread.start()

    @property
    def enabled(self) -> bool:
        """False when the timeout is 0."""
        return self._thread is not None

    @contextmanager
    def guard(self, name: str, since=None):
        """Run the ``with`` body as operation ``name``, watched. Local; nestable.

        ``since`` (a ``time.monotonic()`` value) backdates the start: a server
        waiting for a rank that has been silent since then.
        """
        outer = self._current
        self._current = (str(name), time.monotonic() if since is None else float(since))
        try:
            yield self
        finally:
            self._current = outer
            self.ops_completed += 1
            self.last_op = str(name)
            self._idle_since = time.monotonic()

    @contextmanager
    def activity(self, name: str):
        """Run the ``with`` body as ``name`` for the host's death watch only. Local; not timed.

        A rank killed inside is reported as in ``name`` (a server's checkpoint
        write, which runs between its guarded operations), not as idle after its
        last guarded operation; a guard opened inside names itself instead.
        """
        outer = self._activity
        self._activity = (str(name), self._current)
        self._death_watch.note(self.doing())  # now: the body may be short, the thread polls
        try:
            yield self
        finally:
            self._activity = outer
            self._death_watch.note(self.doing())

    def doing(self) -> str:
        """What this rank does now, for the host's death watch (local)."""
        current, activity = self._current, self._activity
        if activity is not None and activity[1] is current:
            return activity[0]
        if current is not None:
            return current[0]
        return f"idle after {self.last_op!r}"

    def status(self) -> dict:
        """What this rank does now: ``{rank, ops, op, seconds, last}`` (local)."""
        current = self._current
        now = time.monotonic()
        if current is None:
            return {"rank": self.rank, "ops": self.ops_completed, "op": None,
                    "seconds": round(now - self._idle_since, 1), "last": self.last_op}
        return {"rank": self.rank, "ops": self.ops_completed, "op": current[0],
                "seconds": round(now - current[1], 1), "last": self.last_op}

    # ------------------------------------------------------------ the thread
    def _answer_queries(self):
        """Answer every pending "status?" query (watchdog thread)."""
        MPI = _mpi()
        state = MPI.Status()
        while self._query_request.Test(state):
            asker = state.Get_source()
            payload = json.dumps(self.status()).encode()[:_ANSWER_BYTES].ljust(_ANSWER_BYTES)
            buffer = bytearray(payload)
            self._sends.append((self._comm.Isend([buffer, MPI.BYTE], dest=asker,
                                                 tag=_TAG_ANSWER), buffer))
            self._query_request = self._comm.Irecv([self._query, MPI.INT64_T],
                                                   source=MPI.ANY_SOURCE, tag=_TAG_QUERY)
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]

    def _watch(self):
        while not self._stop.wait(_POLL_SECONDS):
            self._answer_queries()
            current = self._current
            self._death_watch.note(self.doing())
            if current is not None and time.monotonic() - current[1] > self.timeout:
                self._fire(current)
                return

    def _fire(self, current):
        """Ask every rank for its state, print one report, abort the job."""
        MPI = _mpi()
        name, started = current
        others = [r for r in range(self.size) if r != self.rank]
        asks, answers = [], {}
        receives = {}
        me = np.array([self.rank], np.int64)
        for r in others:
            asks.append(self._comm.Isend([me, MPI.INT64_T], dest=r, tag=_TAG_QUERY))
            buffer = bytearray(_ANSWER_BYTES)
            receives[r] = (self._comm.Irecv([buffer, MPI.BYTE], source=r, tag=_TAG_ANSWER),
                           buffer)
        deadline = time.monotonic() + self.grace
        while receives and time.monotonic() < deadline:
            self._answer_queries()  # other ranks that timed out ask us too
            for r, (request, buffer) in list(receives.items()):
                if request.Test():
                    answers[r] = json.loads(bytes(buffer).decode().strip())
                    del receives[r]
            time.sleep(0.02)
        stuck = time.monotonic() - started
        self.report = _format_report(self.rank, name, stuck, self.timeout, answers,
                                     sorted(receives), self.ops_completed, self._hosts)
        # Several ranks time out together; the lowest of them that is alive
        # prints, the others only add one short line (1 s slack: they fire
        # one poll apart).
        reporters = [r for r, a in sorted(answers.items()) if r < self.rank
                     and a["op"] is not None and a["seconds"] >= self.timeout - 1.0]
        if reporters:
            text = (f"hpcpax watchdog: rank {self.rank} also stuck {stuck:.1f} s in {name!r}; "
                    f"rank {reporters[0]} reports")
        else:
            text = self.report
        print(text, file=sys.stderr, flush=True)
        if reporters:
            # Let the reporter finish: it may fire up to one poll-slack
            # second later and then waits up to ``grace`` for answers,
            # including ours, so keep answering while we wait (a sleeping
            # thread here made the reporter wait for us and die in our
            # abort before it printed).
            deadline = time.monotonic() + 2.0 * self.grace + 1.0
            while time.monotonic() < deadline:
                self._answer_queries()
                time.sleep(0.02)
        if self._abort is not None:
            self._abort(self.report)
            return
        # The launcher forwards stderr asynchronously and drops what is in
        # flight when the abort kills the job: give the report a moment.
        time.sleep(_FORWARD_SECONDS)
        abort_job(1)

    # ----------------------------------------------------------------- close
    def close(self) -> None:
        """Stop the thread and free the communicator. **Collective**."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        if self.report is not None:
            return  # fired: the job is being aborted, touch nothing
        self._query_request.Cancel()
        self._query_request.Wait()
        for request, _ in self._sends:
            if not request.Test():
                request.Cancel()
                request.Wait()
        self._sends = []
        self._comm.Free()
        self._comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _format_report(rank, name, stuck, timeout, answers, silent, my_ops, hosts=None):
    """The one-line diagnosis: who is stuck where, who never answered (where), who is behind."""
    groups, behind = {}, []
    for r, answer in sorted(answers.items()):
        if answer["op"] is None:
            behind.append(r)
        else:
            groups.setdefault(answer["op"], []).append(r)
    parts = [f"hpcpax watchdog: rank {rank} stuck {stuck:.1f} s in {name!r} "
             f"(HPCPAX_TIMEOUT={timeout:g})",
             f"no answer from ranks {silent}" + (" (dead or stopped?)" if silent else "")]
    if silent and hosts:
        lost = sorted({hosts[r] for r in silent})
        parts[-1] += f" on host{'s' if len(lost) > 1 else ''} {', '.join(lost)} (unreachable?)"
    parts += [f"ranks {ranks} in {op!r}" for op, ranks in groups.items()]
    detail = ", ".join(f"rank {r} idle {answers[r]['seconds']:.1f} s after "
                       f"{answers[r]['last']!r} ({answers[r]['ops']} ops, mine {my_ops})"
                       for r in behind)
    parts.append(f"ranks {behind} behind" + (f": {detail}" if detail else ""))
    return "; ".join(parts) + "; aborting the job"


def _mpi():
    from mpi4py import MPI

    return MPI
