"""Run pytest on every MPI rank; only rank 0 talks, every rank reports.

Launched by ``tests/run_suites.py`` as ``mpirun -n N python -m mpi4py
tests/mpi_pytest.py REPORT_DIR [pytest args]``. Each rank writes a JUnit
report ``REPORT_DIR/rank<R>.xml`` and a log ``REPORT_DIR/rank<R>.log``; the
exit status is non-zero when any test failed on any rank (collective check),
so one failing rank fails the run.
"""

import os
import sys

import pytest
from mpi4py import MPI


def main():
    report_dir, args = sys.argv[1], sys.argv[2:]
    rank = MPI.COMM_WORLD.Get_rank()
    os.makedirs(report_dir, exist_ok=True)
    log = open(os.path.join(report_dir, f"rank{rank}.log"), "w")
    if rank != 0:  # one readable stream; the others go to their logs
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    # --with-mpi would override --only-mpi in pytest-mpi: pass exactly one
    mode = [] if "--only-mpi" in args else ["--with-mpi"]
    code = pytest.main([*mode, f"--junitxml={report_dir}/rank{rank}.xml", *args])
    failed = MPI.COMM_WORLD.allreduce(int(code not in (0, 5)), op=MPI.SUM)
    sys.stdout.flush()
    if rank == 0 and failed:
        print(f"{failed} rank(s) had failures; logs in {report_dir}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
