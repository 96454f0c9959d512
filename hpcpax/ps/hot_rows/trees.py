"""Point-to-point traffic of hot-row trees, among exactly the ranks of each tree.

A tree's messages (a pulled group going down a broadcast tree, a pushed
group's partial sums going up a chain) are nonblocking sends and receives
between a member and its parent or children only: nobody else takes part,
and a member forwards a chunk as soon as it has it (pipelining needs no
rounds). :class:`TreeTraffic` posts them, progresses them until every one
has completed, and counts their bytes exactly per phase, variable and peer.

Tags: the messages of one tree piece (an owner's group, or one chunk of it)
carry the tag :meth:`TreeTraffic.tag` ``(owner, index)``, unique per owner
and piece, from :data:`TAG_BASE` up (below it, other point-to-point users of
the communicator); an owner numbers at most
:attr:`TreeTraffic.pieces_per_owner` pieces (the tags up to the library's
``MPI_TAG_UB`` shared among the ranks), and its groups past them move as
today. A piece moves as two messages, ids then rows (or rows
alone), with the same tag: MPI keeps their order between two ranks.
"""

from __future__ import annotations

import time

import numpy as np

from ...comm.messages import Mailbox, done_now, tag_limit, wait_some
from ...comm.polling import FRACTION, Backoff

__all__ = ["TAG_BASE", "POLL_FRACTION", "TreeTraffic"]

#: A polling member sleeps at most this fraction of the time it has waited.
POLL_FRACTION = FRACTION

#: The first tag of tree messages (half the library's largest tag where that is smaller).
TAG_BASE = 1 << 16


class TreeTraffic:
    """Sends and receives of one operation's trees on ``comm``; local bookkeeping.

    Args:
        comm: the communicator (its ranks are world ranks for accounting).
        accounting: :class:`~hpcpax.comm.accounting.Accounting` or None.
        names: the operation's variable names (index ``k`` in :meth:`send`).
        timed_phase: the phase charged with the seconds of :meth:`run`.

    Posting is local; :meth:`run` completes this rank's part (it returns
    when this rank's receives and sends are done, not everybody's).
    """

    def __init__(self, comm, accounting, names, timed_phase):
        self.comm, self.accounting, self.names = comm, accounting, list(names)
        self.timed_phase = timed_phase
        self.size = comm.Get_size()
        upper = tag_limit(comm)  # MPI promises only 32767
        self._base = min(TAG_BASE, upper // 2)
        self._pieces_per_owner = max(0, (upper - self._base) // self.size)
        self._mail = Mailbox(comm)
        self._receives, self._unit_of = [], []
        self._units = []  # [arrays, messages still to come, callback]
        self._bytes = {}  # phase -> (sent[K, size], received[K, size])
        self._owner = {}  # "egress"/"ingress" -> row bytes per peer (Accounting.record_owner)

    @property
    def pieces_per_owner(self) -> int:
        """How many tree pieces one owner may number in one operation (0: none;
        a group past it moves as today)."""
        return self._pieces_per_owner

    def tag(self, owner, index) -> int:
        """The tag of piece ``index`` (``0 <= index < pieces_per_owner``) of ``owner``."""
        return self._base + int(owner) * self._pieces_per_owner + int(index)

    def _count(self, phase, k, peer, nbytes, column):
        if phase not in self._bytes:
            self._bytes[phase] = (np.zeros((len(self.names), self.size), np.int64),
                                  np.zeros((len(self.names), self.size), np.int64))
        self._bytes[phase][column][k, peer] += nbytes

    def _count_owner(self, owner, peer, nbytes):
        if owner is not None:
            self._owner.setdefault(owner, np.zeros(self.size, np.int64))[peer] += nbytes

    def send(self, dest, tag, arrays, phase, k, owner=None) -> None:
        """Send ``arrays`` (host, C-contiguous) to ``dest``, one message each;
        ``owner="ingress"``: rows to their owner (see ``Accounting.record_owner``)."""
        for array in arrays:
            array = np.ascontiguousarray(array)
            self._mail.send_bytes(array, dest, tag)
            self._count(phase, k, int(dest), array.nbytes, 0)
            self._count_owner(owner, int(dest), array.nbytes)

    def expect(self, source, tag, likes, phase, k, callback, owner=None) -> None:
        """Receive one array per ``(shape, dtype)`` of ``likes`` from ``source``;
        ``callback(arrays)`` runs (inside :meth:`run`) once all have arrived.
        ``owner="egress"``: rows from their owner."""
        unit = len(self._units)
        arrays = [np.empty(shape, dtype) for shape, dtype in likes]
        self._units.append([arrays, len(arrays), callback])
        for array in arrays:
            self._receives.append(self._mail.receive_into(array, source, tag))
            self._unit_of.append(unit)
            self._count(phase, k, int(source), array.nbytes, 1)
            self._count_owner(owner, int(source), array.nbytes)

    def run(self, poll=0.0) -> None:
        """Progress until this rank's receives (each unit's callback run, in
        arrival order) and sends have completed; then count the bytes.

        ``poll``: 0 waits inside MPI (which busy-polls a core); a cap in
        seconds polls with a :class:`~hpcpax.comm.polling.Backoff` instead
        (:func:`~hpcpax.ps.hot_rows.routing.poll_cap`: the one wait policy).
        """
        start = time.perf_counter()
        pending = len(self._receives)
        backoff = Backoff(poll, fraction=POLL_FRACTION) if poll > 0 else None
        while pending:
            if backoff is None:
                done = wait_some(self._receives)
            else:
                done = done_now(self._receives)
                if not done:
                    backoff.pause()
                    continue
                backoff.reset()
            for index in done or ():
                pending -= 1
                unit = self._units[self._unit_of[index]]
                unit[1] -= 1
                if unit[1] == 0:
                    unit[2](unit[0])  # may post sends
        self._mail.flush(poll)
        seconds = time.perf_counter() - start
        if self.accounting is None:
            return
        for direction, per_peer in self._owner.items():
            self.accounting.record_owner(direction, per_peer)
        for phase, (sent, received) in self._bytes.items():
            self.accounting.record_batched_exchange(
                phase, self.names, sent, received,
                seconds if phase == self.timed_phase else 0.0)
        if self.timed_phase not in self._bytes:
            self.accounting.record_seconds(self.timed_phase, None, seconds)
