"""Waiting for MPI messages without holding a core: poll, then sleep with backoff.

MPI libraries busy-poll inside blocking calls (``MPI_Wait``, ``MPI_Probe``),
so a rank waiting there keeps a core at 100 %: on a node with more ranks
than cores it steals the time of the ranks doing the work, and a server
that waits for requests burns a core doing nothing. :class:`Backoff` polls
a few times, then sleeps between polls, doubling the sleep up to
``hpcpax.options.poll_seconds`` (``HPCPAX_POLL_SECONDS``, default 1 ms):
an idle rank then costs about a thousand cheap polls a second, and a
message waits at most one cap before it is seen.
"""

from __future__ import annotations

import time

from ..options import options

__all__ = ["Backoff", "wait_all", "idle_barrier"]

_SPINS = 20  # polls before the first sleep: most answers on one node come this fast
_FIRST_SLEEP = 2e-5


class Backoff:
    """The sleep between two polls of a waiting rank.

    Args:
        cap: longest sleep in seconds (default ``hpcpax.options.poll_seconds``).
    """

    def __init__(self, cap=None, fraction=None):
        self.cap = float(options.poll_seconds if cap is None else cap)
        self.fraction = None if fraction is None else float(fraction)
        self.reset()

    def reset(self) -> None:
        """Something arrived: poll eagerly again."""
        self._spins = 0
        self._sleep = _FIRST_SLEEP
        self._since = None

    def pause(self) -> None:
        """Nothing arrived: spin a little, then sleep (doubling up to the cap; with a
        ``fraction``, each sleep at most that fraction of the time waited so far, so the
        latency it adds stays that fraction of the wait)."""
        if self._spins < _SPINS:
            self._spins += 1
            if self._since is None:
                self._since = time.perf_counter()
            return
        if self.fraction is not None:
            waited = time.perf_counter() - self._since
            self._sleep = max(_FIRST_SLEEP, self.fraction * waited)
        time.sleep(min(self._sleep, self.cap))
        if self.fraction is None:
            self._sleep = min(self._sleep * 2.0, self.cap)


def wait_all(requests, while_waiting=None, backoff=None) -> None:
    """Complete MPI ``requests`` by polling with :class:`Backoff` (not ``Waitall``).

    Args:
        requests: ``MPI.Request`` objects.
        while_waiting: called between polls (e.g. to answer control messages).
        backoff: a :class:`Backoff` to use (default a fresh one).
    """
    from mpi4py import MPI

    requests = [r for r in requests if r is not None]
    if not requests:
        return
    backoff = backoff or Backoff()
    while not MPI.Request.Testall(requests):
        if while_waiting is not None:
            while_waiting()
        backoff.pause()


def idle_barrier(comm, nap_s=0.0005) -> None:
    """A barrier that waits without spinning (``Ibarrier`` polled with naps): for ranks
    with nothing to do while others time something, so that on a host with more ranks
    than cores they do not take the cores of the ranks being timed."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(nap_s)
