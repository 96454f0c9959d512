"""No silent hang: a dead, stopped or hanging rank ends the job, named, in bounded time.

The fault tests start their own ``mpirun -n 4`` (1 server, 3 workers) with
``HPCPAX_TIMEOUT=8`` and run in the serial suite only.
"""

import os
import signal
import threading
import time

import pytest
from mpi4py import MPI

from hpcpax.errors import ConfigError
from hpcpax.comm.startup import check_arrival, leave_together
from hpcpax.comm.watchdog import DEFAULT_TIMEOUT, Watchdog, resolve_timeout
from reliability_jobs import TINY, Job, serial_only

TIMEOUT = 8
BOUND = 30  # seconds from the injection to the end of the job


def test_mpi4py_runs_thread_multiple():
    assert MPI.Query_thread() == MPI.THREAD_MULTIPLE


def test_timeout_resolution(monkeypatch):
    monkeypatch.delenv("HPCPAX_TIMEOUT", raising=False)
    assert resolve_timeout() == DEFAULT_TIMEOUT
    monkeypatch.setenv("HPCPAX_TIMEOUT", "12.5")
    assert resolve_timeout() == 12.5 and resolve_timeout(3) == 3.0
    monkeypatch.setenv("HPCPAX_TIMEOUT", "soon")
    with pytest.raises(ConfigError, match="HPCPAX_TIMEOUT"):
        resolve_timeout()
    with pytest.raises(ConfigError, match=">= 0"):
        resolve_timeout(-1)


def test_disabled_watchdog_does_nothing():
    dog = Watchdog(MPI.COMM_SELF, 0)
    assert not dog.enabled
    with dog.guard("x"):
        pass
    dog.close()


def test_guard_fires_with_a_report_in_process():
    fired = threading.Event()
    reports = []

    def abort(report):
        reports.append(report)
        fired.set()

    dog = Watchdog(MPI.COMM_SELF, 0.3, grace=0.2, abort=abort)
    with dog.guard("quick"):
        pass
    assert dog.status()["ops"] == 1 and dog.status()["last"] == "quick"
    with dog.guard("step 17"):
        assert fired.wait(10)
    dog.close()
    assert "rank 0 stuck" in reports[0] and "'step 17'" in reports[0]
    assert "HPCPAX_TIMEOUT=0.3" in reports[0]


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_deferring_ranks_keep_answering_the_reporter(capsys):
    """Ranks that time out first defer to a lower rank that is stuck too.

    While they wait for it they must keep answering its query: the reporter
    then names them as in the same operation (not silent) and prints well
    inside its grace period. (They once slept instead; the reporter waited
    for them and died in their abort before it printed.)
    """
    comm = MPI.COMM_WORLD
    fired = threading.Event()
    reports = []

    def abort(report):
        reports.append(report)
        fired.set()

    dog = Watchdog(comm, 1.0, grace=1.5, abort=abort)
    comm.Barrier()
    if comm.rank == 0:
        time.sleep(0.5)  # the others time out first and find rank 0 stuck too
    with dog.guard("step 1"):
        assert fired.wait(30)
    dog.close()
    err = capsys.readouterr().err
    others = list(range(1, comm.size))
    if comm.rank == 0:
        assert f"ranks {others} in 'step 1'" in reports[0], reports[0]
        assert "no answer from ranks []" in reports[0], reports[0]
        assert "rank 0 stuck" in err and "also stuck" not in err
    else:
        assert f"rank {comm.rank} also stuck" in err and "rank 0 reports" in err, err
    comm.Barrier()


def _start(tmp_path, steps=400, **env):
    run_dir = tmp_path / "run"
    job = Job(4, ["--steps", str(steps), "--run-dir", str(run_dir), *TINY], tmp_path,
              limit=150, HPCPAX_TIMEOUT=TIMEOUT, **env)
    return job, run_dir


def _ended(job, injected):
    status = job.wait(BOUND + 30)
    elapsed = time.monotonic() - injected
    text = job.output()
    print(f"--- job ended {elapsed:.1f} s after the injection, exit {status}\n{text[-3000:]}")
    return status, elapsed, text


def _fault(tmp_path, inject, **env):
    """Start the 4-rank job, run ``inject(job, run_dir)``, wait for the end.

    Returns ``(exit status, seconds from the injection to the end, output)``.
    """
    job, run_dir = _start(tmp_path, **env)
    try:
        inject(job, run_dir)
        return _ended(job, time.monotonic())
    finally:
        job.kill()


def _signal_after_step_3(signum, victim):
    def inject(job, run_dir):
        pids = job.pids()
        job.wait_for_step(run_dir, 3)
        os.kill(pids[victim], signum)
    return inject


