"""The message-driven server of the relaxed consistency models (server ranks).

Between two barriers (a *phase*) a server rank runs :meth:`RelaxedServer.run`:
it takes each request as it arrives (``Improbe`` + matched receive on the
relaxed communicator, sleeping with backoff when there is none, so an idle
server uses almost no CPU), and:

- a **push** (one per worker per step, empty or not: it is also the worker's
  clock tick) is applied exactly once: on arrival with the row optimizer
  for ``asp``/``psp`` variables; for ``ssp``/``bsp`` variables it joins the
  sum of its clock, which is applied once every worker pushed that clock
  (summed in worker order, as the collective path does);
- a **pull** is answered when its consistency condition holds
  (:meth:`~hpcpax.ps.relaxed.consistency.Consistency.ready`), else it waits in a
  queue that is looked at again after every push;
- a **drain** from a worker means it sent everything of this phase; the
  phase ends when every worker drained (nothing in flight, nothing pending).

The first server also coordinates stops (preemption, and the end of an
``asp``/``psp`` run after the job's worker-steps): it asks every group's
leader for its clock and tells each where to stop: ``asp`` workers where
they are, the others all at the highest clock (an ``ssp`` clock must be
complete, a ``psp`` pull may wait for a peer to get there).

A watchdog guard names the worker a server has waited for longest when it
has been silent for ``HPCPAX_TIMEOUT`` seconds.
"""

from __future__ import annotations

import time

import numpy as np

from ...comm.messages import Mailbox
from ...comm.polling import Backoff
from ...ops import dedup_sum
from . import wire
from .clocks import ClockTable, StalenessLog

__all__ = ["RelaxedServer"]


class _Pull:
    """A pull waiting for its consistency condition."""

    __slots__ = ("source", "group", "clock", "sections", "samples", "arrived")

    def __init__(self, source, group, clock, sections, samples):
        self.source, self.group, self.clock = source, group, clock
        self.sections, self.samples, self.arrived = sections, samples, time.perf_counter()


