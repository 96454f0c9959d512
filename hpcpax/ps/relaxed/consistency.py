"""Consistency models of the parameter server and their barrier conditions (pure, no MPI).

A *clock* counts steps: a worker (or a node group, see
:mod:`hpcpax.ps.relaxed`) is at clock ``c`` once it has pushed the updates
of ``c`` steps. A pull is made at the puller's clock ``c`` (before its step
``c + 1``). Each model says when a server may answer that pull:

========== ================================================== =========================
model      the pull at clock ``c`` is answered when            updates are applied
========== ================================================== =========================
``bsp``    (job-wide: today's collective path, every worker    once per step, summed
           in the same step)                                  over every worker
``ssp:S``  every group's clock is >= ``c - S``                 once per clock, when
                                                              every group pushed it
``asp``    at once                                            on arrival, per push
``psp:B,S`` ``B`` peers drawn at random for this pull are all  on arrival, per push
           at clock >= ``c - S`` (Wang et al. 2017)
========== ================================================== =========================

Guarantees, for the rows a server returns to a pull at clock ``c``:

- ``ssp:S``: they hold every update made at clocks ``< c - S`` by every
  worker, and no update of a clock that some group has not finished (a
  clock's updates become visible together, summed in worker order, like one
  BSP step). ``ssp:0`` is therefore BSP exactly: same sums, same optimizer
  steps, same parameters.
- ``asp``: they hold whatever updates arrived before the pull; no bound.
- ``psp:B,S``: they hold every update made at clocks ``< c - S`` by the
  ``B`` sampled peers; other peers are unbounded. ``psp:B,S`` with ``B`` at
  least the number of other groups waits exactly like ``ssp:S`` (but applies
  on arrival); ``psp:0`` is ``asp``.

Every update is applied exactly once under every model.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ...errors import ConfigError
from ...input_checks import check_int, check_text, shown

__all__ = ["Consistency", "parse_consistency", "parse_consistency_spec", "BSP", "MODELS"]

MODELS = ("bsp", "ssp", "asp", "psp")


@dataclass(frozen=True)
class Consistency:
    """One consistency model.

    Attributes:
        model: ``bsp``, ``ssp``, ``asp`` or ``psp``.
        staleness: S, the clocks a puller may be ahead (ssp, psp; 0 for bsp).
        sample: B, peers sampled per pull (psp only).
    """

    model: str = "bsp"
    staleness: int = 0
    sample: int = 0

    def __str__(self) -> str:
        if self.model == "ssp":
            return f"ssp:{self.staleness}"
        if self.model == "psp":
            return f"psp:{self.sample},{self.staleness}"
        return self.model

    @property
    def relaxed(self) -> bool:
        """Whether this model needs the message-driven server (all but ``bsp``)."""
        return self.model != "bsp"

    @property
    def per_clock(self) -> bool:
        """True when a clock's updates are applied together once every group pushed it.

        (``bsp`` and ``ssp``); False when each push is applied on arrival
        (``asp``, ``psp``).
        """
        return self.model in ("bsp", "ssp")

    @property
    def bounded(self) -> bool:
        """Whether every worker runs a fixed number of steps (bsp, ssp).

        ``asp`` and ``psp`` end when the workers together ran the job's
        steps: a fast worker runs more steps than a slow one.
        """
        return self.model in ("bsp", "ssp")

    @property
    def guarantee(self) -> str:
        """The guarantee in one sentence (for logs and ``summary.json``)."""
        if self.model == "bsp":
            return "every pull sees every update of every earlier step, and nothing later"
        if self.model == "ssp":
            return (f"a pull at clock c waits until every group reached c - {self.staleness}; "
                    f"it sees every update of clocks < c - {self.staleness} and none of "
                    "an unfinished clock")
        if self.model == "asp":
            return "pulls are answered at once; no staleness bound"
        return (f"a pull at clock c waits until {self.sample} peers drawn at random reached "
                f"c - {self.staleness}; it sees their updates of clocks < c - {self.staleness}")

    def ready(self, clock, group, group_clocks, sampled=None) -> bool:
        """Whether a pull of ``group`` at ``clock`` may be answered now.

        Args:
            clock: the puller's clock.
            group: the puller's group index.
            group_clocks: every group's clock as this server sees it (int array).
            sampled: psp: the peers drawn for this pull (:meth:`draw`).
        """
        if self.model == "asp":
            return True
        if self.model == "psp":
            if sampled is None or len(sampled) == 0:
                return True
            return int(group_clocks[sampled].min()) >= clock - self.staleness
        return int(group_clocks.min()) >= clock - self.staleness

    def draw(self, rng, group, num_groups) -> np.ndarray:
        """psp: ``B`` peers of ``group`` drawn uniformly without replacement (empty otherwise)."""
        if self.model != "psp" or num_groups <= 1 or self.sample == 0:
            return np.zeros(0, np.int64)
        peers = np.array([g for g in range(num_groups) if g != group], np.int64)
        if self.sample >= len(peers):
            return peers
        return np.sort(rng.choice(peers, self.sample, replace=False))


BSP = Consistency()
#: Largest staleness S or sample B (beyond it a bound never binds; clocks stay int64).
MAX_COUNT = (1 << 31) - 1


def _count(text, what, spec) -> int:
    if text.strip().isdigit() and len(text.strip()) > 10:  # past MAX_COUNT, unparsed
        raise ConfigError(f"consistency {shown(spec)}: {what} must be an int <= {MAX_COUNT}, "
                          f"not {shown(text.strip())}")
    try:
        value = check_int(text, what, None, None)
    except ConfigError:
        raise ConfigError(f"consistency {shown(spec)}: {what} must be an int >= 0, "
                          f"not {shown(text)}") from None
    if value < 0:
        raise ConfigError(f"consistency {shown(spec)}: {what} must be an int >= 0, not {value}")
    if value > MAX_COUNT:
        raise ConfigError(f"consistency {shown(spec)}: {what} must be an int <= {MAX_COUNT}, "
                          f"not {shown(value)}")
    return value


def parse_consistency(spec) -> Consistency:
    """``bsp``, ``ssp:S``, ``asp`` or ``psp:B[,S]`` as a :class:`Consistency`.

    Raises:
        ConfigError: anything else (the accepted forms named).
    """
    if isinstance(spec, Consistency):
        return spec
    if not isinstance(spec, str):
        raise ConfigError(f"consistency must be a str such as 'ssp:3', not "
                          f"{type(spec).__name__}")
    text = spec.strip().lower()
    model, _, argument = text.partition(":")
    if model in ("bsp", "asp") and not argument:
        return Consistency(model)
    if model == "ssp" and argument:
        return Consistency("ssp", staleness=_count(argument, "S", spec))
    if model == "psp" and argument:
        sample, _, staleness = argument.partition(",")
        return Consistency("psp", staleness=_count(staleness, "S", spec) if staleness else 0,
                           sample=_count(sample, "B", spec))
    raise ConfigError(f"consistency must be bsp, ssp:S, asp or psp:B[,S], not {shown(spec)}")


def parse_consistency_spec(spec, names=None) -> tuple:
    """A job's consistency: ``(default, {variable: Consistency})``.

    ``spec`` is one model (``"ssp:3"``) or the job's model followed by
    per-variable ones, separated by ``;``: ``"ssp:3; softmax_b=asp"``.
    A variable without an entry follows the job's model.

    Args:
        spec: the text (or a :class:`Consistency`).
        names: the sparse variable names, to refuse unknown ones (optional).

    Raises:
        ConfigError: a bad model or an unknown variable name.
    """
    if isinstance(spec, Consistency):
        return spec, {}
    if not isinstance(spec, str):
        raise ConfigError(f"consistency must be a str such as 'ssp:3', not "
                          f"{type(spec).__name__}")
    check_text(spec, "consistency")
    default, per_variable = BSP, {}
    for i, part in enumerate(p.strip() for p in spec.split(";")):
        if not part:
            continue
        name, equals, model = part.partition("=")
        if not equals:
            if i != 0:
                raise ConfigError(f"consistency {spec!r}: the job's model comes first; "
                                  f"later parts must be NAME=MODEL, not {part!r}")
            default = parse_consistency(part)
            continue
        name = name.strip()
        if name in per_variable:
            raise ConfigError(f"consistency {shown(spec)} names variable {shown(name)} twice")
        if names is not None and name not in names:
            raise ConfigError(f"consistency {spec!r} names unknown sparse variable {name!r}; "
                              f"the model has {sorted(names)}")
        per_variable[name] = parse_consistency(model)
    return default, per_variable
