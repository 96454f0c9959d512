"""The fabric as an alpha-beta model, measured at start-up.

A message of ``n`` bytes over a link takes ``latency_s + n / bandwidth_Bps``.
:func:`measure_fabric` times ping-pongs between a pair of ranks on the same
(virtual) node and a pair on different nodes, fits the two constants by least
squares, and times ``Allreduce`` at a few fusion sizes to find the best
bucket for :class:`~hpcpax.comm.allreduce.DenseAllreduce`. Rank 0's figures are
broadcast, so every rank holds the same :class:`Fabric` (the planner and the
fusion engine must agree).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..options import options
from .polling import idle_barrier

__all__ = [
    "Fabric",
    "LinkModel",
    "autotune_bucket_bytes",
    "default_fabric",
    "fit_link_model",
    "host_facts",
    "measure_fabric",
]

#: Ping-pong message sizes (bytes) and round trips per size.
PING_PONG_SIZES = (8, 64 << 10, 1 << 20)
PING_PONG_REPEATS = (40, 12, 6)
#: Bytes of the warm-up Allreduce that sizes :func:`autotune_bucket_bytes`' pattern.
WARMUP_BYTES = 1 << 20
#: Fusion sizes tried by :func:`autotune_bucket_bytes`.
BUCKET_CANDIDATES = (64 << 10, 256 << 10, 1 << 20, 2 << 20, 4 << 20, 8 << 20)
#: Bucket size when nothing was measured: about an L2 cache, where MPI's
#: shared-memory bandwidth peaks on the machines we tried.
DEFAULT_BUCKET_BYTES = 1 << 20

_BUCKET_CACHE = {}


@dataclass
class LinkModel:
    """``t(n) = latency_s + n / bandwidth_Bps`` for one kind of link."""

    latency_s: float
    bandwidth_Bps: float

    def time(self, nbytes) -> float:
        """Seconds to move ``nbytes`` over this link."""
        return self.latency_s + float(nbytes) / self.bandwidth_Bps


@dataclass
class Fabric:
    """Links inside a (virtual) node and between nodes, plus the best fusion size."""

    intra: LinkModel
    inter: LinkModel
    allreduce_bucket_bytes: int

    def to_dict(self) -> dict:
        """JSON-ready copy."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d) -> "Fabric":
        """Inverse of :meth:`to_dict`."""
        return cls(intra=LinkModel(**d["intra"]), inter=LinkModel(**d["inter"]),
                   allreduce_bucket_bytes=int(d["allreduce_bucket_bytes"]))


def default_fabric() -> Fabric:
    """Figures for a single process or when nothing was measured.

    Intra-node: 1 us, 5 GB/s (shared memory); inter-node: 2 us, 12.5 GB/s
    (100 Gb/s InfiniBand HDR-100-class); bucket :data:`DEFAULT_BUCKET_BYTES`.
    """
    return Fabric(intra=LinkModel(1e-6, 5e9), inter=LinkModel(2e-6, 12.5e9),
                  allreduce_bucket_bytes=DEFAULT_BUCKET_BYTES)


def fit_link_model(sizes, seconds) -> LinkModel:
    """Least-squares fit of ``seconds = latency + size / bandwidth``.

    Exact for exact alpha-beta data. A negative intercept is clamped to 0 and
    a non-positive slope falls back to the largest size over its time, so the
    result is always finite and positive. Not collective.
    """
    sizes = np.asarray(sizes, np.float64)
    seconds = np.asarray(seconds, np.float64)
    if sizes.shape != seconds.shape or sizes.size < 2:
        raise ValueError(f"sizes and seconds must be equal-length with >= 2 points, not "
                         f"{sizes.shape} and {seconds.shape}")
    design = np.stack([np.ones_like(sizes), sizes], axis=1)
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds, rcond=None)
    if not per_byte > 0:
        big = int(np.argmax(sizes))
        per_byte = seconds[big] / max(sizes[big], 1.0)
    latency = max(float(latency), 0.0)
    bandwidth = 1.0 / per_byte if per_byte > 0 else default_fabric().intra.bandwidth_Bps
    return LinkModel(latency_s=latency, bandwidth_Bps=float(bandwidth))


def _ping_pong(comm, me, first, second, budget_s):
    """Median one-way seconds per size between world ranks ``first`` and ``second``."""
    out = []
    deadline = time.perf_counter() + budget_s
    for size, repeats in zip(PING_PONG_SIZES, PING_PONG_REPEATS):
        buf = np.zeros(size, np.uint8)
        times = []
        for i in range(repeats + 1):  # the first round trip warms up the path
            # the initiator decides when the budget is spent and tells its partner
            if me == first:
                # at least one timed round trip per size, so the fit always has its points
                go = np.array([i <= 1 or time.perf_counter() < deadline], np.int8)
                comm.Send(go, dest=second, tag=11)
                if not go[0]:
                    break
                start = time.perf_counter()
                comm.Send(buf, dest=second, tag=12)
                comm.Recv(buf, source=second, tag=13)
                if i:
                    times.append((time.perf_counter() - start) / 2)
            else:
                go = np.zeros(1, np.int8)
                comm.Recv(go, source=first, tag=11)
                if not go[0]:
                    break
                comm.Recv(buf, source=first, tag=12)
                comm.Send(buf, dest=first, tag=13)
        out.append(float(np.median(times)) if times else math.nan)
    return out


