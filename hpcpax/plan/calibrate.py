"""Measure the cost model's constants on the machine, with every rank busy.

**Collective** (this is the planner's measuring side, like the fabric
measurement; the pure modules never import MPI). :func:`calibrate` returns
the facts the model needs, each measured here and now:

* the fabric (:func:`hpcpax.comm.fabric.measure_fabric`: alpha-beta of the
  links inside and between (virtual) nodes, fusion size), with
  ``duplex``/``shared_nic`` false when every rank sits on one host (the
  "links" are then copies through one host's memory, done by its cores);
* ``Allreduce`` over the workers as its own alpha-beta class (on one host
  MPICH runs a shared-memory algorithm that no link formula describes);
* kernel rates (:mod:`hpcpax.plan.kernel_rates`), timed on every rank at
  once, so that with more ranks than cores the rates are the ones a step
  sees (the median over ranks is kept);
* hpcpax's own host overhead per operation (:func:`measure_software`:
  the Python/NumPy path of a PS pull or push, an allgather push, a dense
  allreduce, on a one-rank world with a few rows);
* the hand-off cost (:func:`measure_handoff`): what each stage of local
  work costs beyond itself when the next collective needs ranks that sat
  polling meanwhile (large when ranks outnumber free cores).

:func:`time_workers` times a callable on every worker at once while the
servers wait in a collective, as they do during training (MPICH's waiting
ranks poll, so they compete for the cores): that is how a model's compute
time per step is measured under the same oversubscription as the run.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["calibrate", "measure_allreduce", "measure_handoff", "time_workers"]

#: Stage lengths (seconds of local work) at which the hand-off cost is timed.
HANDOFF_WORK_S = (0.0, 300e-6, 1500e-6)

ALLREDUCE_SIZES = (256, 64 << 10, 256 << 10)


def measure_allreduce(comm, sizes=ALLREDUCE_SIZES, repeats: int = 15) -> dict | None:
    """``{"latency_s", "bandwidth_Bps"}`` of ``Allreduce`` over ``comm``; **collective**.

    Each size is timed ``repeats`` times (the slowest rank's time, after a
    barrier), sizes interleaved; the medians are fitted like a link.
    """
    from mpi4py import MPI

    from ..comm.fabric import fit_link_model

    if comm is None or comm.Get_size() < 2:
        return None
    buffers = [np.zeros(size // 4, np.float32) for size in sizes]
    for buf in buffers:
        comm.Allreduce(MPI.IN_PLACE, buf)
    seconds = {size: [] for size in sizes}
    for _ in range(repeats):
        for size, buf in zip(sizes, buffers):
            comm.Barrier()
            start = time.perf_counter()
            comm.Allreduce(MPI.IN_PLACE, buf)
            seconds[size].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    model = fit_link_model(list(sizes), [float(np.median(seconds[s])) for s in sizes])
    model = comm.bcast(model, root=0)
    return {"latency_s": model.latency_s, "bandwidth_Bps": model.bandwidth_Bps}


def measure_handoff(comm, work_s=HANDOFF_WORK_S, repeats: int = 60) -> dict:
    """What a step pays each time local work hands over to a collective; **collective**.

    One rank keeps its core busy for ``w`` seconds while the others wait in
    an ``Allgather``, and the next round another rank works, as servers wait
    while workers compute and the reverse;
    the mean extra time beyond ``w`` and the bare ``Allgather`` is fitted to
    ``extra = handoff_s + handoff_per_work * w``. With no more ranks than
    free cores both are near 0; with more, a waiting rank that MPI keeps
    polling holds a core the working rank needs, and the extra grows with
    the work (means, not medians: the delays are what a step pays).
    """
    from mpi4py import MPI

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
            comm.Allgather(mine, everyone)
            if i >= 5:
                times.append(time.perf_counter() - start)
        means.append(comm.allreduce(float(np.mean(times)), op=MPI.MAX))
    extra = np.array(means) - np.array(work_s) - means[0]
    slope, intercept = np.polyfit(np.array(work_s[1:]), extra[1:], 1)
    result = {"handoff_s": max(float(intercept), 0.0), "handoff_per_work": max(float(slope), 0.0)}
    return comm.bcast(result, root=0)


def time_workers(topology, call, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of ``call()`` on the workers, all at once; **collective**.

    Servers wait in a barrier meanwhile. Every rank returns the median over
    workers of each worker's median.
    """
    comm = topology.comm
    mine = None
    if topology.is_worker:
        for _ in range(warmup):
            call()
        topology.workers.Barrier()
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        mine = float(np.median(times))
    comm.Barrier()
    values = [v for v in comm.allgather(mine) if v is not None]
    return float(np.median(values))


