"""``--consistency auto``: which synchronization to run, from measured step times (pure).

A run under ``auto`` is cut into *segments* of a few steps. After each one
the workers gather what they measured (per worker and step: its own work
seconds, data plus compute, the part that grows with its batch share; its
step seconds; its batch; the losses) and :class:`AutoPolicy` decides the
next segment's mode, the same on every rank (the first worker decides, the
decision is broadcast):

- ``bsp``: the collective path, even shares;
- ``balanced``: BSP with batch shares proportional to measured speed
  (:mod:`hpcpax.plan.shares`): exactly BSP's global batch and gradient;
- ``ssp:S``: the relaxed parameter server with staleness ``S``.

The rules (constants below), first match wins. From ``bsp``/``balanced``:

1. *lockstep*: the workers spend >= ``WAIT_TRIAL`` of a step outside their
   own work (in the collectives: transfers and waiting for each other)
   beyond what a slower worker explains (``persistent_imbalance``, what
   balancing could save) and what stalls explain (``transient_imbalance``,
   rule 3's), counted as a share of the step balancing would
   leave (:func:`lockstep_share`: a straggler's share of the waits does
   not hide the lockstep that stays once it is balanced, so one segment
   can decide both) -> a *trial* of ``ssp:S``, whose message-driven
   steps do not wait in lockstep; ``S`` is ``TRIAL_STALENESS``, or the
   stall lengths' (rule 3) when transient stalls are seen too; the trial
   keeps the batch shares in force (those of rule 2 when it proposes new
   ones, and a failed trial returns to ``balanced`` with them; for a trial
   one segment shows persistence when the slow worker was
   the slowest in >= ``CONSISTENTLY_SLOWEST`` of its >= ``CONSISTENT_STEPS``
   measured steps); whether it pays is measured, not predicted (rule 5);
2. *persistent slowness*: the slowest worker's typical (median) seconds
   per sample are >= ``PERSISTENT_RATIO`` x the fastest's, in this segment
   and the one before (the same worker; once the shares are balanced, this
   segment suffices), and shares proportional to speed save >= ``MIN_GAIN``
   of the step -> ``balanced`` with those shares. The shares are
   proportional to each worker's speed: its seconds per sample, the median
   over those of the last ``HISTORY`` segments of the same family (lockstep
   or relaxed: contention differs) that ran with the shares in force, so
   the noise of one segment does not move samples around, and repeated
   corrections reach the shares that equalize the work even when part of
   it is fixed per step (a line fit ``fixed + share x seconds`` over shares
   that differ little extrapolated wildly on a noisy node); workers that are
   not slower count as equally fast (``_equal_fast``), so noise between
   them does not move samples either; a correction of shares already
   uneven moves no share by more than ``SHARE_TRUST`` of it
   (:func:`~hpcpax.plan.shares.trusted`: a bounded step, so one noisy
   segment cannot halve a worker's share);
3. ``balanced`` but no worker persistently slower any more (the ratio of
   rule 2 below ``PERSISTENT_EXIT``: a hysteresis, so a ratio hovering
   near ``PERSISTENT_RATIO`` does not flip the shares) -> ``bsp``;
   from ``bsp``, *transient stalls*: >= ``MIN_STALL_FRACTION`` of the
   worker-steps took >= ``STALL_FACTOR`` x the worker's typical time, and
   the waiting they cause at the barriers is >= ``MIN_GAIN`` of the step ->
   ``ssp:S``, ``S`` the 90th percentile of the stall lengths in steps
   (``1..MAX_STALENESS``);
4. else the mode stays (no straggler: nothing a relaxed model would win).

From ``ssp:S`` (a relaxed segment):

5. the guard (:func:`guard`): the loss diverges or stalls against the BSP
   trajectory -> back; or the segment was not faster than the last BSP
   segment (a trial: not ``MIN_GAIN`` faster) -> back (``bsp``, or the
   ``balanced`` shares a trial came from);
6. a worker persistently slower (rule 2): bounded staleness cannot absorb
   persistent slowness (the fast workers reach the bound and wait), shares
   can -> ``ssp:S`` with shares proportional to speed (the relaxed steps
   read each worker's share of the global batch and weight its gradient by
   it, as balanced BSP does; one segment suffices when the worker was the
   slowest in most of its steps, as for a trial); balanced shares but no
   worker persistently slower any more -> even shares;
7. a trial that paid stays, at its ``S`` (stall lengths measured on an
   oversubscribed or noisy node vary from segment to segment; each change of
   ``S`` is a phase boundary);
8. no stalls seen any more -> ``bsp`` (``balanced`` with balanced shares);
9. else ``S`` follows the measured stall lengths.

After a step back under rule 5 no relaxed mode is tried (rules 1 and 3) for
``COOLDOWN`` segments (doubling with each failure). A segment that keeps
the mode doubles the next segment's length (up to ``max_segment``), unless
it saw a worker slower (rule 2's ratio) for the first time under even
shares: the next segment, which decides whether that is persistent, keeps
the length; a change resets it.
"""

