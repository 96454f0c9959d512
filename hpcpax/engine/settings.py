"""The engine's settings, typed: what the parameter server, the planner and the
watchdog are told.

``python -m hpcpax.train`` builds them from its flags
(:meth:`EngineSettings.from_config`); :class:`~hpcpax.app.model_sync.ModelSync`
and :mod:`hpcpax.torch` from their keyword arguments. Defaults are
``ModelSync``'s. Nothing here is collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["STARTUP_SHARE", "PlanSettings", "EngineSettings"]

#: The share of a run of known length its start-up measurements may take.
STARTUP_SHARE = 0.02


@dataclass(frozen=True)
class PlanSettings:
    """How ``--plan auto|hybrid`` measures, decides and re-plans
    (:class:`~hpcpax.tune.controller.PlanController`).

    Attributes:
        plan_steps: steps whose sparsity is measured before the plan is made.
        partition_search: run Parallax's partition search on live steps.
        replan_every: re-measure and re-plan every N steps (0: never).
        replan_threshold: predicted gain a re-plan needs to switch a method.
        fabric_seconds: time budget of the start-up fabric measurement.
        plan_calibrate: ``auto`` times the cost model's constants at start-up.
        hot_rows: ``off``, ``relays`` (:mod:`hpcpax.ps.hot_rows.relays`), or ``auto``
            (the plan's cost model decides).
        hot_rows_trial: rounds of the live hot-rows trial (0: none).
        steps: the run's length (searches and re-plans leave the end alone).
        resume: the run continues a run directory (a measured plan is reused).
        planned_run_s: the run's expected wall seconds where known before it
            starts (emulated compute: steps x the modeled step), else None;
            the start-up measurements then keep to
            :data:`STARTUP_SHARE` of it where that is less than their
            defaults (:attr:`startup_budget_s`).
    """

    plan_steps: int = 10
    partition_search: bool = False
    replan_every: int = 0
    replan_threshold: float = 0.1
    fabric_seconds: float = 1.0
    plan_calibrate: bool = True
    hot_rows: str = "auto"
    hot_rows_trial: int = 0
    steps: int = 1 << 62
    resume: bool = False
    planned_run_s: float | None = None

    @property
    def startup_budget_s(self) -> float | None:
        """Seconds the start-up measurements may take beyond their defaults' cap:
        :data:`STARTUP_SHARE` of :attr:`planned_run_s`, or None (defaults)."""
        return None if not self.planned_run_s else STARTUP_SHARE * self.planned_run_s

    def __post_init__(self):
        if isinstance(self.plan_steps, bool) or not isinstance(self.plan_steps, int) \
                or self.plan_steps < 1:
            raise ValueError(f"plan_steps must be a positive int, not {self.plan_steps!r}")
        if int(self.replan_every) < 0:
            raise ValueError(f"replan_every must be >= 0, not {self.replan_every!r}")

    @classmethod
    def from_config(cls, config) -> "PlanSettings":
        """From ``python -m hpcpax.train``'s resolved flags."""
        return cls(plan_steps=int(config["plan_steps"]),
                   partition_search=bool(config["partition_search"]),
                   replan_every=int(config["replan_every"]),
                   replan_threshold=float(config["replan_threshold"]),
                   fabric_seconds=float(config["fabric_seconds"]),
                   plan_calibrate=bool(config["plan_calibrate"]),
                   hot_rows=str(config["hot_rows"]),
                   hot_rows_trial=int(config["hot_rows_trial"] or 0),
                   steps=int(config["steps"]), resume=bool(config["resume"]))


@dataclass(frozen=True)
class EngineSettings:
    """What one :class:`~hpcpax.engine.engine.Engine` is built with.

    Attributes:
        local_aggregation: aggregate sparse pulls and pushes per node.
        seed: key of the layout-independent initializers.
        server_memory_budget: bytes of tables and slots one server rank may
            hold (None: no budget).
        timeout: watchdog seconds (None: ``HPCPAX_TIMEOUT``; 0: off).
        dense_op: ``mean`` or ``sum`` of dense gradients over the workers.
        bucket_bytes: dense fusion bucket bytes (None or 0: measured/autotuned).
        overlap: dense buckets start as gradients become ready
            (:class:`~hpcpax.sync.dense_buckets.BucketedAllreduce`) rather
            than in one call after the backward pass
            (:class:`~hpcpax.comm.allreduce.DenseAllreduce`).
        plan: the planner's :class:`PlanSettings`.
    """

    local_aggregation: bool = True
    seed: int = 0
    server_memory_budget: int | None = None
    timeout: float | None = None
    dense_op: str = "mean"
    bucket_bytes: int | None = None
    overlap: bool = True
    plan: PlanSettings = field(default_factory=PlanSettings)

    def __post_init__(self):
        if self.dense_op not in ("mean", "sum"):
            raise ValueError(f"dense_op must be 'mean' or 'sum', not {self.dense_op!r}")

    @classmethod
    def from_config(cls, config) -> "EngineSettings":
        """From ``python -m hpcpax.train``'s resolved flags."""
        from ..options import parse_bytes

        return cls(local_aggregation=bool(config["local_aggregation"]), seed=int(config["seed"]),
                   server_memory_budget=parse_bytes(config["server_memory_budget"],
                                                    "server_memory_budget"),
                   timeout=config["timeout"], dense_op="mean",
                   bucket_bytes=config["bucket_bytes"] or None, overlap=False,
                   plan=PlanSettings.from_config(config))
