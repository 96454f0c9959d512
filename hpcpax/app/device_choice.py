"""``--device auto``: GPU workers only where a measured step is faster.

With ``--device auto`` on a node whose workers see a GPU, each worker times
the device-local part of its step on the CPU and on its GPU before training
(:func:`measure_step`): its shard of an example batch onto the device, the
pulled rows onto the device, forward and backward, the sparse gradients
deduplicated, the dense optimizer, and what a host-staged MPI then needs
copied back to the host, ``TRIAL_STEPS`` times after one untimed warm-up
(kernel compilation). The workers add their medians (one ``Allreduce``) and
the job takes GPU workers only if every worker has a GPU and the GPUs' sum
is below ``MARGIN`` times the CPUs' (:func:`decide`), so the default job on
a GPU node does not run slower than without one, up to the trial's
accuracy. Communication is left out: it is the same bytes either way, and
the staging copies, its only device-dependent part, are in the trial.

The choice and both times are logged on the first worker and saved in the
run's ``summary.json`` as ``device_choice``. ``--device cpu|gpu`` skips the
trial.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import numpy as np

from ..backend import Device, has_gpu, select_device, synchronize, to_host

__all__ = ["TRIAL_STEPS", "MARGIN", "DeviceChoice", "decide", "measure_step", "worker_device"]

#: Timed trial steps per device (after one warm-up).
TRIAL_STEPS = 5
#: GPU workers only if their trial step takes below this fraction of the CPU's
#: (timing noise must not flip a tie to the GPU).
MARGIN = 0.9


@dataclass(frozen=True)
class DeviceChoice:
    """What ``--device auto`` chose and why.

    Attributes:
        device: ``"cpu"`` or ``"gpu"``.
        cpu_step_s / gpu_step_s: mean over the workers of their median trial
            step on each device (None where not measured).
        reason: one line a user reads.
    """

    device: str
    cpu_step_s: float | None
    gpu_step_s: float | None
    reason: str

    def to_dict(self) -> dict:
        """The JSON of ``summary.json``'s ``device_choice`` (with the trial's settings)."""
        return {**asdict(self), "trial_steps": TRIAL_STEPS, "margin": MARGIN}


def decide(cpu_step_s: float, gpu_step_s: float, every_worker_has_gpu: bool = True) -> DeviceChoice:
    """The choice from measured step times (pure; the same on every rank).

    Args:
        cpu_step_s: trial step time on the CPU (seconds; a mean over workers).
        gpu_step_s: the same on the GPU.
        every_worker_has_gpu: False when some worker sees no GPU (then the
            CPU: one device kind for the whole job).
    """
    if not every_worker_has_gpu:
        return DeviceChoice("cpu", cpu_step_s, None, "device auto: cpu workers (not every "
                            "worker sees a GPU)")
    times = (f"a trial step took {gpu_step_s * 1e3:.3g} ms on the GPU, "
             f"{cpu_step_s * 1e3:.3g} ms on the CPU")
    if gpu_step_s < MARGIN * cpu_step_s:
        return DeviceChoice("gpu", cpu_step_s, gpu_step_s, f"device auto: gpu workers ({times})")
    return DeviceChoice("cpu", cpu_step_s, gpu_step_s,
                        f"device auto: cpu workers ({times}; the GPU must take under "
                        f"{MARGIN:g}x the CPU's)")


def measure_step(model, config, xp, batch_size: int, steps: int = TRIAL_STEPS) -> float:
    """Median seconds of this worker's device-local step work on ``xp``.

    Not collective. ``xp`` is numpy or cupy (already on this worker's GPU).
    """
    from ..ops import dedup_sum
    from ..ops.optimizers import make_optimizer

    host_batch = model.example_batch(max(1, batch_size), seed=config["seed"])
    specs = {s.name: s for s in model.sparse_specs()}
    rng = np.random.default_rng(config["seed"])
    host_rows = {}
    for name, ids in model.sparse_ids(host_batch, 0).items():
        unique = np.unique(to_host(ids))
        scale = specs[name].init_scale
        host_rows[name] = (unique, rng.uniform(-scale, scale, (unique.size, specs[name].dim))
                           .astype(model.dtype))
    dense = {k: xp.asarray(v) for k, v in model.init_dense().items()}
    optimizer = make_optimizer(config["optimizer"], lr=config["lr"])
    state = {k: optimizer.init_state(p.shape, p.dtype, xp) for k, p in dense.items()}

    def step():
        batch = {k: xp.asarray(v) for k, v in host_batch.items()}
        rows = {k: (xp.asarray(u), xp.asarray(r)) for k, (u, r) in host_rows.items()}
        result = model.forward_backward(dense, rows, batch, 0)
        for ids, values in result.sparse_grads.values():
            unique, summed = dedup_sum(ids, values)
            to_host(unique), to_host(summed)
        for name, grad in result.dense_grads.items():
            to_host(grad)
            optimizer.apply_dense(dense[name], state[name], grad)
        synchronize(next(iter(dense.values()), None))

    step()  # untimed: compiles the kernels (Numba, NVRTC, CuPy's own)
    times = []
    for _ in range(steps):
        began = time.perf_counter()
        step()
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def worker_device(trainer, *, measure=None, gpu_seen=None) -> Device:
    """This rank's :class:`~hpcpax.backend.Device`; **collective** over the
    workers when ``--device auto`` on a GPU node (the trial), else local.

    Servers run on the CPU. ``measure``/``gpu_seen`` are the trial's timer and
    the GPU probe (tests inject their own). The choice goes to
    ``trainer.summary_extra["device_choice"]`` and the first worker's log.
    """
    from ..comm.reductions import any_rank, every_rank, sum_in_place
    from ..options import options
    from .datasets import build_model

    measure = measure_step if measure is None else measure
    gpu_seen = has_gpu if gpu_seen is None else gpu_seen
    topo, config = trainer.topology, trainer.config
    if not topo.is_worker:
        return Device("cpu")
    choice = (config["device"] or options.device).lower()
    if choice != "auto":
        return select_device(topo.node_workers.Get_rank(), choice)
    gpu = bool(gpu_seen())
    every_gpu = every_rank(topo.workers, gpu)
    if not every_gpu and not any_rank(topo.workers, gpu):
        return Device("cpu")  # no GPU anywhere: nothing to measure, as before
    model = build_model(config)
    batch_size = config["global_batch"] // topo.num_workers
    cpu_s = measure(model, config, np, batch_size)
    gpu_s = 0.0
    if every_gpu:
        device = select_device(topo.node_workers.Get_rank(), "gpu")
        gpu_s = measure(model, config, device.xp, batch_size)
    total = sum_in_place(topo.workers, np.array([cpu_s, gpu_s], np.float64))
    decision = decide(total[0] / topo.num_workers, total[1] / topo.num_workers, every_gpu)
    trainer.summary_extra["device_choice"] = decision.to_dict()
    trainer.log(decision.reason, important=True)
    return select_device(topo.node_workers.Get_rank(), decision.device)
