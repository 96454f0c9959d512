"""Run pytest on every MPI rank; only rank 0 talks, every rank reports.

Launched by ``tests/run_suites.py`` as ``mpirun -n N python -m mpi4py
tests/mpi_pytest.py REPORT_DIR [pytest args]``. Each rank writes a JUnit
report ``REPORT_DIR/rank<R>.xml`` and a log ``REPORT_DIR/rank<R>.log``; the
exit status is non-zero when any test failed on any rank (collective check),
so one failing rank fails the run.

Every rank writes its threads' stacks to its log a few seconds before a
test's pytest-timeout fires (:class:`StacksBeforeTimeout`): the rank that
times out first ends the job, so without this only its own stack would be
seen, not where the others wait.
"""

import faulthandler
import os
import sys

import pytest
from mpi4py import MPI

#: Seconds before a test's timeout at which every rank dumps its stacks.
STACKS_AHEAD_S = 10.0


class StacksBeforeTimeout:
    """pytest plugin: dump this rank's stacks ``STACKS_AHEAD_S`` before the test's
    timeout (its ``timeout`` mark, else pytest.ini's ``timeout``)."""

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item):
        marker = item.get_closest_marker("timeout")
        timeout = float(marker.args[0] if marker and marker.args
                        else item.config.getini("timeout") or 0)
        if timeout > 2 * STACKS_AHEAD_S:
            faulthandler.dump_traceback_later(timeout - STACKS_AHEAD_S, exit=False)
        try:
            yield
        finally:
            faulthandler.cancel_dump_traceback_later()


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
    code = pytest.main([*mode, f"--junitxml={report_dir}/rank{rank}.xml", *args],
                       plugins=[StacksBeforeTimeout()])
    failed = MPI.COMM_WORLD.allreduce(int(code not in (0, 5)), op=MPI.SUM)
    sys.stdout.flush()
    if rank == 0 and failed:
        print(f"{failed} rank(s) had failures; logs in {report_dir}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