def _link(comm, node_of, want_same_node, budget_s):
    """Fit a link between rank 0 and the first rank on the same (or another) node."""
    rank = comm.Get_rank()
    partners = [r for r in range(1, comm.Get_size())
                if (node_of[r] == node_of[0]) == want_same_node]
    if not partners:
        return None
    partner = partners[0]
    if rank in (0, partner):
        seconds = _ping_pong(comm, rank, 0, partner, budget_s)
        good = [(s, t) for s, t in zip(PING_PONG_SIZES, seconds) if math.isfinite(t)]
        model = fit_link_model(*zip(*good)) if len(good) >= 2 else None
    else:
        model = None
    idle_barrier(comm)
    return comm.bcast(model, root=0)


def _bucketed_allreduce(comm, buf, bucket_elems):
    """Allreduce ``buf`` bucket by bucket, as ``DenseAllreduce.allreduce`` does."""
    from mpi4py import MPI

    for offset in range(0, buf.size, bucket_elems):
        comm.Allreduce(MPI.IN_PLACE, buf[offset:offset + bucket_elems])


def autotune_bucket_bytes(comm, candidates=BUCKET_CANDIDATES, budget_s=0.3) -> int:
    """Fusion size with the highest ``Allreduce`` bandwidth over ``comm``.

    **Collective** over ``comm``. Rank 0's choice is broadcast. Cached per
    group of world ranks, so later calls on the same ranks are free.
    ``hpcpax.options.bucket_bytes`` (``$HPCPAX_BUCKET_BYTES``) overrides the measurement.
    """
    from mpi4py import MPI

    if options.bucket_bytes is not None:
        return options.bucket_bytes
    if comm is None or comm.Get_size() == 1:
        return DEFAULT_BUCKET_BYTES
    group = comm.Get_group()
    world = MPI.COMM_WORLD.Get_group()
    key = tuple(MPI.Group.Translate_ranks(group, list(range(comm.Get_size())), world))
    group.Free()
    world.Free()
    if key in _BUCKET_CACHE:
        return _BUCKET_CACHE[key]
    # Time the engine's own pattern: a fixed total cut into buckets of each
    # candidate size, reduced one after the other, candidates interleaved over
    # rounds and judged by their median, so a burst of noise on a shared
    # machine cannot crown one size. The total is sized in seconds, not bytes:
    # a warm-up of WARMUP_BYTES estimates the link, and the total is what lets
    # two rounds of every candidate fit the budget (at most twice the largest
    # candidate; candidates above it are dropped). The clock is checked after
    # every candidate, so a slow link ends the measurement within one pattern.
    warm = np.zeros(WARMUP_BYTES // 4, np.float32)
    comm.Barrier()
    start = time.perf_counter()
    comm.Allreduce(MPI.IN_PLACE, warm)  # also pages in and sets up the channels
    per_byte = comm.allreduce(time.perf_counter() - start, op=MPI.MAX) / WARMUP_BYTES
    per_byte = comm.bcast(per_byte, root=0)
    affordable = budget_s / (2 * len(candidates)) / max(per_byte, 1e-12)
    total = int(min(2 * max(candidates), max(min(candidates), affordable)))
    candidates = [size for size in sorted(candidates) if size <= total] or [min(candidates)]
    total = max(total // 4 * 4, max(candidates))
    buf = np.zeros(total // 4, np.float32)
    rounds = 3
    seconds = {size: [] for size in candidates}
    deadline = time.perf_counter() + budget_s
    over = False
    for round_index in range(rounds):
        for size in candidates:
            comm.Barrier()
            start = time.perf_counter()
            _bucketed_allreduce(comm, buf, size // 4)
            seconds[size].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
            # same decision on every rank: rank 0's clock
            over = comm.bcast(time.perf_counter() > deadline, root=0)
            if over:
                break
        if over:
            break
    timed = [size for size in candidates if seconds[size]]
    best = min(timed, key=lambda size: (float(np.median(seconds[size])), size))
    best = comm.bcast(best, root=0)
    _BUCKET_CACHE[key] = best
    return best


def measure_fabric(topology, budget_s=1.0) -> Fabric:
    """Measure intra- and inter-node links and the best fusion size.

    **Collective** over ``topology.comm``; every rank returns the same
    :class:`Fabric` (rank 0's fit). With a single node, ``inter`` is the intra
    measurement; with one rank per node, ``intra`` is the inter one; a
    single-rank world returns :func:`default_fabric`. Takes about
    ``budget_s`` seconds (a little more on a busy machine).
    """
    if not isinstance(budget_s, (int, float)) or not budget_s > 0:
        raise ValueError(f"budget_s must be a positive number, not {budget_s!r}")
    comm = topology.comm
    if comm.Get_size() == 1:
        return default_fabric()
    node_of = np.asarray(topology.node_of)
    intra = _link(comm, node_of, True, 0.3 * budget_s)
    inter = _link(comm, node_of, False, 0.3 * budget_s)
    intra = intra or inter or default_fabric().intra
    inter = inter or intra
    bucket = None
    if topology.workers is not None:
        bucket = autotune_bucket_bytes(topology.workers, budget_s=0.3 * budget_s)
    idle_barrier(comm)  # the servers wait for the workers' timing without spinning
    bucket = comm.bcast(bucket, root=topology.worker_ranks[0])
    return Fabric(intra=intra, inter=inter, allreduce_bucket_bytes=int(bucket))


def host_facts() -> list:
    """``[host name, network namespace, MPI library]`` of this rank: what a fabric
    measured here depends on beyond the layout (the nodes of an emulated cluster
    on one machine differ by namespace). Local."""
    import os
    import socket

    from mpi4py import MPI

    try:
        namespace = os.readlink("/proc/self/ns/net")
    except OSError:
        namespace = ""
    return [socket.gethostname(), namespace, MPI.Get_library_version().strip()[:200]]