class RelaxedServer:
    """One server rank's side of the relaxed parameter server.

    Args:
        topology: from :func:`hpcpax.init`.
        comm: the relaxed communicator (a duplicate of ``topology.comm``).
        ps: the :class:`~hpcpax.ps.server.ParameterServer` holding the rows.
        consistency_of: ``name -> Consistency`` of each variable.
        groups: the job's :class:`~hpcpax.ps.relaxed.clocks.Groups`.
        seed: seed of the psp samples.
        watchdog: optional :class:`~hpcpax.comm.watchdog.Watchdog`.
    """

    def __init__(self, topology, comm, ps, consistency_of, groups, seed=0, watchdog=None):
        self.topology, self.comm, self.ps = topology, comm, ps
        self._mail = Mailbox(comm)
        self.consistency_of, self.groups, self.watchdog = consistency_of, groups, watchdog
        self.clocks = ClockTable(groups)
        self.rng = np.random.default_rng([int(seed), topology.rank, 7403])
        self.is_coordinator = topology.rank == topology.server_ranks[0]
        #: ``{str(consistency): StalenessLog}`` over every phase.
        self.logs = {}
        self.stats = {"pushes": 0, "pulls": 0, "phases": 0, "busy_seconds": 0.0,
                      "idle_seconds": 0.0, "cpu_seconds": 0.0, "phase_seconds": 0.0,
                      "sleeps": 0}
        #: ``[(name, start, end, args)]`` (``perf_counter`` seconds) of every request
        #: handled and every pull held back, when a trace is recorded (else None).
        self.events = None

    # ----------------------------------------------------------------- phase
    def run(self, phase, clocks, budget=None) -> None:
        """Serve one phase: until every worker drained.

        Args:
            phase: the phase number (every rank passes the same).
            clocks: every worker's clock at the start, by worker index.
            budget: worker-steps after which the coordinator stops the run
                (asp/psp), or None.
        """
        self._start(phase, clocks, budget)
        mail = self._mail
        backoff = Backoff()
        cpu, began = time.process_time(), time.perf_counter()
        while len(self.drained) < len(self.groups.workers):
            silent, since = self._longest_silent()
            name = (f"relaxed server: waiting for rank {silent}" if silent is not None
                    else "relaxed server: serving")
            with self._guard(name, since):
                buffer = mail.take_bytes(wire.TAG_REQUEST)
                if buffer is None:
                    mail.reap()
                    idle = time.perf_counter()
                    backoff.pause()
                    self.stats["idle_seconds"] += time.perf_counter() - idle
                    self.stats["sleeps"] += 1
                    continue
                source = mail.last_source
                start = time.perf_counter()
                self._handle(source, buffer)
                end = time.perf_counter()
                self.stats["busy_seconds"] += end - start
                if self.events is not None:
                    kind = int(np.frombuffer(buffer, np.int64, count=1)[0])
                    self.events.append((f"serve {wire.KIND_NAMES.get(kind, kind)}", start, end,
                                        {"from": source}))
                backoff.reset()
        mail.flush()
        if self.waiting:
            raise RuntimeError(f"relaxed PS: phase {phase} ended with "
                               f"{len(self.waiting)} unanswered pulls")
        # Workers that stopped at different clocks leave clocks unfinished: their
        # sums are applied now (once); the rest of those clocks joins later phases.
        for clock in sorted(self.pending):
            self._apply_clock(clock)
        self.stats["cpu_seconds"] += time.process_time() - cpu
        self.stats["phase_seconds"] += time.perf_counter() - began
        self.stats["phases"] += 1

    def _start(self, phase, clocks, budget):
        self.phase = int(phase)
        self.clocks.start(clocks)
        self.closed = self.clocks.min_clock  # clocks below are applied everywhere
        self.pending = {}  # clock -> {variable index: [(rank, ids, values)]}
        self.waiting = []
        self.drained = set()
        self.budget = budget
        now = time.monotonic()
        self.last_heard = {r: now for r in self.groups.workers}
        self.paused = set()  # groups waiting for their stop clock
        self.variables = {v.index: v for v in self.ps.variables.values()}
        self.formats = {i: (v.spec.dim, v.spec.dtype) for i, v in self.variables.items()}
        self.models = {i: self.consistency_of(v.spec.name) for i, v in self.variables.items()}
        self.stop = None  # coordinator: {"reports": {group: clock}, "sent": bool}

    def _guard(self, name, since):
        if self.watchdog is None:
            from contextlib import nullcontext

            return nullcontext()
        return self.watchdog.guard(name, since=since)

    def _longest_silent(self):
        """The worker heard from longest ago that we still expect to hear from."""
        waiting = {p.source for p in self.waiting}
        candidates = [(t, r) for r, t in self.last_heard.items()
                      if r not in self.drained and r not in waiting
                      and self.groups.group_of[r] not in self.paused]
        if not candidates:
            return None, None
        since, rank = min(candidates)
        return rank, since

    # -------------------------------------------------------------- messages
    def _handle(self, source, buffer) -> None:
        kind, phase, clock, argument, _ = wire.header(buffer)
        self.last_heard[source] = time.monotonic()
        if phase != self.phase:
            raise RuntimeError(f"relaxed PS: rank {source} sent a {wire.KIND_NAMES.get(kind)} "
                               f"of phase {phase} during phase {self.phase}")
        if kind == wire.PUSH:
            self._push(source, buffer)
        elif kind == wire.PULL:
            self._pull(source, buffer)
        elif kind == wire.DRAIN:
            self._drain(source, clock)
        elif kind == wire.STOP_REQUEST:
            self._stop_request()
        elif kind == wire.CLOCK_REPORT:
            self._report(self.groups.group_of[source], clock)
        else:
            raise RuntimeError(f"relaxed PS: unexpected message kind {kind} from rank {source}")

    def _send(self, dest, buffer, tag) -> None:
        self._mail.send_bytes(buffer, dest, tag)

    def _push(self, source, buffer) -> None:
        _, _, clock, _, sections = wire.unpack(buffer, self.formats, with_values=True)
        self.clocks.pushed(source, clock)  # raises on a lost or repeated push
        self.stats["pushes"] += 1
        acct = self.topology.accounting
        for index, ids, values in sections:
            var = self.variables[index]
            acct.record_bytes("push", var.spec.name, recv=ids.nbytes + values.nbytes,
                              recv_inter=(ids.nbytes + values.nbytes) * self._inter(source))
            if len(ids) and var.shard is None:
                raise RuntimeError(f"relaxed PS: rank {source} pushed rows of "
                                   f"{var.spec.name!r} to rank {self.topology.rank}, "
                                   "which owns none")
            if self.models[index].per_clock:
                self.pending.setdefault(clock, {}).setdefault(index, []).append(
                    (source, ids, values))
            elif len(ids):
                with acct.timer("apply", var.spec.name):
                    var.shard.apply(ids, self._scaled(np.array(values)))
        self._close_clocks()
        self._answer_ready()
        self._check_budget()

    def _scaled(self, summed):
        """The mean (or sum) over workers, as the collective path applies it."""
        workers = len(self.groups.workers)
        if self.ps.reduce == "mean" and workers > 1:
            summed /= workers
        return summed

    def _close_clocks(self) -> None:
        """Apply every clock all workers have pushed, in clock order, once each."""
        while self.clocks.min_clock > self.closed:
            self._apply_clock(self.closed)
            self.closed += 1

    def _apply_clock(self, clock) -> None:
        """Sum clock ``clock``'s pushes per variable in worker order and apply them once."""
        for index, parts in sorted(self.pending.pop(clock, {}).items()):
            var = self.variables[index]
            if var.shard is None:
                continue
            parts.sort(key=lambda part: part[0])  # worker order, as the collective path
            with self.topology.accounting.timer("apply", var.spec.name):
                ids = np.concatenate([p[1] for p in parts])
                values = np.concatenate([p[2] for p in parts])
                unique, summed = dedup_sum(ids, values)
                var.shard.apply(unique, self._scaled(summed))

    def _pull(self, source, buffer) -> None:
        _, _, clock, _, sections = wire.unpack(buffer, self.formats)
        group = self.groups.group_of[source]
        for index, ids in ((i, ids) for i, ids, _ in sections):
            var = self.variables[index]
            if len(ids) and (var.shard is None or ids.min() < 0 or ids.max() >= var.spec.rows):
                raise RuntimeError(f"relaxed PS: rank {source} asked rank {self.topology.rank} "
                                   f"for rows of {var.spec.name!r} it does not hold")
        models = {self.models[i] for i, _, _ in sections}
        samples = {m: m.draw(self.rng, group, self.groups.num_groups) for m in models}
        pull = _Pull(source, group, clock, [(i, ids) for i, ids, _ in sections], samples)
        group_clocks = self.clocks.group_clocks()
        if self._ready(pull, group_clocks):
            self._answer(pull, group_clocks, waited=False)
        else:
            self.waiting.append(pull)

    @staticmethod
    def _ready(pull, group_clocks) -> bool:
        return all(m.ready(pull.clock, pull.group, group_clocks, s)
                   for m, s in pull.samples.items())

    def _answer_ready(self) -> None:
        """Answer, in arrival order, every waiting pull whose condition now holds."""
        if not self.waiting:
            return
        group_clocks = self.clocks.group_clocks()
        still = []
        for pull in self.waiting:
            if self._ready(pull, group_clocks):
                self._answer(pull, group_clocks)
            else:
                still.append(pull)
        self.waiting = still

    def _answer(self, pull, group_clocks, waited=True) -> None:
        now = time.perf_counter()
        waited = now - pull.arrived if waited else 0.0
        if waited and self.events is not None:
            self.events.append(("pull waits", pull.arrived, now,
                                {"from": pull.source, "clock": pull.clock,
                                 "slowest": int(min(group_clocks))}))
        for model, sampled in pull.samples.items():
            log = self.logs.setdefault(str(model), StalenessLog(model))
            log.record(pull.clock, group_clocks, sampled, waited)
        sections = []
        acct = self.topology.accounting
        for index, ids in pull.sections:
            var = self.variables[index]
            rows = (var.shard.gather(ids) if len(ids) else
                    np.zeros((0, var.spec.dim), var.spec.dtype))
            sections.append((index, None, rows))
            acct.record_bytes("pull", var.spec.name, sent=rows.nbytes, recv=ids.nbytes,
                              sent_inter=rows.nbytes * self._inter(pull.source),
                              recv_inter=ids.nbytes * self._inter(pull.source))
        self._send(pull.source, wire.pack(wire.REPLY, self.phase, pull.clock, sections),
                   wire.TAG_REPLY)
        self.stats["pulls"] += 1

    def _inter(self, rank) -> int:
        node_of = self.topology.node_of
        return int(node_of[rank] != node_of[self.topology.rank])

    # --------------------------------------------------------- drain and stop
    def _drain(self, source, clock) -> None:
        pushed = self.clocks.clock_of_worker(source)
        if clock != pushed:
            raise RuntimeError(f"relaxed PS: rank {source} drained at clock {clock}, but "
                               f"rank {self.topology.rank} has {pushed} of its pushes")
        self.drained.add(source)
        self._send(source, wire.control(wire.DRAINED, self.phase, clock), wire.TAG_CONTROL)
        group = self.groups.group_of[source]
        if self.stop is not None and source == self.groups.leader(group):
            self._report(group, clock)

    def _check_budget(self) -> None:
        if (self.is_coordinator and self.budget is not None and self.stop is None
                and self.clocks.worker_steps() >= self.budget):
            self._stop_request()

    def _stop_request(self) -> None:
        """Coordinator: ask every group leader still running for its clock."""
        if not self.is_coordinator:
            raise RuntimeError("relaxed PS: a stop request reached a server that does not "
                               "coordinate")
        if self.stop is not None:
            return
        self.stop = {"reports": {}, "sent": False}
        for group in range(self.groups.num_groups):
            leader = self.groups.leader(group)
            if leader in self.drained:
                self.stop["reports"][group] = self.clocks.clock_of_worker(leader)
            else:
                self._send(leader, wire.control(wire.STOP_QUERY, self.phase), wire.TAG_CONTROL)
        self._maybe_decide()

    def _report(self, group, clock) -> None:
        if self.stop is None:
            raise RuntimeError(f"relaxed PS: group {group} reported a clock without a query")
        self.stop["reports"][group] = int(clock)
        if self.groups.leader(group) not in self.drained:
            self.paused.add(group)
        self._maybe_decide()

    def _maybe_decide(self) -> None:
        """Once every group reported: send each its stop clock."""
        stop = self.stop
        if stop["sent"] or len(stop["reports"]) < self.groups.num_groups:
            return
        # Only asp workers may stop where they are: ssp's per-clock sums need every
        # worker at the same clock, and a psp pull may wait for a peer to get there.
        equal = any(m.model != "asp" for m in self.models.values())
        top = max(stop["reports"].values())
        for group, reported in stop["reports"].items():
            leader = self.groups.leader(group)
            if leader not in self.drained:
                self._send(leader, wire.control(wire.STOP_AT, self.phase,
                                                top if equal else reported), wire.TAG_CONTROL)
        stop["sent"] = True
        self.paused.clear()

    def staleness(self) -> dict:
        """``{model: StalenessLog.as_dict()}`` of this server (local)."""
        return {key: log.as_dict() for key, log in self.logs.items()}

