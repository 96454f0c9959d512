"""hpcpax's fixed cost per operation, measured (the calibration's host-overhead part).

:func:`measure_operations` (**collective**) times each operation a step runs
(a batched PS pull or push with and without local aggregation, an allgather
push, a dense allreduce, the step's figures ``Allreduce``) with a few rows on
the job's own ranks, one after the other as in a step, and the extra cost of
a PS table's partitions; :func:`measure_software` times the same host path
on a one-rank world. Used by :func:`hpcpax.tune.calibrate.calibrate`.
"""

from __future__ import annotations

import time

import numpy as np

from .caches import evict_caches
from ..plan.kernel_rates import median_seconds

__all__ = ["COLD_OPERATIONS", "measure_operations", "measure_software", "per_partition"]

#: partitions of the table whose extra cost per partition is measured
PARTITIONS = 16
#: ids of one call that measures an operation's cost per row (against 16)
ROWS_PER_CALL = 512
#: operations on replicated tables, timed before the PS holds any table
REPLICATED_OPERATIONS = ("allgather_push", "after_allgather_push", "allreduce_push",
                         "after_allreduce_push", "replica_pull")
#: the workers' own collectives, timed alone with the servers idle (``*_idle``: no table
#: on the PS) and serving (tables on the PS), neither after a PS operation
WORKER_COLLECTIVES = ("dense_allreduce", "control")
#: a push's wait in the workers' next collective (after a PS push, the servers' work
#: on it, on their cores, after the workers' part returned; after a replicated push,
#: what it leaves behind on an oversubscribed host), timed as one dense tensor's
#: allreduce right after the push, less that allreduce timed alone in the same
#: servers' state (the value here)
AFTER_PUSH = {"after_ps_push": "dense_allreduce",
              "after_ps_push_no_aggregation": "dense_allreduce",
              "after_allgather_push": "dense_allreduce_idle",
              "after_allreduce_push": "dense_allreduce_idle"}
