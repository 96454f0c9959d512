"""Relaxed runs end, named, when a rank dies or goes silent (serial suite only).

Each test starts ``mpirun -n 4`` (1 server, 3 workers) of a relaxed run with
``HPCPAX_TIMEOUT=8``. Under ``ssp`` the others wait for a silent worker in
their pulls and their watchdogs name it; under ``asp`` nobody waits for it,
so the server names it: it has heard nothing from that worker for the
timeout. A stopped server leaves the workers' pulls unanswered.
"""

import signal
import time

import pytest

from reliability_jobs import TINY, Job, serial_only

TIMEOUT = 8
BOUND = 40  # seconds from the injection to the end of the job


def _job(tmp_path, consistency, *extra, **env):
    run_dir = tmp_path / "run"
    return Job(4, ["--steps", "2000", "--run-dir", str(run_dir), "--consistency", consistency,
                   *extra, *TINY], tmp_path, limit=150, HPCPAX_TIMEOUT=TIMEOUT, **env), run_dir


def _ended(job, injected):
    status = job.wait(BOUND + 40)
    elapsed = time.monotonic() - injected
    text = job.output()
    print(f"--- job ended {elapsed:.1f} s after the injection, exit {status}\n{text[-3000:]}")
    return status, elapsed, text


@pytest.mark.timeout(170)
@pytest.mark.parametrize("consistency,reporter", [("ssp:1", "'step "),
                                                  ("asp", "'relaxed server: waiting for rank 3'")])
def test_hanging_worker_is_named(tmp_path, consistency, reporter):
    """Rank 3 sleeps forever after its step 4: the job ends, naming it."""
    serial_only()
    job, _ = _job(tmp_path, consistency, RELIABILITY_HANG_RANK=3, RELIABILITY_HANG_STEP=4)
    try:
        job.pids()
        status, elapsed, text = _ended(job, time.monotonic())
    finally:
        job.kill()
    assert status != 0 and "hpcpax watchdog: rank" in text and reporter in text, text
    assert "rank 3 idle" in text and "after 'step 4'" in text, text
    # the watchdog's rank announced its abort: the hosts' watcher adds no second report
    assert "ended without finishing" not in text, text


@pytest.mark.timeout(170)
@pytest.mark.parametrize("consistency,victim,role", [("ssp:2", 3, "worker"), ("asp", 3, "worker"),
                                                     ("asp", 2, "worker"), ("asp", 0, "server")])
def test_killed_rank_is_named(tmp_path, consistency, victim, role):
    """kill -9 a rank mid-run: the job ends non-zero in bounded time and the host's
    watcher names the killed rank, its role and its PID, though hydra's banner names
    a survivor it ended in its clean-up (issue 49, item 7)."""
    serial_only()
    job, run_dir = _job(tmp_path, consistency, "--checkpoint-every", "3")
    try:
        pids = job.pids()
        job.wait_for_step(run_dir, 3)
        import os

        os.kill(pids[victim], signal.SIGKILL)
        status, elapsed, text = _ended(job, time.monotonic())
    finally:
        job.kill()
    assert status != 0 and elapsed < BOUND
    named = [line for line in text.splitlines() if "ended without finishing" in line]
    assert len(named) == 1, text
    assert named[0].startswith(f"hpcpax: rank {victim} ({role}, host ")
    # the operation it was in: a step, or the barrier of a checkpoint (every 3 steps)
    assert f", pid {pids[victim]}) ended without finishing" in named[0], named[0]
    others = sorted(set(range(4)) - {victim})
    assert f"the launcher then ended ranks {others} on this host" in named[0], named[0]


@pytest.mark.timeout(170)
def test_stopped_server_is_named_as_not_answering(tmp_path):
    """SIGSTOP the server mid-run under asp: the workers' pulls go unanswered and
    their watchdog names rank 0 as silent."""
    serial_only()
    job, run_dir = _job(tmp_path, "asp", "--checkpoint-every", "3")
    try:
        pids = job.pids()
        job.wait_for_step(run_dir, 3)
        import os

        os.kill(pids[0], signal.SIGSTOP)
        status, elapsed, text = _ended(job, time.monotonic())
    finally:
        job.kill()
    assert status != 0 and elapsed < BOUND
    assert "no answer from ranks [0] (dead or stopped?)" in text, text
