"""The one wait policy: how every rank waits for MPI requests without holding a core.

MPI libraries busy-poll inside blocking calls (``MPI_Wait``, ``MPI_Probe``,
a blocking collective), so a rank waiting there keeps a core at 100 %: a
parameter server waiting for the workers' next operation, or a worker
waiting for its pulled rows, takes the core a worker on the same host needs
for its forward pass (measured: a DLRM step's ``embedding_bag`` took 7.7 ms
instead of 0.02 ms beside a spinning server on 2 cores).

Every wait between and inside hpcpax's operations (the server's next
header, the sparse exchanges, the dense buckets started during the
backward pass, the relaxed server and clients, the hot-row trees) goes
through :func:`wait` (or a :class:`Backoff` where the waiting loop does
other work too). One exception, measured: the transports' synchronous
calls wait inside MPI. They serve the synchronous dense allreduce
(:meth:`~hpcpax.comm.allreduce.DenseAllreduce.allreduce`) and the leaders'
allreduce and node broadcast of a hierarchical one. (The BSP step starts
its dense allreduce before the sparse push, whose polls progress it, and
waits for the rest with :func:`wait`.) Every worker is already in those
calls (in a model with sparse tables a straggler is waited for in the
sparse push before them; in a dense-only model they wait for it too), and
a polled wait adds a wake-up to each round of the collective. Measured
on 16 emulated nodes (hybrid, 5 alternated runs each): dense phase 47-50
ms blocking against 55-64 ms polled, samples/s -2.6 % polled (a 0.1 ms cap was as fast
as blocking and as busy); 4 ranks on 2 cores, 64 KB: 0.3 ms blocking
against 3.3 ms polled (MPICH yields the core inside blocking calls when
ranks outnumber cores). The price is CPU: the phase keeps each worker's
core busy (``cpu_busy_max`` 0.45-0.52 against 0.33-0.36 polled at 16
nodes; see ``docs/measurements.md``). The policy is
``hpcpax.options.wait`` (``HPCPAX_WAIT``):

- ``sleep`` (default): poll for :data:`SPIN_SECONDS` (inside an operation
  already under way, whose peers are in it too, :data:`WITHIN_SPIN_SECONDS`
  while such waits end that fast: see below), then sleep between polls;
  each sleep is at most :data:`FRACTION` of the time waited so far (so the
  latency it adds stays a tenth of the wait) and at most
  ``options.poll_seconds`` (1 ms). An idle rank costs about a thousand
  cheap polls a second: a few percent of a core.
- ``spin``: wait inside MPI (the lowest latency), for nodes with a spare
  core per rank.

The longer spin inside an operation pays only when the wait ends within it
(it saves a wake-up of ~60 us); a wait that outlasts it has spun 2 ms for
nothing, and on a host with more ranks than cores the spinning ranks take
the turns of the ranks whose work the round waits for (on slow links every
exchange of a step waits for its bytes: 16 emulated nodes on 2 cores spent
most of their pull and push CPU in this spin). So each kind of wait inside
an operation (the ``within`` name, e.g. the exchanges' ``"counts"`` and
``"rows"``) keeps its last :data:`HISTORY` durations and spins the long
time only while their median ended within it (:func:`within_spin_seconds`);
otherwise it spins :data:`SPIN_SECONDS`, like any other wait. A wait's
duration is seen either way (its sleeps are a tenth of it), so the choice
follows the waits when they become short again.

On Linux the sleeping thread's timer slack is set to 1 us once
(``PR_SET_TIMERSLACK``): the kernel's default 50 us slack would make the
shortest sleep about 100 us instead of about 20 us.
"""

from __future__ import annotations

import sys
import time
from collections import deque

from ..options import options

__all__ = ["Backoff", "wait", "wait_all", "idle_barrier", "spinning", "within_spin_seconds",
           "within_waits", "SPIN_SECONDS", "WITHIN_SPIN_SECONDS", "FRACTION", "HISTORY"]

#: Seconds a waiting rank polls without sleeping: most answers inside an operation
#: come this fast (the next collective of a pull or push), and the shortest sleep
#: costs ~60 us here.
SPIN_SECONDS = 1e-4
#: Seconds a rank polls before sleeping inside an operation already under way (the
#: later exchanges of a pull or push, whose peers are in the same operation): each
#: sleep there would cost a wake-up (~60 us, far more on a VM whose idle vCPU halts).
WITHIN_SPIN_SECONDS = 2e-3
#: Each sleep of a proportional :class:`Backoff` is at most this share of the wait so far.
FRACTION = 0.1
#: Durations kept per kind of wait inside an operation (:func:`within_spin_seconds`).
HISTORY = 16
_WITHIN_HISTORY: dict = {}
_SPINS = 20  # polls before the first sleep of a Backoff without a fraction
_MAX_SPINS = 5000  # a proportional Backoff's bound on polls, should the clock stall
_FIRST_SLEEP = 2e-5
_SLACK = []


