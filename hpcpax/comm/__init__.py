"""Communication layer: who talks to whom, and how bytes move.

- :mod:`~hpcpax.comm.topology`: :func:`init` (nodes, roles, communicators);
  :mod:`~hpcpax.comm.slurm`, the map from ``SLURM_*`` variables to concepts;
- :mod:`~hpcpax.comm.transport`: CPU, CUDA-aware and host-staged MPI buffers;
- :mod:`~hpcpax.comm.exchange`: the one batched ``Alltoallv`` every sparse
  transfer goes through;
- :mod:`~hpcpax.comm.allreduce`: the fused dense allreduce;
- :mod:`~hpcpax.comm.fabric`: alpha-beta link measurement;
- :mod:`~hpcpax.comm.accounting`: every byte and second;
- :mod:`~hpcpax.comm.agreement`: ranks that must agree are checked;
- :mod:`~hpcpax.comm.watchdog`: a stuck or silent rank is named.

This layer imports nothing from :mod:`hpcpax.ps`, :mod:`hpcpax.sync`,
:mod:`hpcpax.plan` or :mod:`hpcpax.app`.
"""
