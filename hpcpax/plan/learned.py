"""A learned correction of the analytic cost model, fitted on recorded runs.

AutoSync's idea, kept small: the analytic model is the prior; what the run
log shows it gets wrong on this machine is learned. The model charges every
predicted second to a mechanism (:data:`FEATURES`: latency, link bytes, NIC,
server CPU, client kernels); the correction is one weight per mechanism,
fitted by NumPy least squares so that

    measured step seconds  ~  sum_k w_k * predicted_k  +  the rest as predicted

with a ridge pull of every weight towards 1 (the analytic model), so a
mechanism the records rarely exercise keeps its analytic cost. Weights are
kept in ``[0.05, 20]``. It needs :data:`MIN_RECORDS` records with a
prediction; :func:`load_correction` says why it is or is not used, and
``--plan auto`` writes that into the plan. Pure NumPy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["FEATURES", "MIN_RECORDS", "Correction", "fit_correction", "load_correction",
           "record_features"]

FEATURES = ("latency", "intra link", "inter link", "node NIC", "server CPU", "client kernels",
            "scheduling", "software")
MIN_RECORDS = 8
RIDGE = 0.1  # pull towards the analytic model, relative to the mean squared feature
WEIGHT_RANGE = (0.05, 20.0)


def record_features(record: dict):
    """``(features, rest, measured)`` of a record, or None when it has no prediction."""
    predicted = record.get("predicted") or {}
    resources = predicted.get("resources")
    measured = (record.get("measured") or {}).get("step_s")
    if not resources or measured is None:
        return None
    features = np.array([float(resources.get(k, 0.0)) for k in FEATURES])
    rest = float(sum(v for k, v in resources.items() if k not in FEATURES))
    return features, rest, float(measured)


@dataclass
class Correction:
    """Per-mechanism weights on the analytic model's seconds."""

    weights: dict
    records: int = 0
    models: list = field(default_factory=list)

    def apply(self, prediction) -> float:
        """Corrected seconds of a :class:`~hpcpax.plan.step_model.StepPrediction` (or its dict)."""
        resources = prediction["resources"] if isinstance(prediction, dict) else \
            prediction.resources
        return float(sum(v * self.weights.get(k, 1.0) for k, v in resources.items()))

    def to_dict(self) -> dict:
        """The correction as a JSON-able dict."""
        return {"weights": dict(self.weights), "records": self.records, "models": self.models}

    @classmethod
    def from_dict(cls, data: dict) -> "Correction":
        """A correction from :meth:`to_dict`'s dict."""
        return cls(dict(data["weights"]), int(data.get("records", 0)),
                   list(data.get("models", [])))


def fit_correction(records, ridge: float = RIDGE) -> Correction | None:
    """Fit the weights on ``records`` (run-log dicts); None when none has a prediction."""
    rows = [f for f in (record_features(r) for r in records) if f is not None]
    if not rows:
        return None
    x = np.array([f for f, _, _ in rows])
    y = np.array([m - rest for _, rest, m in rows])
    # relative errors matter: weight each run by 1 / its measured time
    scale = 1.0 / np.maximum(np.array([m for _, _, m in rows]), 1e-9)
    xs, ys = x * scale[:, None], y * scale
    strength = ridge * max(float(np.mean(xs ** 2)), 1e-12) * len(rows)
    k = len(FEATURES)
    design = np.vstack([xs, np.sqrt(strength) * np.eye(k)])
    target = np.concatenate([ys, np.sqrt(strength) * np.ones(k)])
    weights, *_ = np.linalg.lstsq(design, target, rcond=None)
    weights = np.clip(weights, *WEIGHT_RANGE)
    models = sorted({(r.get("model") or {}).get("name") or "?" for r in records})
    return Correction({name: float(w) for name, w in zip(FEATURES, weights)}, len(rows), models)


def load_correction(path: str | None = None, min_records: int = MIN_RECORDS):
    """``(Correction or None, why)`` from the run log (see :mod:`hpcpax.plan.runlog`).

    Not collective; never raises for a bad log (the log warns and gives nothing).
    """
    from .runlog import RunLog

    log = RunLog(path)
    if not log.enabled:
        return None, "not used: run log off"
    usable = [r for r in log.records() if record_features(r) is not None]
    if len(usable) < min_records:
        return None, f"not used: {len(usable)} records with a prediction < {min_records}"
    correction = fit_correction(usable)
    return correction, f"used: fitted on {correction.records} records"
