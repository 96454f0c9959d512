"""Balanced BSP: each worker reads a share of the global batch (``--batch-shares``).

Under BSP a step waits for the slowest worker. With ``--batch-shares speed``
every worker measures its own work seconds per step (the data and compute
phases: what grows with its share) and its step seconds (not on the
process's first step nor on the plan's measured steps: start-up), and every
``--rebalance-every`` steps the workers agree new shares that make them
finish together
(:func:`hpcpax.plan.shares.balanced_shares`, on a per-worker model
``fixed + share x seconds per sample`` fitted to the last evaluations where
they determine it, else proportional; a correction of uneven shares moves
no share by more than a quarter of it): the
medians are gathered, the first worker decides, the decision is broadcast,
so every rank uses the same shares from the next step on; a change must
be predicted to save ``MIN_GAIN`` of the step. With
``--batch-shares A,B,...`` the shares are fixed (tests, a known slow worker).

A change is a prediction, and the next evaluation checks it: the median
step seconds of the first window run with the new shares against those of
the window the change was decided on (``measured_step_gain`` beside
``predicted_step_gain``, logged and written to ``metrics.jsonl``). A change
after which the steps ran >= ``UNDO_LOSS`` *longer* in two windows in a
row is undone (back to the shares before it), and the shares then stay for
``COOLDOWN`` evaluations,
doubling with each undo: on a noisy node a wrong model must not keep moving
samples to where they cost more.

The global batch is untouched: worker ``w`` reads samples
``[start_w, stop_w)`` of it (:meth:`~hpcpax.data.reading.ShardedReader.batch_range`),
the ranges of all workers concatenate to the even shards' samples, and the
trainer scales each worker's gradients by ``share x workers / G``, so the
dense allreduce's mean is the mean over the global batch: the parameters
are BSP's with the same global batch (to float round-off).
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..input_checks import check_int, check_text, shown
from ..plan.shares import (SHARE_TRUST, balanced_shares, even_shares, fit_work,
                           parse_shares, relative_gain, share_ranges, step_work, trusted)

__all__ = ["BatchBalancer", "MIN_GAIN", "UNDO_LOSS", "COOLDOWN", "check_batch_shares",
           "check_run_time"]

#: Shares change only when the new ones are predicted to save this fraction of the
#: step (of the slowest worker's work when step times are not given): measurement
#: noise does not move samples around.
MIN_GAIN = 0.05
#: Evaluations each worker's work model is fitted on (the newest ones).
HISTORY = 6
#: A change after which two windows' steps in a row ran this fraction longer is undone
#: (twice the gain a change must promise; see :meth:`BatchBalancer._check`).
UNDO_LOSS = 2 * MIN_GAIN
#: Evaluations without a change after a change was undone (doubling with each undo).
COOLDOWN = 2


#: Most examples in one global batch (flags, configs and batch shares).
MAX_GLOBAL_BATCH = 1 << 24

def check_batch_shares(spec) -> None:
    """Check ``--batch-shares`` before any communication (the worker count is not known yet).

    Raises:
        ConfigError: not ``speed`` nor comma-separated positive ints.
    """
    if spec in (None, "", "speed"):
        return
    text = check_text(str(spec), "batch_shares", 1 << 20)
    parts = [p for p in text.replace(" ", "").split(",") if p]
    try:
        values = [check_int(p, "batch_shares", 1, MAX_GLOBAL_BATCH) for p in parts]
    except ConfigError:
        values = []
    if not values or len(values) > MAX_GLOBAL_BATCH:
        raise ConfigError(f"batch_shares must be 'speed' or comma-separated positive ints "
                          f"(one per worker, summing to the global batch), not {shown(spec)}")


def check_run_time(config) -> bool:
    """Check ``--batch-shares`` and ``--consistency auto``'s exclusions; whether it is auto.

    Raises:
        ConfigError: a bad ``batch_shares``, or ``auto`` with a setting it
            decides itself (batch shares) or a live plan search.
    """
    check_batch_shares(config["batch_shares"])
    if config["consistency"] != "auto":
        return False
    for key in ("partition_search", "replan_every", "batch_shares"):
        if config[key]:
            raise ConfigError(f"{key} and consistency auto exclude each other (auto sets the "
                              "batch shares and keeps the plan fixed)")
    return True


class BatchBalancer:
    """Which samples of each global batch this worker reads, and when that changes.

    Args:
        spec: ``--batch-shares``: None (even shards), ``speed``, or ``A,B,...``.
        every: ``--rebalance-every``: steps between re-evaluations (``speed``).
        topology: the run's :class:`~hpcpax.comm.topology.Topology` (a worker).
        global_batch: samples per step.
        log: ``log(text, important=...)`` for decisions.

    Raises:
        ConfigError: fixed shares that are not one positive int per worker
            summing to ``global_batch`` (the same on every worker: checked
            before any communication).
    """

    def __init__(self, spec, every, topology, global_batch, log=None):
        self.topology, self.global_batch = topology, int(global_batch)
        self.workers, self.index = topology.num_workers, topology.worker_index
        self.adaptive = spec == "speed"
        self.every = max(1, int(every))
        fixed = None if self.adaptive else parse_shares(spec, self.global_batch, self.workers)
        if self.adaptive and self.global_batch < self.workers:
            raise ConfigError(f"batch_shares speed needs global_batch >= the {self.workers} "
                              f"workers, not {self.global_batch}")
        self.shares = fixed or even_shares(self.global_batch, self.workers)
        self._log = log or (lambda text, important=False: None)
        self._measured = []  # this worker's work seconds per step since the last evaluation
        self._steps = []  # ... and its step seconds
        self._seen = 0  # steps seen by this process (its first one is not measured)
        self._observed = []  # first worker: [(shares, every worker's median work)], newest last
        self._evaluations = 0  # first worker: evaluations so far
        self._undos = 0  # ... changes undone so far
        self._frozen_until = 0  # ... no change up to this many evaluations
        #: Every change: ``{step, from, to, seconds_per_sample, fixed_seconds, gain,
        #: predicted_step_gain, step_seconds}``, and once the next evaluation checked it
        #: ``measured_step_gain`` (an undo: ``undo`` true, ``gain`` the measured loss).
        self.history = []

    @property
    def even(self) -> bool:
        """Whether every worker reads the same number of samples."""
        return len(set(self.shares)) == 1

    def batch(self, reader, position) -> dict:
        """This worker's samples of global batch ``position`` (host arrays); not collective."""
        if self.even:
            return reader.batch(position, self.global_batch, self.index, self.workers)
        start, stop = share_ranges(self.shares)[self.index]
        return reader.batch_range(position, self.global_batch, start, stop)

    def observe(self, step, times, local_batch, metrics=None, step_seconds=None,
                warming=False) -> dict | None:
        """Note one step's phase seconds; every ``every`` steps agree new shares.

        **Collective** over the workers at the steps where ``step % every ==
        0`` under ``speed`` (every worker calls it after every step), unless
        the window holds no measured step.
        ``step_seconds``: the step's wall seconds (default: the sum of
        ``times``). ``warming``: a step not to measure (the plan's measured
        steps, the same on every worker); the process's first step (start-up,
        or a resumed run's restart) is not measured either: they ran 1.5-3x
        slower than the steps after them on a 2-core VM. Returns the decision when the shares changed (also
        written to ``metrics``, a :class:`~hpcpax.app.metrics.MetricsWriter`,
        and logged), else None; the check of the last change is written and
        logged too.
        """
        if not self.adaptive:
            return None
        self._seen += 1
        if self._seen > 1 and not warming:
            self._measured.append(times["data"] + times["compute"])
            self._steps.append(float(sum(times.values()) if step_seconds is None
                                     else step_seconds))
        if step % self.every:
            return None
        if not self._measured:
            return None  # the window was all warm-up: the same on every worker
        mine = (float(np.median(self._measured)), float(np.median(self._steps)))
        self._measured, self._steps = [], []
        workers = self.topology.workers
        gathered = workers.gather(mine, root=0)
        outcome = None
        if self.index == 0:
            decision = self.decide(step, [g[0] for g in gathered], [g[1] for g in gathered])
            outcome = (decision, self.history)
        decision, history = workers.bcast(outcome, root=0)
        self.history = list(history)  # the first worker's changes and checks, on every worker
        for checked in history[-2:]:
            if checked.get("checked_at") == int(step):
                if metrics is not None:
                    metrics.write({"step": int(step), "batch_shares_check": {
                        k: checked.get(k) for k in ("step", "to", "predicted_step_gain",
                                                    "measured_step_gain", "suspect")}})
                self._log(f"step {step}: batch shares {checked['to']} (from step "
                          f"{checked['step']}): steps "
                          f"{_percent(checked['measured_step_gain'])} (predicted "
                          f"{_percent(checked['predicted_step_gain'])})"
                          + ("; the next window decides whether they stay"
                             if checked.get("suspect") else ""), important=True)
            elif checked.get("confirmed_at") == int(step):
                if metrics is not None:
                    metrics.write({"step": int(step), "batch_shares_check": {
                        k: checked.get(k) for k in ("step", "to", "confirmed_step_gain")}})
                if not decision or not decision.get("undo"):
                    self._log(f"step {step}: batch shares {checked['to']}: steps "
                              f"{_percent(checked['confirmed_step_gain'])} in the next "
                              "window: kept", important=True)
        if decision is not None:
            self.shares = list(decision["to"])
            if metrics is not None:
                metrics.write({"step": int(step), "batch_shares": decision})
            if decision.get("undo"):
                self._log(f"step {step}: batch shares {decision['from']} -> {decision['to']}: "
                          f"undone, the steps ran {_percent(decision['gain'])} with them; no "
                          f"change for {decision['cooldown']} evaluation(s)", important=True)
                return decision
            self._log(f"step {step}: batch shares {decision['from']} -> {decision['to']}: "
                      "seconds per sample " + ", ".join(
                          f"{t:.3g}" for t in decision["seconds_per_sample"])
                      + "; fixed seconds " + ", ".join(
                          f"{t:.3g}" for t in decision["fixed_seconds"])
                      + f"; predicted to save {100 * decision['gain']:.0f} % of the slowest "
                      "worker's work" + (
                          f", {100 * decision['predicted_step_gain']:.0f} % of a step"
                          if decision.get("predicted_step_gain") is not None else ""),
                      important=True)
        return decision

    def decide(self, step, work, step_seconds=None) -> dict | None:
        """The new shares from every worker's median work seconds per step under the
        current shares (None: keep them); local, deterministic. Called on the first
        worker only; the changes go to :attr:`history` (which :meth:`observe` shares).

        ``step_seconds``: every worker's median step seconds over the same
        window (their median is the window's step time). With them, the last
        change is checked first: the first window after it against the window
        it was decided on (``measured_step_gain``, set in its history entry
        with ``checked_at``); steps ``UNDO_LOSS`` or more longer in that window
        and the next undo it (:meth:`_check`; the
        returned decision has ``undo`` true and goes back to its ``from``
        shares), and no change follows for ``COOLDOWN`` evaluations (x2 per
        undo).

        Each worker's work is modelled as ``fixed + share x seconds per
        sample``, fitted on the last ``HISTORY`` evaluations
        (:func:`~hpcpax.plan.shares.fit_work`: proportional to the share until
        the evaluations determine a line), so a worker's per-step costs do not
        make a small share look slow per sample. A correction of shares
        already uneven moves no share by more than ``SHARE_TRUST`` of it
        (:func:`~hpcpax.plan.shares.trusted`).
        """
        self._observed = (self._observed + [(list(self.shares), [float(w) for w in work])])
        self._observed = self._observed[-HISTORY:]
        self._evaluations += 1
        window = float(np.median(step_seconds)) if step_seconds else None
        undo = self._check(step, window)
        if undo is not None or self._evaluations <= self._frozen_until:
            return undo
        fits = [fit_work([o[0][w] for o in self._observed], [o[1][w] for o in self._observed])
                for w in range(self.workers)]
        fixed, per_sample = [f[0] for f in fits], [f[1] for f in fits]
        proposed = balanced_shares(per_sample, self.global_batch, fixed=fixed)
        if not self.even:
            proposed = trusted(self.shares, proposed, SHARE_TRUST)
        gain = relative_gain(self.shares, proposed, per_sample, fixed)
        work_now = step_work(self.shares, per_sample, fixed)
        step_gain = float(gain * work_now / window) if window else None
        # the gate: a share of the step when it is measured (the slowest worker's work
        # alone is a small part of a step where communication dominates)
        if proposed == self.shares or (gain if step_gain is None else step_gain) < MIN_GAIN:
            return None
        decision = {"step": int(step), "from": list(self.shares), "to": proposed,
                    "seconds_per_sample": per_sample, "fixed_seconds": fixed,
                    "gain": float(gain), "step_seconds": window,
                    "predicted_step_gain": step_gain}
        self.history.append(decision)
        return decision

    def _check(self, step, window) -> dict | None:
        """Check the last change on the windows run with it; the undo, if due.

        The first window after the change sets its ``measured_step_gain``.
        Steps ``UNDO_LOSS`` longer make it *suspect*: no new change, and the
        next window decides (``confirmed_step_gain``): longer again, undone;
        else kept. One window's median moves by more than ``UNDO_LOSS`` now
        and then on a shared node (in one in four consecutive 10-step windows
        of a run with fixed shares here); twice in a row is rarer.
        """
        last = self.history[-1] if self.history else None
        if last is None or last.get("undo") or window is None or not last.get("step_seconds"):
            return None
        measured = float(1.0 - window / last["step_seconds"])
        if "checked_at" not in last:
            last["checked_at"] = int(step)
            last["measured_step_gain"] = measured
            last["suspect"] = measured <= -UNDO_LOSS
            if last["suspect"]:
                self._frozen_until = max(self._frozen_until, self._evaluations)
            return None
        if not last.get("suspect") or "confirmed_step_gain" in last:
            return None
        last["confirmed_at"], last["confirmed_step_gain"] = int(step), measured
        if measured > -UNDO_LOSS:
            return None
        self._undos += 1
        cooldown = COOLDOWN * 2 ** (self._undos - 1)
        self._frozen_until = self._evaluations + cooldown
        undo = {"step": int(step), "from": list(self.shares), "to": list(last["from"]),
                "undo": True, "undone_step": last["step"],
                "gain": min(measured, last["measured_step_gain"]),
                "cooldown": cooldown, "step_seconds": window}
        self.history.append(undo)
        return undo

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict:
        """JSON-able state (checkpoint metadata)."""
        return {"shares": list(self.shares), "history": list(self.history),
                "observed": list(self._observed), "evaluations": self._evaluations,
                "undos": self._undos, "frozen_until": self._frozen_until}

    def resume(self, path) -> None:
        """Take the shares saved in checkpoint ``path``; **collective** over the workers."""
        from .checkpoint_files import read_meta

        state = read_meta(path).get("batch_shares") if self.index == 0 else None
        self.load(self.topology.workers.bcast(state, root=0))

    def load(self, state) -> None:
        """Continue from :meth:`state` (kept only when the worker count is the same)."""
        shares = list((state or {}).get("shares") or [])
        if self.adaptive and len(shares) == self.workers and sum(shares) == self.global_batch:
            self.shares = [int(s) for s in shares]
            self.history = list(state.get("history", []))
            self._observed = [(list(a), list(b)) for a, b in state.get("observed", [])]
            self._evaluations = int(state.get("evaluations", 0))
            self._undos = int(state.get("undos", 0))
            self._frozen_until = int(state.get("frozen_until", 0))


def _percent(gain) -> str:
    """``0.12`` -> ``"12 % shorter"``, ``-0.07`` -> ``"7 % longer"``; None -> ``"?"``."""
    if gain is None:
        return "?"
    return f"{100 * abs(gain):.0f} % " + ("shorter" if gain >= 0 else "longer")
