"""Byte and time accounting: every byte hpcpax moves is counted here.

Each transfer is recorded with a *phase* (``dense``, ``push``, ``pull``,
``intra_node`` exchanges, ...) and an optional *variable* name. Bytes are split
by whether the peer sits on the same node (virtual nodes included) or on
another one, so off-node traffic, the figure that limits scaling on a real
fabric, is always visible.

Point-to-point style exchanges (``Alltoallv``) are counted exactly, from the
per-destination counts. Collectives whose internal algorithm belongs to the
MPI library (``Allreduce``) are counted by the formula of a named algorithm
(ring: each rank sends and receives ``2 (n-1)/n`` of the buffer to/from its
ring successor/predecessor); the formula is stated where it is used.
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import numpy as np

__all__ = ["Accounting", "FIELDS", "OWNER_FIELDS"]

#: The counters kept for each phase and each variable.
FIELDS = (
    "sent_bytes",
    "recv_bytes",
    "sent_intra_bytes",
    "sent_inter_bytes",
    "recv_intra_bytes",
    "recv_inter_bytes",
    "seconds",
    "calls",
)


#: Parameter-server owners' row bytes, counted by the workers that exchange them
#: with the owners (see :meth:`Accounting.record_owner`).
OWNER_FIELDS = ("egress", "egress_inter", "ingress", "ingress_inter")


def _zero():
    return dict.fromkeys(FIELDS, 0)


class Accounting:
    """Counts bytes and seconds per phase and per variable for one rank.

    Args:
        node_of: node index of every rank of the communicator whose ranks are
            passed to :meth:`record_exchange` (world ranks, normally).
        rank: this process's rank in that communicator.

    Not collective; every method is local.
    """

    def __init__(self, node_of=None, rank: int = 0):
        self.node_of = np.zeros(1, np.int64) if node_of is None else np.asarray(node_of, np.int64)
        self.rank = int(rank)
        self.reset()

    def reset(self) -> None:
        """Set every counter to zero (registered groups stay registered)."""
        self._phases = defaultdict(_zero)
        self._variables = defaultdict(_zero)
        self.owner = dict.fromkeys(OWNER_FIELDS, 0)
        for group in getattr(self, "_groups", []):
            group[3] = 0
        if not hasattr(self, "_groups"):
            self._groups = []

    def add_group(self, phase, names, **per_variable) -> int:
        """Register a fixed transfer repeated every step, for O(1) recording.

        A fused allreduce moves the same bytes of the same thousand tensors
        every step; recording each tensor each step would cost more than the
        transfer. Register the per-variable byte counts once here, then call
        :meth:`record_group` once per step.

        Args:
            phase: phase name.
            names: variable names.
            per_variable: for some fields of :data:`FIELDS` (bytes fields),
                one integer per name.

        Returns:
            A handle for :meth:`record_group`.
        """
        arrays = {k: np.asarray(v, np.int64) for k, v in per_variable.items()}
        for k, v in arrays.items():
            if k not in FIELDS or len(v) != len(names):
                raise ValueError(f"{k} must be a field with one value per name")
        self._groups.append([phase, list(names), arrays, 0])
        return len(self._groups) - 1

    def record_group(self, handle: int, seconds=0.0) -> None:
        """Count one more occurrence of group ``handle`` (and its seconds)."""
        phase, _, arrays, _ = self._groups[handle]
        self._groups[handle][3] += 1
        entry = self._phases[phase]
        for k, v in arrays.items():
            entry[k] += int(v.sum())
        entry["seconds"] += float(seconds)
        entry["calls"] += 1

    def record_empty(self, phase, names) -> None:
        """Count one call of an exchange of ``names`` that moved nothing (a
        one-worker push), as :meth:`record_batched_exchange` would with zero
        bytes; O(1) per call after the first with the same names."""
        handles = self.__dict__.setdefault("_empty_groups", {})
        key = (phase, tuple(names))
        if key not in handles:
            handles[key] = self.add_group(phase, names)
        self.record_group(handles[key])

    def _variables_with_groups(self):
        table = defaultdict(_zero, {k: dict(v) for k, v in self._variables.items()})
        for _, names, arrays, count in self._groups:
            if count == 0:
                continue
            for i, name in enumerate(names):
                entry = table[name]
                for k, v in arrays.items():
                    entry[k] += int(v[i]) * count
                entry["calls"] += count
        return table

    def _add(self, phase, variable, **fields):
        for table, key in ((self._phases, phase), (self._variables, variable)):
            if key is None:
                continue
            entry = table[key]
            for name, value in fields.items():
                entry[name] += value

    def record_exchange(self, phase, variable, sent_per_rank, recv_per_rank, seconds=0.0,
                        ranks=None, calls=1) -> None:
        """Record an exchange whose per-peer byte counts are known exactly.

        Args:
            phase: phase name, e.g. ``"push"``.
            variable: variable name or None.
            sent_per_rank: bytes sent to each peer (self included, which is
                not counted as traffic).
            recv_per_rank: bytes received from each peer.
            seconds: wall time spent.
            ranks: world rank of each peer, when the exchange ran on a
                sub-communicator; default: peers are world ranks 0..n-1.
            calls: how many operations this record counts as.
        """
        self.record_batched_exchange(phase, [variable], [sent_per_rank], [recv_per_rank],
                                     seconds, ranks=ranks, calls=calls)

    def record_batched_exchange(self, phase, variables, sent_per_rank, recv_per_rank,
                                seconds=0.0, ranks=None, calls=1) -> None:
        """Record one exchange that carried several variables at once.

        The phase gets the summed bytes, the seconds and ``calls`` calls;
        each variable gets its own exact bytes, ``calls`` calls (the
        collective that carried it) and a share of the seconds proportional
        to its bytes (sent + received; equal shares when nothing moved).
        :meth:`record_exchange` is the one-variable case.

        Args:
            phase: phase name.
            variables: the ``K`` variable names (None entries count for the
                phase only).
            sent_per_rank, recv_per_rank: ``[K, peers]`` bytes per variable
                and peer (self included, not counted as traffic).
            seconds: wall time of the whole exchange.
            ranks: world rank of each peer, when the exchange ran on a
                sub-communicator; default: peers are world ranks 0..n-1.
            calls: how many operations this record counts as.
        """
        sent = np.asarray(sent_per_rank, np.int64).reshape(len(variables), -1)
        recv = np.asarray(recv_per_rank, np.int64).reshape(len(variables), -1)
        peers = np.arange(sent.shape[1]) if ranks is None else np.asarray(ranks, np.int64)
        not_self = peers != self.rank
        same_node = self.node_of[peers] == self.node_of[self.rank]
        intra, inter = not_self & same_node, not_self & ~same_node
        fields = {
            "sent_bytes": sent[:, not_self].sum(axis=1),
            "recv_bytes": recv[:, not_self].sum(axis=1),
            "sent_intra_bytes": sent[:, intra].sum(axis=1),
            "sent_inter_bytes": sent[:, inter].sum(axis=1),
            "recv_intra_bytes": recv[:, intra].sum(axis=1),
            "recv_inter_bytes": recv[:, inter].sum(axis=1),
        }
        moved = (sent.sum(axis=1) + recv.sum(axis=1)).astype(np.float64)
        share = moved / moved.sum() if moved.sum() > 0 else np.full(len(variables),
                                                                    1.0 / len(variables))
        self._add(phase, None, seconds=float(seconds), calls=calls,
                  **{name: int(values.sum()) for name, values in fields.items()})
        for k, variable in enumerate(variables):
            if variable is not None:
                self._add(None, variable, seconds=float(seconds) * float(share[k]), calls=calls,
                          **{name: int(values[k]) for name, values in fields.items()})

    def record_bytes(self, phase, variable, sent=0, recv=0, sent_inter=0, recv_inter=0,
                     seconds=0.0) -> None:
        """Record a transfer counted by formula (``sent_inter`` of ``sent`` left the node)."""
        self._add(
            phase,
            variable,
            sent_bytes=int(sent),
            recv_bytes=int(recv),
            sent_intra_bytes=int(sent - sent_inter),
            sent_inter_bytes=int(sent_inter),
            recv_intra_bytes=int(recv - recv_inter),
            recv_inter_bytes=int(recv_inter),
            seconds=float(seconds),
            calls=1,
        )

    def record_owner(self, direction, bytes_per_rank) -> None:
        """Count row bytes exchanged with parameter-server owners, from this rank's side.

        Owners' links are the ones hot rows load, and a dedicated server
        takes part in no step's reduction, so its traffic is counted here
        by its peers: ``egress`` what owners sent this rank (pulled rows,
        with their ids where they travel together), ``ingress`` what this
        rank sent owners (pushed ids and gradient rows). Control words
        (counts, manifests, codes) are not rows and are not counted.

        Args:
            direction: ``"egress"`` or ``"ingress"``.
            bytes_per_rank: bytes exchanged with each world rank (an owner
                or not; this rank itself is not counted).
        """
        if direction not in ("egress", "ingress"):
            raise ValueError(f"direction must be 'egress' or 'ingress', not {direction!r}")
        per_rank = np.asarray(bytes_per_rank, np.int64)
        peers = np.arange(len(per_rank))
        other = peers != self.rank
        inter = other & (self.node_of[peers] != self.node_of[self.rank])
        self.owner[direction] += int(per_rank[other].sum())
        self.owner[direction + "_inter"] += int(per_rank[inter].sum())

    def record_seconds(self, phase, variable, seconds) -> None:
        """Record time spent in a phase that moved no bytes (e.g. a kernel)."""
        self._add(phase, variable, seconds=float(seconds))

    @contextmanager
    def timer(self, phase, variable=None):
        """Context manager adding the wall time of its body to ``phase``."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.record_seconds(phase, variable, time.perf_counter() - start)

    def phase(self, name) -> dict:
        """Counters of one phase (zeros if it never ran)."""
        return dict(self._phases.get(name, _zero()))

    def variable(self, name) -> dict:
        """Counters of one variable (zeros if it never moved)."""
        return dict(self._variables_with_groups().get(name, _zero()))

    def totals(self) -> dict:
        """Counters summed over all phases."""
        total = _zero()
        for entry in self._phases.values():
            for key in FIELDS:
                total[key] += entry[key]
        return total

    def as_dict(self) -> dict:
        """``{"phases": {...}, "variables": {...}, "total": {...}}``, JSON-ready, with
        ``"owner"`` (:meth:`record_owner`'s counters) when anything was counted there."""
        out = {
            "phases": {k: dict(v) for k, v in sorted(self._phases.items())},
            "variables": {k: dict(v) for k, v in sorted(self._variables_with_groups().items())},
            "total": self.totals(),
        }
        if any(self.owner.values()):
            out["owner"] = dict(self.owner)
        return out

    def reduce(self, comm) -> dict:
        """Sum :meth:`as_dict` over the ranks of ``comm`` (collective).

        Seconds are summed too; divide by the number of ranks for a mean.
        """
        mine = self.as_dict()
        everyone = comm.allgather(mine)
        out = {"phases": defaultdict(_zero), "variables": defaultdict(_zero), "total": _zero()}
        owner = dict.fromkeys(OWNER_FIELDS, 0)
        for d in everyone:
            for field, value in d.get("owner", {}).items():
                owner[field] += value
            for section in ("phases", "variables"):
                for key, entry in d[section].items():
                    for field in FIELDS:
                        out[section][key][field] += entry[field]
            for field in FIELDS:
                out["total"][field] += d["total"][field]
        out["phases"] = dict(sorted(out["phases"].items()))
        out["variables"] = dict(sorted(out["variables"].items()))
        if any(owner.values()):
            out["owner"] = owner
        return out


def ring_allreduce_bytes(node_of, ranks, rank, nbytes):
    """Bytes one rank moves in a ring allreduce of ``nbytes`` over ``ranks``.

    The formula hpcpax counts allreduces by: a reduce-scatter and an
    allgather around the ring of ``ranks`` (in that order), each sending
    ``(n-1)/n`` of the buffer to the ring successor and receiving as much from
    the predecessor. Returns ``(sent, recv, sent_inter, recv_inter)``.
    """
    n = len(ranks)
    if n <= 1:
        return 0, 0, 0, 0
    i = list(ranks).index(rank)
    moved = 2 * (n - 1) * nbytes // n
    succ, pred = ranks[(i + 1) % n], ranks[(i - 1) % n]
    sent_inter = moved if node_of[succ] != node_of[rank] else 0
    recv_inter = moved if node_of[pred] != node_of[rank] else 0
    return moved, moved, sent_inter, recv_inter
