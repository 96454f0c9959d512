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
  polling meanwhile (large when ranks outnumber free cores).

:func:`time_workers` times a callable on every worker at once while the
servers wait in a collective, as they do during training (MPICH's waiting
ranks poll, so they compete for the cores): that is how a model's compute
time per step is measured under the same oversubscription as the run.
"""

from __future__ import annotations

import time

import numpy as np

__all__ = ["calibrate", "evict_caches", "fit_relative", "private_cache_bytes", "measure_allreduce", "measure_handoff", "measure_operations",
           "time_workers"]

#: Stage lengths (seconds of local work) at which the hand-off cost is timed.
HANDOFF_WORK_S = (0.0, 300e-6, 1500e-6)

#: ``Allreduce`` sizes: from the step's small figures to a few MiB (densified tables
#: and dense buckets are that large; a fit from small sizes alone misses the cache
#: and memory-bandwidth limits of big ones).
ALLREDUCE_SIZES = (256, 64 << 10, 1 << 20, 8 << 20)


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
                      fresh: bool = False) -> dict | None:
    """``{"latency_s", "bandwidth_Bps"}`` of ``Allreduce`` over ``comm``; **collective**.

    Each size is timed ``repeats`` times (the slowest rank's time, after a
    barrier), sizes interleaved; the medians are fitted by :func:`fit_relative`.
    ``fresh``: each call reduces a buffer allocated (``np.zeros``) just
    before it, as a densified table is (its pages are faulted in inside the
    ``Allreduce``, several times slower on some hosts); else buffers reused.
    """
    from mpi4py import MPI

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
            if fresh:
                buf = np.zeros(size // 4, np.float32)
            comm.Allreduce(MPI.IN_PLACE, buf)
            seconds[size].append(comm.allreduce(time.perf_counter() - start, op=MPI.MAX))
    latency, bandwidth = comm.bcast(
        fit_relative(list(sizes), [float(np.median(seconds[s])) for s in sizes]), root=0)
    return {"latency_s": latency, "bandwidth_Bps": bandwidth}


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


def time_workers(topology, call, repeats: int = 5, warmup: int = 1,
                 between=None) -> float:
    """Median seconds of ``call()`` on the workers, all at once; **collective**.

    Servers wait in a barrier meanwhile. ``between()``, when given, runs
    before each timed call, untimed (e.g. :func:`evict_caches`: in a step
    the pull and push move other data between two computes). Every rank
    returns the median over workers of each worker's median.
    """
    comm = topology.comm
    mine = None
    if topology.is_worker:
        for _ in range(warmup):
            call()
        topology.workers.Barrier()
        times = []
        for _ in range(repeats):
            if between is not None:
                between()
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        mine = float(np.median(times))
    comm.Barrier()
    values = [v for v in comm.allgather(mine) if v is not None]
    return float(np.median(values))


_EVICT = {}


def private_cache_bytes(cpu: int = 0) -> int:
    """Bytes of the largest cache private to one core (Linux sysfs; 2 MiB if unknown)."""
    import glob
    import os

    best = 0
    for index in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/cache/index*"):
        try:
            with open(os.path.join(index, "shared_cpu_list"), encoding="ascii") as handle:
                shared = handle.read().strip()
            with open(os.path.join(index, "size"), encoding="ascii") as handle:
                size = handle.read().strip()
        except OSError:
            continue
        if "," in shared or "-" in shared:
            continue  # shared between cores
        units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
        best = max(best, int(size[:-1]) * units[size[-1]] if size[-1] in units else int(size))
    return best or (2 << 20)


def evict_caches(nbytes: int | None = None) -> None:
    """Write ``nbytes`` of scratch memory (default 4 x :func:`private_cache_bytes`),
    pushing other data out of the core's private caches, as a step's pull and push
    do between two computes. Local."""
    nbytes = int(nbytes or 4 * private_cache_bytes())
    buf = _EVICT.get(nbytes)
    if buf is None:
        buf = _EVICT[nbytes] = np.zeros(nbytes // 8, np.float64)
    buf += 1.0


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
    for key, fresh in (("allreduce", False), ("allreduce_fresh", True)):
        measured = measure_allreduce(topology.workers, fresh=fresh) if topology.is_worker \
            else None
        measured = comm.bcast(measured, root=topology.worker_ranks[0])
        if measured is not None and one_host:
            fabric[key] = measured
    handoff = measure_handoff(comm)
    comm.Barrier()
    mine = measure_kernel_rates(dim=dim, cache=False)
    everyone = comm.allgather(mine)
    kernels = {name: {key: float(np.median([r[name][key] for r in everyone]))
                      for key in ("call_s", "unit_s")} for name in mine}
    comm.Barrier()
    software = measure_operations(topology)
    return {"fabric": fabric, "kernels": kernels, "handoff": handoff, "software": software,
            "software_scope": "job", "one_host": bool(one_host)}


def _thread_limits():
    """This rank's BLAS and Numba thread settings (to restore them later)."""
    from ..ops import _numba

    blas = None
    try:
        from threadpoolctl import threadpool_info  # noqa: PLC0415

        blas = [p["num_threads"] for p in threadpool_info() if p.get("user_api") == "blas"]
    except ImportError:
        pass
    return _numba._DEFAULT_THREADS, blas


