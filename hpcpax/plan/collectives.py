"""Seconds of one MPI collective, for the algorithm MPICH actually runs.

Pure arithmetic (no MPI): the cost model prices every collective of a step
here. Each function takes the communicator as ``node_of`` (node index of
each of its ranks, in rank order) and the bytes each rank contributes, and
returns a :class:`Cost`.

Algorithm choice follows the collective-selection table compiled into the
``mpich`` wheel (MPICH 5.0.2, ``MPIR_Csel`` JSON; read from ``libmpi.so``):

* ``Allgather(v)``: a power-of-two communicator with under 512 KiB in total
  uses recursive doubling; otherwise under 80 KiB Bruck; otherwise the ring.
* ``Alltoall``: under 8 ranks ``scattered`` (every send posted at once) up
  to 32 KiB per peer; 8 ranks or more with at most 256 bytes per peer use
  Bruck. ``Alltoallv`` (not in place) is always ``scattered``, and skips
  peers with a zero count.
* ``Allreduce``: across several nodes the node-aware composition (reduce to
  a node leader, allreduce among leaders, broadcast in the node); among the
  leaders recursive doubling when the element count is below the largest
  power of two <= ranks, else reduce-scatter + allgather (Rabenseifner).

Every round costs ``latency + bytes / bandwidth`` of the link it crosses
(``intra`` or ``inter``); a round ends when its slowest rank is done. On a
real cluster the ranks of a node share one NIC: a round also lasts at least
the node's off-node bytes over the inter-node bandwidth (``shared_nic``).
With more busy ranks than cores, every round also waits for its ranks'
turns on the cores (``Links.round_wait_s``; a scattered ``Alltoallv``
waits once). Full-duplex links move a rank's sends and receives at once;
when the "links" are copies through host memory on one machine
(``duplex=False``) the same core does both, so they add up.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

__all__ = ["Links", "Cost", "allgatherv", "allgatherv_algorithm", "alltoallv", "alltoall",
           "allreduce", "ring_allreduce_bytes_per_rank"]

#: MPICH 5.0.2 selection thresholds (bytes), from the compiled-in Csel table.
ALLGATHER_RD_LIMIT = 524288
ALLGATHER_BRUCK_LIMIT = 81920
ALLTOALL_BRUCK_LIMIT = 256
ALLTOALL_SCATTERED_LIMIT = 32768
ALLTOALL_SMALL_COMM = 8
SHORT_MESSAGE = 2048  # reduce/bcast switch from binomial trees to scatter-based algorithms


@dataclass(frozen=True)
class Links:
    """The two link classes of the alpha-beta model, plus how they share.

    Args:
        intra_latency, intra_bandwidth: inside a node (seconds, bytes/s).
        inter_latency, inter_bandwidth: between nodes.
        bucket_bytes: fusion buffer of the dense allreduce.
        duplex: a rank sends and receives at once (networks); False for
            copies through the memory of one host, where they add up.
        shared_nic: the ranks of a node share one NIC of
            ``inter_bandwidth`` (False for virtual nodes on one host).
        allreduce: measured ``(latency, bandwidth)`` of ``Allreduce`` over
            the workers on this machine, used instead of the algorithm
            formula when given (MPICH runs a shared-memory algorithm there).
        allreduce_fresh: the same for a buffer allocated just before the
            call (a densified table: its pages are first touched, and
            faulted in, inside the ``Allreduce``); None: as ``allreduce``.
        round_wait_s: seconds every round of a collective waits beyond its
            latency, for the ranks in it to get a core (ranks outnumbering
            the cores: see :mod:`hpcpax.plan.sim`'s ``oversubscription``);
            not added to a measured ``allreduce``, whose measurement holds it.
    """

    intra_latency: float
    intra_bandwidth: float
    inter_latency: float
    inter_bandwidth: float
    bucket_bytes: int = 64 << 20
    duplex: bool = True
    shared_nic: bool = True
    allreduce: tuple | None = None
    allreduce_fresh: tuple | None = None
    round_wait_s: float = 0.0

    @classmethod
    def from_fabric(cls, fabric) -> "Links":
        """From a ``hpcpax.comm.fabric.Fabric``, its ``to_dict()``, or a :class:`Links`.

        A dict may also carry ``duplex``, ``shared_nic``, ``allreduce``
        (``{"latency_s", "bandwidth_Bps"}``) and ``round_wait_s``.
        """
        if isinstance(fabric, cls):
            return fabric
        if isinstance(fabric, Mapping):
            get = fabric.get
            intra, inter = fabric["intra"], fabric["inter"]
            il, ib = float(intra["latency_s"]), float(intra["bandwidth_Bps"])
            xl, xb = float(inter["latency_s"]), float(inter["bandwidth_Bps"])
        else:
            get = lambda key, default=None: getattr(fabric, key, default)  # noqa: E731
            il, ib = float(fabric.intra.latency_s), float(fabric.intra.bandwidth_Bps)
            xl, xb = float(fabric.inter.latency_s), float(fabric.inter.bandwidth_Bps)
        if min(ib, xb) <= 0:
            raise ValueError(f"fabric bandwidths must be > 0, not intra={ib}, inter={xb}")
        measured, fresh = get("allreduce", None), get("allreduce_fresh", None)
        if isinstance(measured, Mapping):
            measured = (float(measured["latency_s"]), float(measured["bandwidth_Bps"]))
        if isinstance(fresh, Mapping):
            fresh = (float(fresh["latency_s"]), float(fresh["bandwidth_Bps"]))
        return cls(il, ib, xl, xb, max(1, int(get("allreduce_bucket_bytes", 64 << 20) or 1)),
                   bool(get("duplex", True)), bool(get("shared_nic", True)),
                   tuple(measured) if measured else None, tuple(fresh) if fresh else None,
                   float(get("round_wait_s", 0.0) or 0.0))

    def link(self, crosses: bool):
        """``(latency, bandwidth)`` of the inter-node link if ``crosses``, else intra."""
        if crosses:
            return self.inter_latency, self.inter_bandwidth
        return self.intra_latency, self.intra_bandwidth


@dataclass
class Cost:
    """Seconds of some communication, split by what they are spent on.

    ``latency_s``: per-message and per-round latencies; ``bandwidth_s``:
    bytes over a rank's own link; ``nic_s``: extra time because a node's
    shared NIC (incast at a server included) is the slower resource.
    ``bottleneck`` names the resource that dominated the most.
    """

    latency_s: float = 0.0
    bandwidth_s: float = 0.0
    nic_s: float = 0.0
    rounds: int = 0
    algorithm: str = ""
    bottleneck: str = ""
    parts: dict = field(default_factory=dict)

    @property
    def seconds(self) -> float:
        """Latency, bandwidth and NIC seconds together."""
        return self.latency_s + self.bandwidth_s + self.nic_s

    def add_round(self, latency, link_s, nic_s, link_name, nic_name):
        """Add one round: its latency, link seconds and the NIC's excess over the link."""
        self.latency_s += latency
        self.bandwidth_s += link_s
        self.nic_s += max(0.0, nic_s - link_s)
        self.rounds += 1
        key = nic_name if nic_s > link_s else link_name
        self.parts[key] = self.parts.get(key, 0.0) + max(link_s, nic_s)
        self.bottleneck = max(self.parts, key=self.parts.get) if any(self.parts.values()) \
            else ("latency" if self.latency_s else "")


def _node_array(node_of) -> np.ndarray:
    return np.asarray(node_of, np.int64).ravel()


def _round(cost, links, node_of, send_bytes, dest, recv_bytes, source):
    """Price one round: rank ``r`` sends ``send_bytes[r]`` to ``dest[r]`` and
    receives ``recv_bytes[r]`` from ``source[r]`` (-1: nothing)."""
    sends = (dest >= 0) & (send_bytes > 0)
    recvs = (source >= 0) & (recv_bytes > 0)
    if not sends.any() and not recvs.any():
        return
    cross_out = sends & (node_of[np.maximum(dest, 0)] != node_of)
    cross_in = recvs & (node_of[np.maximum(source, 0)] != node_of)
    crosses = bool(cross_out.any() or cross_in.any())
    latency, _ = links.link(crosses)
    out_bw = np.where(cross_out, links.inter_bandwidth, links.intra_bandwidth)
    in_bw = np.where(cross_in, links.inter_bandwidth, links.intra_bandwidth)
    t_out = np.where(sends, send_bytes / out_bw, 0.0)
    t_in = np.where(recvs, recv_bytes / in_bw, 0.0)
    link_s = float((np.maximum(t_out, t_in) if links.duplex else t_out + t_in).max())
    nic_s = 0.0
    if links.shared_nic and crosses:
        nic_s = _nic_seconds(links, node_of, np.where(cross_out, send_bytes, 0.0),
                             np.where(cross_in, recv_bytes, 0.0))
    cost.add_round(latency + links.round_wait_s, link_s, nic_s,
                   "inter link" if crosses else "intra link", "node NIC")


def _nic_seconds(links, node_of, off_out, off_in) -> float:
    nodes = int(node_of.max()) + 1
    out = np.bincount(node_of, weights=off_out, minlength=nodes)
    into = np.bincount(node_of, weights=off_in, minlength=nodes)
    both = np.maximum(out, into) if links.duplex else out + into
    return float(both.max()) / links.inter_bandwidth


def allgatherv_algorithm(ranks: int, total_bytes: float) -> str:
    """MPICH's choice for ``Allgather``/``Allgatherv``: ``recursive_doubling``, ``bruck`` or ``ring``."""
    pow2 = ranks & (ranks - 1) == 0
    if pow2 and total_bytes < ALLGATHER_RD_LIMIT:
        return "recursive_doubling"
    if not pow2 and total_bytes < ALLGATHER_BRUCK_LIMIT:
        return "bruck"
    return "ring"


def allgatherv(node_of, block_bytes, links: Links, algorithm: str | None = None) -> Cost:
    """Seconds of ``Allgatherv`` where rank ``r`` contributes ``block_bytes[r]``.

    Every rank ends with every block, so each receives ``total - own``
    bytes whatever the algorithm; the algorithm decides the rounds (ring:
    ``p - 1``; recursive doubling and Bruck: ``ceil(log2 p)``) and which
    links and NICs the bytes cross in each round.
    """
    node_of = _node_array(node_of)
    blocks = np.broadcast_to(np.asarray(block_bytes, np.float64), node_of.shape).copy()
    p = len(node_of)
    algorithm = algorithm or allgatherv_algorithm(p, float(blocks.sum()))
    cost = Cost(algorithm=algorithm)
    if p <= 1:
        return cost
    ranks = np.arange(p)
    if algorithm == "ring":
        # round i: rank j passes block (j - i) to j + 1
        for i in range(p - 1):
            send = blocks[(ranks - i) % p]
            _round(cost, links, node_of, send, (ranks + 1) % p, send[(ranks - 1) % p],
                   (ranks - 1) % p)
    elif algorithm == "recursive_doubling":
        held = blocks.copy()  # bytes of the aligned group each rank holds
        distance = 1
        while distance < p:
            partner = ranks ^ distance
            valid = partner < p
            partner = np.where(valid, partner, -1)
            got = np.where(valid, held[np.maximum(partner, 0)], 0.0)
            _round(cost, links, node_of, np.where(valid, held, 0.0), partner, got, partner)
            held = held + got
            distance *= 2
    elif algorithm == "bruck":
        prefix = np.concatenate([[0.0], np.cumsum(np.concatenate([blocks, blocks]))])
        distance = 1
        while distance < p:
            count = min(distance, p - distance)
            send = prefix[ranks + count] - prefix[ranks]  # blocks j .. j+count-1
            source = (ranks + distance) % p
            _round(cost, links, node_of, send, (ranks - distance) % p, send[source], source)
            distance *= 2
    else:
        raise ValueError(f"algorithm must be ring, recursive_doubling or bruck, not {algorithm!r}")
    return cost


def alltoallv(node_of, matrix, links: Links) -> Cost:
    """Seconds of MPICH's ``scattered`` ``Alltoallv``: ``matrix[i, j]`` bytes from i to j.

    All sends and receives are posted at once: a rank pays one latency per
    non-empty peer and its bytes over its links; the collective lasts as
    long as its slowest rank, or its busiest NIC.
    """
    node_of = _node_array(node_of)
    m = np.array(matrix, np.float64, copy=True)
    np.fill_diagonal(m, 0.0)
    cost = Cost(algorithm="scattered")
    if len(node_of) <= 1 or not m.any():
        return cost
    cross = node_of[:, None] != node_of[None, :]
    nonzero = m > 0
    messages = np.maximum(nonzero.sum(axis=1), nonzero.sum(axis=0))
    crosses = bool((nonzero & cross).any())
    latency, _ = links.link(crosses)
    times = []
    for mask, bandwidth in ((~cross, links.intra_bandwidth), (cross, links.inter_bandwidth)):
        out = np.where(mask, m, 0.0).sum(axis=1) / bandwidth
        into = np.where(mask, m, 0.0).sum(axis=0) / bandwidth
        times.append(np.maximum(out, into) if links.duplex else out + into)
    per_rank = messages * latency + (np.maximum(*times) if links.duplex else times[0] + times[1])
    slowest = int(np.argmax(per_rank))
    link_s = float(per_rank[slowest] - messages[slowest] * latency)
    nic_s = 0.0
    if links.shared_nic and crosses:
        nic_s = _nic_seconds(links, node_of, np.where(cross, m, 0.0).sum(axis=1),
                             np.where(cross, m, 0.0).sum(axis=0))
    # every send is posted at once: the ranks' turns on the cores are waited for once
    cost.add_round(float(messages[slowest] * latency) + links.round_wait_s, link_s, nic_s,
                   "inter link" if crosses else "intra link", "node NIC")
    return cost


def alltoall(node_of, bytes_per_peer: float, links: Links) -> Cost:
    """Seconds of ``Alltoall`` of ``bytes_per_peer`` to every peer (MPICH's choice)."""
    node_of = _node_array(node_of)
    p = len(node_of)
    if p >= ALLTOALL_SMALL_COMM and bytes_per_peer <= ALLTOALL_BRUCK_LIMIT:
        cost = Cost(algorithm="bruck")
        ranks = np.arange(p)
        distance = 1
        while distance < p:
            moved = np.full(p, bytes_per_peer * math.ceil(p / 2))  # about half the blocks move
            _round(cost, links, node_of, moved, (ranks + distance) % p, moved,
                   (ranks - distance) % p)
            distance *= 2
        return cost
    matrix = np.full((p, p), float(bytes_per_peer))
    return alltoallv(node_of, matrix, links)


def ring_allreduce_bytes_per_rank(ranks: int, nbytes: float) -> float:
    """Bytes each rank sends (and receives) in a ring or Rabenseifner allreduce: ``2 (p-1)/p B``."""
    return 0.0 if ranks <= 1 else 2.0 * (ranks - 1) / ranks * nbytes


def _allreduce_flat(ranks, nbytes, count, latency, bandwidth, duplex) -> tuple:
    """(latency seconds, bandwidth seconds, rounds, algorithm) among ``ranks`` equal peers."""
    if ranks <= 1:
        return 0.0, 0.0, 0, ""
    steps = math.ceil(math.log2(ranks))
    pow2 = 1 << (ranks.bit_length() - 1)
    per_byte = (1.0 if duplex else 2.0) / bandwidth
    if count < pow2 or nbytes <= 8:
        return steps * latency, steps * nbytes * per_byte, steps, "recursive_doubling"
    moved = ring_allreduce_bytes_per_rank(ranks, nbytes) / 2  # each half
    return 2 * steps * latency, 2 * moved * per_byte, 2 * steps, "reduce_scatter_allgather"


def allreduce(node_of, nbytes: float, links: Links, itemsize: int = 4,
              fresh: bool = False) -> Cost:
    """Seconds of one ``Allreduce`` of ``nbytes`` over the ranks ``node_of`` describes.

    With a measured ``links.allreduce`` (same machine, same workers) that is
    used (``links.allreduce_fresh`` for a ``fresh`` buffer, when measured);
    otherwise MPICH's algorithm on the link classes (see the module
    docstring).
    """
    node_of = _node_array(node_of)
    p = len(node_of)
    cost = Cost()
    if p <= 1 or nbytes <= 0:
        return cost
    measured = links.allreduce_fresh if fresh and links.allreduce_fresh else links.allreduce
    if measured is not None:
        latency, bandwidth = measured
        cost.algorithm = "measured"
        cost.add_round(latency, nbytes / bandwidth, 0.0, "allreduce (measured)", "node NIC")
        return cost
    count = max(1, int(nbytes // itemsize))
    nodes = np.unique(node_of)
    if len(nodes) == 1:
        lat, bw, rounds, name = _allreduce_flat(p, nbytes, count, links.intra_latency,
                                                links.intra_bandwidth, links.duplex)
        cost.algorithm = name
        cost.add_round(lat + rounds * links.round_wait_s, bw, 0.0, "intra link", "node NIC")
        cost.rounds = rounds
        return cost
    g = int(np.bincount(node_of).max())
    cost.algorithm = "node-aware"
    inside = math.ceil(math.log2(g)) if g > 1 else 0
    per_byte_in = (1.0 if links.duplex else 2.0) / links.intra_bandwidth
    if g > 1:
        # reduce to the node leader, later broadcast from it: binomial trees for
        # small buffers, scatter + gather (each 2 (g-1)/g B) for large ones
        small = nbytes <= SHORT_MESSAGE or count < 1 << (g.bit_length() - 1)
        moved = inside * nbytes if small else 2.0 * (g - 1) / g * nbytes
        steps = inside if small else 2 * inside
        cost.add_round(2 * steps * (links.intra_latency + links.round_wait_s),
                       2 * moved * per_byte_in, 0.0, "intra link", "node NIC")
    lat, bw, rounds, _ = _allreduce_flat(len(nodes), nbytes, count, links.inter_latency,
                                         links.inter_bandwidth, links.duplex)
    cost.add_round(lat + rounds * links.round_wait_s, bw, 0.0, "inter link", "node NIC")
    cost.rounds = 2 * inside + rounds
    return cost
