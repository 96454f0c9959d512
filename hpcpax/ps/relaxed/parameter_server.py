"""Relaxed consistency on the parameter server: SSP, ASP and PSP over point-to-point MPI.

The collective path (:class:`~hpcpax.ps.server.ParameterServer`) is BSP: every
operation is a collective, so one slow worker holds every other at every
step. :class:`RelaxedParameterServer` serves the same tables (the same
:class:`~hpcpax.ps.table.TableShard` s, optimizers and layouts) with
point-to-point requests on a communicator of its own, under a consistency
model per variable (:mod:`hpcpax.ps.relaxed.consistency`): ``ssp:S``, ``asp``,
``psp:B[,S]`` (and ``bsp``, which there means ``ssp:0``: the same
parameters as the collective path).

Work alternates between *phases* of relaxed steps and collective moments
(registration, checkpoints, evaluation, the end)::

    relaxed = RelaxedParameterServer(ps, "ssp:2")   # collective: every rank
    if topo.is_server:
        relaxed.serve()                             # until relaxed.shutdown()
    else:
        ps.register(specs)                          # collective path, as before
        relaxed.begin()                             # servers enter a phase
        for step in range(steps):
            rows = relaxed.pull({"emb": ids})
            relaxed.push({"emb": SparseGrad(ids, grads, rows)})
        relaxed.end()                               # drain: nothing in flight
        ps.pull_unique("emb", ids)                  # collective again (exact view)
        relaxed.shutdown()

A phase ends when every worker drained (:meth:`end`): each server has then
applied every push of the phase exactly once (per-clock sums included, as
every worker ends at a common clock unless the models are asp/psp), and no
request is in flight, so a checkpoint taken between phases loses nothing
and a resumed run applies nothing twice.

Groups: ``groups="worker"`` (each worker is relaxed against the others) or
``"node"`` (BSP inside a node, with node-local aggregation, relaxed between
nodes: on a cluster the straggler is usually a node).
"""

from __future__ import annotations

from ...errors import ConfigError
from .clocks import Groups, merge_staleness
from .consistency import parse_consistency, parse_consistency_spec
from .client import RelaxedClient
from .server import RelaxedServer

__all__ = ["RelaxedParameterServer"]


