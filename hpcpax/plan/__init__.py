"""Planning: measurements, cost model, partition search, plans, the live controller.

Two kinds of modules. The planning maths is pure Python and NumPy: nothing
in it is collective and nothing imports MPI (checked by
``tests/test_layers.py``); the trainer measures (fabric, sparsity, step
times), feeds the numbers in, and compares the resulting plan's fingerprint
across ranks. The collective parts act on a running job:
:mod:`~hpcpax.plan.calibrate` (measures the machine's constants),
:mod:`~hpcpax.plan.controller` (measure, plan, apply, re-plan, through the
trainer's public interface) and :mod:`~hpcpax.plan.live_search` (the
partition search on live steps).

Pure:

* :mod:`~hpcpax.plan.plan`: :class:`Plan`, :class:`VariablePlan`, JSON,
  :func:`assign_owners`.
* :mod:`~hpcpax.plan.cost_model`: predictions per variable and method, on
  :mod:`~hpcpax.plan.traffic` (exact routing and bytes),
  :mod:`~hpcpax.plan.collectives` (MPICH's algorithms) and
  :mod:`~hpcpax.plan.step_model` (the trainer's step, bottleneck).
* :mod:`~hpcpax.plan.runlog`, :mod:`~hpcpax.plan.learned`: the SQLite run
  log and the correction fitted on it (``python -m hpcpax.runs``).
* :mod:`~hpcpax.plan.calibrate` (collective, not pure): the model's
  constants measured on the machine.
* :mod:`~hpcpax.plan.partition_search`: Parallax's partition search.
* :mod:`~hpcpax.plan.measure`: :class:`SparsityStats`.
* :mod:`~hpcpax.plan.auto`: :func:`make_plan` by mode or by cost.

* :mod:`~hpcpax.plan.sim`: the simulator (``python -m hpcpax.sim``) on the
  same model; its presets are JSON files in ``hpcpax/plan/presets/``.
"""

from .auto import MODES, make_plan, should_switch
from .cost_model import ClusterShape, CostParams, VarSpec, choose, predict, predict_all
from .measure import SparsityStats
from .partition_search import SearchResult, fit_cost_curve, search_partitions
from .plan import METHODS, Plan, VariablePlan, assign_owners

__all__ = [
    "ClusterShape",
    "CostParams",
    "METHODS",
    "MODES",
    "Plan",
    "SearchResult",
    "SparsityStats",
    "VarSpec",
    "VariablePlan",
    "assign_owners",
    "choose",
    "fit_cost_curve",
    "make_plan",
    "predict",
    "predict_all",
    "search_partitions",
    "should_switch",
]
