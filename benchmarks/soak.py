"""Soak: N trainer steps on every rank; resident memory must stay flat, no MPI request left.

Run: ``mpirun -n 4 python -m mpi4py benchmarks/soak.py [--steps 2000 | --quick]``.
Each rank samples its RSS (``/proc/self/statm``) with the number of guarded
operations done (steps on workers, served operations on servers, from the
trainer's watchdog); growth is measured from the first sample after the
warm-up fraction to the end. After the run every rank counts the
``MPI.Request`` objects still active. Prints one JSON line (rank 0); exits 1
when growth >= ``--max-growth`` or a request is left.
"""

import argparse
import gc
import json
import os
import sys
import tempfile
import threading
import time

from mpi4py import MPI

from hpcpax.app.trainer import Trainer

PAGE = os.sysconf("SC_PAGE_SIZE")
TINY = {"model": "lm", "vocab_size": 2000, "context": 3, "emb_dim": 16, "hidden": [32],
        "out_dim": 16, "num_sampled": 32, "global_batch": 24, "synthetic_samples": 20000,
        "plan": "ps", "quiet": True}


def rss_bytes():
    with open("/proc/self/statm", encoding="ascii") as handle:
        return int(handle.read().split()[1]) * PAGE


def active_requests():
    return sum(1 for o in gc.get_objects()
               if isinstance(o, MPI.Request) and o != MPI.REQUEST_NULL)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--quick", action="store_true", help="200 steps")
    parser.add_argument("--warmup", type=float, default=0.25, help="fraction of the run")
    parser.add_argument("--max-growth", type=float, default=0.05)
    parser.add_argument("--checkpoint-every", type=int, default=0)
    args = parser.parse_args()
    steps = 200 if args.quick else args.steps
    comm = MPI.COMM_WORLD
    run_dir = comm.bcast(tempfile.mkdtemp(prefix="hpcpax-soak-") if comm.Get_rank() == 0
                         else None, root=0)
    trainer = Trainer({**TINY, "steps": steps, "run_dir": run_dir,
                       "checkpoint_every": args.checkpoint_every, "keep_checkpoints": 1},
                      comm=comm)
    samples, stop = [], threading.Event()

    def sample():
        while not stop.wait(0.05):
            dog = getattr(trainer, "watchdog", None)
            if dog is not None:
                samples.append((dog.ops_completed, rss_bytes()))

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    start = time.perf_counter()
    trainer.run()
    seconds = time.perf_counter() - start
    stop.set()
    thread.join()
    samples.append((trainer.watchdog.ops_completed, rss_bytes()))
    gc.collect()
    total = samples[-1][0] if samples else 0
    warm = next((s for s in samples if s[0] >= args.warmup * total), samples[0])
    end = samples[-1]
    mine = {"rank": comm.Get_rank(), "ops": total, "rss_warm_mb": warm[1] / 2**20,
            "rss_end_mb": end[1] / 2**20, "growth": end[1] / warm[1] - 1,
            "active_requests": active_requests()}
    everyone = comm.gather(mine, root=0)
    ok = True
    if comm.Get_rank() == 0:
        growth = max(r["growth"] for r in everyone)
        leaked = sum(r["active_requests"] for r in everyone)
        ok = growth < args.max_growth and leaked == 0
        print(json.dumps({"benchmark": "soak", "ranks": comm.Get_size(), "steps": steps,
                          "seconds": round(seconds, 2), "max_rss_growth": round(growth, 4),
                          "active_requests": leaked, "ok": ok,
                          "per_rank": [{k: (round(v, 4) if isinstance(v, float) else v)
                                        for k, v in r.items()} for r in everyone]}),
              flush=True)
    ok = comm.bcast(ok, root=0)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
