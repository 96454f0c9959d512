"""Clocks of the relaxed parameter server: groups, per-worker push counts, staleness.

A *group* is the unit the consistency model relaxes: one worker (the plain
mode) or the workers of one node (the hierarchical mode: BSP inside the
node, relaxed between nodes). A group's clock is the number of steps all
its members have pushed. Nothing here communicates.
"""

from __future__ import annotations

import numpy as np

from ...errors import ConfigError

__all__ = ["Groups", "ClockTable", "StalenessLog", "GROUP_MODES", "merge_staleness"]

#: ``worker``: every worker is its own group; ``node``: the workers of a node are one.
GROUP_MODES = ("worker", "node")


class Groups:
    """Which workers form each group, the same on every rank.

    Args:
        topology: from :func:`hpcpax.init`.
        mode: ``worker`` or ``node``.
    """

    def __init__(self, topology, mode="worker"):
        if mode not in GROUP_MODES:
            raise ConfigError(f"consistency groups must be one of {list(GROUP_MODES)}, "
                              f"not {mode!r}")
        self.mode = mode
        workers = list(topology.worker_ranks)
        if mode == "worker":
            members = [[r] for r in workers]
        else:
            nodes = sorted({int(topology.node_of[r]) for r in workers})
            members = [topology.workers_on_node(n) for n in nodes]
        #: World ranks of each group's workers (ascending); the first leads.
        self.members = [list(m) for m in members]
        #: Group index of each worker rank.
        self.group_of = {r: g for g, m in enumerate(self.members) for r in m}
        #: Worker index (0..workers-1) of each worker rank.
        self.worker_index = {r: i for i, r in enumerate(workers)}
        self.workers = workers

    @property
    def num_groups(self) -> int:
        """Number of groups."""
        return len(self.members)

    def leader(self, group) -> int:
        """World rank of ``group``'s leader (its first worker)."""
        return self.members[group][0]

    def size(self, group) -> int:
        """Workers in ``group``."""
        return len(self.members[group])


class ClockTable:
    """A server's view of every worker's pushes and every group's clock.

    Args:
        groups: the job's :class:`Groups`.
    """

    def __init__(self, groups):
        self.groups = groups
        self.pushes = np.zeros(len(groups.workers), np.int64)
        self._member_index = [np.array([groups.worker_index[r] for r in m], np.int64)
                              for m in groups.members]

    def start(self, clocks) -> None:
        """Set every worker's clock (a phase starts; ``clocks`` by worker index)."""
        self.pushes[:] = np.asarray(clocks, np.int64)

    def pushed(self, rank, clock) -> None:
        """Count one push of worker ``rank`` made at ``clock`` (must be its next).

        Raises:
            RuntimeError: the push is not the worker's next one (lost or
                repeated message: exactly-once would be broken).
        """
        i = self.groups.worker_index[rank]
        if clock != self.pushes[i]:
            raise RuntimeError(f"relaxed PS: push of rank {rank} made at clock {clock}, "
                               f"expected {int(self.pushes[i])} (a push lost or repeated)")
        self.pushes[i] += 1

    def clock_of_worker(self, rank) -> int:
        """Pushes seen from worker ``rank``."""
        return int(self.pushes[self.groups.worker_index[rank]])

    def group_clocks(self) -> np.ndarray:
        """Every group's clock: the fewest pushes among its members."""
        return np.array([self.pushes[m].min() for m in self._member_index], np.int64)

    @property
    def min_clock(self) -> int:
        """The slowest worker's clock."""
        return int(self.pushes.min()) if len(self.pushes) else 0

    def worker_steps(self) -> int:
        """Steps pushed by all workers together."""
        return int(self.pushes.sum())


class StalenessLog:
    """What the server saw when it answered pulls under one consistency model.

    For every answered pull: ``gap`` = the puller's clock minus the slowest
    group's clock; for psp also the gap to the slowest *sampled* peer and
    whether the sampled condition held.
    """

    def __init__(self, consistency):
        self.consistency = consistency
        self.pulls = 0
        self.max_gap = 0
        self.histogram = {}
        self.max_sampled_gap = 0
        self.violations = 0
        self.waited_pulls = 0
        self.wait_seconds = 0.0

    def record(self, clock, group_clocks, sampled, waited_seconds) -> None:
        """One answered pull at ``clock``; ``group_clocks`` as seen at the answer."""
        gap = int(clock - group_clocks.min())
        self.pulls += 1
        self.max_gap = max(self.max_gap, gap)
        self.histogram[gap] = self.histogram.get(gap, 0) + 1
        if waited_seconds > 0:
            self.waited_pulls += 1
            self.wait_seconds += waited_seconds
        model = self.consistency
        if model.model == "psp" and len(sampled):
            sampled_gap = int(clock - group_clocks[sampled].min())
            self.max_sampled_gap = max(self.max_sampled_gap, sampled_gap)
            self.violations += sampled_gap > model.staleness
        elif model.model in ("ssp", "bsp"):
            self.violations += gap > model.staleness

    def as_dict(self) -> dict:
        """JSON-ready figures."""
        return {"consistency": str(self.consistency), "pulls": self.pulls,
                "max_gap": self.max_gap, "max_sampled_gap": self.max_sampled_gap,
                "violations": self.violations, "waited_pulls": self.waited_pulls,
                "wait_seconds": self.wait_seconds,
                "histogram": {str(k): v for k, v in sorted(self.histogram.items())}}


def merge_staleness(logs) -> dict:
    """Several servers' :meth:`StalenessLog.as_dict` of one model, merged."""
    out = None
    for log in logs:
        if out is None:
            out = {**log, "histogram": dict(log["histogram"])}
            continue
        for key in ("pulls", "violations", "waited_pulls", "wait_seconds"):
            out[key] += log[key]
        for key in ("max_gap", "max_sampled_gap"):
            out[key] = max(out[key], log[key])
        for gap, count in log["histogram"].items():
            out["histogram"][gap] = out["histogram"].get(gap, 0) + count
    return out
