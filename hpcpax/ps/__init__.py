"""The parameter server: sparse tables partitioned over owner ranks.

- :mod:`~hpcpax.ps.spec`: :class:`SparseVariableSpec`, what a worker registers;
- :mod:`~hpcpax.ps.sparse_grad`: :class:`SparseGrad`, a step's sparse gradient;
- :mod:`~hpcpax.ps.placement`: which owner holds which partition;
- :mod:`~hpcpax.ps.server`: :class:`ParameterServer` (register, pull, push, serve);
- :mod:`~hpcpax.ps.hot_rows`: trees or relays for the rows many nodes touch;
- :mod:`~hpcpax.ps.relaxed`: :class:`RelaxedParameterServer`, the same tables
  under ssp/asp/psp over point-to-point messages (:mod:`~hpcpax.ps.relaxed.consistency`,
  :mod:`~hpcpax.ps.relaxed.clocks`, :mod:`~hpcpax.ps.relaxed.server`,
  :mod:`~hpcpax.ps.relaxed.client`, :mod:`~hpcpax.ps.relaxed.wire`).

Built on :mod:`hpcpax.comm` and :mod:`hpcpax.ops` only.
"""
