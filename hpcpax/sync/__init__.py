"""Per-variable synchronization: one object per sparse variable behind one interface.

- :mod:`~hpcpax.sync.methods`: the methods' registry, one
  :class:`~hpcpax.sync.methods.SyncMethod` per method
  (:mod:`~hpcpax.sync.ps_method`, :mod:`~hpcpax.sync.replicated_methods`);
- :mod:`~hpcpax.sync.variable`: :class:`VariableSync`, one sparse variable's
  method (``ps``, ``allgather`` or ``allreduce``), its pull and push, method
  switches, repartitioning and checkpoint rows;
- :mod:`~hpcpax.sync.sparse_set`: :class:`SparseSync`, every sparse variable
  of a model, batching each step's pulls and pushes by method;
- :mod:`~hpcpax.sync.replicated`: tables replicated on every worker, synced
  by ``allgather`` or densified ``allreduce`` (Horovod's sparse methods);
- :mod:`~hpcpax.sync.relaxed`: :class:`RelaxedSync`, a step under ssp/asp/psp
  (sparse rows, and dense variables held as server tables).

Built on :mod:`hpcpax.ps`, :mod:`hpcpax.comm` and :mod:`hpcpax.ops`.
"""

from . import replicated_methods, ps_method  # noqa: F401  (register the methods, in this order)
from .methods import method_of, methods, names

#: The synchronization methods, one name each from config to plan.json to
#: planner to trainer: ``allreduce`` (dense, or a sparse table densified),
#: ``allgather`` (a sparse table replicated, gradients allgathered), ``ps``.
#: Each is a :class:`~hpcpax.sync.methods.SyncMethod` (:func:`method_of`).
METHODS = names()
#: Methods that keep a whole replica of a sparse table on every worker.
REPLICATED_METHODS = tuple(m.name for m in methods() if m.replicated)