def calibrate(topology, fabric_seconds: float = 1.0, dim: int = 64) -> dict:
    """The model's measured constants for this job; **collective** over ``topology.comm``.

    Returns ``{"fabric": dict for Links.from_fabric, "kernels": {...},
    "one_host": bool}``, the same on every rank.
    """
    from mpi4py import MPI

    from ..comm.fabric import measure_fabric
    from .kernel_rates import measure_kernel_rates

    comm = topology.comm
    shared = comm.Split_type(MPI.COMM_TYPE_SHARED)
    one_host = comm.allreduce(shared.Get_size(), op=MPI.MIN) == comm.Get_size()
    shared.Free()
    fabric = measure_fabric(topology, budget_s=fabric_seconds).to_dict()
    fabric.update(duplex=not one_host, shared_nic=not one_host)
    measured = measure_allreduce(topology.workers) if topology.is_worker else None
    measured = comm.bcast(measured, root=topology.worker_ranks[0])
    if measured is not None and one_host:
        fabric["allreduce"] = measured
    handoff = measure_handoff(comm)
    comm.Barrier()
    mine = measure_kernel_rates(dim=dim, cache=False)
    everyone = comm.allgather(mine)
    kernels = {name: {key: float(np.median([r[name][key] for r in everyone]))
                      for key in ("call_s", "unit_s")} for name in mine}
    comm.Barrier()
    mine = measure_software()
    everyone = comm.allgather(mine)
    software = {name: {key: float(np.median([r[name][key] for r in everyone]))
                       for key in ("call_s", "per_variable_s")} for name in mine}
    return {"fabric": fabric, "kernels": kernels, "handoff": handoff, "software": software,
            "one_host": bool(one_host)}


def _per_op(call, repeats):
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


def measure_software(counts=(1, 8), repeats: int = 30, dim: int = 16) -> dict:
    """hpcpax's own per-operation host overhead, without communication.

    Not collective: runs a one-rank world on ``MPI.COMM_SELF`` in this
    process (call it on every rank at once to include the load). Each
    operation moves a few rows of ``k`` tables (``k`` in ``counts``) so
    that only its fixed Python/NumPy path remains; fitted per operation to
    ``call_s + per_variable_s * k``:

    * ``ps_pull``, ``ps_push``: :meth:`ParameterServer.pull_unique_many` /
      :meth:`~hpcpax.ps.server.ParameterServer.push_many`;
    * ``allgather_push``: :func:`hpcpax.sync.replicated.push_many`;
    * ``dense_allreduce``: :meth:`DenseAllreduce.allreduce` (per tensor).
    """
    from mpi4py import MPI

    import hpcpax
    from ..comm.allreduce import DenseAllreduce
    from ..ps.server import ParameterServer, SparseVariableSpec
    from ..ps.sparse_grad import SparseGrad
    from ..sync.replicated import ReplicatedTable, push_many

    topo = hpcpax.init(None, 0, comm=MPI.COMM_SELF)
    try:
        ids = np.arange(4, dtype=np.int64)
        values = np.ones((4, dim), np.float32)
        points = {name: [] for name in ("ps_pull", "ps_push", "allgather_push",
                                        "dense_allreduce")}
        for k in counts:
            specs = [SparseVariableSpec(f"t{k}_{i}", rows=64, dim=dim) for i in range(k)]
            ps = ParameterServer(topo)
            ps.register(specs)
            names = [s.name for s in specs]
            points["ps_pull"].append((k, _per_op(
                lambda: ps.pull_unique_many({n: ids for n in names}), repeats)))
            points["ps_push"].append((k, _per_op(
                lambda: ps.push_many({n: SparseGrad(ids, values, 64) for n in names}), repeats)))
            tables = {s.name: ReplicatedTable(topo, s, "allgather") for s in specs}
            points["allgather_push"].append((k, _per_op(
                lambda: push_many(tables, {n: SparseGrad(ids, values, 64) for n in names}),
                repeats)))
            tensors = {f"w{i}": ((16,), np.float32) for i in range(k)}
            engine = DenseAllreduce(topo, tensors)
            grads = {n: np.ones(16, np.float32) for n in tensors}
            points["dense_allreduce"].append((k, _per_op(lambda: engine.allreduce(grads),
                                                         repeats)))
            ps.shutdown()
    finally:
        topo.free()
    out = {}
    for name, ((k0, t0), (k1, t1)) in points.items():
        per = max((t1 - t0) / (k1 - k0), 0.0)
        out[name] = {"call_s": max(t0 - per * k0, 0.0), "per_variable_s": per}
    return out
