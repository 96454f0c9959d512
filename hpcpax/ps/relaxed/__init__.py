"""The relaxed parameter server: SSP, ASP and PSP over point-to-point messages.

* :mod:`~hpcpax.ps.relaxed.parameter_server`: :class:`RelaxedParameterServer`,
  the same tables as :class:`~hpcpax.ps.server.ParameterServer` under a
  relaxed consistency model (re-exported here);
* :mod:`~hpcpax.ps.relaxed.consistency`: the models and their barrier
  conditions (pure, no MPI);
* :mod:`~hpcpax.ps.relaxed.clocks`: groups, per-worker push counts, staleness;
* :mod:`~hpcpax.ps.relaxed.wire`: the messages;
* :mod:`~hpcpax.ps.relaxed.server`: the message-driven server loop (server ranks);
* :mod:`~hpcpax.ps.relaxed.client`: the worker side (pulls, pushes, clocks, stops).
"""

from .parameter_server import RelaxedParameterServer

__all__ = ["RelaxedParameterServer"]