@pytest.mark.timeout(150)
def test_hanging_worker_is_named_by_the_watchdog(tmp_path):
    """Rank 3 (a worker) sleeps forever between steps: the others report it and abort."""
    serial_only()
    status, elapsed, text = _fault(tmp_path, lambda job, run_dir: job.wait_for_step(run_dir, 4),
                                   RELIABILITY_HANG_RANK=3, RELIABILITY_HANG_STEP=4)
    assert status != 0 and elapsed < BOUND
    assert "hpcpax watchdog: rank" in text and "stuck" in text and "'step 5'" in text
    assert "rank 3 idle" in text and "after 'step 4'" in text
    assert text.count("aborting the job") == 1  # one report, not one per rank


@pytest.mark.timeout(150)
def test_rank_hanging_in_setup_is_named_by_the_watchdog(tmp_path):
    """Rank 3 hangs selecting its device; the others wait in the next set-up collective."""
    serial_only()
    status, elapsed, text = _fault(tmp_path, lambda job, run_dir: job.pids(),
                                   RELIABILITY_SETUP_HANG_RANK=3)
    assert status != 0 and elapsed < BOUND + 20  # start-up of 4 ranks included
    assert "stuck" in text and "'set-up: run dir and config'" in text, text
    assert "ranks [3] in 'set-up: device'" in text, text
    assert text.count("aborting the job") == 1


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", [3, 0], ids=["worker", "server"])
def test_stopped_rank_is_named_as_not_answering(tmp_path, victim):
    """SIGSTOP one rank (a hang MPI cannot see): the watchdog names it as silent."""
    serial_only()
    status, elapsed, text = _fault(tmp_path, _signal_after_step_3(signal.SIGSTOP, victim))
    assert status != 0 and elapsed < BOUND
    assert f"no answer from ranks [{victim}] (dead or stopped?)" in text


@pytest.mark.timeout(150)
@pytest.mark.parametrize("victim", [3, 0], ids=["worker", "server"])
def test_killed_rank_ends_the_job(tmp_path, victim):
    """kill -9 one rank: the job must end non-zero, in bounded time.

    MPICH's hydra usually tears the job down itself, naming the PID; when it
    does not, the watchdog names the rank. Either is accepted, a hang is not.
    """
    serial_only()
    status, elapsed, text = _fault(tmp_path, _signal_after_step_3(signal.SIGKILL, victim))
    assert status != 0 and elapsed < BOUND
    by_hydra = "BAD TERMINATION" in text and ("signal 9" in text or "EXIT CODE: 9" in text)
    assert by_hydra or f"no answer from ranks [{victim}]" in text, text


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_arrival_check_names_a_rank_that_never_starts(comm):
    """Before any collective: the last rank never arrives; rank 0 names it, the others
    report rank 0's silence; nobody hangs."""
    work = comm.Dup()  # leftover messages of the failed check stay off COMM_WORLD
    try:
        assert check_arrival(work, timeout=20) >= 0.0  # everyone arrives: no report
        reports = []
        late = work.Get_size() - 1
        if work.Get_rank() != late:
            check_arrival(work, timeout=1.0, abort=reports.append)
        if work.Get_rank() == 0:
            ok = len(reports) == 1 and f"ranks [{late}] of {work.Get_size()} did not arrive " \
                "within 1 s" in reports[0]
        elif work.Get_rank() != late:
            ok = len(reports) == 1 and "waited 1 s for rank 0" in reports[0]
        else:
            ok = not reports
        assert comm.allreduce(ok, op=MPI.LAND)
    finally:
        comm.Barrier()
        work.Free()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
def test_ranks_leave_together_with_the_highest_status(comm):
    """Every rank leaves with the highest status; one that never comes is reported by
    the others after the timeout, nobody hangs."""
    work = comm.Dup()
    try:
        rank, size = work.Get_rank(), work.Get_size()
        ok = leave_together(3 if rank == size - 1 else 0, work, timeout=20) == 3
        reports = []
        if rank != size - 1:
            ok &= leave_together(0, work, timeout=1.0, abort=reports.append) == 0
            ok &= len(reports) == 1 and reports[0].startswith(f"hpcpax: rank {rank} (") \
                and "not every rank did within 1 s (HPCPAX_TIMEOUT); ending the job with " \
                "status 0" in reports[0]
        comm.Barrier()
        if rank == size - 1:
            ok &= leave_together(0, work, timeout=20) == 0  # completes the others' request
        assert comm.allreduce(ok, op=MPI.LAND)
    finally:
        comm.Barrier()
        work.Free()


@pytest.mark.timeout(150)
def test_rank_stuck_before_the_trainer_starts_is_named(tmp_path):
    """Rank 2 hangs before the trainer starts (as in a hung import): the others do not
    wait forever in their first collective; rank 0 names rank 2."""
    serial_only()
    status, elapsed, text = _fault(tmp_path, lambda job, run_dir: job.pids(),
                                   RELIABILITY_EARLY_HANG_RANK=2)
    assert status != 0 and elapsed < BOUND + 20  # start-up of 4 ranks included
    assert "hpcpax start-up: ranks [2] of 4 did not arrive within 8 s" in text, text
