"""Planning: measurements, cost model, partition search, plans, run-time policies (pure).

Everything here is pure Python and NumPy: nothing in it is collective and
nothing imports MPI (checked by ``tests/test_layers.py``); the trainer
measures (fabric, sparsity, step times), feeds the numbers in, and compares
the resulting plan's fingerprint across ranks. What acts on a running job
lives in :mod:`hpcpax.tune`: :mod:`~hpcpax.tune.calibrate` (measures the
machine's constants), :mod:`~hpcpax.tune.controller` (measure, plan, apply,
re-plan, through the trainer's public interface) and
:mod:`~hpcpax.tune.live_search` (the partition search on live steps). The
run log and the correction learned on it are :mod:`hpcpax.runlog`.

* :mod:`~hpcpax.plan.plan`: :class:`Plan`, :class:`VariablePlan`, JSON,
  :func:`assign_owners`.
* :mod:`~hpcpax.plan.cost_model`: predictions per variable and method, on
  :mod:`~hpcpax.plan.traffic` (exact routing and bytes),
  :mod:`~hpcpax.plan.collectives` (MPICH's algorithms) and
  :mod:`~hpcpax.plan.step_model` (the trainer's step, bottleneck).
* :mod:`~hpcpax.plan.kernel_rates`: the kernels' rates, timed in this
  process (local, no MPI; :mod:`~hpcpax.tune.calibrate` times them with
  every rank busy).
* :mod:`~hpcpax.plan.partition_search`: Parallax's partition search.
* :mod:`~hpcpax.plan.measure`: :class:`SparsityStats`.
* :mod:`~hpcpax.plan.auto`: :func:`make_plan` by mode or by cost.

* :mod:`~hpcpax.plan.joint_choice`, :mod:`~hpcpax.plan.hot_rows_cost`: the
  whole step's choice of methods; whether hot-row trees pay.
* run-time policies: :mod:`~hpcpax.plan.adaptive` (``--consistency auto``)
  with :mod:`~hpcpax.plan.loss_guard`, :mod:`~hpcpax.plan.shares` (balanced
  BSP), :mod:`~hpcpax.plan.dense_period`.

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
