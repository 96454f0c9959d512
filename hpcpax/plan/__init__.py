"""Planner: measurements, cost model, partition search, plans.

Pure Python and NumPy; nothing here is collective and nothing imports MPI,
CuPy or matplotlib. The trainer measures (fabric, sparsity, step times),
feeds the numbers here, and compares the resulting plan's fingerprint
across ranks.

* :mod:`~hpcpax.plan.plan`: :class:`Plan`, :class:`VariablePlan`, JSON,
  :func:`assign_owners`.
* :mod:`~hpcpax.plan.cost_model`: alpha-beta predictions per method.
* :mod:`~hpcpax.plan.partition_search`: Parallax's partition search.
* :mod:`~hpcpax.plan.measure`: :class:`SparsityStats`.
* :mod:`~hpcpax.plan.auto`: :func:`make_plan` by mode or by cost.

The simulator CLI built on the same model is ``python -m hpcpax.sim``;
its presets are JSON files in ``hpcpax/planner/presets/``.
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