def _fine_timer_slack() -> None:
    """Make this thread's sleeps end within ~1 us of their time (Linux; once)."""
    if _SLACK or not sys.platform.startswith("linux"):
        return
    _SLACK.append(True)
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(29, 1000, 0, 0, 0)  # PR_SET_TIMERSLACK, 1 us
    except (OSError, AttributeError):
        pass


def spinning() -> bool:
    """True when the policy is to wait inside MPI (``HPCPAX_WAIT=spin``)."""
    return options.wait == "spin"


class Backoff:
    """The sleep between two polls of a waiting rank.

    Args:
        cap: longest sleep in seconds (default ``hpcpax.options.poll_seconds``).
        fraction: with a fraction, poll for :data:`SPIN_SECONDS`, then make
            each sleep at most this share of the time waited so far (a bounded
            relative latency); without, poll 20 times, then double the sleep up
            to the cap.
    """

    def __init__(self, cap=None, fraction=None, spin=SPIN_SECONDS):
        self.cap = float(options.poll_seconds if cap is None else cap)
        self.fraction = None if fraction is None else float(fraction)
        self.spin = float(spin)
        _fine_timer_slack()
        self.reset()

    def reset(self) -> None:
        """Something arrived: poll eagerly again."""
        self._spins = 0
        self._sleep = _FIRST_SLEEP
        self._since = None

    def pause(self) -> None:
        """Nothing arrived: spin a little, then sleep (see the class)."""
        if self.fraction is not None:
            now = time.perf_counter()
            if self._since is None:
                self._since = now
            waited = now - self._since
            if waited < self.spin and self._spins < _MAX_SPINS:
                self._spins += 1
                return
            self._sleep = max(_FIRST_SLEEP, self.fraction * waited)
            time.sleep(min(self._sleep, self.cap))
            return
        if self._spins < _SPINS:
            self._spins += 1
            return
        time.sleep(min(self._sleep, self.cap))
        self._sleep = min(self._sleep * 2.0, self.cap)


def _median(durations) -> float:
    return sorted(durations)[len(durations) // 2]


def within_spin_seconds(kind) -> float:
    """Seconds a wait of ``kind`` inside an operation polls before it sleeps:
    :data:`WITHIN_SPIN_SECONDS` until :data:`HISTORY` ``// 2`` such waits are
    known and while the median of the last :data:`HISTORY` ended within it,
    else :data:`SPIN_SECONDS` (see the module)."""
    durations = _WITHIN_HISTORY.get(kind, ())
    if len(durations) < HISTORY // 2 or _median(durations) <= WITHIN_SPIN_SECONDS:
        return WITHIN_SPIN_SECONDS
    return SPIN_SECONDS


def within_waits() -> dict:
    """This rank's kinds of waits inside an operation: per kind, the median of its
    last durations (``median_s``), how many (``waits``) and the spin it now uses
    (``spin_s``, :func:`within_spin_seconds`)."""
    return {str(kind): {"median_s": _median(durations), "waits": len(durations),
                        "spin_s": within_spin_seconds(kind)}
            for kind, durations in _WITHIN_HISTORY.items()}


def _remember_within(kind, seconds: float) -> None:
    durations = _WITHIN_HISTORY.get(kind)
    if durations is None:
        durations = _WITHIN_HISTORY[kind] = deque(maxlen=HISTORY)
    durations.append(seconds)


def wait(requests, cap=None, within=False) -> None:
    """Complete MPI ``requests`` by the wait policy (see the module).

    Args:
        requests: ``MPI.Request`` objects (``None`` entries are skipped).
        cap: longest sleep; 0 waits inside MPI (default: the policy, with
            ``options.poll_seconds``).
        within: the wait is inside an operation under way (its peers are in it
            too): a name for this kind of wait (``True`` is one shared kind);
            poll :func:`within_spin_seconds` of it before the first sleep.
    """
    from mpi4py import MPI

    requests = [r for r in requests if r is not None]
    if not requests:
        return
    if cap == 0 or (cap is None and spinning()):
        MPI.Request.Waitall(requests)
        return
    start = time.perf_counter()
    if not MPI.Request.Testall(requests):
        spin = SPIN_SECONDS if within is False else within_spin_seconds(within)
        backoff = Backoff(cap, fraction=FRACTION, spin=spin)
        while not MPI.Request.Testall(requests):
            backoff.pause()
    if within is not False:
        _remember_within(within, time.perf_counter() - start)


def wait_all(requests, while_waiting=None, backoff=None) -> None:
    """Complete MPI ``requests`` by polling with :class:`Backoff` (never inside MPI,
    whatever the policy: ``while_waiting`` must run between polls).

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
