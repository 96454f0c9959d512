"""The worker side of the relaxed parameter server: pulls, pushes, clocks, stops.

A worker's step under a relaxed model is::

    rows = client.pull(ids_by_name)    # one request per server, answered when
                                       # the server's consistency condition holds
    ... forward / backward ...
    client.push(grads_by_name)         # one message per server (the clock tick)

Nothing here is collective over the job: requests are point-to-point on the
relaxed communicator. In the hierarchical mode (groups = nodes) a node's
workers first exchange ids and gradients inside the node, exactly as the
collective path's local aggregation does (:class:`~hpcpax.ps.movement.Hop`
over ``topology.node_workers``: BSP inside the node), and each partition's
node delegate talks to its owner.

Waits poll with :class:`~hpcpax.comm.polling.Backoff` (no core held), and a
group leader answers the coordinator's stop messages while it waits.
"""

from __future__ import annotations

import time

import numpy as np

from ...backend import array_module, to_host
from ...comm.messages import Mailbox
from ...comm.polling import Backoff, wait_all
from ...comm.reductions import start_max_in_place
from ...errors import NonFiniteError
from ...ops import dedup_sum, partition_pack
from . import wire
from ..movement import Hop
from ..sparse_grad import check_indices, prepare_push

__all__ = ["RelaxedClient"]

NO_STOP = np.iinfo(np.int64).max


