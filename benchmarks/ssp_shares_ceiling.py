"""The ceiling of ``auto``'s ``ssp:2+balanced`` choice with a persistent straggler.

``asp``, ``ssp:2`` and ``ssp:2`` with two fixed uneven shares (``--batch-shares``)
on the ``stragglers`` benchmark's model and persistent scenario (the last worker 2x
slower), interleaved round by round; samples over training seconds per mode and
round. Run: ``mpirun -n 4 python -m mpi4py benchmarks/ssp_shares_ceiling.py
[--rounds N]`` (1 server + 3 workers). One JSON line.
"""

import argparse
import json
import os
import sys
import tempfile

from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import stragglers as S  # noqa: E402

SHARES = {"ssp:2+shares 320,300,148": "320,300,148", "ssp:2+shares 340,300,128": "340,300,128"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=150)
    args = parser.parse_args()
    comm = MPI.COMM_WORLD
    if comm.Get_size() != 4:
        raise SystemExit("run with mpirun -n 4 (1 server + 3 workers)")
    for name, shares in SHARES.items():
        S.MODES[name] = {"consistency": "ssp:2", "batch_shares": shares}
    modes = ["asp", "ssp:2", *SHARES]
    base = {**S.MODEL, "lr": 0.001}
    workdir = comm.bcast(tempfile.mkdtemp() if comm.Get_rank() == 0 else None)
    runs = {m: [] for m in modes}
    for r in range(args.rounds):
        for m in modes:
            out = S.one_run(comm, base, m, {"straggler": "3:2"}, args.steps, 1 + r, workdir)
            runs[m].append(out["samples_per_s_train"])
    if comm.Get_rank() == 0:
        print(json.dumps({"benchmark": "ssp_shares_ceiling", "steps": args.steps,
                          "rounds": args.rounds, "straggler": "rank 3 x2",
                          "layout": "1 parameter server + 3 workers on one node",
                          "model": base,  # the plan: base["plan"] (ps) for every run
                          "modes": {m: S.MODES.get(m, {"consistency": m}) for m in modes},
                          "samples_per_s_train": runs,
                          "ratio_vs_asp": {m: [a / b for a, b in zip(runs[m], runs["asp"])]
                                           for m in modes[1:]},
                          "load_average": list(os.getloadavg())}), flush=True)


if __name__ == "__main__":
    main()
