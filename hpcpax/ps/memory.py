"""Resource limits: a memory budget for the sparse rows each owner rank holds.

Tables create rows on first touch (:mod:`hpcpax.ps.rowstore`), so what
counts is the rows a rank actually holds, not the declared table size.
:class:`RankMemory` adds up this rank's shards and tells a growing shard how
many rows still fit; a shard that would exceed the budget evicts its least
recently used rows (``SparseVariableSpec.eviction="lru"``) or fails with the
variable and the numbers named, on every rank together (at the next
parameter-server operation), not found by the kernel's OOM killer an hour
into the run. Loading a whole table at once (a method switch to ``ps``) is
checked at registration, before anything is allocated. The budget of one
owner rank is, in order:

1. ``ParameterServer.memory_budget`` (the trainer's ``--server-memory-budget``);
2. ``$HPCPAX_SERVER_MEMORY``;
3. ``MemAvailable`` of ``/proc/meminfo`` x :data:`DEFAULT_FRACTION`, divided
   by the ranks on the node (no limit where ``/proc/meminfo`` is unreadable).

Sizes are bytes, or a number with a suffix ``K``, ``M``, ``G``, ``T``
(powers of 1024; ``KiB``, ``GB``... accepted alike). The headroom: a shard
counts its allocated capacity (rows held plus the slack of its last
growth) and its id map at a conservative bytes-per-row, and the default
budget leaves 20 % of the available memory for everything else.

Whole tables (a replica on every worker for ``allgather``/``allreduce``,
:meth:`~hpcpax.ps.server.ParameterServer.gather_table`,
``read_table``) must fit ``hpcpax.options.replica_memory``
(``HPCPAX_REPLICA_MEMORY``): :func:`check_whole_table` refuses larger ones
clearly, and the planner never picks a replicated method for them
(:func:`replicable`).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..options import format_bytes, options

__all__ = ["MemoryBudgetError", "available_memory", "default_budget", "owner_budget", "table_bytes",
           "check_memory_budget", "DEFAULT_FRACTION", "RankMemory", "row_footprint",
           "whole_table_bytes", "replicable", "fits_whole", "check_whole_table", "MAP_BYTES_PER_ROW",
           "table_stats", "table_report"]

class MemoryBudgetError(ConfigError):
    """A table would grow beyond its owner's memory budget (and does not evict)."""


#: Share of the node's available memory the owner ranks of a node may fill.
DEFAULT_FRACTION = 0.8
#: Bytes of the id -> slot map per held row, counted at its emptiest (35 %
#: full, just after doubling: 16 bytes per bucket).
MAP_BYTES_PER_ROW = 48


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
    """Bytes per owner index ``[(table, slots)]`` of ``specs`` held whole.

    Uses the same partitioning and owner assignment as the parameter server,
    without allocating anything: what loading every row at once puts on
    each owner.
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


def check_memory_budget(ps, specs, whole=False) -> None:
    """Refuse ``specs`` if any owner would exceed its budget. **Collective** over ``topology.comm``.

    One ``allgather`` of (budget, bytes already held) per rank; every rank
    then does the same arithmetic and raises the same ConfigError, before
    anything is allocated. Tables start empty (rows come on first touch and
    are checked as they grow), so only ``whole=True`` (every row is about
    to be loaded, e.g. a replicated table moving to ``ps``) counts their
    declared rows.
    """
    topo = ps.topology
    held = sum(var.shard.nbytes for var in ps.variables.values() if var.shard is not None)
    everyone = topo.comm.allgather((owner_budget(ps), int(held)))
    load = table_bytes(specs if whole else [], len(topo.owner_ranks))
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


def row_footprint(spec, optimizer, lru=False) -> int:
    """Bytes one held row of ``spec`` costs an owner: values, optimizer row slots,
    its id, its last use (``lru``) and its share of the id map."""
    return (spec.row_bytes * (1 + len(optimizer.row_slots)) + 8 + (8 if lru else 0)
            + MAP_BYTES_PER_ROW)


class RankMemory:
    """The bytes this rank's table shards hold, against its budget. Local, no MPI.

    Args:
        limit: callable returning this rank's budget in bytes, or None for
            no limit (e.g. ``lambda: owner_budget(ps)``); read at the first
            check and again after :meth:`refresh`.
    """

    def __init__(self, limit=None):
        self._limit_of = limit
        self._limit = None
        self._known = False
        self._shards = {}

    @property
    def limit(self):
        """The budget in bytes (None: unlimited)."""
        if not self._known:
            self._limit = self._limit_of() if self._limit_of is not None else None
            self._known = True
        return self._limit

    def refresh(self) -> None:
        """Read the budget again at the next check (e.g. after it was changed)."""
        self._known = False

    def track(self, name, shard) -> None:
        """Count ``shard`` as variable ``name``'s rows here (replacing an older shard)."""
        self._shards[name] = shard

    def forget(self, name) -> None:
        """Stop counting variable ``name`` (this rank holds none of it any more)."""
        self._shards.pop(name, None)

    def held(self, exclude=None) -> int:
        """Bytes held by the tracked shards (but ``exclude``)."""
        return sum(s.nbytes for s in self._shards.values() if s is not exclude)

    def room(self, shard):
        """Bytes ``shard`` may hold in all without the rank exceeding its budget (None: any)."""
        limit = self.limit
        return None if limit is None else limit - self.held(exclude=shard)

    def describe(self, exclude=None) -> str:
        """``name rows (bytes)`` of every tracked shard, for messages."""
        return ", ".join(f"{name} {s.rows_held:,} rows ({format_bytes(s.nbytes)})"
                         for name, s in self._shards.items() if s is not exclude) or "nothing"


