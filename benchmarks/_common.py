"""Helpers shared by the side-by-side benchmarks (not part of hpcpax).

- :func:`emit`: print the one JSON line a benchmark reports (rank 0 only).
- :func:`idle_wait`: a barrier for ranks idle while others are timed.
- :func:`interleaved`: time several methods A B C A B C ... on the same data,
  each repetition bounded by barriers and taken as the slowest rank's time.
- :func:`median`, :func:`ratio`: figures as the reports show them.
- :func:`zipf_ids`, :func:`sparse_step`: the LM-like sparse workload
  (Zipf s=1.0 ids over 200,000 rows, dim 64, 4,096 ids per worker per step).
- :func:`offnode_lower_bound`, :func:`allgather_bytes`: byte figures by formula.

Nothing here imports torch; the torch scripts import it themselves.
"""

from __future__ import annotations

import json
import math
import socket
import time

import numpy as np

ROWS = 200_000
DIM = 64
IDS_PER_WORKER = 4096
ZIPF_S = 1.0
ID_BYTES = 8  # int64 id on the wire


def emit(result: dict, rank: int = 0) -> None:
    """Print ``result`` as one JSON line on rank 0 (rounded, finite floats)."""
    if rank == 0:
        print(json.dumps(_rounded(result)), flush=True)


def _rounded(value):
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_rounded(v) for v in value]
    if isinstance(value, (float, np.floating)):
        value = float(value)
        return float(f"{value:.6g}") if math.isfinite(value) else None
    if isinstance(value, np.integer):
        return int(value)
    return value


def median(values) -> float:
    """Median of a non-empty sequence, as a float."""
    return float(np.median(np.asarray(values, np.float64)))


def measured(value) -> bool:
    """Whether ``value`` is a figure that was measured: a finite number, not None or NaN."""
    return isinstance(value, (int, float, np.integer, np.floating)) and \
        not isinstance(value, bool) and math.isfinite(float(value))


def all_valid(entries) -> bool:
    """A benchmark's ``valid``: at least one entry, and every entry a dict whose own
    ``valid`` is True. A run that measured nothing (no entries, or an entry standing
    for a failed or timed-out round) is not valid."""
    entries = list(entries)
    return bool(entries) and all(isinstance(e, dict) and e.get("valid") is True
                                 for e in entries)


def ratio(numerator, denominator):
    """``numerator / denominator`` or None when undefined."""
    if numerator is None or denominator is None or denominator == 0:
        return None
    return float(numerator) / float(denominator)


def interleaved(comm, methods: dict, repeats: int, warmup: int = 2, before=None) -> dict:
    """Seconds of each call of each method, interleaved A B A B ... .

    **Collective** over ``comm`` (every rank runs every method in the same
    order). Each timed call starts after a barrier and counts as the slowest
    rank's time, so a straggler is never hidden. ``before(name)`` runs
    untimed before each call (e.g. to reset counters).

    Returns:
        ``{name: [seconds, ...]}``, ``repeats`` entries each.
    """
    from mpi4py import MPI

    times = {name: [] for name in methods}
    for step in range(warmup + repeats):
        for name, call in methods.items():
            if before is not None:
                before(name)
            comm.Barrier()
            start = time.perf_counter()
            call()
            elapsed = comm.allreduce(time.perf_counter() - start, op=MPI.MAX)
            if step >= warmup:
                times[name].append(elapsed)
    return times


def idle_wait(comm, nap_s=0.005) -> None:
    """A barrier that sleeps instead of spinning (ranks idle while others are timed)."""
    request = comm.Ibarrier()
    while not request.Test():
        time.sleep(nap_s)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def zipf_cdf(rows: int = ROWS, s: float = ZIPF_S) -> np.ndarray:
    """CDF of P(r) proportional to ``(r + 1) ** -s`` over ``rows`` rows."""
    weights = np.arange(1, rows + 1, dtype=np.float64) ** -float(s)
    cdf = np.cumsum(weights)
    return cdf / cdf[-1]


def zipf_ids(rng, count: int, cdf: np.ndarray) -> np.ndarray:
    """``count`` int64 ids drawn from ``cdf`` (row 0 most frequent)."""
    ids = np.searchsorted(cdf, rng.random(count), side="right")
    return np.minimum(ids, len(cdf) - 1).astype(np.int64)


def sparse_step(seed: int, step: int, worker: int, count: int = IDS_PER_WORKER,
                dim: int = DIM, rows: int = ROWS, cdf=None):
    """One worker's raw sparse gradient of one step: ``(ids with repeats, float32 rows)``.

    Depends only on its arguments, so every method and every script sees the
    same gradients.
    """
    cdf = zipf_cdf(rows) if cdf is None else cdf
    rng = np.random.default_rng([seed, step, worker])
    ids = zipf_ids(rng, count, cdf)
    values = rng.standard_normal((count, dim), dtype=np.float32) * np.float32(0.01)
    return ids, values


def offnode_lower_bound(unique_ids_per_worker, node_of_worker, owner_node_of, dim: int,
                        value_bytes: int = 4) -> dict:
    """Least off-node bytes any PS sync of one step can move.

    For each node, the union of its workers' unique ids whose owner sits on
    another node must leave it: once as a push (id + row, ``8 + dim*4``
    bytes) and once as a pull (id out, row back: ``8 + dim*4`` bytes).
    Workers of a node can share a pull and merge a push inside the node, so
    rows already on the node, and repeats among its workers, cost nothing.

    Args:
        unique_ids_per_worker: list of int64 arrays, one per worker.
        node_of_worker: node index of each worker.
        owner_node_of: function ids -> node index of each id's owner.
        dim, value_bytes: row width and bytes per value.

    Returns:
        ``{"push", "pull", "total"}`` bytes.
    """
    row = ID_BYTES + dim * value_bytes
    remote = 0
    for node in sorted(set(node_of_worker)):
        ids = [u for u, n in zip(unique_ids_per_worker, node_of_worker) if n == node]
        union = np.unique(np.concatenate(ids)) if ids else np.zeros(0, np.int64)
        remote += int(np.count_nonzero(owner_node_of(union) != node))
    return {"push": remote * row, "pull": remote * row, "total": 2 * remote * row}


def allgather_bytes(nnz_per_rank, node_of_rank, row_bytes: int) -> dict:
    """Bytes of an allgather of per-rank row blocks, direct-send equivalent.

    Every rank's ``nnz * row_bytes`` block reaches each of the other ranks
    once (what Horovod's Allgatherv and gloo's sparse allreduce deliver; a
    ring moves the same total). Off-node: the copies that go to ranks on
    another node.

    Returns:
        ``{"total", "offnode"}`` bytes over all ranks.
    """
    nnz = np.asarray(nnz_per_rank, np.int64)
    nodes = np.asarray(node_of_rank)
    n = len(nnz)
    total = int((nnz * row_bytes).sum()) * (n - 1)
    remote_peers = np.array([np.count_nonzero(nodes != nodes[r]) for r in range(n)], np.int64)
    offnode = int((nnz * row_bytes * remote_peers).sum())
    return {"total": total, "offnode": offnode}


def phase_bytes(reduced: dict, phases) -> dict:
    """Total and off-node bytes sent in ``phases`` of an ``Accounting.reduce`` result."""
    total = sum(reduced["phases"].get(p, {}).get("sent_bytes", 0) for p in phases)
    inter = sum(reduced["phases"].get(p, {}).get("sent_inter_bytes", 0) for p in phases)
    return {"total": int(total), "offnode": int(inter)}
