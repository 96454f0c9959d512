"""The parameter server's wire protocol: one fixed header per operation.

Every PS operation starts with one small ``Allgather`` of a four-int64
header over ``topology.comm``: operation, variable index, status, argument.
That is how server ranks learn what to do next, how a worker that disagrees
with the others (another operation, another variable) is named on every
rank, and how a bad input on one worker makes every worker raise together
instead of deadlocking. Batched operations carry their variables as a bit
mask in the argument, relative to the header's variable index.

An owner that could not serve its part of an operation already under way
(a table that would outgrow the memory budget) answers it as well as it can
and :meth:`Protocol.defer` s the error: its next header carries
:data:`STATUS_DEFERRED`, and every rank, servers included, raises that
error before the next operation runs.
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.polling import FRACTION, spinning, wait
from ..options import options
from ..comm.agreement import STATUS_NONFINITE, STATUS_OK, refuse_together, status_of
from ..errors import MismatchError
from .memory import MemoryBudgetError

__all__ = ["Protocol", "OP_NAMES", "MAX_BATCH", "batches", "mask_of", "names_of", "status_of",
           "SERVER_POLL_FRACTION", "server_wait_cap", "server_wait"]

(OP_REGISTER, OP_PULL, OP_PUSH, OP_SHUTDOWN, OP_EXPORT, OP_REPARTITION, OP_IMPORT,
 OP_PULL_MANY, OP_PUSH_MANY) = range(1, 10)
OP_NAMES = {OP_REGISTER: "register", OP_PULL: "pull", OP_PUSH: "push", OP_SHUTDOWN: "shutdown",
            OP_EXPORT: "export", OP_REPARTITION: "repartition", OP_IMPORT: "import",
            OP_PULL_MANY: "pull_many", OP_PUSH_MANY: "push_many"}
MANY_OPS = (OP_PULL_MANY, OP_PUSH_MANY)
#: Variables per batched operation: their indices travel as a bit mask in
#: the header's int64 argument, relative to the header's variable index.
MAX_BATCH = 62
HEADER_INTS = 4  # op, variable index, status (see hpcpax.comm.agreement), argument
#: Header status of a rank holding a deferred error (any rank, servers included).
STATUS_DEFERRED = 99


#: A waiting BSP server sleeps at most this fraction of the time it has waited.
SERVER_POLL_FRACTION = FRACTION


def server_wait_cap(topology=None, idle=True) -> float:
    """How a BSP server rank waits for the workers' next operation: the longest sleep
    between two polls, 0 for a wait inside MPI.

    ``hpcpax.options.server_poll_seconds`` when set; else the one wait policy
    (:mod:`hpcpax.comm.polling`): ``options.poll_seconds`` under ``HPCPAX_WAIT=sleep``
    (the default: a server never holds a core a worker on its host could use),
    0 under ``spin``. Each sleep is at most :data:`SERVER_POLL_FRACTION` of the
    time waited so far. ``topology`` and ``idle`` are kept for callers that
    name the rank (the policy no longer depends on them).
    """
    cap = options.server_poll_seconds
    if cap is None:
        return 0.0 if spinning() else float(options.poll_seconds)
    return float(cap)


def server_wait(request, cap) -> None:
    """Complete ``request`` as a server waits (:func:`server_wait_cap`'s ``cap``):
    polling with a proportional backoff, or inside MPI when ``cap`` is 0."""
    wait([request], cap)


def batches(variables) -> list:
    """Split variables (sorted by index) into groups whose indices span < MAX_BATCH."""
    groups = []
    for var in variables:
        if groups and var.index - groups[-1][0].index < MAX_BATCH:
            groups[-1].append(var)
        else:
            groups.append([var])
    return groups


def mask_of(group) -> tuple:
    """``(base index, bit mask)`` of a group from :func:`batches`."""
    base = group[0].index
    return base, sum(1 << (v.index - base) for v in group)


def names_of(group) -> str:
    """The variables of a group, for messages."""
    return ", ".join(v.spec.name for v in group)


class Protocol:
    """Header exchange and the one bad-input protocol of the parameter server.

    Args:
        topology: from :func:`hpcpax.init`.
        variables: the server's list of registered variables by index
            (read when a header is described in an error message).
        nonfinite: ``raise`` or ``skip`` a push holding NaN/Inf.
    """

    def __init__(self, topology, variables, nonfinite="raise"):
        self.topology = topology
        self.variables = variables
        self.nonfinite = nonfinite
        #: Pushes skipped on every rank under ``nonfinite="skip"``.
        self.skipped_pushes = 0
        #: This rank's error from an operation it could not complete (see :meth:`defer`).
        self.deferred = None

    def defer(self, error) -> None:
        """Raise ``error`` on every rank at the next header (the first one deferred wins)."""
        if self.deferred is None:
            self.deferred = error

    def batch(self, base, mask) -> list:
        """The variables of a batched header: indices ``base + i`` for set bits ``i``."""
        return [self.variables[base + i] for i in range(MAX_BATCH)
                if mask >> i & 1 and base + i < len(self.variables)]

    def _describe(self, header) -> str:
        op, index, _, argument = (int(v) for v in header)
        if op in MANY_OPS:
            return f"{OP_NAMES[op]}({names_of(self.batch(index, argument))})"
        name = self.variables[index].spec.name if 0 <= index < len(self.variables) else index
        return f"{OP_NAMES.get(op, op)}({name}, {argument})"

    def header(self, op, var_index=-1, status=STATUS_OK, argument=0) -> np.ndarray:
        """Exchange this rank's header; **collective** over ``topology.comm``.

        Returns the workers' headers ``[num_workers, 4]``. Raises
        :class:`~hpcpax.errors.MismatchError` on every rank when the workers
        called different operations (or the same on different variables).
        """
        from ..comm.reductions import start_allgather

        topo = self.topology
        comm = topo.comm
        if self.deferred is not None:
            status = STATUS_DEFERRED
        mine = np.array([op, var_index, status, argument], np.int64)
        everyone = np.empty((comm.Get_size(), HEADER_INTS), np.int64)
        start = time.perf_counter()
        # non-blocking on every rank (a blocking collective does not match a
        # non-blocking one), so that a server can wait for the next operation
        # by the one wait policy (server_wait_cap) instead of inside MPI
        request = start_allgather(comm, mine, everyone)
        wait([request], server_wait_cap(topo) if topo.is_server else None)
        n = comm.Get_size() - 1
        topo.accounting.record_bytes("control", None, sent=n * mine.nbytes, recv=n * mine.nbytes,
                                     seconds=time.perf_counter() - start)
        if (everyone[:, 2] == STATUS_DEFERRED).any():
            self._raise_deferred(everyone)
        workers = everyone[topo.worker_ranks]
        first = workers[0]
        disagree = [r for r, h in zip(topo.worker_ranks, workers)
                    if (h[0], h[1], h[3]) != (first[0], first[1], first[3])]
        if disagree:
            raise MismatchError(
                f"workers called different parameter-server operations: rank "
                f"{topo.worker_ranks[0]} {self._describe(first)}, ranks {disagree} "
                f"{self._describe(everyone[disagree[0]])}")
        return workers

    def _raise_deferred(self, everyone):
        """Every rank raises the first deferred error (one ``bcast`` of its message)."""
        first = int(np.flatnonzero(everyone[:, 2] == STATUS_DEFERRED)[0])
        comm = self.topology.comm
        message = comm.bcast(str(self.deferred) if comm.Get_rank() == first else None,
                             root=first)
        self.deferred = None
        refused = OP_NAMES.get(int(everyone[self.topology.worker_ranks[0], 0]), "?")
        raise MemoryBudgetError(f"owner rank {first}: {message} (raised on every rank; the "
                                f"next operation, {refused}, was not run)")

    def check_status(self, workers, var_name, op_name, error=None) -> bool:
        """Raise on every worker if any worker reported bad input.

        **Collective** on the error path only: the first offender's message
        is broadcast so every rank's error names the variable and the value.
        Returns True when the operation is to be skipped (servers, or the
        ``nonfinite="skip"`` policy), False when it goes ahead.
        """
        topo = self.topology
        statuses = workers[:, 2]
        if not statuses.any():
            return False
        if self.nonfinite == "skip" and all(st in (STATUS_OK, STATUS_NONFINITE) for st in statuses):
            self.skipped_pushes += 1
            return True
        # the header's status column is every worker's; servers are always OK
        everyone = np.zeros(topo.size, np.int64)
        everyone[topo.worker_ranks] = statuses
        refuse_together(topo.comm, everyone, list(range(topo.size)), error,
                        f"{op_name} of {var_name!r}", raise_here=topo.is_worker)
        return True