class RelaxedParameterServer:
    """The relaxed parameter server over a :class:`~hpcpax.ps.server.ParameterServer`.

    Args:
        ps: the job's parameter server (its tables, layouts and optimizers).
        consistency: the job's model, optionally with per-variable ones:
            ``"ssp:3"``, ``"asp; emb=ssp:1"`` (see
            :func:`~hpcpax.ps.relaxed.consistency.parse_consistency_spec`).
        groups: ``worker`` or ``node``.
        seed: seed of the psp samples.

    **Collective** over ``ps.topology.comm`` (duplicates it). Needs server
    ranks: with none, the workers host the rows and could not answer
    requests while they compute (:class:`~hpcpax.errors.ConfigError` on
    every rank).
    """

    def __init__(self, ps, consistency="ssp:0", groups="worker", seed=0):
        topo = ps.topology
        self.default, self.per_variable = parse_consistency_spec(consistency)
        if not topo.server_ranks:
            raise ConfigError(f"consistency {consistency!r} needs server ranks "
                              "(servers_per_node >= 1): with none the workers host the rows "
                              "and cannot answer requests while they compute")
        self.ps, self.topology = ps, topo
        self.groups = Groups(topo, groups)
        self.comm = topo.comm.Dup()
        self.phase = 0
        self.in_phase = False
        self.client = (RelaxedClient(topo, self.comm, ps, self.groups, ps.watchdog)
                       if topo.is_worker else None)
        self.server = (RelaxedServer(topo, self.comm, ps, self.consistency_of, self.groups,
                                     seed=seed, watchdog=ps.watchdog)
                       if topo.is_server else None)

    # ------------------------------------------------------------ the models
    def consistency_of(self, name):
        """The :class:`~hpcpax.ps.relaxed.consistency.Consistency` of variable ``name``."""
        return self.per_variable.get(name, self.default)

    def set_consistency(self, name, model) -> None:
        """Set ``name``'s model (local; every rank makes the same call, between phases)."""
        if self.in_phase:
            raise ConfigError("a variable's consistency changes between phases only")
        self.per_variable[name] = parse_consistency(model)

    @property
    def clock(self) -> int:
        """This worker's clock (steps pushed); 0 on servers."""
        return self.client.clock if self.client is not None else 0

    # -------------------------------------------------------------- workers
    def begin(self, clock=None, budget=None) -> None:
        """Start a phase; **collective** over the workers (servers follow in :meth:`serve`).

        Args:
            clock: this worker's clock from now on (default: where it is).
            budget: asp/psp: the coordinator stops every worker once the
                workers together pushed this many steps (see :meth:`boundary`).
        """
        topo = self.topology
        clock = self.clock if clock is None else int(clock)
        clocks = topo.workers.allgather(clock)
        self.ps.shutdown()  # releases the servers from ParameterServer.serve()
        command = topo.comm.bcast({"op": "relaxed", "phase": self.phase + 1, "clocks": clocks,
                                   "budget": budget}, root=topo.worker_ranks[0])
        self.enter_phase(command["phase"], command["clocks"], command["budget"])

    def enter_phase(self, phase, clocks, budget=None) -> None:
        """Every rank: start phase ``phase`` (servers serve it until every worker drained).

        Called by :meth:`begin` and :meth:`serve`, or by a command channel
        that already has every rank at the same point. ``clocks`` lists
        every worker's clock (by worker index), the same on every rank.
        """
        self.phase = int(phase)
        if self.server is not None:
            self.in_phase = True
            try:
                self.server.run(self.phase, clocks, budget)
            finally:
                self.in_phase = False
        else:
            self.client.start(self.phase, clocks[self.topology.worker_index])
            self.in_phase = True

    def pull(self, ids_by_name) -> dict:
        """``{name: (unique sorted ids, rows)}``; see :meth:`RelaxedClient.pull`."""
        return self.client.pull(ids_by_name)

    def push(self, grads) -> bool:
        """Push ``{name: SparseGrad}``; see :meth:`RelaxedClient.push`."""
        return self.client.push(grads)

    def boundary(self, static_stop, preempted=False) -> bool:
        """Whether to stop at this step boundary; see :meth:`RelaxedClient.boundary`."""
        return self.client.boundary(static_stop, preempted)

    def end(self) -> None:
        """End this worker's phase (drain). Local; the phase ends when every worker did.

        Under ``ssp``/``psp`` a worker still waiting in a pull needs the others
        to reach its bound first: end every worker at the same clock, or stop
        them with :meth:`boundary`, which agrees the stop clocks.
        """
        self.client.drain()
        self.in_phase = False

    def shutdown(self) -> None:
        """Release the servers from :meth:`serve`; **collective** over the workers."""
        self.ps.shutdown()
        self.topology.comm.bcast({"op": "stop"}, root=self.topology.worker_ranks[0])

    # -------------------------------------------------------------- servers
    def serve(self) -> None:
        """Server ranks: serve collective operations and relaxed phases until :meth:`shutdown`."""
        topo = self.topology
        while True:
            self.ps.serve()
            command = topo.comm.bcast(None, root=topo.worker_ranks[0])
            if command["op"] == "stop":
                return
            self.enter_phase(command["phase"], command["clocks"], command["budget"])

    # ---------------------------------------------------------------- after
    def staleness(self) -> dict:
        """Every server's staleness records merged, ``{model: figures}``, on every rank.

        **Collective** over ``topology.comm`` (outside a phase).
        """
        mine = self.server.staleness() if self.server is not None else {}
        merged = {}
        for logs in self.topology.comm.allgather(mine):
            for key, log in logs.items():
                merged.setdefault(key, []).append(log)
        return {key: merge_staleness(logs) for key, logs in merged.items()}

    def server_stats(self) -> list:
        """Each server's counters (pushes, pulls, busy/idle/CPU seconds); **collective**."""
        mine = dict(self.server.stats, rank=self.topology.rank) if self.server else None
        return [s for s in self.topology.comm.allgather(mine) if s is not None]

    def free(self) -> None:
        """Free the relaxed communicator; **collective**."""
        if self.comm is not None:
            self.comm.Free()
            self.comm = None
