"""Emulated accelerator compute (``--emulate-compute``) and time dilation (``--time-dilation``).

On a GPU cluster a worker's host CPU mostly waits while its accelerator
computes the forward and backward pass. On a machine with fewer cores than
ranks, a real forward/backward instead takes a core from every other rank
and the links never bind. With ``--emulate-compute`` a worker's forward and
backward become a wait of a modeled duration that holds no CPU
(``time.sleep``); everything else stays real: the data's ids, the pulled
rows, pushed row gradients for exactly the rows pulled (synthetic,
deterministic: every value ``GRAD_VALUE``), dense gradients of the model's
real shapes, every exchange, the servers' optimizer. The loss is not
computed (reported as 0.0; metrics and ``summary.json`` carry
``"emulated_compute"``): an emulated run measures time and bytes, not
convergence.

The modeled duration of a step on a shard of ``n`` samples is
``(fixed + per_sample x n) x D``; ``--straggler`` and ``--stalls`` multiply
it as they do real compute (their delay is charged after it).

Time dilation ``D`` (``--time-dilation``) slows the whole emulated cluster
by ``D``: the cluster tool divides its link rates by ``D``
(``python -m hpcpax.cluster up --dilation D``), modeled compute is
multiplied by ``D``; every time ``metrics.jsonl`` and ``summary.json``
report (step and phase seconds, samples/s, ``train_seconds``) is divided by
``D`` again, so results are in undilated units (``time_dilation`` says
which ``D``); ``wall_seconds``, CPU seconds and ``cpu_busy`` stay real.
Waits are dilated too (:func:`dilated_waits`): a waiting rank's longest
sleep between two polls (``hpcpax.options.poll_seconds``) becomes ``D``
times longer, so polling costs the same CPU per undilated second and the
same latency in undilated units as on the real cluster.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..errors import ConfigError
from ..input_checks import check_float, check_text, shown

__all__ = ["ComputeModel", "parse_emulate_compute", "EmulatedCompute", "GRAD_VALUE",
           "dilated_waits", "MAX_STEP_SECONDS", "check_step_seconds"]

#: Longest emulated step (fixed part, per-sample part of a whole global batch, dilated).
MAX_STEP_SECONDS = 86400.0

#: Every value of an emulated gradient (sparse rows and dense tensors).
GRAD_VALUE = 1e-6


@dataclass(frozen=True)
class ComputeModel:
    """A modeled forward/backward: ``(fixed_s + per_sample_s x samples) x dilation`` seconds.

    Attributes:
        fixed_s: seconds per step whatever the shard's size.
        per_sample_s: seconds per sample of the worker's shard.
        dilation: the time dilation ``D`` (>= 1 slows the emulated cluster).
        source: how it was given (the flag's value), for the metrics.
    """

    fixed_s: float = 0.0
    per_sample_s: float = 0.0
    dilation: float = 1.0
    source: str = ""

    def seconds(self, samples) -> float:
        """The (dilated) wait of a step on ``samples`` samples."""
        return (self.fixed_s + self.per_sample_s * samples) * self.dilation

    def to_dict(self) -> dict:
        """For ``summary.json`` and the metrics."""
        return {"fixed_s": self.fixed_s, "per_sample_s": self.per_sample_s,
                "time_dilation": self.dilation, "source": self.source}


@contextmanager
def dilated_waits(dilation):
    """Within the block, ``hpcpax.options.poll_seconds`` is ``dilation`` times its value.

    Only where the poll cap is the default: one set in code or in
    ``HPCPAX_POLL_SECONDS`` is the user's and is kept. Restored on exit.
    Without it, a rank polls up to 1000 times per *dilated* second, so its
    polling CPU grows ``D``-fold per undilated second of the run and
    dilation cannot bring a busy emulated cluster under one core per node.
    """
    from ..options import options

    if dilation == 1 or options.source("poll_seconds") != "default":
        yield
        return
    options.poll_seconds = options.poll_seconds * float(dilation)
    try:
        yield
    finally:
        del options.poll_seconds


def parse_emulate_compute(spec, dilation=1.0) -> ComputeModel | None:
    """``--emulate-compute`` -> :class:`ComputeModel` (None for ``off`` or None).

    Forms: ``SECONDS`` (per step), ``SECONDS+SECONDS/sample`` (fixed plus per
    sample), ``SECONDS/sample``, or a preset name (``lm1b``: its
    ``compute_ms`` over its ``samples_per_worker``, per sample).

    Raises:
        ConfigError: anything else, or a negative time, or a dilation not > 0.
    """
    if not isinstance(dilation, (int, float)) or isinstance(dilation, bool) or \
            not np.isfinite(dilation) or dilation <= 0:
        raise ConfigError(f"time_dilation must be a number > 0, not {shown(dilation)}")
    if spec is None or str(spec).strip().lower() in ("", "off", "none"):
        return None
    text = check_text(str(spec), "emulate_compute", 256).strip()
    fixed = per_sample = 0.0
    try:
        for part in text.split("+"):
            part = part.strip()
            if part.endswith("/sample"):
                per_sample += float(part[:-len("/sample")])
            else:
                fixed += float(part)
    except ValueError:
        per_sample, fixed = _preset(text), 0.0
    if fixed < 0 or per_sample < 0 or not np.isfinite(fixed + per_sample):
        raise ConfigError(f"emulate_compute times must be finite and >= 0, not {shown(text)}")
    return ComputeModel(fixed, per_sample, float(dilation), text)


def check_step_seconds(model, global_batch) -> None:
    """Refuse an emulated step longer than :data:`MAX_STEP_SECONDS` (a sleep that long
    is a typo, and a far longer one overflows ``time.sleep``); a no-op for None.

    Raises:
        ConfigError: naming ``emulate_compute``, ``time_dilation`` and the seconds.
    """
    if model is None:
        return
    longest = model.seconds(global_batch)
    if not longest <= MAX_STEP_SECONDS:
        raise ConfigError(f"emulate_compute {shown(model.source)} x time_dilation "
                          f"{model.dilation:g} makes a step of up to {longest:.3g} s "
                          f"({global_batch} samples), more than {MAX_STEP_SECONDS:g} s")


def _preset(name) -> float:
    from ..plan.sim import load_preset

    try:
        preset = load_preset(name)
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"emulate_compute must be SECONDS, SECONDS+SECONDS/sample or a "
                          f"preset name (lm1b, ...), not {shown(name)}") from None
    if "compute_ms" not in preset or not preset.get("samples_per_worker"):
        raise ConfigError(f"emulate_compute: preset {shown(name)} has no compute_ms per "
                          "samples_per_worker")
    where = f"emulate_compute: preset {shown(name)}"
    return (check_float(preset["compute_ms"], f"{where}: compute_ms", minimum=0.0) / 1e3
            / check_float(preset["samples_per_worker"], f"{where}: samples_per_worker",
                          above=0.0))


class EmulatedCompute:
    """A model's forward/backward replaced by a wait that holds no CPU (see the module doc).

    Args:
        compute: the :class:`ComputeModel`.
        dense_shapes: ``{name: shape}`` of the model's dense parameters.
        dtype: their dtype.
        xp: the array module (NumPy or CuPy).
    """

    def __init__(self, compute, dense_shapes, dtype, xp=np):
        self.compute, self.xp, self.dtype = compute, xp, np.dtype(dtype)
        self._dense = {name: xp.full(tuple(shape), GRAD_VALUE, self.dtype)
                       for name, shape in dense_shapes.items()}
        self._rows = {}  # table -> a buffer of GRAD_VALUE rows, grown as needed

    def forward_backward(self, dense, rows, batch, position):
        """Wait the modeled time; gradients of the real shapes for the rows pulled.

        Returns a :class:`~hpcpax.models.base.StepResult` with loss 0.0.
        """
        from ..models.base import StepResult

        samples = len(next(iter(batch.values())))
        seconds = self.compute.seconds(samples)
        if seconds > 0:
            time.sleep(seconds)  # the accelerator computes; the host holds no core
        sparse = {name: (ids, self._row_grads(name, values))
                  for name, (ids, values) in rows.items()}
        return StepResult(0.0, {"loss": 0.0}, dict(self._dense), sparse)

    def _row_grads(self, name, values):
        n = int(values.shape[0])
        shape = tuple(values.shape[1:])
        buffer = self._rows.get(name)
        if buffer is None or buffer.shape[0] < n or buffer.shape[1:] != shape:
            buffer = self.xp.full((max(n, 1024),) + shape, GRAD_VALUE, values.dtype)
            self._rows[name] = buffer
        return buffer[:n]
