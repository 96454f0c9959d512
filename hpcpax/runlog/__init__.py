"""The run log: what training and benchmark runs recorded, and what is learned from it.

* :mod:`~hpcpax.runlog.log`: :class:`RunLog`, one SQLite record per run;
* :mod:`~hpcpax.runlog.records`: the record of one training run, and the
  call that saves it (with the analytic model's prediction);
* :mod:`~hpcpax.runlog.learned`: the correction of the cost model fitted on
  recorded runs (pure NumPy);
* :mod:`~hpcpax.runlog.cli`: ``python -m hpcpax.runs list|export``.

Above :mod:`hpcpax.plan` (a record carries the model's prediction), below
:mod:`hpcpax.tune` (the controller loads the learned correction). Not
collective; no MPI.
"""
