"""Per-variable synchronization: one object per variable behind one interface.

- :mod:`~hpcpax.sync.replicated`: tables replicated on every worker, synced by
  ``allgather`` or densified ``allreduce`` (Horovod's sparse methods).

Built on :mod:`hpcpax.ps`, :mod:`hpcpax.comm` and :mod:`hpcpax.ops`.
"""