from __future__ import annotations

import math

import numpy as np

from .loss_guard import GUARD_RATE, GUARD_RISE, expected_fall, guard, loss_figures
from .shares import SHARE_TRUST, balanced_shares, even_shares, relative_gain, step_work, trusted

__all__ = ["analyze", "lockstep_share", "loss_figures", "expected_fall", "guard", "AutoPolicy", "PERSISTENT_RATIO",
           "PERSISTENT_EXIT",
           "STALL_FACTOR", "MIN_STALL_FRACTION", "MIN_GAIN", "MAX_STALENESS",
           "GUARD_RISE", "GUARD_RATE", "COOLDOWN", "WAIT_TRIAL",
           "TRIAL_STALENESS", "HISTORY", "CONSISTENTLY_SLOWEST", "CONSISTENT_STEPS",
           "SHARE_TRUST", "trusted"]

PERSISTENT_RATIO = 1.25  # slowest worker's typical seconds per sample / the fastest's
PERSISTENT_EXIT = 1.1    # ... below which balanced shares go back to even (hysteresis)
STALL_FACTOR = 2.0       # a worker-step this many times its typical work is a stall
MIN_STALL_FRACTION = 0.01
MIN_GAIN = 0.05          # fraction of the step a change must save (predicted or measured)
MAX_STALENESS = 4
COOLDOWN = 3             # segments without relaxed trials after a failed one
#: share of a step outside own work that makes auto try ssp. 0.5 until 2026-12-06: with
#: emulated accelerators at D = 4 (compute a larger share of the step) BSP's steps at 8
#: workers spent ~45 % outside own work, ssp:3 ran 1.64x BSP's samples/s, and auto never
#: tried it. A trial is measured and kept only when >= MIN_GAIN faster.
WAIT_TRIAL = 0.3
TRIAL_STALENESS = 2      # the staleness of that trial
HISTORY = 6              # segments whose speeds the shares come from (newest)
CONSISTENTLY_SLOWEST = 0.8  # ... of a segment's steps: persistent within it (for a trial)
CONSISTENT_STEPS = 8     # ... of at least this many measured steps (4 of 4 happen by chance)


