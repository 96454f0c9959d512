"""Who sends how many rows to whom in one training step, and the bytes it makes.

The cost model and the byte accounting must agree to the byte, so the
routing of every method is written once here, the way
:mod:`hpcpax.ps.server` and :mod:`hpcpax.sync.replicated` move data:

* ``ps``: worker ``w`` sends its unique ids of partition ``p`` to the owner
  of ``p`` (pull: 8-byte ids out, rows back; push: id + row). With local
  aggregation the ids first go to the node's delegate worker of ``p``
  (``p % workers on the node``), which deduplicates the node's share and
  alone talks to the owner. Each batched operation starts with a 32-byte
  header ``Allgather`` over every rank and one ``Alltoall`` of 8 bytes per
  peer and variable (counts).
* ``allgather``: each worker's unique ``(id, row)`` records reach every
  other worker (counted as direct sends, whatever algorithm MPI runs), all
  tables in one block per worker; where
  :func:`~hpcpax.comm.sparse_collectives.padded_block_bytes` pads the
  blocks to the largest, the padding is the phase's too.
* ``dense`` (allreduce, densified or not): the ring formula,
  ``floor(2 (n-1) B / n)`` per rank and tensor.

A :class:`Routing` holds the row counts of one variable in one step,
either exactly (:func:`routing_from_ids`, from the ids each worker touched)
or in expectation (:func:`expected_routing`, from the measured row density
``alpha``); :func:`step_bytes` turns routings into bytes per rank and phase,
in the :class:`~hpcpax.comm.accounting.Accounting` convention (self-traffic
not counted). Pure NumPy; nothing here is collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..comm.sparse_collectives import padded_block_bytes
from ..ps.placement import assign_owners
from ..sync.methods import method_of

__all__ = ["Layout", "Routing", "routing_from_ids", "expected_routing", "step_bytes", "owner_bytes",
           "HEADER_BYTES", "COUNT_BYTES", "INDEX_BYTES", "partition_shares"]

HEADER_BYTES = 32  # op, variable, status, argument: four int64
COUNT_BYTES = 8  # one int64 row count per peer and variable
INDEX_BYTES = 8  # an int64 id travels beside each row


@dataclass(frozen=True)
class Layout:
    """Ranks of a job: node of each world rank, servers, workers (ascending)."""

    node_of: tuple
    server_ranks: tuple
    worker_ranks: tuple

    @classmethod
    def from_shape(cls, num_nodes: int, workers_per_node: int, servers_per_node: int = 0):
        """The layout ``hpcpax.init`` makes: per node, the first ``servers_per_node``
        local ranks serve, the rest work; nodes are consecutive rank blocks."""
        per_node = workers_per_node + servers_per_node
        node_of = tuple(r // per_node for r in range(num_nodes * per_node))
        servers = tuple(r for r in range(len(node_of)) if r % per_node < servers_per_node)
        workers = tuple(r for r in range(len(node_of)) if r % per_node >= servers_per_node)
        return cls(node_of, servers, workers)

    @classmethod
    def from_topology(cls, topology):
        """From a :class:`~hpcpax.comm.topology.Topology` or its ``describe()``."""
        get = topology.get if isinstance(topology, dict) else lambda k: getattr(topology, k)
        return cls(tuple(int(n) for n in get("node_of")), tuple(get("server_ranks")),
                   tuple(get("worker_ranks")))

    @property
    def size(self) -> int:
        """Ranks in all."""
        return len(self.node_of)

    @property
    def owner_ranks(self) -> tuple:
        """Ranks that own partitions: the servers, or the workers without servers."""
        return self.server_ranks if self.server_ranks else self.worker_ranks

    @property
    def num_nodes(self) -> int:
        """Nodes in the layout."""
        return len(set(self.node_of))

    def node_workers(self, node: int) -> list:
        """Worker ranks on ``node``."""
        return [r for r in self.worker_ranks if self.node_of[r] == node]

    def workers_per_node(self) -> int:
        """The most workers on one node."""
        return max(len(self.node_workers(n)) for n in set(self.node_of))


@dataclass
class Routing:
    """Row counts of one sparse variable in one step (floats in expectation).

    Attributes:
        method: ``ps``, ``allgather`` or ``allreduce`` (densified).
        row_bytes: bytes of one row's values (``dim * itemsize``).
        rows: rows of the table.
        raw: ids each worker's batch holds, duplicates included, by world rank.
        unique: distinct ids of each worker, by world rank.
        to_owner: ``[size, size]`` ids rank ``i`` sends to owner ``j``
            (pull requests; pushes carry the same rows). ``ps`` only.
        to_delegate: ``[size, size]`` ids worker ``i`` sends to delegate
            ``j`` on its node (local aggregation), or None.
        parts_of_owner: partitions each world rank owns. ``ps`` only.
        union: distinct ids over all workers (rows a replica updates).
    """

    method: str
    row_bytes: int
    rows: int
    raw: np.ndarray
    unique: np.ndarray
    to_owner: np.ndarray | None = None
    to_delegate: np.ndarray | None = None
    parts_of_owner: np.ndarray | None = None
    union: float = 0.0

    @property
    def sync_method(self):
        """The method, as its :class:`~hpcpax.sync.methods.SyncMethod`."""
        return method_of(self.method)

    @property
    def local_aggregation(self) -> bool:
        """Whether rows go through a node delegate."""
        return self.to_delegate is not None


def partition_shares(rows: int, partitions: int) -> np.ndarray:
    """Fraction of rows in each partition of the ``mod`` partitioning."""
    counts = np.array([len(range(p, rows, partitions)) for p in range(partitions)], np.float64)
    return counts / rows


def _owner_rank_of_part(layout, rows, row_bytes, partitions, owners):
    if owners is None or len(owners) != partitions:
        part_bytes = [len(range(p, rows, partitions)) * row_bytes for p in range(partitions)]
        owners = assign_owners(part_bytes, len(layout.owner_ranks))
    return np.array([layout.owner_ranks[o] for o in owners], np.int64)


def _delegates(layout, aggregate):
    """World rank of each worker's delegate list: ``{worker: [node workers]}``."""
    out = {}
    for w in layout.worker_ranks:
        node = layout.node_workers(layout.node_of[w])
        out[w] = node if aggregate and len(node) > 1 else None
    return out


