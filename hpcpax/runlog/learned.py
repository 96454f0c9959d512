"""A learned correction of the analytic cost model, fitted on recorded runs.

AutoSync's idea, kept small: the analytic model is the prior; what the run
log shows it gets wrong on this machine is learned. The model charges every
predicted second to a mechanism (:data:`FEATURES`: latency, link bytes, NIC,
server CPU, client kernels); the correction is one weight per mechanism,
fitted by NumPy least squares so that

    measured step seconds  ~  sum_k w_k * predicted_k  +  the rest as predicted

with a ridge pull of every weight towards 1 (the analytic model), so a
mechanism the records rarely exercise keeps its analytic cost. Weights are
kept in ``[0.05, 20]``.

A correction fitted on one machine's load or one model's mix of mechanisms
can make predictions of other runs worse. So when the records span at least
two groups (a group: one model on one layout), :func:`fit_correction`
cross-validates: leave each group out, fit on the rest, predict it; the
ridge strength is chosen among :data:`RIDGES` by that held-out median
relative error, and when no strength beats the analytic model on held-out
groups the correction is *not used* (``validation["helps"]`` False; its
weights are all 1, so applying it gives the analytic prediction). It needs
:data:`MIN_RECORDS` records with a prediction; :func:`load_correction` says
why it is or is not used, and ``--plan auto`` writes that into the plan.
Pure NumPy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

__all__ = ["FEATURES", "MIN_RECORDS", "RIDGES", "Correction", "fit_correction",
           "load_correction", "record_features", "record_group", "usable_records"]

FEATURES = ("latency", "intra link", "inter link", "node NIC", "server CPU", "client kernels",
            "scheduling", "software")
MIN_RECORDS = 8
RIDGE = 0.1  # pull towards the analytic model, relative to the mean squared feature
#: ridge strengths tried by cross-validation (stronger: closer to the analytic model)
RIDGES = (0.1, 1.0, 10.0)
WEIGHT_RANGE = (0.05, 20.0)


def _part(record, key) -> dict:
    """``record[key]`` when it is a dict, else ``{}`` (a malformed record has no such part)."""
    value = record.get(key) if isinstance(record, dict) else None
    return value if isinstance(value, dict) else {}


def _seconds(value) -> float:
    """``value`` as finite, non-negative seconds; ValueError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not np.isfinite(value) or value < 0:
        raise ValueError(f"{value!r} is not a number of seconds")
    return float(value)


def record_features(record: dict):
    """``(features, rest, measured)`` of a record, or None when it has no prediction.

    Raises:
        ValueError: the record's prediction or measurement is malformed (not
            finite non-negative seconds; a measured step of 0).
    """
    resources = _part(record, "predicted").get("resources")
    measured = _part(record, "measured").get("step_s")
    if not resources or measured is None:
        return None
    if not isinstance(resources, dict):
        raise ValueError(f"predicted resources are a {type(resources).__name__}")
    features = np.array([_seconds(resources.get(k, 0.0)) for k in FEATURES])
    rest = float(sum(_seconds(v) for k, v in resources.items() if k not in FEATURES))
    measured = _seconds(measured)
    if measured == 0:
        raise ValueError("a measured step of 0 s")
    return features, rest, measured


def usable_records(records) -> list:
    """The records with a well-formed prediction and measurement; one
    :class:`~hpcpax.runlog.log.RunLogWarning` names how many others were malformed."""
    from .log import _warn

    usable, malformed = [], []
    for record in records:
        try:
            if record_features(record) is not None:
                usable.append(record)
        except ValueError as exc:
            malformed.append(f"record {record.get('id', '?')}: {exc}")
    if malformed:
        _warn(f"run log: {len(malformed)} malformed record(s) left out of the learned "
              f"correction ({malformed[0]})")
    return usable


def _model_name(record) -> str:
    name = _part(record, "model").get("name")
    return name if isinstance(name, str) else "?"


@dataclass
class Correction:
    """Per-mechanism weights on the analytic model's seconds."""

    weights: dict
    records: int = 0
    models: list = field(default_factory=list)
    #: cross-validation: ``{"groups", "ridge", "analytic_error", "learned_error", "helps"}``
    #: (None when the records were one group, so nothing could be held out)
    validation: dict | None = None

    @property
    def helps(self) -> bool:
        """False when cross-validation found it no better than the analytic model."""
        return self.validation is None or bool(self.validation.get("helps", True))

    def apply(self, prediction) -> float:
        """Corrected seconds of a :class:`~hpcpax.plan.step_model.StepPrediction` (or its dict)."""
        resources = prediction["resources"] if isinstance(prediction, dict) else \
            prediction.resources
        return float(sum(v * self.weights.get(k, 1.0) for k, v in resources.items()))

    def to_dict(self) -> dict:
        """The correction as a JSON-able dict."""
        return {"weights": dict(self.weights), "records": self.records, "models": self.models,
                "validation": self.validation}

    @classmethod
    def from_dict(cls, data: dict) -> "Correction":
        """A correction from :meth:`to_dict`'s dict."""
        return cls(dict(data["weights"]), int(data.get("records", 0)),
                   list(data.get("models", [])), data.get("validation"))


