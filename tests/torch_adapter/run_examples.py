"""Run several cases of the ``hpcpax.torch`` examples in one MPI job.

``mpirun -n 4 python -m mpi4py tests/torch_adapter/run_examples.py CASES.json OUT``:
each case of the JSON list (``{"example", "args", "ranks_per_node"}``) runs the
example's ``main`` as ``mpirun -n 4 python examples/torch_EXAMPLE.py ARGS``
would, one after the other, with ``HPCPAX_RANKS_PER_NODE`` as the case says.
Each rank's standard output of case ``i`` goes to ``OUT/case<i>.rank<r>.out``;
the servers, which end their process after serving in a real run (``sys.exit(0)``
in :func:`hpcpax.torch.distribute`), go on to the next case instead, and the
workers release them with :func:`hpcpax.torch.finish`. One job instead of one per
case spares each case four interpreters importing torch, hpcpax and Numba.
"""

import contextlib
import importlib
import json
import os
import sys
from pathlib import Path

from mpi4py import MPI

import hpcpax.torch

ROOT = Path(__file__).resolve().parents[2]


def main():
    cases = json.loads(Path(sys.argv[1]).read_text())
    out = Path(sys.argv[2])
    rank = MPI.COMM_WORLD.Get_rank()
    sys.path.insert(0, str(ROOT / "examples"))
    for index, case in enumerate(cases):
        os.environ.pop("HPCPAX_RANKS_PER_NODE", None)
        if case["ranks_per_node"]:
            os.environ["HPCPAX_RANKS_PER_NODE"] = str(case["ranks_per_node"])
        module = importlib.import_module(f"torch_{case['example']}")
        with open(out / f"case{index}.rank{rank}.out", "w") as handle, \
                contextlib.redirect_stdout(handle):
            try:
                module.main(case["args"])
            except SystemExit as end:  # a server, done serving
                if end.code not in (0, None):
                    raise
            hpcpax.torch.finish()
        MPI.COMM_WORLD.Barrier()


if __name__ == "__main__":
    main()
