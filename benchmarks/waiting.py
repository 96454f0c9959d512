"""The one wait policy: the latency it adds per operation and the CPU it frees.

One parameter server and one worker (``mpirun -n 2``). The worker "computes"
for a gap (a sleep: the core is free, as while an accelerator works), then
pulls 256 rows of a 100,000 x 64 table and pushes their gradients: one PS
step. The server waits for each operation under ``HPCPAX_WAIT=sleep`` (the
default: polls, then sleeps at most a tenth of the wait so far, up to 1 ms)
or ``spin`` (inside MPI). Policies interleaved, 3 rounds, each round every
gap; figures are medians over the rounds, with their spread:

- ``pull_us``: the worker's pull, call to rows (its own waits follow the
  same policy), per gap and policy, and ``added_latency_us_<gap>``: sleep's
  median pull minus spin's;
- ``server_cpu_busy``: the server's CPU seconds over wall seconds while it
  served those steps, per gap and policy; ``cpu_busy_server_idle``: the
  same under the default for 3 steps 2 s apart (goal <= 0.1).

Run: ``mpirun -n 2 python -m mpi4py benchmarks/waiting.py [--quick]``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common  # noqa: E402

GAPS_MS = (0.0, 1.0, 10.0, 50.0)
IDLE_S = 2.0  # the idle server: one step after this long
ROWS, DIM, IDS = 100_000, 64, 256


def one_run(topo, policy, gap_s, steps):
    """Serve (server) or run ``steps`` PS steps (worker) under ``policy``."""
    from hpcpax import ParameterServer, SparseVariableSpec
    from hpcpax.options import options
    from hpcpax.ps.sparse_grad import SparseGrad

    options.wait = policy
    ps = ParameterServer(topo)
    ps.register([SparseVariableSpec("emb", ROWS, DIM, optimizer="sgd",
                                    optimizer_params={"lr": 0.01})])
    out = {}
    if topo.is_server:
        wall, cpu = time.perf_counter(), time.process_time()
        ps.serve()
        out["busy"] = (time.process_time() - cpu) / (time.perf_counter() - wall)
    else:
        rng = np.random.default_rng(0)
        pulls = []
        for _ in range(steps):
            ids = rng.integers(0, ROWS, IDS)
            time.sleep(gap_s)
            begin = time.perf_counter()
            ps.pull("emb", ids)
            pulls.append(time.perf_counter() - begin)
            ps.push("emb", SparseGrad(ids, np.ones((IDS, DIM), np.float32), ROWS))
        ps.shutdown()
        out["pull_us"] = 1e6 * float(np.median(pulls[2:]))
    del options.wait
    return out


def main():
    import hpcpax

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, steps = (1, 6) if args.quick else (3, 40)
    topo = hpcpax.init(servers_per_node=1)
    if topo.size != 2:
        raise SystemExit("run with mpirun -n 2 (1 server + 1 worker)")
    comm = topo.comm
    rank = comm.Get_rank()
    results = {}  # (policy, gap) -> [(pull_us, busy) per round]
    for _ in range(rounds):
        for gap in GAPS_MS:
            for policy in ("sleep", "spin"):
                steps_here = max(6, min(steps, int(2.0 / max(gap / 1e3, 1e-3))))
                mine = one_run(topo, policy, gap / 1e3, steps_here)
                both = comm.allgather(mine)
                pull = next(r["pull_us"] for r in both if "pull_us" in r)
                busy = next(r["busy"] for r in both if "busy" in r)
                results.setdefault((policy, gap), []).append((pull, busy))
    line = {"rounds": rounds, "ids_per_pull": IDS, "row_bytes": DIM * 4}
    for (policy, gap), values in results.items():
        pulls, busy = [v[0] for v in values], [v[1] for v in values]
        line[f"pull_us_{policy}_{gap:g}ms"] = _common.median(pulls)
        line[f"pull_us_{policy}_{gap:g}ms_spread"] = [min(pulls), max(pulls)]
        line[f"server_cpu_busy_{policy}_{gap:g}ms"] = _common.median(busy)
        line[f"server_cpu_busy_{policy}_{gap:g}ms_spread"] = [min(busy), max(busy)]
    for gap in GAPS_MS:
        line[f"added_latency_us_{gap:g}ms"] = (line[f"pull_us_sleep_{gap:g}ms"]
                                               - line[f"pull_us_spin_{gap:g}ms"])
    idle = []
    for _ in range(rounds):
        mine = one_run(topo, "sleep", IDLE_S, 3)
        idle.append(next(r["busy"] for r in comm.allgather(mine) if "busy" in r))
    line["cpu_busy_server_idle"] = _common.median(idle)
    line["cpu_busy_server_idle_spread"] = [min(idle), max(idle)]
    topo.free()
    _common.emit(line, rank)


if __name__ == "__main__":
    main()