def routing_from_ids(layout: Layout, method: str, rows: int, row_bytes: int, ids_by_worker,
                     partitions: int = 1, owners=None, local_aggregation: bool = False) -> Routing:
    """Exact :class:`Routing` of one step from each worker's ids (in worker order)."""
    size = layout.size
    raw = np.zeros(size)
    unique = np.zeros(size)
    uniques = {}
    for w, ids in zip(layout.worker_ranks, ids_by_worker):
        ids = np.asarray(ids, np.int64).ravel()
        uniques[w] = np.unique(ids)
        raw[w], unique[w] = ids.size, uniques[w].size
    union = float(np.unique(np.concatenate(list(uniques.values()))).size) if uniques else 0.0
    routing = Routing(method, int(row_bytes), int(rows), raw, unique, union=union)
    if not routing.sync_method.on_servers:
        return routing
    owner_of_part = _owner_rank_of_part(layout, rows, row_bytes, partitions, owners)
    routing.parts_of_owner = np.bincount(owner_of_part, minlength=size).astype(np.float64)
    to_owner = np.zeros((size, size))
    delegates = _delegates(layout, local_aggregation)
    aggregate = any(d is not None for d in delegates.values())
    if aggregate:
        to_delegate = np.zeros((size, size))
        gathered = {}
        for w, mine in uniques.items():
            node = delegates[w]
            which = np.asarray(node)[(mine % partitions) % len(node)]
            for d in node:
                part = mine[which == d]
                to_delegate[w, d] = part.size
                gathered.setdefault(d, []).append(part)
        routing.to_delegate = to_delegate
        senders = {d: np.unique(np.concatenate(parts)) for d, parts in gathered.items()}
    else:
        senders = uniques
    for s, ids in senders.items():
        np.add.at(to_owner[s], owner_of_part[ids % partitions], 1.0)
    routing.to_owner = to_owner
    return routing