class RelaxedClient:
    """One worker rank's side of the relaxed parameter server.

    Args:
        topology: from :func:`hpcpax.init`.
        comm: the relaxed communicator (a duplicate of ``topology.comm``).
        ps: the :class:`~hpcpax.ps.server.ParameterServer` (layouts, specs).
        groups: the job's :class:`~hpcpax.ps.relaxed.clocks.Groups`.
        watchdog: optional :class:`~hpcpax.comm.watchdog.Watchdog`.
    """

    def __init__(self, topology, comm, ps, groups, watchdog=None):
        self.topology, self.comm, self.ps, self.groups = topology, comm, ps, groups
        self.watchdog = watchdog
        self.group = groups.group_of[topology.rank]
        self.is_leader = groups.leader(self.group) == topology.rank
        nw = topology.node_workers
        self.node = nw if groups.mode == "node" and nw is not None and nw.Get_size() > 1 else None
        self._node_ranks = (np.array(nw.allgather(topology.rank), np.int64)
                            if self.node is not None else None)
        self.coordinator = topology.server_ranks[0]
        #: Steps this worker has pushed (its clock).
        self.clock = 0
        self.phase = -1
        self._mail = Mailbox(comm)
        self.skipped_pushes = 0

    # ----------------------------------------------------------------- phase
    def start(self, phase, clock) -> None:
        """A phase begins at ``clock`` (after the servers entered it)."""
        self.phase, self.clock = int(phase), int(clock)
        self.stop_at = None
        self.reported = self.requested = False
        self.group_preempted = False

    def _var(self, name):
        try:
            return self.ps.variables[name]
        except KeyError:
            raise KeyError(f"unknown sparse variable {name!r}; registered: "
                           f"{sorted(self.ps.variables)}") from None

    # ------------------------------------------------------------------ pull
    def pull(self, ids_by_name) -> dict:
        """``{name: (unique sorted ids, rows)}``, rows answered under each variable's model.

        Not collective over the job (inside the node in the hierarchical
        mode). Raises :class:`~hpcpax.errors.SparseIndexError` for an id out
        of range before anything is sent.
        """
        names = list(ids_by_name)
        variables = sorted((self._var(n) for n in names), key=lambda v: v.index)
        uniques = []
        for var in variables:
            ids = ids_by_name[var.spec.name]
            xp = array_module(ids)
            unique = xp.unique(ids.astype(xp.int64, copy=False))
            check_indices(var.spec.name, unique, var.spec.rows)
            uniques.append(unique)
        if self.node is None:
            rows = self._fetch(variables, uniques)
        else:
            hop = self._node_hop(variables, uniques, None)
            mine, inverses = [], []
            for (got,) in hop.send():
                unique, inverse = np.unique(got, return_inverse=True)
                mine.append(unique)
                inverses.append(inverse.reshape(-1))
            fetched = self._fetch(variables, mine)
            rows = hop.reply([r[inv] for r, inv in zip(fetched, inverses)])
        out = {}
        for var, unique, r in zip(variables, uniques, rows):
            out[var.spec.name] = (unique, array_module(unique).asarray(r))
        return {n: out[n] for n in names}

    def _node_hop(self, variables, ids, values):
        size = self.node.Get_size()
        packs = [(v.layout.partitioning, i, None if values is None else values[k],
                  v.layout.delegate_of_part(size))
                 for k, (v, i) in enumerate(zip(variables, ids))]
        return Hop(self.node, self.topology.accounting, "intra_node",
                   [v.spec.name for v in variables], packs, ranks=self._node_ranks)

    def _pack(self, variables, ids, values=None):
        """Per server rank: ``[(index, ids, values)]``; and each variable's packing order."""
        size = self.comm.Get_size()
        per_server = {s: [] for s in self.topology.server_ranks}
        orders = []
        for k, var in enumerate(variables):
            packed = partition_pack(ids[k], None if values is None else values[k],
                                    var.layout.partitioning, var.layout.owner_rank_of_part, size)
            packed_ids = to_host(packed.indices)
            packed_values = None if values is None else to_host(packed.values)
            orders.append(to_host(packed.order))
            for s in per_server:
                lo, n = int(packed.displs[s]), int(packed.counts[s])
                per_server[s].append((var.index, packed_ids[lo:lo + n],
                                      None if values is None else packed_values[lo:lo + n]))
        return per_server, orders

    def _fetch(self, variables, ids) -> list:
        """Host rows of each variable's ids (unique, owned by servers), in the ids' order."""
        per_server, orders = self._pack(variables, ids)
        formats = {v.index: (v.spec.dim, v.spec.dtype) for v in variables}
        replies, requests = {}, []
        for s, sections in per_server.items():
            size = wire.reply_bytes([(i, len(x)) for i, x, _ in sections], formats)
            replies[s] = np.empty(size, np.uint8)
            requests.append(self._mail.receive_into(replies[s], s, wire.TAG_REPLY))
        for s, sections in per_server.items():
            self._send(s, wire.pack(wire.PULL, self.phase, self.clock, sections))
        start = time.perf_counter()
        wait_all(requests, self._while_waiting_in_step)
        seconds = time.perf_counter() - start
        parts = [[] for _ in variables]
        for s in per_server:  # server ranks ascending: the packing order
            _, phase, _, _, sections = wire.unpack(replies[s], formats, with_ids=False,
                                                   with_values=True)
            for k, (_, _, rows) in enumerate(sections):
                parts[k].append(rows)
        acct, out = self.topology.accounting, []
        for k, var in enumerate(variables):
            rows = np.concatenate(parts[k]) if parts[k] else np.zeros((0, var.spec.dim),
                                                                      var.spec.dtype)
            unpacked = np.empty_like(rows)
            unpacked[orders[k]] = rows
            out.append(unpacked)
            sent = len(ids[k]) * 8
            acct.record_bytes("pull", var.spec.name, sent=sent, recv=rows.nbytes,
                              seconds=seconds / len(variables))
        return out

    # ------------------------------------------------------------------ push
    def push(self, grads) -> bool:
        """Send this step's gradients ``{name: SparseGrad}``; the clock advances.

        Not collective over the job. Every server gets one message (possibly
        empty: it is the clock tick). Bad input (ids out of range, wrong
        width or dtype, NaN/Inf under ``nonfinite="raise"``) raises here
        before anything is sent, and the tables stay untouched. Returns False
        when a NaN/Inf push was skipped (``nonfinite="skip"``: the clock
        still advances, with no rows).
        """
        variables = sorted((self._var(n) for n in grads), key=lambda v: v.index)
        ids, values, skip = [], [], False
        for var in variables:
            try:
                i, v = prepare_push(var.spec, grads[var.spec.name])
            except NonFiniteError:
                if self.ps.nonfinite != "skip":
                    raise
                skip = True
                i = np.zeros(0, np.int64)
                v = np.zeros((0, var.spec.dim), var.spec.dtype)
            ids.append(i)
            values.append(v)
        if skip:
            self.skipped_pushes += 1
            ids = [i[:0] for i in ids]
            values = [v[:0] for v in values]
        if self.node is not None:
            hop = self._node_hop(variables, ids, values)
            ids, values = [], []
            for got_ids, got_values in hop.send():
                i, v = dedup_sum(got_ids, got_values)
                ids.append(i)
                values.append(v)
        per_server, _ = self._pack(variables, ids, values)
        for s, sections in per_server.items():
            self._send(s, wire.pack(wire.PUSH, self.phase, self.clock, sections))
        acct = self.topology.accounting
        for var, i, v in zip(variables, ids, values):
            acct.record_bytes("push", var.spec.name, sent=i.nbytes + v.nbytes)
        self.clock += 1
        return not skip

    def _send(self, dest, buffer) -> None:
        self._mail.reap()
        self._mail.send_bytes(buffer, dest, wire.TAG_REQUEST)

    # -------------------------------------------------------------- control
    def _while_waiting_in_step(self) -> None:
        if self.is_leader:
            self._poll_control(mid_step=True)

    def answer_control(self) -> None:
        """Answer the coordinator's stop messages that arrived (the group's leader; a
        no-op on the others): for a worker that waits between two steps outside this
        client, so a stop agreement never waits for it."""
        if self.is_leader:
            self._poll_control()

    def _poll_control(self, mid_step=False) -> None:
        """Leader: answer the coordinator's stop messages that arrived."""
        while True:
            buffer = self._mail.take_bytes(wire.TAG_CONTROL, source=self.coordinator)
            if buffer is None:
                return
            kind, phase, value, _, _ = wire.header(buffer)
            if phase != self.phase:
                raise RuntimeError(f"relaxed PS: rank {self.topology.rank} got a "
                                   f"{wire.KIND_NAMES.get(kind)} of phase {phase} in {self.phase}")
            if kind == wire.STOP_QUERY:
                self.reported = True
                self._send(self.coordinator, wire.control(wire.CLOCK_REPORT, self.phase,
                                                          self.clock + int(mid_step)))
            elif kind == wire.STOP_AT:
                self.stop_at = int(value)
            else:
                raise RuntimeError(f"relaxed PS: unexpected {wire.KIND_NAMES.get(kind, kind)} "
                                   f"on rank {self.topology.rank} during a phase")

    def boundary(self, static_stop, preempted=False) -> bool:
        """At a step boundary: whether this worker stops at its current clock.

        Args:
            static_stop: the clock this worker stops at anyway (end of a
                bsp/ssp run, the next checkpoint or evaluation), the same on
                every worker of the group.
            preempted: a preemption signal reached this worker.

        The leader asks the coordinator to stop the job when the group was
        signalled, answers its clock queries, and waits here for its stop
        clock after answering one; the group agrees on the result (one
        small ``Iallreduce`` inside the node in the hierarchical mode).
        """
        stop = int(static_stop)
        if self.is_leader:
            self._poll_control()
            if (preempted or self.group_preempted) and not self.requested:
                self.requested = True
                self._send(self.coordinator, wire.control(wire.STOP_REQUEST, self.phase))
            if self.reported and self.stop_at is None and self.clock < stop:
                with self._guard("relaxed stop: waiting for the stop clock"):
                    backoff = Backoff()
                    while self.stop_at is None:
                        backoff.pause()
                        self._poll_control()
            if self.stop_at is not None:
                stop = min(stop, self.stop_at)
        if self.node is not None:
            vector = np.array([stop if self.is_leader else 0, int(preempted)], np.int64)
            request = start_max_in_place(self.node, vector)
            wait_all([request])
            stop, self.group_preempted = int(vector[0]), bool(vector[1])
        return self.clock >= stop

    def _guard(self, name):
        if self.watchdog is None:
            from contextlib import nullcontext

            return nullcontext()
        return self.watchdog.guard(name)

    def drain(self) -> None:
        """End this worker's phase: everything sent, every server told and answered.

        Sends a drain (after every push and pull of the phase, so a server
        reads it last) to every server and waits for each one's receipt,
        consuming any stop message the coordinator sent meanwhile.
        """
        for s in self.topology.server_ranks:
            self._send(s, wire.control(wire.DRAIN, self.phase, self.clock))
        pending = set(self.topology.server_ranks)
        backoff = Backoff()
        with self._guard("relaxed drain"):
            while pending:
                buffer = self._mail.take_bytes(wire.TAG_CONTROL)
                if buffer is None:
                    backoff.pause()
                    continue
                kind = wire.header(buffer)[0]
                if kind == wire.DRAINED:
                    pending.discard(self._mail.last_source)
            self._mail.flush_polled()
