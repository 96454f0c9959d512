"""Placement of a sparse variable's partitions on owner ranks.

The one placement policy of the package: the parameter server uses it when a
variable is registered or repartitioned, the planner when it writes a plan.
Pure and deterministic, so every rank computes the same map without talking.
"""

from __future__ import annotations

import heapq

import numpy as np

__all__ = ["assign_owners"]


def assign_owners(partition_bytes: list, num_servers: int) -> list:
    """Place partitions on servers, balancing bytes.

    Greedy largest-first: partitions in order of decreasing bytes (ties by
    index) each go to the server holding the fewest bytes so far (ties to the
    lowest server index). Deterministic, so every rank computes the same map.

    Args:
        partition_bytes: bytes of each partition.
        num_servers: number of servers (>= 1).

    Returns:
        The server index of each partition, aligned with ``partition_bytes``.
    """
    if isinstance(num_servers, bool) or not isinstance(num_servers, (int, np.integer)):
        raise TypeError(f"num_servers must be an int, not {type(num_servers).__name__}")
    if num_servers < 1:
        raise ValueError(f"num_servers must be >= 1, not {num_servers}")
    sizes = [int(b) for b in partition_bytes]
    if any(b < 0 for b in sizes):
        raise ValueError(f"partition_bytes must be >= 0, not {min(sizes)}")
    heap = [(0, server) for server in range(int(num_servers))]  # (bytes, server): ties go to the lower index
    owners = [0] * len(sizes)
    for index in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        load, server = heapq.heappop(heap)
        owners[index] = server
        heapq.heappush(heap, (load + sizes[index], server))
    return owners
