"""Parallax's partition search, run live inside the job.

Parallax relaunched its whole job for every trial partition count; here the
table is repartitioned in place (:meth:`hpcpax.ps.server.ParameterServer.repartition`
moves every row with its optimizer state to its new owner, exactly), a few
steps are timed, and :func:`~hpcpax.plan.partition_search.search_partitions`
decides where to go next.

**Collective** over the workers (servers follow inside ``serve()``): every
worker must call :func:`search_partitions_live` with the same arguments, and
the measured time is the slowest worker's, so all workers take the same
decisions.
"""

from __future__ import annotations

import time

import numpy as np

from ..plan.partition_search import SearchResult, search_partitions

__all__ = ["search_partitions_live", "time_steps"]


def time_steps(topology, step_fn, first_step: int, steps: int, warmup: int) -> float:
    """Median seconds of ``steps`` calls of ``step_fn`` after ``warmup`` calls.

    **Collective** over ``topology.workers``: each step's time is the
    slowest worker's (``MAX``), so every worker returns the same number.
    """
    from ..comm.reductions import largest

    comm = topology.workers
    times = []
    for k in range(warmup + steps):
        comm.Barrier()
        start = time.perf_counter()
        step_fn(first_step + k)
        elapsed = largest(comm, time.perf_counter() - start)
        if k >= warmup:
            times.append(elapsed)
    return float(np.median(times))


def search_partitions_live(ps, name: str, step_fn, *, first_step: int = 0, steps: int = 3,
                           warmup: int = 1, p0: int | None = None, p_max: int = 64,
                           max_measurements: int = 8) -> tuple[SearchResult, int]:
    """Search the partition count of ``name`` by timing real steps.

    Args:
        ps: the :class:`~hpcpax.ps.server.ParameterServer` holding ``name``.
        name: a sparse variable on the PS.
        step_fn: ``step_fn(step)`` runs one training step (collective on the
            workers; it may update parameters: the search is part of training).
        first_step: step number of the first call.
        steps, warmup: timed and untimed steps per candidate.
        p0: first candidate; default the number of owner ranks.
        p_max: largest candidate (capped at the variable's rows).
        max_measurements: candidates tried at most.

    Returns:
        ``(result, next_step)``: the search result (its ``chosen`` count is
        in place when this returns) and the next step number.
    """
    topo = ps.topology
    var = ps.variables[name]
    p0 = p0 or len(topo.owner_ranks)
    p_max = int(min(p_max, var.spec.rows))
    state = {"step": first_step}

    def measure(partitions):
        ps.repartition(name, partitions)
        seconds = time_steps(topo, step_fn, state["step"], steps, warmup)
        state["step"] += steps + warmup
        return seconds

    result = search_partitions(measure, p0=p0, p_max=p_max, max_measurements=max_measurements)
    if var.layout.num_partitions != result.chosen:
        ps.repartition(name, result.chosen)
    return result, state["step"]
