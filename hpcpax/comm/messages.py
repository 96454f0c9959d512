"""Tagged messages between ranks: sends that never block, and whatever has arrived.

The message-driven parts of hpcpax (the relaxed parameter server and its
clients, the hot-row trees, the ``--consistency auto`` channel) talk through
a :class:`Mailbox` instead of mpi4py's point-to-point calls, so that only
:mod:`hpcpax.comm` names MPI and another transport has one class to provide.

A mailbox wraps one communicator (it does not own it). Two kinds of
payload: byte buffers (``numpy.uint8`` arrays or any contiguous array seen as
bytes; the fast path, no pickling) and Python objects (small control
messages). A send returns at once and keeps its buffer alive until MPI is
done with it; :meth:`Mailbox.reap` drops finished sends, :meth:`Mailbox.flush`
waits for all of them.
"""

from __future__ import annotations

import numpy as np

__all__ = ["Mailbox", "ANY", "tag_limit", "wait_some", "done_now"]

#: ``source`` for a message from any rank.
ANY = -1


def _mpi():
    from mpi4py import MPI

    return MPI


def _source(source):
    return _mpi().ANY_SOURCE if source == ANY else int(source)


def _bytes(array):
    return [np.asarray(array).reshape(-1).view(np.uint8), _mpi().BYTE]


class Mailbox:
    """Non-blocking tagged sends and receives over ``comm`` (local, not collective).

    Attributes:
        comm: the communicator (mpi4py, or anything with the same methods).
        last_source: the sender of the message :meth:`take_bytes` or
            :meth:`take_object` returned last.
    """

    def __init__(self, comm):
        self.comm = comm
        self._sends = []  # (request, buffer kept alive until the send is done)
        self._status = _mpi().Status()
        self.last_source = None

    # ---------------------------------------------------------------- sends
    def send_bytes(self, array, dest: int, tag: int) -> None:
        """Start sending ``array``'s bytes to rank ``dest``; it must not change until sent."""
        self._sends.append((self.comm.Isend(_bytes(array), dest=int(dest), tag=int(tag)),
                            array))

    def send_object(self, payload, dest: int, tag: int) -> None:
        """Start sending a picklable ``payload`` to rank ``dest``."""
        self._sends.append((self.comm.isend(payload, dest=int(dest), tag=int(tag)), None))

    def reap(self) -> int:
        """Forget the sends that are done; how many are still in flight."""
        self._sends = [(r, b) for r, b in self._sends if not r.Test()]
        return len(self._sends)

    def flush(self, cap=0) -> None:
        """Wait until every send has left this rank's buffers.

        ``cap``: 0 waits inside MPI; a number of seconds (or None, the policy's
        default) waits by the one wait policy (:func:`hpcpax.comm.polling.wait`).
        """
        from .polling import wait

        if self._sends:
            wait([r for r, _ in self._sends], cap)
        self._sends = []

    def flush_polled(self, while_waiting=None) -> None:
        """:meth:`flush`, always polling (never inside MPI), ``while_waiting`` between polls."""
        from .polling import wait_all

        wait_all([r for r, _ in self._sends], while_waiting)
        self._sends = []

    # ------------------------------------------------------------- receives
    def take_bytes(self, tag: int, source=ANY):
        """The next arrived byte message with ``tag`` (from ``source``), or None now.

        Returns a new ``uint8`` array; :attr:`last_source` names the sender.
        """
        message = self.comm.Improbe(_source(source), int(tag), self._status)
        if message is None:
            return None
        buffer = np.empty(self._status.Get_count(_mpi().BYTE), np.uint8)
        message.Recv([buffer, _mpi().BYTE])
        self.last_source = self._status.Get_source()
        return buffer

    def take_object(self, tag: int, source=ANY):
        """``(True, payload)`` for the next arrived object message, or ``(False, None)``."""
        message = self.comm.improbe(source=_source(source), tag=int(tag), status=self._status)
        if message is None:
            return False, None
        self.last_source = self._status.Get_source()
        return True, message.recv()

    def receive_into(self, array, source: int, tag: int):
        """Start receiving a byte message from ``source`` into ``array``; its request."""
        return self.comm.Irecv(_bytes(array), source=_source(source), tag=int(tag))


def tag_limit(comm) -> int:
    """The largest tag ``comm`` accepts (MPI promises at least 32767)."""
    return int(comm.Get_attr(_mpi().TAG_UB))


def wait_some(requests):
    """Block until at least one of ``requests`` is done; the indices of those done."""
    return _mpi().Request.Waitsome(requests) or []


def done_now(requests):
    """The indices of ``requests`` that are done now (none: an empty list)."""
    return _mpi().Request.Testsome(requests) or []
