"""Straggler injection for tests and benchmarks: slow ranks without burning CPU.

- ``--straggler RANK:FACTOR[,RANK:FACTOR...]``: that world rank is
  ``FACTOR`` times slower all the time: after computing a step it sleeps
  ``(FACTOR - 1)`` x the step's own compute time, as a slower device would
  take longer, without using the CPU the others need.
- ``--stalls P:FACTOR``: every worker, independently, stalls on a fraction
  ``P`` of its steps (drawn from ``(seed, rank, step)``, so the same steps
  stall in every run): it sleeps ``(FACTOR - 1)`` x that step's compute time
  (a noisy neighbour, an I/O hiccup).

The sleep counts as compute time in the step's phase times.
"""

from __future__ import annotations

import time

import numpy as np

from ..errors import ConfigError
from ..input_checks import INT64_MAX, check_float, check_int, check_text, shown

__all__ = ["Stragglers", "parse_straggler", "parse_stalls", "check_straggler_ranks",
           "MAX_FACTOR"]

#: Slowest straggler or stall: a worker this many times slower than its compute.
MAX_FACTOR = 1000.0


def _factor(text, where) -> float:
    try:
        return check_float(text, "FACTOR", minimum=1.0, maximum=MAX_FACTOR)
    except ConfigError:
        raise ConfigError(f"{where}: FACTOR must be a number in [1, {MAX_FACTOR:g}], "
                          f"not {shown(text)}") from None


def parse_straggler(spec) -> dict:
    """``"2:2.0,3:1.5"`` -> ``{2: 2.0, 3: 1.5}`` (None or "" -> ``{}``)."""
    if not spec:
        return {}
    spec = check_text(str(spec), "straggler")
    out = {}
    for part in spec.replace(" ", "").split(","):
        rank, colon, factor = part.partition(":")
        if not colon:
            raise ConfigError(f"straggler must be RANK:FACTOR[,RANK:FACTOR...], "
                              f"not {shown(spec)}")
        try:
            rank = check_int(rank, "RANK", 0, INT64_MAX)
        except ConfigError:
            raise ConfigError(f"straggler {shown(spec)}: RANK must be an int >= 0, "
                              f"not {shown(rank)}") from None
        out[rank] = _factor(factor, f"straggler {shown(spec)}")
    return out


def check_straggler_ranks(straggler, size, worker_ranks) -> None:
    """Raise :class:`ConfigError` unless every ``--straggler`` rank is a worker rank.

    A rank beyond the job, or a server rank (servers do not compute steps, so
    they never sleep), would make the flag a silent no-op. Every rank checks
    the same config against the same topology, so all raise together.
    """
    slow = straggler if isinstance(straggler, dict) else parse_straggler(straggler)
    workers = sorted(int(r) for r in worker_ranks)
    for rank in sorted(slow):
        if rank >= int(size):
            raise ConfigError(f"straggler rank {rank} is not in this job of {size} ranks "
                              f"(worker ranks: {workers})")
        if rank not in workers:
            raise ConfigError(f"straggler rank {rank} is a server rank; stragglers slow "
                              f"workers (worker ranks: {workers})")


def parse_stalls(spec) -> tuple:
    """``"0.05:5"`` -> ``(0.05, 5.0)`` (None or "" -> ``(0.0, 1.0)``)."""
    if not spec:
        return 0.0, 1.0
    spec = check_text(str(spec), "stalls")
    probability, colon, factor = spec.replace(" ", "").partition(":")
    if not colon:
        raise ConfigError(f"stalls must be P:FACTOR (e.g. 0.05:5), not {shown(spec)}")
    try:
        probability = check_float(probability, "P", minimum=0.0, maximum=1.0)
    except ConfigError:
        raise ConfigError(f"stalls {shown(spec)}: P must be a probability in [0, 1], "
                          f"not {shown(probability)}") from None
    return probability, _factor(factor, f"stalls {shown(spec)}")


class Stragglers:
    """What one rank sleeps after each step's compute.

    Args:
        straggler: ``--straggler`` text (or its parsed dict).
        stalls: ``--stalls`` text (or its parsed tuple).
        rank: this world rank.
        seed: the run's seed.
    """

    def __init__(self, straggler=None, stalls=None, rank=0, seed=0):
        slow = straggler if isinstance(straggler, dict) else parse_straggler(straggler)
        self.factor = slow.get(int(rank), 1.0)
        self.stall_probability, self.stall_factor = (
            stalls if isinstance(stalls, tuple) else parse_stalls(stalls))
        self.rank, self.seed = int(rank), int(seed)
        #: Seconds slept so far, and stalls taken.
        self.slept = 0.0
        self.stalls = 0

    @classmethod
    def for_topology(cls, config, topology):
        """This rank's stragglers from a run's ``config`` (``straggler``, ``stalls``,
        ``seed``), its straggler ranks checked against ``topology``
        (:func:`check_straggler_ranks`)."""
        check_straggler_ranks(config["straggler"], topology.size, topology.worker_ranks)
        return cls(config["straggler"], config["stalls"], topology.rank, config["seed"])

    @property
    def active(self) -> bool:
        """Whether this rank ever sleeps."""
        return self.factor > 1.0 or (self.stall_probability > 0 and self.stall_factor > 1.0)

    def stalls_at(self, step) -> bool:
        """Whether this rank stalls at ``step`` (deterministic)."""
        if self.stall_probability <= 0:
            return False
        draw = np.random.default_rng([self.seed, self.rank, int(step), 0x57A11]).random()
        return bool(draw < self.stall_probability)

    def delay(self, step, compute_seconds) -> float:
        """Sleep what ``step`` costs this rank beyond ``compute_seconds``; the seconds slept."""
        if not self.active:
            return 0.0
        extra = (self.factor - 1.0) * compute_seconds
        if self.stalls_at(step):
            extra += (self.stall_factor - 1.0) * compute_seconds
            self.stalls += 1
        if extra > 0:
            time.sleep(extra)
            self.slept += extra
        return extra
