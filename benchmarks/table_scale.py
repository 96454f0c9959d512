"""Start-up and server memory against the declared table size (rows on first touch).

One parameter-server job (``mpirun -n 3``: 1 server, 2 workers, method
``ps``) per table size V = 10^5, 10^7, 10^9 rows (dim 16, float32,
Adagrad), all with the same first batch (4,096 Zipf ids per worker below
10^5): the *first step* is registration + pull + push of that batch, timed
as the slowest rank, after a small warm-up table has loaded the kernels
(``process_start_up_s``: ``hpcpax.init`` to the end of that warm-up). The run then touches min(V, 10^6) distinct rows spread
over the whole id space (batches of 50,000 ids per worker) and a few more
steps of the first batch (the *steady step*); the server's peak RSS is read
at the end. Sizes run interleaved (A B C A B C ...), ``--repeats`` times,
each a fresh job; medians with min and max.

    python benchmarks/table_scale.py            # runs the mpirun jobs itself
    python benchmarks/table_scale.py --quick    # 1 repeat, 10^5 touched rows

Keys: ``first_step_s``, ``steady_step_s``, ``server_rss_gb``, ``rows_held``
per size; ``ratio_first_step_1e9_vs_1e5`` (goal <= 2) and
``server_rss_gb_1e9`` (goal <= 1.5) from the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

SIZES = {"1e5": 10**5, "1e7": 10**7, "1e9": 10**9}
DIM, FIRST_IDS, TOUCH_BATCH = 16, 4096, 50_000


def child(rows: int, touch: int, steady: int) -> None:
    """One job: first step, touch ``touch`` rows, steady steps; rank 0 prints JSON."""
    from mpi4py import MPI

    import hpcpax
    from hpcpax import ParameterServer, SparseVariableSpec
    from hpcpax.ps.memory import table_report
    from hpcpax.ps.sparse_grad import SparseGrad

    comm = MPI.COMM_WORLD
    comm.Barrier()
    start = time.perf_counter()
    topo = hpcpax.init(servers_per_node=1)
    spec = SparseVariableSpec("emb", rows=rows, dim=DIM, optimizer="adagrad",
                              optimizer_params={"lr": 0.05})
    ps = ParameterServer(topo, seed=1)
    steady_s = []
    if topo.is_server:
        ps.serve()
    else:
        w, n = topo.worker_index, topo.num_workers
        rng = np.random.default_rng([7, w])
        first = _common.zipf_ids(rng, FIRST_IDS, _common.zipf_cdf(10**5))
        grads = rng.standard_normal((FIRST_IDS, DIM), dtype=np.float32) * np.float32(0.01)

        def step(ids, values):
            ps.pull_unique("emb", ids)
            ps.push("emb", SparseGrad(ids, values, rows))

        # a small table first: kernels compiled or loaded, the process warm
        ps.register([SparseVariableSpec("warm", rows=1000, dim=DIM, optimizer="adagrad",
                                        optimizer_params={"lr": 0.05})])
        ps.pull_unique("warm", first % 1000)
        ps.push("warm", SparseGrad(first % 1000, grads, 1000))
        cold_s = topo.workers.allreduce(time.perf_counter() - start, op=MPI.MAX)
        topo.workers.Barrier()
        began = time.perf_counter()
        ps.register([spec])
        step(first, grads)
        first_s = topo.workers.allreduce(time.perf_counter() - began, op=MPI.MAX)
        stride = max(1, rows // touch)  # touched rows spread over the whole id space
        for begin in range(0, touch, TOUCH_BATCH * n):
            ids = np.arange(begin + w * TOUCH_BATCH, min(begin + (w + 1) * TOUCH_BATCH, touch),
                            dtype=np.int64) * stride
            step(ids, np.full((ids.size, DIM), 1e-3, np.float32))
        for _ in range(steady):
            topo.workers.Barrier()
            began = time.perf_counter()
            step(first, grads)
            steady_s.append(topo.workers.allreduce(time.perf_counter() - began, op=MPI.MAX))
        ps.shutdown()
    report = table_report(topo.comm, ps)["emb"]
    rss = comm.gather((topo.role, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024),
                      root=0)
    timing = comm.bcast((first_s, steady_s, cold_s) if topo.is_worker and topo.worker_index == 0
                        else None, root=topo.worker_ranks[0])
    if comm.Get_rank() == 0:
        print(json.dumps({"first_step_s": timing[0], "steady_step_s": _common.median(timing[1]),
                          "start_up_s": timing[2],
                          "server_rss_bytes": max(b for role, b in rss if role == "server"),
                          "rows_held": report["rows_held"],
                          "server_bytes": report["max_owner_bytes"]}), flush=True)
    topo.free()


def run_job(rows, touch, steady, timeout):
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    if not os.path.exists(mpirun):
        mpirun = "mpirun"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    done = subprocess.run([mpirun, "-n", "3", sys.executable, "-m", "mpi4py",
                           os.path.abspath(__file__), "--child", str(rows), "--touch",
                           str(touch), "--steady", str(steady)],
                          capture_output=True, text=True, timeout=timeout, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"table_scale job V={rows} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def spread(values):
    return {"median": _common.median(values), "min": min(values), "max": max(values)}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--touch", type=int, default=10**6, help="distinct rows touched")
    parser.add_argument("--steady", type=int, default=5, help="steady steps timed")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, min(args.touch, args.child), args.steady)
        return
    if args.quick:
        args.repeats, args.touch, args.steady = 1, 10**5, 2
    runs = {label: [] for label in SIZES}
    for _ in range(args.repeats):
        for label, rows in SIZES.items():  # interleaved: 1e5 1e7 1e9 1e5 ...
            runs[label].append(run_job(rows, min(args.touch, rows), args.steady, args.timeout))
    result = {"benchmark": "table_scale", "ranks": 3, "servers": 1, "method": "ps",
              "dim": DIM, "optimizer": "adagrad", "first_batch_ids_per_worker": FIRST_IDS,
              "touched_rows": {k: min(args.touch, v) for k, v in SIZES.items()},
              "repeats": args.repeats, "machine": "shared (timings noisy)"}
    for label, jobs in runs.items():
        result[label] = {
            "first_step_s": spread([j["first_step_s"] for j in jobs]),
            "process_start_up_s": spread([j["start_up_s"] for j in jobs]),
            "steady_step_s": spread([j["steady_step_s"] for j in jobs]),
            "server_rss_gb": spread([j["server_rss_bytes"] / 2**30 for j in jobs]),
            "server_table_gb": _common.median([j["server_bytes"] / 2**30 for j in jobs]),
            "rows_held": jobs[-1]["rows_held"]}
    result["ratio_first_step_1e9_vs_1e5"] = _common.ratio(
        result["1e9"]["first_step_s"]["median"], result["1e5"]["first_step_s"]["median"])
    result["server_rss_gb_1e9"] = result["1e9"]["server_rss_gb"]["median"]
    _common.emit(result)


if __name__ == "__main__":
    main()
