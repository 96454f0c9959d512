"""The synchronization methods, as classes in one registry.

A variable's method is named by one string from config to plan.json to
checkpoint (``ps``, ``allgather``, ``allreduce``; file formats keep these
names). In code, the name maps to one :class:`SyncMethod` instance
(:func:`method_of`), and code asks the instance instead of comparing names:

- what it is (:attr:`~SyncMethod.on_servers`, :attr:`~SyncMethod.replicated`,
  :attr:`~SyncMethod.gathers`, :attr:`~SyncMethod.densified`,
  :attr:`~SyncMethod.relaxed`, :attr:`~SyncMethod.dense_ok`): the planner, the
  cost model and the application read these;
- what it does for one variable (:class:`~hpcpax.sync.variable.VariableSync`
  delegates to it): build, switch in (import) and out (export) exactly,
  partitions and owners, checkpoint rows, whole-table reads and loads;
- how a step batches it (:attr:`~SyncMethod.batch`, a :class:`StepBatch`):
  the pulls and pushes of every variable in one batch travel together.

The methods live in :mod:`~hpcpax.sync.ps_method` (``ps``) and
:mod:`~hpcpax.sync.replicated_methods` (``allgather``, ``allreduce``); a new
method is one new module with a :class:`SyncMethod` subclass and its
:func:`register` call, imported by :mod:`hpcpax.sync`.

This module imports nothing but the base (no MPI): the pure planning modules
use it. The behaviour modules import the MPI layers lazily, inside methods.
"""

from __future__ import annotations

from ..errors import ConfigError
from ..input_checks import shown

__all__ = ["SyncMethod", "StepBatch", "register", "method_of", "methods", "names"]


class StepBatch:
    """How a step moves the variables of one or more methods together.

    ``order``: batches run in increasing order (the same on every rank).
    """

    order = 0

    def pull(self, sync, ids_by_name) -> dict:
        """``{name: (unique sorted ids, rows)}``; ``sync`` the :class:`~hpcpax.sync.sparse_set.SparseSync`."""
        raise NotImplementedError

    def push(self, sync, grads) -> None:
        """Push ``{name: SparseGrad}`` of this batch's variables."""
        raise NotImplementedError


class SyncMethod:
    """One synchronization method: its properties and its per-variable behaviour.

    Instances are stateless singletons (one per method, in the registry); the
    per-variable state lives on the :class:`~hpcpax.sync.variable.VariableSync`
    passed to each call.
    """

    #: The name in config, plans and checkpoints.
    name = ""
    #: Rows live on the parameter server's owners: partitions, owners, local
    #: aggregation and hot-row trees apply.
    on_servers = False
    #: A whole replica of the table on every worker.
    replicated = False
    #: The push allgathers each worker's deduplicated ``(ids, rows)``.
    gathers = False
    #: The gradient travels densified, in an allreduce (Horovod's ``sparse_as_dense``;
    #: a dense variable's plain allreduce).
    densified = False
    #: Runs under relaxed consistency (ssp/asp/psp).
    relaxed = False
    #: Can sync a dense variable.
    dense_ok = True
    #: The :class:`StepBatch` its variables' pulls and pushes travel in.
    batch: StepBatch | None = None

    def __repr__(self):
        return f"<sync method {self.name!r}>"

    # --------------------------------------------------------- one variable
    def create(self, var) -> None:
        """Set up ``var`` on this rank at construction; local."""
        raise NotImplementedError

    def enter(self, var, source: "SyncMethod") -> None:
        """Move ``var`` from ``source`` to this method, exactly; **collective** (every rank)."""
        raise NotImplementedError

    def export_whole(self, var):
        """``(table, row state, scalars)`` of the whole table where an import needs it;
        **collective** (every rank)."""
        raise NotImplementedError

    def load_whole(self, var, table, row_state, scalars) -> None:
        """Set the rows held here from whole-table arrays; local."""
        raise NotImplementedError

    def partitions(self, var) -> int:
        """Row partitions (1 unless on servers)."""
        return 1

    def owners(self, var) -> list:
        """Owner index of each partition (empty unless on servers)."""
        return []

    def local_aggregation(self, var) -> bool:
        """Whether pulls and pushes aggregate per node."""
        return False

    def set_local_aggregation(self, var, enabled) -> None:
        """Per-variable local aggregation; nothing unless on servers."""

    def repartition(self, var, partitions, owners=None) -> None:
        """Move to ``partitions`` partitions; only methods on servers have partitions."""
        raise ConfigError(f"{var.name} is synced by {self.name!r}, not 'ps'; "
                          "only ps variables have partitions")

    def shard(self, var):
        """The :class:`~hpcpax.ps.table.TableShard` of ``var`` this rank holds, or None."""
        raise NotImplementedError

    def checkpoint_rows(self, var):
        """The rows this rank writes: ``(ids, table, row state, scalars)`` or None; local."""
        raise NotImplementedError

    def read_table(self, var):
        """The whole table on every worker."""
        raise NotImplementedError


_REGISTRY: dict = {}
#: Names that are no method, with what to use instead.
_HINTS = {"dense": "a densified sparse table is 'allreduce'"}


def register(method_class):
    """Register a :class:`SyncMethod` subclass (usable as a class decorator)."""
    instance = method_class()
    if not instance.name or instance.name in _REGISTRY:
        raise ValueError(f"sync method name {instance.name!r} is empty or taken")
    _REGISTRY[instance.name] = instance
    return method_class


def names() -> tuple:
    """The registered method names, in registration order (the tie-breaking order)."""
    return tuple(_REGISTRY)


def methods() -> tuple:
    """The registered :class:`SyncMethod` instances, in registration order."""
    return tuple(_REGISTRY.values())


def method_of(method, where: str = "method") -> SyncMethod:
    """The :class:`SyncMethod` named ``method`` (an instance passes through).

    Raises :class:`~hpcpax.errors.ConfigError` naming the known methods for
    anything else.
    """
    if isinstance(method, SyncMethod):
        return method
    found = _REGISTRY.get(method) if isinstance(method, str) else None
    if found is None:
        hint = f" ({_HINTS[method]})" if isinstance(method, str) and method in _HINTS else ""
        raise ConfigError(f"{where} must be one of {names()}, not {shown(method)}{hint}")
    return found