def expected_routing(layout: Layout, method: str, rows: int, row_bytes: int, alpha: float,
                     alpha_node: float | None = None, duplicate_ratio: float = 1.0,
                     partitions: int = 1, owners=None, local_aggregation: bool = False,
                     alpha_all: float | None = None) -> Routing:
    """Expected :class:`Routing` when each worker touches ``alpha * rows`` rows,
    a node's workers together ``alpha_node * rows`` (default: independent
    workers, ``1 - (1 - alpha)^g``), all workers ``alpha_all * rows``."""
    size = layout.size
    u = float(alpha) * rows
    raw, unique = np.zeros(size), np.zeros(size)
    workers = list(layout.worker_ranks)
    raw[workers], unique[workers] = u * float(duplicate_ratio), u
    if alpha_all is None:
        alpha_all = 1.0 - (1.0 - float(alpha)) ** len(workers)
    routing = Routing(method, int(row_bytes), int(rows), raw, unique, union=float(alpha_all) * rows)
    if not routing.sync_method.on_servers:
        return routing
    shares = partition_shares(rows, partitions)
    owner_of_part = _owner_rank_of_part(layout, rows, row_bytes, partitions, owners)
    routing.parts_of_owner = np.bincount(owner_of_part, minlength=size).astype(np.float64)
    owner_share = np.bincount(owner_of_part, weights=shares, minlength=size)
    to_owner = np.zeros((size, size))
    delegates = _delegates(layout, local_aggregation)
    if any(d is not None for d in delegates.values()):
        to_delegate = np.zeros((size, size))
        for w in workers:
            node = delegates[w]
            g = len(node)
            node_alpha = alpha_node if alpha_node is not None else 1.0 - (1.0 - alpha) ** g
            for j, d in enumerate(node):
                mask = np.arange(partitions) % g == j
                to_delegate[w, d] = u * shares[mask].sum()
                if w == node[0]:  # the node's union, routed once per delegate
                    to_owner[d] += float(node_alpha) * rows * np.bincount(
                        owner_of_part[mask], weights=shares[mask], minlength=size)
        routing.to_delegate = to_delegate
    else:
        to_owner[workers] = u * owner_share
    routing.to_owner = to_owner
    return routing


class _Bytes:
    """Per-rank byte counters of each phase: ``sent, recv, sent_inter, recv_inter``."""

    def __init__(self, layout):
        self.layout = layout
        self.node = np.asarray(layout.node_of)
        self.phases = {}

    def add(self, phase, matrix):
        """Add ``matrix[i, j]`` bytes from rank i to rank j (diagonal ignored)."""
        m = np.array(matrix, np.float64, copy=True)
        np.fill_diagonal(m, 0.0)
        cross = self.node[:, None] != self.node[None, :]
        entry = self.phases.setdefault(phase, np.zeros((4, self.layout.size)))
        entry[0] += m.sum(axis=1)
        entry[1] += m.sum(axis=0)
        entry[2] += np.where(cross, m, 0.0).sum(axis=1)
        entry[3] += np.where(cross, m, 0.0).sum(axis=0)

    def add_ranks(self, phase, ranks, sent, recv, sent_inter, recv_inter):
        entry = self.phases.setdefault(phase, np.zeros((4, self.layout.size)))
        for column, values in enumerate((sent, recv, sent_inter, recv_inter)):
            entry[column, list(ranks)] += values


def _among(layout, ranks, per_peer):
    """Matrix of ``per_peer`` bytes between every pair of ``ranks``."""
    m = np.zeros((layout.size, layout.size))
    idx = np.asarray(list(ranks))
    m[np.ix_(idx, idx)] = per_peer
    return m


