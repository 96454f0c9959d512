"""Per-variable synchronization: one object per sparse variable behind one interface.

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

#: The synchronization methods, one name each from config to plan.json to
#: planner to trainer: ``allreduce`` (dense, or a sparse table densified),
#: ``allgather`` (a sparse table replicated, gradients allgathered), ``ps``.
METHODS = ("allreduce", "allgather", "ps")
#: Methods that keep a whole replica of a sparse table on every worker.
REPLICATED_METHODS = ("allgather", "allreduce")