def analyze(work, batch, seconds) -> dict:
    """Figures of one segment's step-time trace.

    Args:
        work: ``[steps, workers]`` each worker's own work seconds per step.
        batch: ``[steps, workers]`` each worker's samples per step.
        seconds: ``[steps, workers]`` each worker's step seconds (wall).

    Returns:
        dict: ``per_sample`` (each worker's median work seconds per sample),
        ``persistent_ratio`` (slowest / fastest of those), ``stall_fraction``
        (of worker-steps), ``stall_steps`` (each stall's extra seconds in
        relaxed steps: the median own work per step, the step of a mode in
        which workers do not wait for each other, shorter than a BSP step;
        consecutive stalled steps of a worker as one), ``imbalance`` (mean over steps of slowest minus mean work,
        over the step: what waiting for the slowest costs),
        ``persistent_imbalance`` (the part the typical speeds explain),
        ``transient_imbalance`` (the rest), ``wait_fraction`` (mean share
        of a step outside own work), ``step_seconds`` (median),
        ``slowest_fraction`` (of the steps in which the worker of the
        largest ``per_sample`` took the most seconds per sample), ``steps``.
    """
    work = np.asarray(work, np.float64)
    batch = np.maximum(np.asarray(batch, np.float64), 1.0)
    seconds = np.asarray(seconds, np.float64)
    if work.ndim != 2 or work.shape != batch.shape or work.shape != seconds.shape \
            or work.shape[0] == 0:
        raise ValueError(f"work, batch and seconds must be [steps, workers] arrays of one "
                         f"shape, not {work.shape}, {batch.shape}, {seconds.shape}")
    per_sample_steps = work / batch
    per_sample = np.median(per_sample_steps, axis=0)
    fastest = max(float(per_sample.min()), 1e-12)
    step = float(np.median(seconds))
    # a stall's length in relaxed steps: those run at about a worker's own work (no
    # lockstep wait), shorter than the BSP step the trace may come from
    relaxed_step = max(float(np.median(work)), 1e-12)
    typical = per_sample[None, :] * batch
    extra = work - typical
    stalled = (work > STALL_FACTOR * typical) & (extra > 0)
    lengths = []
    for w in range(work.shape[1]):
        run = 0.0
        for s in range(work.shape[0]):
            if stalled[s, w]:
                run += extra[s, w]
            elif run:
                lengths.append(run)
                run = 0.0
        if run:
            lengths.append(run)
    step_mean = np.maximum(seconds.mean(axis=1), 1e-12)
    imbalance = float(np.mean((work.max(axis=1) - work.mean(axis=1)) / step_mean))
    persistent = float(np.mean((typical.max(axis=1) - typical.mean(axis=1)) / step_mean))
    waits = np.clip((seconds - work) / np.maximum(seconds, 1e-12), 0.0, 1.0)
    return {
        "per_sample": [float(x) for x in per_sample],
        "persistent_ratio": float(per_sample.max()) / fastest,
        "stall_fraction": float(stalled.mean()),
        "stall_steps": sorted(float(x) / relaxed_step for x in lengths),
        "imbalance": imbalance, "persistent_imbalance": persistent,
        "transient_imbalance": max(0.0, imbalance - persistent),
        "wait_fraction": float(waits.mean()), "step_seconds": step,
        "slowest_fraction": float(np.mean(np.argmax(per_sample_steps, axis=1)
                                          == int(np.argmax(per_sample)))),
        "steps": int(work.shape[0]),
    }


def lockstep_share(figures) -> float:
    """The share of a step the workers wait beyond what a slower worker or a stall
    explains, of the step balanced shares would leave: ``(wait_fraction - imbalance)
    / (1 - persistent_imbalance)`` (rule 1; :func:`analyze`'s figures). Waits for a
    stalled worker are rule 3's (``transient_imbalance``), not lockstep."""
    explained = min(figures["persistent_imbalance"], 0.99)
    waits = figures["wait_fraction"] - explained - figures["transient_imbalance"]
    return waits / (1.0 - explained)


