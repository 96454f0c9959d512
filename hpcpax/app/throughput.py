"""Steady-state throughput of a run: the steps that measure training, not set-up.

A run's first step compiles and allocates (1-2.5 s with numba or CuPy); with
``--plan auto|hybrid`` the first ``--plan-steps`` steps also measure sparsity
(extra collectives) and the step after them runs on freshly moved tables;
a partition search times trial layouts; each re-plan measures again. A mean
over all steps mixes these in (issue: 5,580 samples/s against a per-step
median of 12,472). :func:`unsteady_steps` names these steps from the config
(and the searches the planner ran), :func:`steady_throughput` averages the
others and says which steps it covers. Not collective.
"""

from __future__ import annotations

import numpy as np

__all__ = ["unsteady_steps", "steady_throughput", "describe_steps"]


def unsteady_steps(config, start_step, planning=None) -> dict:
    """``{step: reason}`` of the steps a steady-state figure leaves out.

    Args:
        config: the run config (``plan``, ``plan_steps``, ``replan_every``,
            ``steps``).
        start_step: the first step this run executed (after a resume, > 1).
        planning: the trainer's plan controller, if any; its ``mode`` and the
            partition ``search`` results it holds tell how many trial steps ran.
    """
    out = {start_step: "warm-up (first step of the run)"}
    mode = getattr(planning, "mode", None) if planning is not None else None
    if mode is None and planning is None and config.get("plan") in ("auto", "hybrid"):
        mode = config["plan"]
    if mode is None:
        return out
    plan_steps = int(config["plan_steps"])
    decided = start_step + plan_steps - 1
    for step in range(start_step, decided + 2):  # measured steps and the first on the plan
        out.setdefault(step, f"plan {mode}: measuring, then the first step on the plan")
    search = getattr(planning, "search", None) or {}
    trials = sum(2 * len(result.get("samples", [])) for result in search.values())
    for step in range(decided + 1, decided + trials + 2):
        out.setdefault(step, "partition search trial steps")
    every = int(config.get("replan_every") or 0)
    if every:
        for boundary in range(every * (decided // every + 1), int(config["steps"]), every):
            for step in range(boundary + 1, boundary + plan_steps + 2):
                out.setdefault(step, "re-plan: measuring, then the first step on the plan")
    return out


def describe_steps(steps) -> str:
    """``[1, 2, 3, 7, 9, 10]`` -> ``"1-3, 7, 9-10"``."""
    steps = sorted(int(s) for s in steps)
    parts, begin = [], None
    for i, step in enumerate(steps):
        if begin is None:
            begin = step
        if i + 1 == len(steps) or steps[i + 1] != step + 1:
            parts.append(str(begin) if begin == step else f"{begin}-{step}")
            begin = None
    return ", ".join(parts)


def steady_throughput(records, global_batch, unsteady) -> dict:
    """Samples per second over the steady steps of ``records``.

    Args:
        records: per-step dicts with ``step`` and ``seconds`` (the metrics lines
            of this run's steps).
        global_batch: samples per step.
        unsteady: ``{step: reason}`` from :func:`unsteady_steps`.

    Returns:
        dict: ``samples_per_s`` (global batch x steady steps / their seconds),
        ``steps`` (which, e.g. ``"7-300"``), ``num_steps``, ``excluded``
        (``{reason: steps}``), ``all_steps_samples_per_s`` and
        ``median_step_samples_per_s``. When every step is unsteady (a short
        run), all steps but the first are used, or the only one, and
        ``steps`` says so.
    """
    records = [r for r in records if r.get("seconds")]
    if not records:
        return {"samples_per_s": None, "steps": "none", "num_steps": 0, "excluded": {},
                "all_steps_samples_per_s": None, "median_step_samples_per_s": None}
    chosen = [r for r in records if r["step"] not in unsteady]
    note = ""
    if not chosen:
        chosen = records[1:] or records
        note = " (no steady steps: every step was set-up)"
    seconds = sum(r["seconds"] for r in chosen)
    excluded = {}
    for record in records:
        reason = unsteady.get(record["step"])
        if reason is not None and record not in chosen:
            excluded.setdefault(reason, []).append(record["step"])
    return {
        "samples_per_s": global_batch * len(chosen) / seconds if seconds else None,
        "steps": describe_steps(r["step"] for r in chosen) + note,
        "num_steps": len(chosen),
        "excluded": {reason: describe_steps(steps) for reason, steps in excluded.items()},
        "all_steps_samples_per_s": (global_batch * len(records)
                                    / sum(r["seconds"] for r in records)),
        "median_step_samples_per_s": float(np.median([global_batch / r["seconds"]
                                                      for r in records])),
    }
