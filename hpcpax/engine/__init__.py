"""The engine layer: one job's synchronization machinery, made by one factory.

Between the tuning layer (:mod:`hpcpax.tune`) and the applications
(:mod:`hpcpax.app`: ``python -m hpcpax.train`` and ``ModelSync``; :mod:`hpcpax.torch`
on top of ``ModelSync``):

* :mod:`~hpcpax.engine.engine`: :class:`Engine` (parameter server, sparse
  synchronizers, dense allreduce, planner, commands, watchdog, accounting)
  and :func:`build_engine`, the one factory every entry point uses;
* :mod:`~hpcpax.engine.settings`: :class:`EngineSettings` and
  :class:`PlanSettings`, the typed settings it is built with;
* :mod:`~hpcpax.engine.plan_requests`: ``--plan`` values and plan tables ->
  :class:`PlanRequest` (:func:`resolve_plan`);
* :mod:`~hpcpax.engine.commands`: :class:`CommandChannel`, what every rank
  runs together besides the steps (servers follow the workers).
"""

from .commands import CommandChannel
from .engine import Engine, TensorSpec, build_engine
from .plan_requests import PLAN_MODES, PlanRequest, resolve_plan
from .settings import EngineSettings, PlanSettings

__all__ = ["Engine", "build_engine", "TensorSpec", "EngineSettings", "PlanSettings",
           "PlanRequest", "resolve_plan", "PLAN_MODES", "CommandChannel"]
