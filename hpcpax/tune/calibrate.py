"""Measure the cost model's constants on the machine, with every rank busy.

**Collective** (this is the planner's measuring side, like the fabric
measurement; the pure modules never import MPI). :func:`calibrate` returns
the facts the model needs, each measured here and now:

* the fabric (:func:`hpcpax.comm.fabric.measure_fabric`: alpha-beta of the
  links inside and between (virtual) nodes, fusion size), with
  ``duplex``/``shared_nic`` false when every rank sits on one host (the
  "links" are then copies through one host's memory, done by its cores);
* ``Allreduce`` over the workers as its own alpha-beta class (on one host
  MPICH runs a shared-memory algorithm that no link formula describes), on
  reused buffers and on fresh ones (a densified table is a fresh buffer);
* kernel rates (:mod:`hpcpax.plan.kernel_rates`), timed on every rank at
  once, so that with more ranks than cores the rates are the ones a step
  sees (the median over ranks is kept);
* hpcpax's own fixed cost per operation (:func:`measure_operations`: a
  PS pull or push, an allgather push, a dense allreduce, the step's figures
  ``Allreduce``, each with a few rows on this job's own ranks, so that the
  collectives' latencies under this job's load are in it;
  :func:`measure_software` is the same path on a one-rank world);
* the hand-off cost (:func:`measure_handoff`): what each stage of local
  work costs beyond itself when the next collective needs ranks that sat
  polling meanwhile (large when ranks outnumber free cores), and what the
  workers' local work, all at once, costs the collective after it
  (:func:`measure_after_work`: with more busy ranks than cores the workers
  take turns, and the collective waits for the turns).

The model's own work per step (data, compute, optimizer) is not timed
here: it comes from real steps of the trainer (a run record's phases,
``benchmarks/cost_model_check.py``'s trial run), where the caches and the
allocator are as a step leaves them.
"""

from __future__ import annotations

import time

import numpy as np

from ..comm.polling import idle_barrier
from .operation_costs import measure_operations, measure_software

__all__ = ["calibrate", "cost_params", "fit_relative", "measure_after_work", "measure_allreduce",
           "measure_handoff", "measure_operations", "measure_software"]

#: Stage lengths (seconds of local work) at which the hand-off cost is timed.
HANDOFF_WORK_S = (0.0, 300e-6, 1500e-6)

#: ``Allreduce`` sizes: from the step's small figures to 16 MiB (densified tables
#: and dense buckets are that large; a fit from small sizes alone misses the cache
#: and memory-bandwidth limits of big ones). With 8 MiB the largest, a 12.8 MB
#: fresh ``Allreduce`` on 3 workers here was predicted 10.2-21.2 ms over 5
#: calibrations (direct: 15.5-23.1 ms); with 16 MiB added, 17.7-21.6 ms.
ALLREDUCE_SIZES = (256, 64 << 10, 1 << 20, 8 << 20, 16 << 20)
#: Seconds each of the two Allreduce measurements of :func:`calibrate` may take.
ALLREDUCE_BUDGET_S = 1.0
#: Seconds :func:`calibrate`'s measurement of the operations' fixed costs may take.
OPERATIONS_BUDGET_S = 3.0


def fit_relative(sizes, seconds) -> tuple:
    """``(latency_s, bandwidth_Bps)`` of ``seconds ~ latency + size / bandwidth``,
    least squares on *relative* residuals (each point weighted by ``1 / seconds``).

    Over sizes that span decades, plain least squares lets the largest size's
    noise set the intercept; relative residuals keep the small sizes' latency.
    Latency is clamped at 0; a non-positive slope falls back to the largest
    size over its time. Not collective.
    """
    sizes = np.asarray(sizes, np.float64)
    seconds = np.asarray(seconds, np.float64)
    if sizes.shape != seconds.shape or sizes.size < 2:
        raise ValueError(f"sizes and seconds must be equal-length with >= 2 points, not "
                         f"{sizes.shape} and {seconds.shape}")
    weight = 1.0 / np.maximum(seconds, 1e-12)
    design = np.stack([np.ones_like(sizes), sizes], axis=1) * weight[:, None]
    (latency, per_byte), *_ = np.linalg.lstsq(design, seconds * weight, rcond=None)
    if latency < 0:  # refit through the origin
        latency = 0.0
        per_byte = float(np.sum(sizes * seconds * weight ** 2) / np.sum((sizes * weight) ** 2))
    if not per_byte > 0:
        big = int(np.argmax(sizes))
        per_byte = seconds[big] / max(sizes[big], 1.0)
    return float(latency), float(1.0 / per_byte)


