"""What a run reports: one reduced record per step, and the summary at the end.

After each step the workers reduce one small vector (loss x batch, batch,
preemption flag, phase seconds, cumulative bytes per phase, the owners' row
bytes) with one ``Allreduce``; the first worker turns it into the
``metrics.jsonl`` line. At the end every rank's accounting is reduced into
``summary.json``.
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.polling import wait

from ..comm.accounting import OWNER_FIELDS

__all__ = ["TIME_PHASES", "BYTE_PHASES", "PhaseClock", "Computed", "compute_step",
           "reduce_step", "step_record", "summarize", "summary_line"]

#: Wall-time phases of one worker step, in the metrics lines.
TIME_PHASES = ("data", "pull", "compute", "push", "dense", "optimizer")
#: Accounting phases whose bytes the metrics lines report (summed over workers).
BYTE_PHASES = ("pull", "push", "intra_node", "dense", "allgather", "dense_sparse", "control",
               "repartition", "relay")
_BYTE_FIELDS = ("sent_bytes", "recv_bytes", "sent_inter_bytes", "recv_inter_bytes")


class PhaseClock:
    """Wall and CPU seconds per phase of one step: :meth:`lap` charges the time
    since the previous lap (or the start) to a phase.

    Attributes:
        times: ``{phase: seconds}``, every phase of ``phases`` starting at 0.
        cpu: ``{phase: CPU seconds}`` of this process (all its threads), the same way.
        began: ``time.perf_counter()`` at the start.
    """

    def __init__(self, phases):
        self.times = dict.fromkeys(phases, 0.0)
        self.cpu = dict.fromkeys(phases, 0.0)
        self.began = self._clock = time.perf_counter()
        self._cpu_clock = time.process_time()

    def lap(self, phase) -> None:
        """Charge the seconds since the previous lap to ``phase``."""
        now, cpu = time.perf_counter(), time.process_time()
        self.times[phase] += now - self._clock
        self.cpu[phase] += cpu - self._cpu_clock
        self._clock, self._cpu_clock = now, cpu


class Computed:
    """One worker's forward/backward result, gradients scaled for the global batch.

    Attributes:
        loss: the local batch's mean loss.
        local_batch: samples in this worker's shard.
        sparse: ``{name: (indices, values)}`` scaled.
        dense: ``{name: gradient}`` scaled (summed over the workers: the mean
            over the global batch).
        dense_local: ``{name: gradient}`` unscaled (the mean over the local
            batch).
    """

    def __init__(self, loss, local_batch, sparse, dense, dense_local):
        self.loss, self.local_batch = loss, local_batch
        self.sparse, self.dense, self.dense_local = sparse, dense, dense_local


def compute_step(trainer, rows, batch, position, step, clock) -> Computed:
    """Forward/backward of ``batch`` and the straggler delay, charged to ``compute``.

    Each worker's gradients are scaled by ``local batch x workers / global
    batch``: summed (or averaged) over the workers they are the mean over
    the global batch even for uneven (balanced) shards; exactly 1 for even
    ones. Local (not collective).
    """
    result = trainer.compute.forward_backward(trainer.dense, rows, batch, position)
    local_batch = len(next(iter(batch.values())))
    scale = local_batch * trainer.topology.num_workers / trainer.config["global_batch"]
    clock.lap("compute")
    trainer.stragglers.delay(step, clock.times["compute"])
    clock.lap("compute")
    sparse = {name: (indices, values * scale if scale != 1 else values)
              for name, (indices, values) in result.sparse_grads.items()}
    dense = {name: g * scale if scale != 1 else g for name, g in result.dense_grads.items()}
    return Computed(result.loss, local_batch, sparse, dense, result.dense_grads)


def reduce_step(topology, loss, local_batch, times, flag, cpu_seconds=0.0,
                cpu_times=None) -> tuple:
    """``(mean loss, any flag, mean phase seconds, cumulative bytes, CPU seconds per
    worker, CPU seconds per phase summed over the workers)``.

    **Collective** over the workers: one ``Allreduce`` of a small vector.
    The cumulative bytes are one flat vector, every phase's fields of
    :data:`BYTE_PHASES` then the owners' counters
    (:data:`~hpcpax.comm.accounting.OWNER_FIELDS`); :func:`step_record`
    reads it. ``cpu_seconds``: this worker's CPU time in the step (all its
    threads), returned for every worker in worker order. ``cpu_times``:
    this worker's CPU seconds per phase (:attr:`PhaseClock.cpu`; None: 0).
    """
    from ..comm.reductions import start_sum_in_place

    acct = topology.accounting
    n = topology.num_workers
    cpu = [0.0] * n
    cpu[topology.worker_index] = float(cpu_seconds)
    vector = [loss * local_batch, local_batch, float(flag)] + cpu
    vector += [times[p] for p in TIME_PHASES]
    vector += [float((cpu_times or {}).get(p, 0.0)) for p in TIME_PHASES]
    for phase in BYTE_PHASES:
        entry = acct.phase(phase)
        vector += [float(entry[f]) for f in _BYTE_FIELDS]
    vector += [float(acct.owner[f]) for f in OWNER_FIELDS]
    vector = np.array(vector, np.float64)
    wait([start_sum_in_place(topology.workers, vector)])
    k, head = len(TIME_PHASES), 3 + n
    mean_times = {p: vector[head + i] / n for i, p in enumerate(TIME_PHASES)}
    cpu_phases = {p: vector[head + k + i] for i, p in enumerate(TIME_PHASES)}
    return (vector[0] / vector[1], vector[2] > 0, mean_times, vector[head + 2 * k:],
            vector[3:head].tolist(), cpu_phases)


def step_record(step, loss, seconds, global_batch, times, delta, cpu_seconds=None,
                dilation=1.0, cpu_phases=None) -> dict:
    """The ``metrics.jsonl`` line of one step (``delta``: this step's bytes, as
    :func:`reduce_step` returns them).

    ``dilation``: the run's time dilation ``D`` (:mod:`hpcpax.app.emulation`):
    step and phase seconds and samples/s are reported undilated (divided by
    ``D``), CPU seconds and ``cpu_busy`` as measured.

    ``cpu_seconds``: each worker's CPU seconds in the step (worker order), with
    ``cpu_busy`` (CPU seconds over the step's wall seconds, per worker): a
    worker near 1 computes or spins, one near 0 waits without holding a core.
    ``cpu_phases``: per phase, the CPU seconds of all workers together
    (``cpu_by_phase``, as measured, not divided by ``D``): beside the
    phase's wall seconds x cores it shows when the workers' CPU work in one
    phase outgrows the host's cores.

    ``bytes``: per phase, what the workers sent and received (``_inter``: to
    or from another node). ``owner`` (only when parameter-server owners moved
    rows): the owners' egress and ingress row bytes, each also off-node
    (:meth:`~hpcpax.comm.accounting.Accounting.record_owner`).
    """
    per_phase = delta[:len(BYTE_PHASES) * len(_BYTE_FIELDS)].reshape(len(BYTE_PHASES), -1)
    owner = delta[len(BYTE_PHASES) * len(_BYTE_FIELDS):]
    real = seconds
    if dilation != 1.0:
        seconds, times = seconds / dilation, {k: v / dilation for k, v in times.items()}
    record = {
        "step": step, "loss": loss, "samples_per_s": global_batch / seconds, "seconds": seconds,
        "time": times,
        "bytes": {phase: {f.replace("_bytes", ""): int(per_phase[i, j])
                          for j, f in enumerate(_BYTE_FIELDS)}
                  for i, phase in enumerate(BYTE_PHASES) if per_phase[i].any()},
    }
    if owner.any():
        record["owner"] = {f: int(v) for f, v in zip(OWNER_FIELDS, owner)}
    if cpu_seconds is not None:
        record["cpu_seconds"] = [round(c, 6) for c in cpu_seconds]
        record["cpu_busy"] = [round(c / real, 4) for c in cpu_seconds]
    if cpu_phases is not None:
        record["cpu_by_phase"] = {p: round(c, 6) for p, c in cpu_phases.items()}
    return record


def summarize(topology, losses, *, start_step, last, steady, train_seconds, wall,
              checkpoints, preempted, signal, cpu_seconds=0.0) -> dict:
    """The run's ``summary.json`` (first worker) from every rank's accounting.

    **Collective** over every rank (the accounting reduce, and a gather of
    each rank's ``cpu_seconds`` over the run's ``wall`` seconds: ``cpu_busy``
    per world rank, servers included). ``steady`` is
    :func:`~hpcpax.app.throughput.steady_throughput`'s result (first worker).
    """
    totals = topology.accounting.reduce(topology.comm)
    cpu = topology.comm.allgather(round(float(cpu_seconds), 3))
    steps_run = max(0, last - start_step + 1)
    return {
        "steps": last, "steps_run": steps_run, "start_step": start_step,
        "first_loss": losses[0] if losses else None,
        "final_loss": losses[-1] if losses else None,
        # steady state (warm-up and plan changes left out): see "throughput"
        "mean_samples_per_s": steady["samples_per_s"] if steady else None,
        "throughput": steady,
        "wall_seconds": wall, "train_seconds": train_seconds,
        "checkpoint_seconds": checkpoints.seconds,
        "preempted": preempted, "signal": signal,
        "last_checkpoint": checkpoints.last,
        "topology": topology.describe(),
        "phases": totals["phases"], "total": totals["total"],
        "owner": totals.get("owner"),
        "cpu_seconds": cpu,
        "cpu_busy": [round(c / wall, 4) if wall > 0 else None for c in cpu],
    }


def summary_line(summary, run_dir) -> str:
    """The one line the first worker prints at the end of a run."""
    first, final = summary["first_loss"], summary["final_loss"]
    return (f"hpcpax.train: {summary['steps_run']} steps in {summary['wall_seconds']:.1f} s"
            + (f", loss {first:.4f} -> {final:.4f}" if first is not None else "")
            + (f", {summary['mean_samples_per_s']:,.0f} samples/s"
               if summary["mean_samples_per_s"] else "")
            + (f" (preempted by {summary['signal']})" if summary["preempted"] else "")
            + f"; outputs in {run_dir}")
