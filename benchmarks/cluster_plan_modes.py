"""``benchmarks/plan_modes.py`` on an emulated 2-node cluster at several link rates.

For each rate (default 0.5, 2 and 10 Gbit/s per direction) the script brings
up a 2-node cluster (network namespaces, tc-shaped links, MPI checked to
cross them; ``python -m hpcpax.cluster``), measures the link with an MPI
stream probe, runs ``plan_modes.py`` under ``mpirun`` with 2 ranks per node
(1 server + 1 worker, its default layout) and tears the cluster down, also
on failure. Needs root and ``ip netns``; otherwise one JSON line with
``skipped``.

One JSON line: per rate the probe and plan_modes' own JSON (samples/s per
mode, the methods auto chose, ``ratio_auto_vs_best``); ``best_mode_by_rate``
shows where the best fixed method changes; ``ratio_auto_vs_best`` is the
worst over rates (goal >= 0.9: auto within 10 % of the best fixed plan).

Usage: ``python benchmarks/cluster_plan_modes.py [--quick] [--rates 0.5gbit,2gbit,10gbit]``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)
import _common  # noqa: E402

PREFIX, SUBNET = "hpm", "10.213.253.0/24"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="plan_modes --quick, 2 rates")
    parser.add_argument("--rates", default="0.5gbit,2gbit,10gbit")
    parser.add_argument("--timeout", type=int, default=1200, help="seconds per rate")
    parser.add_argument("plan_modes_args", nargs="*", help="passed to plan_modes.py")
    args = parser.parse_args()
    from hpcpax import cluster
    from hpcpax.cluster import check, mpirun_argv, mpirun_env

    out = {"benchmark": "cluster_plan_modes"}
    reason = cluster.preflight()
    if reason:
        out["skipped"] = f"no emulated cluster here: {reason}"
        _common.emit(out)
        return 0
    rates = args.rates.split(",")[:2] if args.quick else args.rates.split(",")
    extra = list(args.plan_modes_args) + (["--quick"] if args.quick else [])
    out.update({"nodes": 2, "ranks_per_node": 2, "rates": rates, "plan_modes_args": extra,
                "machine_shared": True, "loadavg_at_start": os.getloadavg()})
    start = time.perf_counter()
    for rate in rates:
        cluster.down(PREFIX, log=lambda text: None)
        try:
            spec = cluster.up(2, rate=rate, prefix=PREFIX, subnet=SUBNET)
            probe = check(spec, nbytes=64 << 20)
            env = mpirun_env()
            env.update({"OMP_NUM_THREADS": "1", "NUMBA_NUM_THREADS": "1",
                        "PYTHONPATH": ROOT + os.pathsep + env.get("PYTHONPATH", ""),
                        "MPIEXEC_TIMEOUT": str(args.timeout), "PYTHONWARNINGS": "ignore"})
            argv = [sys.executable, "-m", "mpi4py", os.path.join(HERE, "plan_modes.py"), *extra]
            done = subprocess.run(mpirun_argv(spec, 2, argv), cwd=ROOT, env=env,
                                  capture_output=True, text=True, timeout=args.timeout + 30)
            lines = [t for t in done.stdout.splitlines() if t.startswith("{")]
            entry = {"link_probe": {k: probe.get(k) for k in ("gbit_per_s", "latency_us",
                                                              "used", "reason")}}
            if done.returncode == 0 and lines:
                entry["plan_modes"] = json.loads(lines[-1])
            else:
                entry["error"] = (done.stderr or done.stdout)[-1500:]
            out[rate] = entry
        finally:
            cluster.down(PREFIX, log=lambda text: None)
    ok = [r for r in rates if "plan_modes" in out[r]]
    out["best_mode_by_rate"] = {r: {m: out[r]["plan_modes"].get(f"{m}_best_mode")
                                    for m in ("lm", "ctr")} for r in ok}
    out["auto_methods_by_rate"] = {r: {m: out[r]["plan_modes"][m]["auto"]["methods"]
                                       for m in ("lm", "ctr")} for r in ok}
    out["ratio_auto_vs_best_by_rate"] = {r: out[r]["plan_modes"]["ratio_auto_vs_best"]
                                         for r in ok}
    out["ratio_auto_vs_best"] = min(out["ratio_auto_vs_best_by_rate"].values()) if ok else None
    out["wall_seconds"] = time.perf_counter() - start
    out["loadavg_at_end"] = os.getloadavg()
    _common.emit(out)
    return 0 if len(ok) == len(rates) else 1


if __name__ == "__main__":
    sys.exit(main())