def measure_allreduce(comm, sizes=ALLREDUCE_SIZES, repeats: int = 9,
                      fresh: bool = False, budget_s: float | None = None) -> dict | None:
    """``{"latency_s", "bandwidth_Bps", "sizes"}`` of ``Allreduce`` over ``comm`` (``sizes``:
    the sizes timed); **collective**.

    Each size is timed ``repeats`` times in a row (the slowest rank's time,
    after a barrier), after one untimed call of that size, as a step calls
    the same sizes step after step; the medians are fitted by
    :func:`fit_relative`. ``fresh``: each call reduces a buffer allocated
    (``np.zeros``) just before it and freed after it, as a densified table
    is; else one buffer per size, reused. Interleaving the sizes instead
    (256 B, 64 KiB, 1 MiB, 8 MiB, 256 B, ...) made every fresh call slower
    than a step's: on this VM 2 workers' fits read 43-56 us + 0.86-1.14 GB/s
    interleaved against 7-8 us + 1.8-2.8 GB/s in a row, and a 12.8 MB fresh
    ``Allreduce`` in a row took 4.2-5.1 ms, where the interleaved fit said
    12.8 ms (the allocator's thresholds move with the sizes freed before).

    ``budget_s``: sizes are timed smallest first, and a size whose predicted
    time (from the sizes timed so far) would take the measurement past the
    budget is left out (at least two sizes are always timed). The decision
    uses the slowest rank's times, so every rank takes it alike.
    """
    from ..comm.reductions import largest, sum_in_place

    if comm is None or comm.Get_size() < 2:
        return None
    seconds = {}
    began = time.perf_counter()
    for size in sorted(sizes):
        if budget_s is not None and len(seconds) >= 2:
            latency, bandwidth = fit_relative(list(seconds), list(seconds.values()))
            spent = largest(comm, time.perf_counter() - began)
            if spent + (repeats + 1) * (latency + size / bandwidth) > budget_s:
                break  # every rank breaks here: the same figures (the slowest rank's)
        buf = None if fresh else np.zeros(size // 4, np.float32)
        times = []
        for _ in range(repeats + 1):  # the first call's time is dropped
            comm.Barrier()
            start = time.perf_counter()
            data = np.zeros(size // 4, np.float32) if fresh else buf
            sum_in_place(comm, data)
            times.append(largest(comm, time.perf_counter() - start))
            del data  # freed before the next call allocates, as between two steps
        seconds[size] = float(np.median(times[1:]))
    timed = sorted(seconds)
    latency, bandwidth = comm.bcast(
        fit_relative(timed, [seconds[s] for s in timed]), root=0)
    return {"latency_s": latency, "bandwidth_Bps": bandwidth, "sizes": timed}


def measure_handoff(comm, work_s=HANDOFF_WORK_S, repeats: int = 60, topology=None) -> dict:
    """What a step pays each time local work hands over to a collective; **collective**.

    Two patterns, each timed at the stage lengths ``work_s``:

    * ``handoff_s``, ``handoff_per_work``: one rank keeps its core busy for
      ``w`` seconds while the others wait in an ``Allgather``, and the next
      round another rank works, as servers wait while workers compute and
      the reverse; the mean extra time beyond ``w`` and the bare
      ``Allgather`` is fitted to ``extra = handoff_s + handoff_per_work * w``.
      With no more ranks than free cores both are near 0; with more, a
      waiting rank that MPI keeps polling holds a core the working rank
      needs, and the extra grows with the work (means, not medians: the
      delays are what a step pays). With a ``topology``, the ranks wait as
      in training: a server as a serving server waits for the workers' next
      operation (:func:`~hpcpax.ps.protocol.server_wait_cap`), a worker
      inside MPI.
    * ``after_work``: ``{"serving": f, "idle": f}``, see
      :func:`measure_after_work`: every worker does the same CPU work at
      once, then the workers' collective waits ``f`` times that work
      (the ranks that outnumber the cores ran one after the other).
    """
    from ..comm.reductions import largest
    from ..ps.protocol import server_wait, server_wait_cap

    # (a server that serves: the hand-off is charged to the PS's server work)
    cap = (server_wait_cap(topology, idle=False)
           if topology is not None and topology.is_server else 0.0)

    mine = np.zeros(4, np.int64)
    everyone = np.zeros(4 * comm.Get_size(), np.int64)
    scratch = np.random.default_rng(0).random(4096)
    means = []
    for work in work_s:
        comm.Barrier()
        times = []
        for i in range(repeats + 5):
            start = time.perf_counter()
            if comm.Get_rank() == i % comm.Get_size():  # work changes hands, as in a step
                while time.perf_counter() - start < work:
                    scratch.sum()
            server_wait(comm.Iallgather(mine, everyone), cap)
            if i >= 5:
                times.append(time.perf_counter() - start)
        means.append(largest(comm, float(np.mean(times))))
    extra = np.array(means) - np.array(work_s) - means[0]
    slope, intercept = np.polyfit(np.array(work_s[1:]), extra[1:], 1)
    result = {"handoff_s": max(float(intercept), 0.0), "handoff_per_work": max(float(slope), 0.0),
              "after_work": measure_after_work(topology, work_s, repeats)
              if topology is not None else _after_work_on(comm, work_s, repeats)}
    return comm.bcast(result, root=0)


def _cpu_work(workers, seconds: float):
    """A function doing about ``seconds`` of CPU work: the same number of small sums on
    every worker, from the fastest worker's rate (timed on all at once; a rank that
    was descheduled while timing would otherwise get less work than the others).
    Unlike a wall-clock spin, the work does not end early when the rank is
    descheduled. **Collective** over ``workers``."""
    from ..comm.reductions import smallest

    scratch = np.random.default_rng(1).random(2048)
    # at least one call: a rank descheduled right after reading the clock would
    # otherwise leave the loop with no calls (a division by zero on a busy node)
    start, calls = time.perf_counter(), 0
    while calls == 0 or time.perf_counter() - start < 2e-3:
        scratch.sum()
        calls += 1
    per_call = smallest(workers, (time.perf_counter() - start) / calls)
    count = int(round(seconds / per_call))

    def work():
        for _ in range(count):
            scratch.sum()
    return work


def _after_work_factor(workers, work_s, repeats) -> float:
    """Workers' side of :func:`measure_after_work`: the fitted factor, the same on
    every worker."""
    from ..comm.reductions import sum_in_place

    vector = np.zeros(8, np.float64)
    works, waits = [], []
    for seconds in work_s:
        work = _cpu_work(workers, seconds)
        workers.Barrier()
        spent, waited = [], []
        for i in range(repeats + 3):
            start = time.perf_counter()
            work()
            done = time.perf_counter()
            sum_in_place(workers, vector)
            if i >= 3:
                spent.append(done - start)
                waited.append(time.perf_counter() - done)
        works.append(float(np.mean(spent)))
        waits.append(float(np.mean(waited)))
    # the workers' mean own work time (as a step's phase timer sees it) against their
    # mean wait at the collective beyond the bare one; least squares through the origin
    n = workers.Get_size()
    works = np.sum(workers.allgather(works), axis=0) / n
    waits = np.sum(workers.allgather(waits), axis=0) / n
    work, extra = works[1:] - works[0], waits[1:] - waits[0]
    return max(float(np.dot(work, extra) / max(float(np.dot(work, work)), 1e-18)), 0.0)


def _after_work_on(comm, work_s, repeats) -> dict:
    """:func:`measure_after_work` when every rank of ``comm`` is a worker; **collective**."""
    factor = _after_work_factor(comm, work_s, repeats) if comm.Get_size() > 1 else 0.0
    return {"serving": factor, "idle": factor}


def measure_after_work(topology, work_s=HANDOFF_WORK_S, repeats: int = 60) -> dict:
    """What local work on *every* worker at once costs the next collective; **collective**.

    Every worker runs the same CPU work (a fixed count of small sums, so
    a descheduled worker finishes later, as real compute does) of each
    length in ``work_s``, then a small ``Allreduce`` of the workers; the
    mean wait in it beyond the bare ``Allreduce`` is fitted, through the
    origin, to ``factor * w``, ``w`` each worker's own timer of its work
    (what a step's phase timer shows). With more busy ranks than cores the
    ranks run in turns: each worker's own timer shows its work unstretched,
    and the collective after it waits for the others' turns (measured on a
    2-core host: ``factor`` 1.0 with 4 workers, 2.3 with 6, 0 with 2).
    Timed twice, with the servers waiting as in training: ``"serving"``
    (a server that holds tables waits inside MPI, taking a core), and
    ``"idle"`` (every table replicated: an idle server polls on an
    oversubscribed host, :func:`~hpcpax.ps.protocol.server_wait_cap`).
    Returns ``{"serving": factor, "idle": factor}``, the same on every rank.
    """
    from ..comm.reductions import start_allgather
    from ..ps.protocol import server_wait, server_wait_cap

    comm = topology.comm
    if topology.num_workers < 2:  # every rank knows: no collective of workers to wait in
        return {"serving": 0.0, "idle": 0.0}
    if not topology.server_ranks:  # every rank is a worker
        return _after_work_on(topology.workers, work_s, repeats)
    out = {}
    mine = np.zeros(1, np.int64)
    everyone = np.zeros(comm.Get_size(), np.int64)
    for mode, idle in (("serving", False), ("idle", True)):
        factor = None
        if topology.is_worker:
            factor = _after_work_factor(topology.workers, work_s, repeats)
        # the servers wait for the workers' whole timing in one collective, as they
        # wait for the next operation in training; the workers join it at the end
        cap = server_wait_cap(topology, idle=idle) if topology.is_server else 0.0
        server_wait(start_allgather(comm, mine, everyone), cap)
        out[mode] = comm.bcast(factor, root=topology.worker_ranks[0])
    return out


def calibrate(topology, fabric_seconds: float = 1.0, dim: int = 64,
              budget_s: float | None = None) -> dict:
    """The model's measured constants for this job; **collective** over ``topology.comm``.

    ``budget_s`` (None: the defaults, a few seconds): a cap on the timed parts,
    for a run whose length is known (2 % of it, see
    :attr:`~hpcpax.engine.settings.PlanSettings.startup_budget_s`): the fabric
    and the Allreduce get at most a fifth of it each, the operations half,
    each never more than its default.

    Returns ``{"fabric": dict for Links.from_fabric, "kernels": {...},
    "handoff", "software", "software_scope": "job", "partition_overhead_s",
    "partition_overhead_per": "exchange", "one_host": bool, "budgets": the
    seconds each timed part was given}``, the same on
    every rank (the keyword arguments of
    :class:`~hpcpax.plan.cost_model.CostParams` but ``fabric`` and
    ``one_host``).
    """
    from ..comm.fabric import measure_fabric
    from ..comm.reductions import on_one_host
    from ..plan.kernel_rates import measure_kernel_rates

    comm = topology.comm
    one_host = on_one_host(comm)

    def capped(default, share):
        return default if budget_s is None else min(default, share * budget_s)

    budgets = {"fabric_s": capped(fabric_seconds, 0.2),
               "allreduce_s": capped(ALLREDUCE_BUDGET_S, 0.2) if one_host else 0.0,
               "operations_s": capped(OPERATIONS_BUDGET_S, 0.5)}
    fabric = measure_fabric(topology, budget_s=budgets["fabric_s"]).to_dict()
    fabric.update(duplex=not one_host, shared_nic=not one_host)
    # on one host the model's Allreduce figures are measured (the alpha-beta links do
    # not price shared memory's copies); across hosts the fabric's links price it, and
    # nothing is sent for a figure the model would not use
    for key, fresh in (("allreduce", False), ("allreduce_fresh", True)) if one_host else ():
        measured = (measure_allreduce(topology.workers, fresh=fresh,
                                      budget_s=budgets["allreduce_s"])
                    if topology.is_worker else None)
        idle_barrier(comm)  # the servers wait for the workers' timing without spinning
        measured = comm.bcast(measured, root=topology.worker_ranks[0])
        if measured is not None:
            fabric[key] = measured
    handoff = measure_handoff(comm, topology=topology)
    comm.Barrier()
    mine = measure_kernel_rates(dim=dim, cache=False)
    everyone = comm.allgather(mine)
    kernels = {name: {key: float(np.median([r[name][key] for r in everyone]))
                      for key in ("call_s", "unit_s")} for name in mine}
    comm.Barrier()
    software = measure_operations(topology, budget_s=budgets["operations_s"])
    per_partition = software.pop("per_partition")["call_s"]
    return {"fabric": fabric, "kernels": kernels, "handoff": handoff, "software": software,
            "software_scope": "job", "partition_overhead_s": per_partition,
            "partition_overhead_per": "exchange",
            "one_host": bool(one_host), "budgets": budgets}


def cost_params(calibration, source: str = "calibrated in this job"):
    """The :class:`~hpcpax.plan.cost_model.CostParams` of a :func:`calibrate` result
    (its ``fabric`` goes to the model as the links: pass ``calibration["fabric"]``
    where a fabric is asked for). Pure."""
    from ..plan.cost_model import CostParams

    return CostParams(kernels=calibration["kernels"], handoff=calibration["handoff"],
                      software=calibration["software"],
                      software_scope=calibration.get("software_scope", "process"),
                      partition_overhead_s=calibration.get("partition_overhead_s", 0.0),
                      partition_overhead_per=calibration.get("partition_overhead_per",
                                                             "variable"),
                      source=source)
