"""Resource limits: a memory budget for the sparse tables each owner rank holds.

A table too large for its servers should be refused at registration, with
the sizes named, on every rank together, not found by the kernel's OOM
killer an hour into the run. The budget of one owner rank is, in order:

1. ``ParameterServer.memory_budget`` (the trainer's ``--server-memory-budget``);
2. ``$HPCPAX_SERVER_MEMORY``;
3. ``MemAvailable`` of ``/proc/meminfo`` x :data:`DEFAULT_FRACTION`, divided
   by the ranks on the node (no limit where ``/proc/meminfo`` is unreadable).

Sizes are bytes, or a number with a suffix ``K``, ``M``, ``G``, ``T``
(powers of 1024; ``KiB``, ``GB``... accepted alike).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..options import format_bytes, options

__all__ = ["available_memory", "default_budget", "owner_budget", "table_bytes",
           "check_memory_budget", "DEFAULT_FRACTION"]

#: Share of the node's available memory the owner ranks of a node may fill.
DEFAULT_FRACTION = 0.8
def available_memory(meminfo="/proc/meminfo"):
    """``MemAvailable`` in bytes, or None where unknown."""
    try:
        with open(meminfo, encoding="ascii") as handle:
            for line in handle:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def default_budget(local_size: int, meminfo="/proc/meminfo"):
    """Bytes one rank may hold by default: ``options.server_memory``, else MemAvailable x
    fraction / ranks on node."""
    if options.server_memory is not None:
        return options.server_memory
    available = available_memory(meminfo)
    if available is None:
        return None
    return int(available * DEFAULT_FRACTION / max(1, int(local_size)))


def owner_budget(ps):
    """This rank's budget for ``ps``: its ``memory_budget`` attribute, else the default."""
    budget = getattr(ps, "memory_budget", None)
    return budget if budget is not None else default_budget(ps.topology.local_size)


def _slot_count(spec) -> int:
    """Optimizer slots with one row per table row (Adagrad 1, Adam 2...)."""
    from ..ops.optimizers import make_optimizer

    return len(make_optimizer(spec.optimizer, **spec.optimizer_params).row_slots)


def table_bytes(specs, num_owners: int) -> list:
    """Bytes per owner index ``[(table, slots)]`` the layout of ``specs`` puts there.

    Uses the same partitioning and owner assignment as the parameter server,
    without allocating anything.
    """
    from ..ops.partitioning import Partitioning
    from .placement import assign_owners

    load = [[0, 0] for _ in range(num_owners)]
    for spec in specs:
        parts = spec.num_partitions or num_owners
        partitioning = Partitioning(spec.partitioning, spec.rows, int(parts))
        part_bytes = [partitioning.part_rows(p) * spec.row_bytes for p in range(parts)]
        slots = _slot_count(spec)
        for p, owner in enumerate(assign_owners(part_bytes, num_owners)):
            load[owner][0] += part_bytes[p]
            load[owner][1] += part_bytes[p] * slots
    return load


def check_memory_budget(ps, specs) -> None:
    """Refuse ``specs`` if any owner would exceed its budget. **Collective** over ``topology.comm``.

    One ``allgather`` of (budget, bytes already held) per rank; every rank
    then does the same arithmetic and raises the same ConfigError, before
    anything is allocated.
    """
    topo = ps.topology
    held = sum(var.shard.nbytes for var in ps.variables.values() if var.shard is not None)
    everyone = topo.comm.allgather((owner_budget(ps), int(held)))
    load = table_bytes(specs, len(topo.owner_ranks))
    worst = None
    for index, rank in enumerate(topo.owner_ranks):
        budget, already = everyone[rank]
        need = already + load[index][0] + load[index][1]
        if budget is not None and need > budget and (worst is None or need - budget > worst[0]):
            worst = (need - budget, rank, budget, already, load[index])
    if worst is None:
        return
    _, rank, budget, already, (tables, slots) = worst
    names = ", ".join(f"{s.name} {s.rows}x{s.dim} {np.dtype(s.dtype)}" for s in specs)
    raise ConfigError(
        f"sparse tables do not fit: owner rank {rank} would hold "
        f"{format_bytes(already + tables + slots)} ({format_bytes(tables)} of tables + "
        f"{format_bytes(slots)} of optimizer slots"
        + (f" + {format_bytes(already)} already registered" if already else "")
        + f"), above its memory budget of {format_bytes(budget)} "
        f"(--server-memory-budget / HPCPAX_SERVER_MEMORY); tables: {names}; "
        f"add server ranks or nodes, or raise the budget")