def _restore_thread_limits(saved):
    """Undo a one-rank world's thread limits: a one-rank ``hpcpax.init`` gives this rank
    every core, and a job with more ranks than cores then computes many times slower."""
    from ..ops import _numba

    numba_threads, blas = saved
    _numba._DEFAULT_THREADS = numba_threads
    if blas:
        from threadpoolctl import threadpool_limits  # noqa: PLC0415

        threadpool_limits(limits=min(blas), user_api="blas")


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

    saved = _thread_limits()
    topo = hpcpax.init(None, 0, comm=MPI.COMM_SELF)  # (it sets this rank's thread limits)
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
        _restore_thread_limits(saved)
    out = {}
    for name, ((k0, t0), (k1, t1)) in points.items():
        per = max((t1 - t0) / (k1 - k0), 0.0)
        out[name] = {"call_s": max(t0 - per * k0, 0.0), "per_variable_s": per}
    return out


def measure_operations(topology, counts=(1, 8), repeats: int = 15, dim: int = 16) -> dict:
    """hpcpax's fixed seconds per operation on this job's ranks; **collective**.

    Like :func:`measure_software`, but each operation runs on ``topology``
    itself (servers serving, every worker calling), with 4 rows per table,
    so what remains is the operation's fixed cost as a step pays it: the
    Python/NumPy path on every rank *and* its collectives' latencies with
    this job's ranks on this machine's cores (an oversubscribed host makes
    every collective wait for descheduled ranks). The operations run one
    after the other, as in a step, without a barrier between them, so each
    also holds the hand-off from the one before; the ``k`` values are
    interleaved, so both see the same load; each worker keeps its median,
    and the mean over workers is kept (the trainer reports phase times as
    means over workers). Fitted per operation to ``call_s + per_variable_s * k``.
    Operations: ``ps_pull``, ``ps_push`` (with local aggregation, and
    ``*_no_aggregation`` without; the same where a node has one worker),
    ``allgather_push``, ``dense_allreduce`` and ``control`` (the trainer's
    per-step figures ``Allreduce``, see
    :data:`hpcpax.plan.step_model.REDUCE_STEP_BYTES`).
    """
    from mpi4py import MPI

    from ..comm.allreduce import DenseAllreduce
    from ..ps.server import ParameterServer, SparseVariableSpec
    from ..ps.sparse_grad import SparseGrad
    from ..sync.replicated import ReplicatedTable, push_many
    from .step_model import REDUCE_STEP_BYTES

    comm = topology.comm
    rows = 64 * max(1, comm.Get_size())
    # 4 ids spread over the table, so every owner gets a request (as in a real step)
    ids = (np.arange(4, dtype=np.int64) * (rows // 4) + max(0, topology.worker_index)) % rows
    values = np.ones((4, dim), np.float32)
    specs = [SparseVariableSpec(f"calibrate_{i}", rows=rows, dim=dim) for i in range(max(counts))]
    keys = [s.name for s in specs]
    ps = ParameterServer(topology)
    if not topology.is_worker:
        ps.serve()  # the register, the pulls and pushes, until the shutdown
        return comm.bcast(None, root=topology.worker_ranks[0])
    ps.register(specs)

    def pull(names):
        return lambda: ps.pull_unique_many({n: ids for n in names})

    def push(names):
        return lambda: ps.push_many({n: SparseGrad(ids, values, rows) for n in names})

    def set_aggregation(enabled):
        return lambda: [ps.set_local_aggregation(n, enabled) for n in keys]

    tables = {s.name: ReplicatedTable(topology, s, "allgather") for s in specs}
    engines = {k: DenseAllreduce(topology, {f"w{i}": ((16,), np.float32) for i in range(k)})
               for k in counts}
    grads = {f"w{i}": np.ones(16, np.float32) for i in range(max(counts))}
    vector = np.zeros(REDUCE_STEP_BYTES // 8, np.float64)
    # (operation, setup before it, call for k tables)
    operations = [
        ("ps_pull", set_aggregation(True), lambda k: pull(keys[:k])),
        ("ps_push", None, lambda k: push(keys[:k])),
        ("ps_pull_no_aggregation", set_aggregation(False), lambda k: pull(keys[:k])),
        ("ps_push_no_aggregation", None, lambda k: push(keys[:k])),
        ("allgather_push", None, lambda k: lambda: push_many(
            {n: tables[n] for n in keys[:k]},
            {n: SparseGrad(ids, values, rows) for n in keys[:k]})),
        ("dense_allreduce", None, lambda k: lambda: engines[k].allreduce(
            {f"w{i}": grads[f"w{i}"] for i in range(k)})),
        ("control", None, lambda k: lambda: topology.workers.Allreduce(MPI.IN_PLACE, vector)),
    ]
    times = {(name, k): [] for name, _, _ in operations for k in counts}
    calls = {(name, k): make(k) for name, _, make in operations for k in counts}
    topology.workers.Barrier()
    for repeat in range(repeats + 1):  # the first is a warm-up
        for k in counts:
            # one after the other as in a step (no barrier): each call pays the
            # hand-off from the one before, with ranks arriving as they come
            for name, setup, _ in operations:
                if setup is not None:
                    setup()
                start = time.perf_counter()
                calls[(name, k)]()
                if repeat:
                    times[(name, k)].append(time.perf_counter() - start)
    ps.shutdown()
    mine = {key: float(np.median(v)) for key, v in times.items()}
    means = topology.workers.allreduce(mine, op=_sum_dicts)
    n = topology.workers.Get_size()
    out = {}
    k0, k1 = counts[0], counts[-1]
    for name, _, _ in operations:
        t0, t1 = means[(name, k0)] / n, means[(name, k1)] / n
        per = max((t1 - t0) / (k1 - k0), 0.0) if name != "control" else 0.0
        out[name] = {"call_s": max(t0 - per * k0, 0.0), "per_variable_s": per}
    return comm.bcast(out, root=topology.worker_ranks[0])


def _sum_dicts(a, b, _datatype=None):
    return {key: a[key] + b[key] for key in a}