def whole_table_bytes(rows: int, row_bytes: int, row_slots: int) -> int:
    """Bytes of a whole table of ``rows`` rows with ``row_slots`` optimizer slots per row."""
    return int(rows) * int(row_bytes) * (1 + int(row_slots))


def replicable(rows: int, row_bytes: int, row_slots: int = 0) -> bool:
    """Whether a whole table fits ``options.replica_memory`` (may be replicated or gathered)."""
    return whole_table_bytes(rows, row_bytes, row_slots) <= options.replica_memory


def fits_whole(spec) -> bool:
    """Whether the table of ``spec`` (a SparseVariableSpec) with its optimizer slots fits
    ``options.replica_memory`` on one rank."""
    return replicable(spec.rows, spec.row_bytes, _slot_count(spec))


def check_whole_table(spec, what: str) -> None:
    """Raise ConfigError (identically on every rank) if ``spec`` is too large to hold whole.

    Args:
        spec: the :class:`~hpcpax.ps.spec.SparseVariableSpec`.
        what: the refused operation, for the message.
    """
    slots = _slot_count(spec)
    need = whole_table_bytes(spec.rows, spec.row_bytes, slots)
    if need > options.replica_memory:
        raise ConfigError(
            f"{spec.name}: {what} needs the whole table on one rank: {spec.rows:,} rows x "
            f"{spec.dim} {np.dtype(spec.dtype)}" + (f" with {slots} optimizer slots" if slots else "")
            + f" = {format_bytes(need)}, above HPCPAX_REPLICA_MEMORY "
            f"({format_bytes(options.replica_memory)}); keep the table on the parameter servers "
            f"(method ps) and read the rows you need with pull")


def table_stats(ps) -> dict:
    """``{name: counters}`` of this rank's shards of ``ps`` (rows held and created,
    evictions, bytes; see :meth:`~hpcpax.ps.table.TableShard.stats`). Local."""
    return {name: var.shard.stats() for name, var in ps.variables.items()
            if var.shard is not None}


def table_report(comm, ps) -> dict:
    """Every ``ps`` variable's rows over all owners. **Collective** over ``comm``.

    One ``allgather`` of each rank's :func:`table_stats`. Returns
    ``{name: {"rows", "rows_held", "rows_created", "rows_evicted",
    "evictions", "bytes", "max_owner_bytes", "eviction"}}`` (``rows``: the
    declared rows; counters summed over owners).
    """
    report = {}
    for stats in comm.allgather(table_stats(ps)):
        for name, entry in stats.items():
            spec = ps.variables[name].spec
            total = report.setdefault(name, {"rows": int(spec.rows), "rows_held": 0,
                                             "rows_created": 0, "rows_evicted": 0,
                                             "evictions": 0, "bytes": 0, "max_owner_bytes": 0,
                                             "eviction": spec.eviction})
            for key in ("rows_held", "rows_created", "rows_evicted", "evictions", "bytes"):
                total[key] += int(entry[key])
            total["max_owner_bytes"] = max(total["max_owner_bytes"], int(entry["bytes"]))
    return report