def _ring(layout, nbytes):
    """Per-worker ``(sent, recv, sent_inter, recv_inter)`` of a ring allreduce of ``nbytes``."""
    ranks = list(layout.worker_ranks)
    n = len(ranks)
    if n <= 1:
        z = np.zeros(n)
        return z, z, z, z
    moved = np.full(n, float(2 * (n - 1) * int(nbytes) // n))
    node = np.asarray(layout.node_of)[ranks]
    succ, pred = np.roll(node, -1), np.roll(node, 1)
    return moved, moved, np.where(succ != node, moved, 0.0), np.where(pred != node, moved, 0.0)


def step_bytes(layout: Layout, routings: dict, dense_bytes=()) -> dict:
    """Bytes of one step per phase and rank: ``{phase: [4, size] array}``.

    Rows of each array: sent, received, sent off-node, received off-node.
    ``routings`` maps sparse variable names to :class:`Routing`;
    ``dense_bytes`` lists the bytes of each dense tensor allreduced.
    """
    out = _Bytes(layout)
    everyone = range(layout.size)
    on_ps = {n: r for n, r in routings.items() if r.sync_method.on_servers}
    if on_ps:
        for phase in ("pull", "push"):  # one header and one count exchange each
            out.add_ranks("control", everyone, *(np.full(layout.size, (layout.size - 1.0)
                                                         * HEADER_BYTES),) * 2, 0.0, 0.0)
            out.add(phase, _among(layout, everyone, COUNT_BYTES * len(on_ps)))
        aggregated = [r for r in on_ps.values() if r.local_aggregation]
        if aggregated:
            for node in sorted(set(layout.node_of)):
                workers = layout.node_workers(node)
                if len(workers) > 1:
                    for _ in ("pull", "push"):
                        out.add("intra_node", _among(layout, workers, COUNT_BYTES * len(aggregated)))
        for r in on_ps.values():
            out.add("pull", r.to_owner * INDEX_BYTES)
            out.add("pull", r.to_owner.T * r.row_bytes)
            out.add("push", r.to_owner * (INDEX_BYTES + r.row_bytes))
            if r.to_delegate is not None:
                out.add("intra_node", r.to_delegate * INDEX_BYTES)
                out.add("intra_node", r.to_delegate.T * r.row_bytes)
                out.add("intra_node", r.to_delegate * (INDEX_BYTES + r.row_bytes))
    workers = list(layout.worker_ranks)
    idx = np.asarray(workers)
    gathered = np.zeros(len(workers))  # each worker's block of the batched allgather
    for r in routings.values():
        if r.sync_method.gathers:
            record = INDEX_BYTES + r.row_bytes
            m = np.zeros((layout.size, layout.size))
            m[np.ix_(idx, idx)] = (r.unique[idx] * record)[:, None]
            out.add("allgather", m)
            gathered += r.unique[idx] * record
        elif r.sync_method.densified:
            out.add_ranks("dense_sparse", workers, *_ring(layout, r.rows * r.row_bytes + r.rows))
    block = padded_block_bytes(np.rint(gathered)) if gathered.any() else None
    if block is not None:  # every block padded to the largest: the phase's bytes
        m = np.zeros((layout.size, layout.size))
        m[np.ix_(idx, idx)] = np.maximum(block - gathered, 0.0)[:, None]
        out.add("allgather", m)
    for nbytes in dense_bytes:
        out.add_ranks("dense", workers, *_ring(layout, nbytes))
    return out.phases


def owner_bytes(layout: Layout, routings: dict) -> dict:
    """Owners' row bytes of one step, as the workers count them
    (:meth:`~hpcpax.comm.accounting.Accounting.record_owner`; no hot-row trees).

    ``{"egress", "egress_inter", "ingress", "ingress_inter"}``: rows owners
    send (pulled rows) and receive (pushed ids and gradient rows), in all and
    off their node, summed over the step's ``ps`` variables.
    """
    node = np.asarray(layout.node_of)
    other = ~np.eye(layout.size, dtype=bool)
    cross = node[:, None] != node[None, :]
    out = dict.fromkeys(("egress", "egress_inter", "ingress", "ingress_inter"), 0.0)
    for r in routings.values():
        if not r.sync_method.on_servers:
            continue
        for key, width in (("egress", r.row_bytes), ("ingress", INDEX_BYTES + r.row_bytes)):
            out[key] += float((r.to_owner * width)[other].sum())
            out[key + "_inter"] += float((r.to_owner * width)[cross].sum())
    return out


def ceil_div(a: float, b: float) -> int:
    """``ceil(a / b)``, 0 when ``b`` is 0."""
    return int(math.ceil(a / b)) if b else 0
