"""The parameter server: sparse tables partitioned over owner ranks.

- :mod:`~hpcpax.ps.spec`: :class:`SparseVariableSpec`, what a worker registers;
- :mod:`~hpcpax.ps.sparse_grad`: :class:`SparseGrad`, a step's sparse gradient;
- :mod:`~hpcpax.ps.placement`: which owner holds which partition;
- :mod:`~hpcpax.ps.server`: :class:`ParameterServer` (register, pull, push, serve);
- :mod:`~hpcpax.ps.relaxed`: :class:`RelaxedParameterServer`, the same tables
  under ssp/asp/psp over point-to-point messages (:mod:`~hpcpax.ps.consistency`,
  :mod:`~hpcpax.ps.clocks`, :mod:`~hpcpax.ps.relaxed_server`,
  :mod:`~hpcpax.ps.relaxed_client`, :mod:`~hpcpax.ps.relaxed_wire`).

Built on :mod:`hpcpax.comm` and :mod:`hpcpax.ops` only.
"""