class AutoPolicy:
    """The decisions of ``--consistency auto`` (state kept for checkpoints).

    Args:
        workers: the number of workers.
        global_batch: samples per step.
        segment: steps of the first segment (and after every change).
        max_segment: the longest segment.
    """

    def __init__(self, workers, global_batch, segment=10, max_segment=80):
        self.workers, self.global_batch = int(workers), int(global_batch)
        self.base_segment, self.max_segment = int(segment), max(int(segment), int(max_segment))
        self.mode, self.staleness = "bsp", 0
        self.shares = even_shares(global_batch, workers)
        self.segment = self.base_segment
        self.segments = 0
        self.cooldown_until = 0
        self.failures = 0
        self.slow_worker = None  # the slowest worker of the last segment, when >= the ratio
        self.bsp_loss = self.previous_loss = None
        self.bsp_rate = None
        #: ``[mode, shares]`` a lockstep trial (rule 1) came from, None otherwise.
        self.trial = None
        #: ``[family, shares, each worker's median work seconds per step]`` of the
        #: last segments (``family``: ``lockstep`` or ``relaxed``), for the speeds.
        self.observed = []
        #: Every decision that changed something (JSON-able dicts).
        self.history = []

    @property
    def consistency(self) -> str:
        """The mode in force: ``bsp``, ``balanced``, ``ssp:S`` or ``ssp:S+balanced``
        (batch shares proportional to speed under ``ssp:S``)."""
        if self.mode != "ssp":
            return self.mode
        return f"ssp:{self.staleness}" + ("+balanced" if self.uneven else "")

    @property
    def uneven(self) -> bool:
        """Whether balanced (uneven) batch shares are in force, under BSP or ``ssp``."""
        return self.shares != even_shares(self.global_batch, self.workers)

    # -------------------------------------------------------------- decide
    def decide(self, step, work, batch, seconds, losses, steps, samples_per_s) -> dict | None:
        """The decision after a segment ending at ``step`` (None: keep everything).

        ``work``, ``batch``, ``seconds`` as :func:`analyze` takes them;
        ``losses`` and ``steps`` the segment's per-step losses;
        ``samples_per_s`` its measured steady throughput (the trainer passes
        each worker's samples over its step seconds, summed over the workers,
        the segment's first step left out).
        """
        figures = analyze(work, batch, seconds)
        loss = loss_figures(steps, losses)
        self.segments += 1
        family = "relaxed" if self.mode == "ssp" else "lockstep"
        seen = [family, [int(x) for x in np.median(np.asarray(batch), axis=0)],
                [float(x) for x in np.median(np.asarray(work), axis=0)]]
        self.observed = [o for o in self.observed if o[0] == family][-(HISTORY - 1):] + [seen]
        seen_slow = self.slow_worker
        if self.mode == "ssp":
            change = self._from_relaxed(figures, loss, samples_per_s)
        else:
            self.bsp_loss, self.bsp_rate = loss, float(samples_per_s)
            change = self._from_bsp(figures)
        self.previous_loss = loss
        if change is None:
            # the length doubles, but not after a worker was seen slower for the first
            # time under even shares: the next segment, deciding if it persists, keeps it
            if self.slow_worker in (None, seen_slow) or self.uneven:
                self.segment = min(self.max_segment, 2 * self.segment)
            return None
        mode, staleness, shares, reason = change
        before = self.consistency
        self.mode, self.staleness, self.shares = mode, staleness, list(shares)
        decision = {"step": int(step), "from": before, "to": self.consistency,
                    "shares": list(shares), "reason": reason,
                    "measurements": {**{k: v for k, v in figures.items() if k != "stall_steps"},
                                     "stalls": len(figures["stall_steps"]),
                                     "samples_per_s": float(samples_per_s),
                                     "bsp_samples_per_s": self.bsp_rate, "loss": loss}}
        self.segment = self.base_segment
        self.history.append(decision)
        return decision

    def _cooling(self) -> bool:
        return self.segments < self.cooldown_until

    def _fail(self) -> None:
        self.failures += 1
        self.cooldown_until = self.segments + 1 + COOLDOWN * 2 ** (self.failures - 1)

    def _persistent(self, figures, at_once=False):
        """``(shares, reason)`` when balancing pays (rule 2), else None; ``at_once`` (for
        a trial, rule 1: it is measured anyway; and under ``ssp``, rule 6: the fast
        workers wait at the staleness bound from the first step) one segment suffices
        when the worker was the slowest in most of its steps (``CONSISTENTLY_SLOWEST``)."""
        times = figures["per_sample"]
        slow, seen = int(np.argmax(times)), self.slow_worker
        threshold = PERSISTENT_EXIT if self.uneven else PERSISTENT_RATIO
        self.slow_worker = slow if figures["persistent_ratio"] >= threshold else None
        within = (at_once and figures["slowest_fraction"] >= CONSISTENTLY_SLOWEST
                  and figures["steps"] >= CONSISTENT_STEPS)
        if self.slow_worker is None or (not self.uneven and seen != slow and not within):
            return None  # slower in one segment only: not yet persistent
        # each worker's seconds per sample at the shares in force: the median over the
        # last segments run with them (a fixed part per step makes it grow as a share
        # shrinks, so speeds seen at other shares would keep the correction short)
        regime = [o for o in self.observed if o[1] == list(self.shares)] or self.observed
        per_sample = self._equal_fast([float(np.median([o[2][w] / max(o[1][w], 1)
                                                        for o in regime]))
                                       for w in range(self.workers)])
        proposed = balanced_shares(per_sample, self.global_batch)
        if self.uneven:
            proposed = trusted(self.shares, proposed, SHARE_TRUST)
        work = step_work(self.shares, per_sample)
        gain = relative_gain(self.shares, proposed, per_sample) * work / max(
            figures["step_seconds"], 1e-12)
        if proposed == self.shares or gain < MIN_GAIN:
            return None
        return proposed, (f"persistent: worker {slow} takes {figures['persistent_ratio']:.2f} x "
                          f"the fastest's time per sample; shares {proposed} save "
                          f"{100 * gain:.0f} % of a step")

    def _equal_fast(self, per_sample) -> list:
        """Speeds with the workers that are not slower counted as equally fast (their
        median): only a slower worker's share moves, not noise between fast ones. A
        worker is slower at ``PERSISTENT_RATIO`` x the reference seconds per sample, the
        median of the faster half of the workers (the fastest alone is the minimum of
        noisy figures: biased low, it made a fast worker count slower); the slowest one
        also at ``PERSISTENT_EXIT`` x while its share is below an even one
        (hysteresis). The hysteresis is the slowest worker's only: a fast worker whose
        share noise once cut shows a larger fixed cost per sample at its smaller share,
        and at ``PERSISTENT_EXIT`` that alone kept it counted slower."""
        slowest = int(np.argmax(per_sample))
        reference = float(np.median(sorted(per_sample)[:(len(per_sample) + 1) // 2]))
        even = even_shares(self.global_batch, self.workers)
        slower = [t >= (PERSISTENT_EXIT if w == slowest and share < even[w]
                        else PERSISTENT_RATIO) * reference
                  for w, (t, share) in enumerate(zip(per_sample, self.shares))]
        fast = float(np.median([t for t, s in zip(per_sample, slower) if not s]))
        return [t if s else fast for t, s in zip(per_sample, slower)]

    def _staleness(self, figures) -> int:
        lengths = figures["stall_steps"]
        if not lengths:
            return 1
        return int(min(MAX_STALENESS, max(1, math.ceil(np.percentile(lengths, 90)))))

    def _stalls(self, figures) -> bool:
        return (figures["stall_fraction"] >= MIN_STALL_FRACTION
                and figures["transient_imbalance"] >= MIN_GAIN)

    def _lockstep(self, figures) -> bool:
        """Rule 1: the waits outside own work that balancing cannot remove, as a share
        of the step balancing would leave (the step less ``persistent_imbalance``)."""
        return lockstep_share(figures) >= WAIT_TRIAL and not self._cooling()

    def _from_bsp(self, figures):
        if self._lockstep(figures):
            balanced = self._persistent(figures, at_once=True)  # tracks the slowest worker too
            shares = balanced[0] if balanced is not None else list(self.shares)
            # a failed trial returns to BSP with the shares it ran with (balanced ones
            # when it proposed them: they were measured to pay)
            self.trial = [self.mode if balanced is None else "balanced", list(shares)]
            staleness = TRIAL_STALENESS
            if self._stalls(figures):
                staleness = max(staleness, self._staleness(figures))
            return "ssp", staleness, shares, (
                f"lockstep: the workers spend {100 * figures['wait_fraction']:.0f} % of a step "
                f"outside their own work ({100 * figures['persistent_imbalance']:.0f} % "
                f"explained by a slower worker); trying ssp:{staleness} (kept if >= "
                f"{100 * MIN_GAIN:.0f} % faster)")
        balanced = self._persistent(figures)
        if balanced is not None:
            return ("balanced",) + (0,) + balanced
        even = even_shares(self.global_batch, self.workers)
        if self.mode == "balanced" and figures["persistent_ratio"] < PERSISTENT_EXIT:
            return "bsp", 0, even, (f"no worker persistently slower any more (ratio "
                                    f"{figures['persistent_ratio']:.2f}): even shares")
        if self.mode == "balanced" or self._cooling():
            return None
        if self._stalls(figures):
            staleness = self._staleness(figures)
            return "ssp", staleness, even, (
                f"transient stalls on {100 * figures['stall_fraction']:.1f} % of worker-steps "
                f"cost {100 * figures['transient_imbalance']:.0f} % of a step in barrier waits; "
                f"90 % of them last <= {staleness} step(s)")
        return None

    def _back(self, reason):
        """Rule 5: back to ``bsp`` (or the balanced shares a trial came from), cooling down."""
        self._fail()
        mode, shares = self.trial or ["bsp", even_shares(self.global_batch, self.workers)]
        self.trial = None
        return mode, 0, shares, reason

    def _from_relaxed(self, figures, loss, samples_per_s):
        even = even_shares(self.global_batch, self.workers)
        why = guard(self.bsp_loss, self.previous_loss, loss)
        if why is not None:
            return self._back("guard: " + why)
        needed = (1 + MIN_GAIN) if self.trial else 1.0
        if self.bsp_rate is not None and samples_per_s < needed * self.bsp_rate:
            return self._back(f"ssp:{self.staleness} ran {samples_per_s:,.0f} samples/s, "
                              f"bsp {self.bsp_rate:,.0f}: no gain")
        balanced = self._persistent(figures, at_once=True)
        if balanced is not None:  # rule 6
            shares, reason = balanced
            return "ssp", self.staleness, shares, reason + f" (under ssp:{self.staleness})"
        if self.uneven and figures["persistent_ratio"] < PERSISTENT_EXIT:
            return "ssp", self.staleness, even, (
                f"no worker persistently slower any more (ratio "
                f"{figures['persistent_ratio']:.2f}): even shares")
        if self.trial is not None:
            return None  # a trial that paid stays, at its staleness
        if figures["stall_fraction"] < MIN_STALL_FRACTION:
            if self.uneven:
                return "balanced", 0, list(self.shares), "stalls gone: balanced BSP"
            return "bsp", 0, even, "stalls gone"
        staleness = self._staleness(figures)
        if staleness != self.staleness:
            return "ssp", staleness, list(self.shares), (
                f"stall lengths now: 90 % last <= {staleness} step(s)")
        return None

    # ---------------------------------------------------------- checkpoint
    def state(self) -> dict:
        """JSON-able state (checkpoint metadata)."""
        keys = ("mode", "staleness", "shares", "segment", "segments", "cooldown_until",
                "failures", "slow_worker", "bsp_loss", "previous_loss", "bsp_rate", "trial",
                "observed", "history")
        return {k: getattr(self, k) for k in keys}

    def load(self, state) -> None:
        """Continue from :meth:`state`."""
        for key, value in state.items():
            if hasattr(self, key):
                setattr(self, key, value)
