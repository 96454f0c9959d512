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

import os
import re

import numpy as np

from ..errors import ConfigError

__all__ = ["parse_bytes", "available_memory", "default_budget", "owner_budget",
           "table_bytes", "check_memory_budget", "format_bytes", "DEFAULT_FRACTION"]

#: Share of the node's available memory the owner ranks of a node may fill.
DEFAULT_FRACTION = 0.8
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value, where="size"):
    """``"8G"`` -> 8589934592; None stays None; ints pass. ConfigError names ``where``."""
    if value is None or value == "":
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        number = int(value)
    else:
        match = _SIZE.match(str(value)) if isinstance(value, (str, float)) else None
        if match is None:
            raise ConfigError(f"{where} must be a size like 512M or 8G, not {value!r}")
        number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number <= 0:
        raise ConfigError(f"{where} must be a positive size, not {value!r}")
    return number


def format_bytes(n) -> str:
    """``3.0 GiB``-style text."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


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
    """Bytes one rank may hold by default: env, else MemAvailable x fraction / ranks on node."""
    from_env = parse_bytes(os.environ.get("HPCPAX_SERVER_MEMORY"), "HPCPAX_SERVER_MEMORY")
    if from_env is not None:
        return from_env
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

    state = make_optimizer(spec.optimizer, **spec.optimizer_params).init_state(
        (2, spec.dim), np.dtype(spec.dtype), np)
    return sum(1 for v in state.values() if np.ndim(v) == 2 and np.shape(v)[0] == 2)


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
    held = sum(var.table.nbytes + sum(np.asarray(v).nbytes for v in var.state.values())
               for var in ps.variables.values() if var.table is not None)
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