def record_group(record: dict) -> str:
    """The cross-validation group of a record: its model's name and its layout."""
    return _model_name(record) + " " + json.dumps(_part(record, "layout"), sort_keys=True,
                                                 default=str)


def _arrays(records):
    """``(features [n, K], rest [n], measured [n])`` of records that have a prediction."""
    rows = [record_features(r) for r in records]
    return (np.array([f for f, _, _ in rows]).reshape(len(rows), len(FEATURES)),
            np.array([rest for _, rest, _ in rows]), np.array([m for _, _, m in rows]))


def _errors(data, weights) -> np.ndarray:
    """Relative errors of the corrected predictions of ``data`` (:func:`_arrays`)."""
    features, rest, measured = data
    return np.abs(features @ weights + rest - measured) / measured


def fit_correction(records, ridge: float | None = None) -> Correction | None:
    """Fit the weights on ``records`` (run-log dicts); None when none has a prediction.

    ``ridge``: one strength, or None to choose among :data:`RIDGES` by
    leave-one-group-out cross-validation (:data:`RIDGE` when there is one
    group). With two groups or more the result carries ``validation``, and
    when held-out groups are predicted no better than by the analytic model
    its weights are all 1 (``helps`` False). Each record's features are read
    once and each fold is one K x K solve, so thousands of records fit in
    milliseconds (the first worker fits while the others wait).
    """
    usable = usable_records(records)
    if not usable:
        return None
    data = _arrays(usable)
    groups = np.array([record_group(r) for r in usable])
    models = sorted({_model_name(r) for r in usable})
    names = sorted(set(groups.tolist()))
    if len(names) < 2:
        return Correction(_weights_dict(_solve(data, RIDGE if ridge is None else ridge)),
                          len(usable), models)
    analytic = float(np.median(_errors(data, np.ones(len(FEATURES)))))
    scores = {}
    for strength in (RIDGES if ridge is None else (ridge,)):
        errors = []
        for group in names:
            held = groups == group
            weights = _solve(tuple(a[~held] for a in data), strength)
            errors.append(_errors(tuple(a[held] for a in data), weights))
        scores[strength] = float(np.median(np.concatenate(errors)))
    best = min(scores, key=scores.get)
    helps = scores[best] < analytic
    validation = {"groups": len(names), "ridge": best, "analytic_error": analytic,
                  "learned_error": scores[best], "helps": bool(helps)}
    weights = (_weights_dict(_solve(data, best)) if helps
               else dict.fromkeys(FEATURES, 1.0))
    return Correction(weights, len(usable), models, validation)


def _solve(data, ridge: float) -> np.ndarray:
    """Weights fitted on ``data`` (:func:`_arrays`): ridge least squares towards 1.

    Minimises ``sum_i ((x_i w - y_i) / m_i)^2 + s |w - 1|^2`` (relative errors
    matter: each run weighted by 1 / its measured time), ``s`` = ``ridge`` x
    the mean squared scaled feature x the number of runs; solved through the
    K x K normal equations, then clipped to :data:`WEIGHT_RANGE`.
    """
    features, rest, measured = data
    scale = 1.0 / np.maximum(measured, 1e-9)
    xs, ys = features * scale[:, None], (measured - rest) * scale
    k = len(FEATURES)
    strength = ridge * max(float(np.mean(xs ** 2)), 1e-12) * len(measured)
    weights = np.linalg.solve(xs.T @ xs + strength * np.eye(k), xs.T @ ys + strength)
    return np.clip(weights, *WEIGHT_RANGE)


def _weights_dict(weights) -> dict:
    return {name: float(w) for name, w in zip(FEATURES, weights)}


def load_correction(path: str | None = None, min_records: int = MIN_RECORDS):
    """``(Correction or None, why)`` from the run log (see :mod:`hpcpax.runlog.log`).

    Not collective; never raises for a bad log or a malformed record (one
    warning each; the record is left out).
    """
    from .log import RunLog

    log = RunLog(path)
    if not log.enabled:
        return None, "not used: run log off"
    usable = usable_records(log.records())
    if len(usable) < min_records:
        return None, f"not used: {len(usable)} records with a prediction < {min_records}"
    correction = fit_correction(usable)
    if not correction.helps:
        v = correction.validation
        return None, (f"not used: cross-validation over {v['groups']} groups: held-out median "
                      f"error {v['learned_error']:.3f} with it, {v['analytic_error']:.3f} "
                      f"without")
    return correction, f"used: fitted on {correction.records} records"