#: the name of an operation's measurement with the servers idle
IDLE_SUFFIX = "_idle"
#: operations that follow the worker's own work in a step (a pull after the data, a
#: push after the forward/backward), which has pushed the operation's code and data
#: out of the core's caches: each is timed after ``cold`` (default
#: :func:`~hpcpax.tune.caches.evict_caches`). The others
#: (a push's next collective, the step's figures) follow a hpcpax operation directly.
COLD_OPERATIONS = ("ps_pull", "ps_push", "ps_pull_no_aggregation", "ps_push_no_aggregation",
                   "allgather_push", "allreduce_push", "replica_pull")


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
    call()  # warm-up
    return median_seconds(call, repeats)


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
    * ``allreduce_push``: the same for ``allreduce`` (densified) tables;
    * ``replica_pull``: :meth:`ReplicatedTable.pull_unique` of each table
      (the rows of a replicated table read locally);
    * ``dense_allreduce``: :meth:`DenseAllreduce.allreduce` (per tensor).
    """
    from ..comm.allreduce import DenseAllreduce
    from ..comm.topology import init, self_comm
    from ..ps.server import ParameterServer, SparseVariableSpec
    from ..ps.sparse_grad import SparseGrad
    from ..sync.replicated import ReplicatedTable, push_many

    saved = _thread_limits()
    topo = init(None, 0, comm=self_comm())  # (it sets this rank's thread limits)
    try:
        ids = np.arange(4, dtype=np.int64)
        values = np.ones((4, dim), np.float32)
        points = {name: [] for name in ("ps_pull", "ps_push", "allgather_push",
                                        "allreduce_push", "replica_pull", "dense_allreduce")}
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
            points["replica_pull"].append((k, _per_op(
                lambda: [tables[n].pull_unique(ids) for n in names], repeats)))
            densified = {s.name: ReplicatedTable(topo, s, "allreduce") for s in specs}
            points["allreduce_push"].append((k, _per_op(
                lambda: push_many(densified, {n: SparseGrad(ids, values, 64) for n in names}),
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


def _evict(_name):
    evict_caches()


#: Timed repeats every part of :func:`measure_operations` keeps under a budget.
MIN_REPEATS = 3


def measure_operations(topology, counts=(1, 8), repeats: int = 15, dim: int = 16,
                       cold=_evict, budget_s: float | None = None) -> dict:
    """hpcpax's fixed seconds per operation on this job's ranks; **collective**.

    Like :func:`measure_software`, but each operation runs on ``topology``
    itself (servers serving, every worker calling), with 4 rows per table,
    so what remains is the operation's fixed cost as a step pays it: the
    Python/NumPy path on every rank *and* its collectives' latencies with
    this job's ranks on this machine's cores (an oversubscribed host makes
    every collective wait for descheduled ranks). The operations run one
    after the other, as in a step, without a barrier between them, so each
    also holds the hand-off from the one before, and the operations a step
    runs after the worker's own work (:data:`COLD_OPERATIONS`) run after
    ``cold(name)``, untimed (None: warm), with the caches cold as in a step
    (2 ranks on 2 cores: an allgather push's fixed cost 0.29-0.34 ms warm,
    0.44-0.47 ms cold; with warm costs cost_model_check predicted 0.81-0.88
    of the median case's measured step); the ``k`` values are
    interleaved, so both see the same load; each worker keeps its median,
    and the mean over workers is kept (the trainer reports phase times as
    means over workers). Fitted per operation to ``call_s + per_variable_s * k
    + per_row_s * rows``: ``k`` tables of 16 ids each, and one table of
    :data:`ROWS_PER_CALL` ids for the cost per row (this worker's ids: what
    grows with them beyond the kernels' measured rates, the Python and NumPy
    path, the exchanges inside the node; 0 for the operations whose work does
    not follow the ids).
    Operations: ``ps_pull``, ``ps_push`` (with local aggregation, and
    ``*_no_aggregation`` without; the same where a node has one worker),
    ``allgather_push``, ``allreduce_push`` (densified tables),
    ``replica_pull`` (replicated tables' rows read locally),
    ``dense_allreduce`` and ``control`` (the trainer's
    per-step figures ``Allreduce``, see
    :data:`hpcpax.plan.step_model.REDUCE_STEP_BYTES`): these two only among the
    workers, so each is timed alone (one after the other, no PS operation
    before them, whose servers' backlog would be charged to the number of
    dense tensors) in both states of the servers: serving (``dense_allreduce``,
    ``control``; a serving server waits inside MPI and takes a core) and idle
    (``dense_allreduce_idle``, ``control_idle``; every table replicated, the
    servers poll). A push's wait in the workers' next collective is its own
    operation: ``after_ps_push``, ``after_ps_push_no_aggregation``,
    ``after_allgather_push``, ``after_allreduce_push``, each a one-tensor
    dense allreduce right after that push less the same allreduce alone
    (:data:`AFTER_PUSH`; on 2 cores with 2 workers and a serving server the
    allreduce took 0.33-0.45 ms right after a PS push and 0.02-0.03 ms
    alone). ``per_partition``:
    its ``call_s`` is the extra seconds per partition an owner holds, per PS
    phase (a table of :data:`PARTITIONS` partitions against one of the
    default number, each call timed alone after a barrier of the workers,
    the two tables alternating; :func:`per_partition` of the paired
    differences of pulls and pushes), the model's
    ``CostParams.partition_overhead_s``.

    ``budget_s``: seconds the measurement may take (None: ``repeats`` in
    every part). Each of its five parts (replicated operations, the idle
    collectives, the PS operations, the serving collectives, the partition
    pairs) gets a fifth; after its warm-up and first timed repeat (the
    slowest worker's time, so every worker agrees) it keeps as many repeats
    as fit, at least :data:`MIN_REPEATS` and at most ``repeats``. On a slow
    link this is what keeps start-up in seconds.
    """
    from ..comm.allreduce import DenseAllreduce
    from ..comm.reductions import sum_in_place
    from ..ps.server import ParameterServer, SparseVariableSpec
    from ..ps.sparse_grad import SparseGrad
    from ..sync.replicated import ReplicatedTable, push_many
    from ..plan.step_model import REDUCE_STEP_BYTES

    comm = topology.comm
    rows = 64 * max(16, comm.Get_size())
    # 16 ids 5 apart: every residue mod P <= 16, so every partition and owner gets a
    # request (as in a real step); ROWS_PER_CALL of them for the cost per row
    offset = max(0, topology.worker_index)
    ids = (np.arange(16, dtype=np.int64) * 5 + offset) % rows
    values = np.ones((16, dim), np.float32)
    many = np.unique((np.arange(ROWS_PER_CALL, dtype=np.int64) * 5 + offset) % rows)
    many_values = np.ones((len(many), dim), np.float32)
    specs = [SparseVariableSpec(f"calibrate_{i}", rows=rows, dim=dim) for i in range(max(counts))]
    keys = [s.name for s in specs]
    specs.append(SparseVariableSpec("calibrate_partitioned", rows=rows, dim=dim,
                                    num_partitions=PARTITIONS))
    ps = ParameterServer(topology)
    if not topology.is_worker:
        ps.serve()  # the register, the pulls and pushes, until the shutdown
        return comm.bcast(None, root=topology.worker_ranks[0])

    def pull(names, ids=ids):
        return lambda: ps.pull_unique_many({n: ids for n in names})

    def push(names, ids=ids, values=values):
        return lambda: ps.push_many({n: SparseGrad(ids, values, rows) for n in names})

    def gather_push(names, ids=ids, values=values):
        return lambda: push_many({n: tables[n] for n in names},
                                 {n: SparseGrad(ids, values, rows) for n in names})

    def replica_pull(names, ids=ids):
        return lambda: [tables[n].pull_unique(ids) for n in names]

    def set_aggregation(enabled):
        return lambda: [ps.set_local_aggregation(n, enabled) for n in keys]

    tables = {s.name: ReplicatedTable(topology, s, "allgather") for s in specs}
    densified = {s.name: ReplicatedTable(topology, s, "allreduce") for s in specs}
    engines = {k: DenseAllreduce(topology, {f"w{i}": ((16,), np.float32) for i in range(k)})
               for k in counts}
    grads = {f"w{i}": np.ones(16, np.float32) for i in range(max(counts))}
    vector = np.zeros(REDUCE_STEP_BYTES // 8, np.float64)

    def after_push():  # the workers' next collective after a push: one dense tensor
        engines[counts[0]].allreduce({f"w{i}": grads[f"w{i}"] for i in range(counts[0])})

    # (operation, setup before it, call for k tables, call for one table and many rows
    # or None: an operation whose cost does not grow with the rows it moves)
    operations = [
        ("ps_pull", set_aggregation(True), lambda k: pull(keys[:k]),
         pull(keys[:1], many)),
        ("ps_push", None, lambda k: push(keys[:k]), push(keys[:1], many, many_values)),
        ("after_ps_push", None, lambda k: after_push, after_push),
        ("ps_pull_no_aggregation", set_aggregation(False), lambda k: pull(keys[:k]),
         pull(keys[:1], many)),
        ("ps_push_no_aggregation", None, lambda k: push(keys[:k]),
         push(keys[:1], many, many_values)),
        ("after_ps_push_no_aggregation", None, lambda k: after_push, after_push),
        ("allgather_push", None, lambda k: gather_push(keys[:k]),
         gather_push(keys[:1], many, many_values)),
        # (a replicated push's own rows' work after its collective is the workers' own
        # work, priced with the workers' turns: no per-row form of its wait)
        ("after_allgather_push", None, lambda k: after_push, None),
        ("allreduce_push", None, lambda k: lambda: push_many(
            {n: densified[n] for n in keys[:k]},
            {n: SparseGrad(ids, values, rows) for n in keys[:k]}), None),
        ("after_allreduce_push", None, lambda k: after_push, None),
        ("replica_pull", None, lambda k: replica_pull(keys[:k]),
         replica_pull(keys[:1], many)),
        ("dense_allreduce", None, lambda k: lambda: engines[k].allreduce(
            {f"w{i}": grads[f"w{i}"] for i in range(k)}), None),
        ("control", None, lambda k: lambda: sum_in_place(topology.workers, vector), None),
    ]
    variants = list(counts) + ["rows"]
    calls = {(name, k): make(k) for name, _, make, _ in operations for k in counts}
    calls.update({(name, "rows"): big for name, _, _, big in operations if big is not None})
    times = {key: [] for key in calls}

    collectives = [op for op in operations if op[0] in WORKER_COLLECTIVES]
    idle = [(name + IDLE_SUFFIX, setup, make, big) for name, setup, make, big in collectives]
    calls.update({(name, k): make(k) for name, _, make, _ in idle for k in counts})
    times.update({(name, k): [] for name, _, _, _ in idle for k in counts})

    share = None if budget_s is None else budget_s / 5

    def run_sequence(sequence):
        topology.workers.Barrier()
        began, last = time.perf_counter(), repeats
        repeat = 0
        while repeat <= last:  # the first is a warm-up
            if repeat == 2:
                last = _repeats_within(topology.workers, share, began, repeats)
            for k in variants:
                # one after the other as in a step (no barrier): each call pays the
                # hand-off from the one before, with ranks arriving as they come
                for name, setup, _, _ in sequence:
                    if setup is not None:
                        setup()
                    if (name, k) not in calls:
                        continue
                    if cold is not None and name in COLD_OPERATIONS:
                        cold(name)
                    start = time.perf_counter()
                    calls[(name, k)]()
                    if repeat:
                        times[(name, k)].append(time.perf_counter() - start)
            repeat += 1

    # the replicated tables' operations first, while the servers hold no table and
    # wait as they do when every table is replicated (server_wait_cap: idle), then
    # the PS's, with the servers serving
    replicated = [op for op in operations if op[0] in REPLICATED_OPERATIONS]
    run_sequence(replicated)
    run_sequence(idle)
    ps.register(specs)
    run_sequence([op for op in operations
                  if op[0] not in REPLICATED_OPERATIONS + WORKER_COLLECTIVES])
    run_sequence(collectives)
    # the per-partition cost: one table of PARTITIONS partitions against one of the
    # default number, each call alone (a barrier before it) and the two alternating,
    # so neither carries a hand-off or a server's backlog the other does not (inside
    # the sequence above, after an 8-table push, it measured 35 us per partition
    # where 128 partitions cost nothing measurable alone or in training)
    set_aggregation(True)()
    pair = {"default": keys[0], "partitioned": "calibrate_partitioned"}
    alone = {(kind, op): [] for kind in pair for op in ("pull", "push")}
    began, last = time.perf_counter(), repeats
    for repeat in range(repeats + 1):
        if repeat == 2:
            last = _repeats_within(topology.workers, share, began, repeats)
        if repeat > last:
            break
        for kind, name in pair.items():
            for op, call in (("pull", pull([name])), ("push", push([name]))):
                topology.workers.Barrier()
                start = time.perf_counter()
                call()
                if repeat:
                    alone[(kind, op)].append(time.perf_counter() - start)

    def most_parts(name):
        return int(np.bincount(np.asarray(ps.variables[name].layout.owners)).max())

    extra_parts = most_parts("calibrate_partitioned") - most_parts(keys[0])
    ps.shutdown()
    mine = {key: float(np.median(v)) for key, v in times.items()}
    means = topology.workers.allreduce(mine, op=_sum_dicts)
    # each alternation's difference (partitioned - default), pull and push, every worker
    diffs = [a - b for op in ("pull", "push")
             for a, b in zip(alone[("partitioned", op)], alone[("default", op)])]
    diffs = np.concatenate(topology.workers.allgather(np.asarray(diffs, np.float64)))
    n = topology.workers.Get_size()
    out = {}
    k0, k1 = counts[0], counts[-1]
    extra_rows = len(many) - len(ids)
    # a push's wait in the workers' next collective: beyond that collective alone
    for name, alone in AFTER_PUSH.items():
        for key in [key for key in means if key[0] == name]:
            means[key] = means[key] - means[(alone, k0)]
    for name, _, _, _ in operations + idle:
        t0, t1 = means[(name, k0)] / n, means[(name, k1)] / n
        per = max((t1 - t0) / (k1 - k0), 0.0) if not name.startswith("control") else 0.0
        per_row = (max((means[(name, "rows")] / n - t0) / extra_rows, 0.0)
                   if (name, "rows") in means and k0 == 1 and extra_rows > 0 else 0.0)
        out[name] = {"call_s": max(t0 - per * k0 - per_row * len(ids), 0.0),
                     "per_variable_s": per, "per_row_s": per_row}
    out["per_partition"] = {"call_s": per_partition(diffs, extra_parts), "per_variable_s": 0.0}
    return comm.bcast(out, root=topology.worker_ranks[0])


def _repeats_within(workers, share, began, repeats) -> int:
    """The timed repeats a part keeps after two (warm-up + one): as many as fit ``share``
    seconds at the slowest worker's pace so far, in ``[MIN_REPEATS, repeats]``;
    **collective** over ``workers`` (None: ``repeats``, nothing exchanged)."""
    if share is None:
        return repeats
    from ..comm.reductions import largest

    spent = largest(workers, time.perf_counter() - began)
    per_repeat = spent / 2
    fit = 1 + int(max(share - spent, 0.0) // max(per_repeat, 1e-9))
    return int(min(repeats, max(MIN_REPEATS, fit)))


def per_partition(differences, extra_parts) -> float:
    """Seconds per extra partition from paired differences (partitioned - default).

    The mean difference over ``extra_parts``, but 0 unless it stands out of
    its noise (more than two standard errors above 0): clamping a noisy
    estimate at 0 keeps only its positive draws, so a cost that is really 0
    came out positive in every calibration (the check's runs predicted 16
    partitions slower than the default where training measured them equal
    or faster). Local.
    """
    d = np.asarray(differences, np.float64)
    if extra_parts <= 0 or d.size < 2:
        return 0.0
    mean, error = float(d.mean()), float(d.std(ddof=1) / np.sqrt(d.size))
    return mean / extra_parts if mean > 2.0 * error else 0.0


def _sum_dicts(a, b, _datatype=None):
    return {key: a[key] + b[key] for key in a}
