"""Tuning on the running job: what runs collectives or live steps to decide.

Above :mod:`hpcpax.plan` (the pure planning maths it feeds) and
:mod:`hpcpax.sync`, below :mod:`hpcpax.app`:

* :mod:`~hpcpax.tune.calibrate`: the cost model's constants measured on the
  machine, every rank busy (collective);
* :mod:`~hpcpax.tune.operation_costs`: hpcpax's fixed cost per operation,
  timed on real collectives (:mod:`~hpcpax.tune.caches`: cold caches between
  the timed calls);
* :mod:`~hpcpax.tune.controller`: :class:`PlanController`, the trainer's
  automation (measure, plan, switch, search, live);
* :mod:`~hpcpax.tune.live_search`: Parallax's partition search on live steps;
* :mod:`~hpcpax.tune.hot_rows_trial`: hot-row trees kept only if they pay
  on live steps.
"""
