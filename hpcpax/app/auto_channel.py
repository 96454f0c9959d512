"""``--consistency auto`` decisions taken while an ``ssp`` phase runs, without stopping it.

Inside a relaxed phase the workers never meet. At a segment's last step
``b`` each worker sends its figures of the segment to the first worker
(point-to-point, on a duplicate of the workers' communicator) and steps
on; the first worker picks them up between its own steps, decides, and
sends the decision back to every worker. The decision takes effect at step
``b + S + LEAD`` (``S`` the staleness in force): under ``ssp:S`` no worker
can be further than step ``b + S`` when the slowest one finishes ``b``, so
the decision is normally there before anyone needs it. A worker that
reaches that step first waits for it (the seconds are counted). Every
worker applies the decision before the same step, so batch shares change
at the same global batch everywhere.

Messages are pickled objects (a few kilobytes: a segment's per-step
figures, the policy's state), sent with ``isend`` and received after an
``iprobe``, so a waiting rank polls with
:class:`~hpcpax.comm.polling.Backoff` and keeps answering the relaxed
coordinator's stop queries (``while_waiting``).
"""

from __future__ import annotations

import time

from ..comm.messages import Mailbox
from ..comm.polling import Backoff

__all__ = ["DecisionChannel", "LEAD"]

#: Steps after ``b + S`` at which a decision made on segment end ``b`` applies.
LEAD = 3

_FIGURES, _DECISION = 11, 12


class DecisionChannel:
    """Figures to the first worker, decisions back; **collective** to build and to close.

    Args:
        workers: the workers' communicator (rank 0 decides).
    """

    def __init__(self, workers):
        self.comm = workers.Dup()
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self._mail = Mailbox(self.comm)
        self._figures = {}  # first worker: worker -> (boundary, figures)
        #: Seconds this worker waited for a decision (or, first worker, for figures).
        self.wait_seconds = 0.0

    @property
    def is_leader(self) -> bool:
        """Whether this worker decides."""
        return self.rank == 0

    def _isend(self, payload, dest, tag) -> None:
        self._mail.reap()
        self._mail.send_object(payload, dest, tag)

    def send_figures(self, boundary, figures) -> None:
        """Every worker: this worker's figures of the segment ending at step ``boundary``."""
        if self.is_leader:
            self._figures[0] = (int(boundary), figures)
        else:
            self._isend((int(boundary), figures), 0, _FIGURES)

    def collect(self, boundary, block, while_waiting=None):
        """First worker: every worker's figures of ``boundary`` (by worker index), or None
        while some are missing and ``block`` is false."""
        wait = _Wait(block, while_waiting)
        while True:
            while True:
                arrived, figures = self._mail.take_object(_FIGURES)
                if not arrived:
                    break
                self._figures[self._mail.last_source] = figures
            mine = {w: f for w, (b, f) in self._figures.items() if b == int(boundary)}
            if len(mine) == self.size:
                for w in mine:
                    del self._figures[w]
                self.wait_seconds += wait.seconds
                return [mine[w] for w in range(self.size)]
            if not wait.pause():
                return None

    def send_decision(self, boundary, payload) -> None:
        """First worker: the decision on ``boundary`` to every other worker."""
        for dest in range(1, self.size):
            self._isend((int(boundary), payload), dest, _DECISION)

    def receive_decision(self, boundary, block, while_waiting=None):
        """Other workers: the decision on ``boundary``, or None while it has not come
        and ``block`` is false."""
        wait = _Wait(block, while_waiting)
        while True:
            arrived, message = self._mail.take_object(_DECISION, source=0)
            if arrived:
                break
            if not wait.pause():
                return None
        got, payload = message
        self.wait_seconds += wait.seconds
        if got != int(boundary):
            raise RuntimeError(f"consistency auto: worker {self.rank} expected the decision "
                               f"on step {boundary}, got the one on step {got}")
        return payload

    def close(self) -> None:
        """Complete the sends and free the communicator; **collective** over the workers."""
        self._mail.flush()
        self.comm.Free()


class _Wait:
    """Polling for a message: ``pause()`` False when not blocking; seconds spent."""

    def __init__(self, block, while_waiting):
        self.block, self.while_waiting = block, while_waiting
        self.began = time.perf_counter()
        self.backoff = Backoff()

    @property
    def seconds(self) -> float:
        return time.perf_counter() - self.began if self.block else 0.0

    def pause(self) -> bool:
        if not self.block:
            return False
        if self.while_waiting is not None:
            self.while_waiting()
        self.backoff.pause()
        return True
