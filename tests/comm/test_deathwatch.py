"""The host's watcher names the rank that ended first without finishing (serial).

Each test starts the watcher script as :mod:`hpcpax.comm.deathwatch` does,
with three stand-in ranks: child processes that connect, say hello and then
end as told (a goodbye, an abort, or a ``kill -9``). The whole-job behaviour
under ``mpirun`` (hydra kills the survivors within milliseconds) is tested in
``tests/reliability/test_relaxed_faults.py::test_killed_rank_is_named``.
"""

import os
import signal
import socket
import subprocess
import sys
import time
import uuid

import pytest

from hpcpax.comm import deathwatch

RANK = r"""
import json, os, socket, sys, time
address, rank, role, end = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + address)
hello = {"rank": rank, "host": "testhost", "pid": os.getpid(), "role": role}
s.sendall(("hello " + json.dumps(hello) + "\nop step 7\n").encode())
print("ready", flush=True)
sys.stdin.readline()  # the test says when to end
if end != "die":
    s.sendall((end + "\n").encode())
"""


def _start(node_ranks=3, world=3):
    if not sys.platform.startswith("linux"):
        pytest.skip("abstract sockets are Linux only")
    address = f"hpcpax-deathwatch-test-{uuid.uuid4().hex[:12]}"
    watcher = subprocess.Popen([sys.executable, "-I", "-S", deathwatch._WATCHER, address,
                                str(node_ranks), str(world)], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, stdin=subprocess.DEVNULL)
    assert watcher.stdout.readline().strip() == b"listening"
    return address, watcher


def _ranks(address, ends, roles=None):
    procs = []
    for rank, end in enumerate(ends):
        role = (roles or {}).get(rank, "worker")
        proc = subprocess.Popen([sys.executable, "-c", RANK, address, str(rank), role, end],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert proc.stdout.readline().strip() == b"ready"
        procs.append(proc)
    time.sleep(0.2)  # every hello is read
    return procs


def _end(proc):
    proc.stdin.write(b"go\n")
    proc.stdin.flush()
    proc.wait(30)


def _report(watcher):
    _, err = watcher.communicate(timeout=30)
    return err.decode()


@pytest.mark.timeout(60)
def test_the_killed_rank_is_named_not_the_ones_ended_after_it():
    address, watcher = _start()
    procs = _ranks(address, ["die", "die", "die"], roles={0: "server"})
    procs[1].kill()  # SIGKILL, as the OOM killer or a user would
    procs[1].wait(30)
    time.sleep(0.05)
    for proc in (procs[0], procs[2]):  # "the launcher's clean-up"
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    report = _report(watcher)
    assert report.count("\n") == 1, report
    assert report.startswith(f"hpcpax: rank 1 (worker, host testhost, pid {procs[1].pid}) "
                             "ended without finishing, in 'step 7': killed, crashed or out of "
                             "memory (it left no error of its own); the launcher then ended "
                             "ranks [0, 2] on this host within "), report
    assert watcher.returncode == 0


@pytest.mark.timeout(60)
def test_ranks_that_say_goodbye_are_not_reported():
    address, watcher = _start()
    for proc in _ranks(address, ["bye", "bye", "bye"]):
        _end(proc)
    assert _report(watcher) == ""
    assert watcher.returncode == 0


@pytest.mark.timeout(60)
def test_a_rank_that_aborts_with_its_own_report_silences_the_watcher():
    address, watcher = _start()
    procs = _ranks(address, ["abort", "die", "die"])
    _end(procs[0])
    for proc in procs[1:]:
        proc.kill()
        proc.wait(30)
    assert _report(watcher) == ""


@pytest.mark.timeout(60)
def test_a_death_before_an_abort_is_still_named():
    address, watcher = _start()
    procs = _ranks(address, ["die", "abort", "bye"])
    procs[0].kill()
    procs[0].wait(30)
    time.sleep(0.05)
    _end(procs[1])
    _end(procs[2])
    report = _report(watcher)
    assert report.startswith(f"hpcpax: rank 0 (worker, host testhost, pid {procs[0].pid}) "
                             "ended without finishing"), report


@pytest.mark.timeout(60)
def test_on_a_job_over_several_hosts_the_line_is_stamped_with_the_time():
    address, watcher = _start(node_ranks=2, world=4)
    procs = _ranks(address, ["die", "bye"])
    procs[0].kill()
    procs[0].wait(30)
    _end(procs[1])
    report = _report(watcher)
    assert "ended without finishing" in report and "[at " in report, report
    assert "the earliest such line names the rank that went first" in report, report


@pytest.mark.timeout(60)
def test_the_watcher_ends_when_no_rank_connects():
    """A host whose ranks never connect (they died first) does not keep the launcher
    waiting on the watcher's standard error for more than its accept window."""
    script = open(deathwatch._WATCHER).read().replace("ACCEPT_SECONDS = 120.0",
                                                       "ACCEPT_SECONDS = 0.5")
    address = f"hpcpax-deathwatch-test-{uuid.uuid4().hex[:12]}"
    started = time.monotonic()
    out = subprocess.run([sys.executable, "-I", "-S", "-c", script, address, "2", "2"],
                         capture_output=True, timeout=30)
    assert out.stdout == b"listening\n" and out.stderr == b""
    assert time.monotonic() - started < 10


def test_without_mpi_peers_nothing_is_started():
    from mpi4py import MPI

    watch = deathwatch.DeathWatch(None, None)
    watch.note("step 1")
    watch.farewell()  # nothing to tell: no error
    if MPI.COMM_WORLD.Get_size() == 1:
        assert deathwatch.start_death_watch(MPI.COMM_WORLD).address is None


def test_notes_are_short_single_lines():
    a, b = socket.socketpair()
    watch = deathwatch.DeathWatch(a, "x")
    watch.note("step\n12 " + "x" * 500)
    watch.note("step\n12 " + "x" * 500)  # the same again is not resent
    watch.farewell()
    data = b.recv(4096).decode()
    assert data.count("\n") == 2 and data.startswith("op step 12 x") and data.endswith("bye\n")
    assert len(data.splitlines()[0]) == len("op ") + 200
    b.close()


def test_a_forked_child_does_not_hold_the_ranks_socket():
    """A data loader's forked worker must not keep the rank's socket open after the
    rank ends (the watcher would see the end late), nor say goodbye for it."""
    a, b = socket.socketpair()
    watch = deathwatch.DeathWatch(a, "x")
    pid = os.fork()
    if pid == 0:  # the child: what register_at_fork runs, then a normal exit
        watch._forget()
        watch.farewell()
        os._exit(0)
    os.waitpid(pid, 0)
    b.settimeout(0.2)
    with pytest.raises(socket.timeout):
        b.recv(16)  # the child said nothing
    a.close()  # the "rank" ends: the socket is closed, no copy left in the child
    assert b.recv(16) == b""
    b.close()


COMM_SELF_FIRST = r"""
from mpi4py import MPI
from hpcpax.comm import deathwatch
assert deathwatch.start_death_watch(MPI.COMM_SELF).address is None
watch = deathwatch.start_death_watch(MPI.COMM_WORLD)  # collective: every rank joins
started = MPI.COMM_WORLD.gather(watch.address is not None)
if MPI.COMM_WORLD.Get_rank() == 0:
    print("started", started, flush=True)
"""


@pytest.mark.timeout(120)
def test_a_one_rank_probe_first_does_not_hang_the_jobs_start():
    """Ranks that used hpcpax on COMM_SELF first (a one-rank probe) still start the
    job's watcher later. Before, the probe's stand-in was kept: where every rank
    probed first the job had no watcher (this test), where only some did the
    others waited for them in the split (a hang)."""
    from mpi4py import MPI

    if MPI.COMM_WORLD.Get_size() > 1 or not sys.platform.startswith("linux"):
        pytest.skip("starts its own mpirun; serial suite on Linux only")
    mpirun = os.path.join(os.path.dirname(sys.executable), "mpirun")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPI", "OMPI_", "PMIX_"))}
    done = subprocess.run([mpirun if os.path.exists(mpirun) else "mpirun", "-n", "2",
                           sys.executable, "-c", COMM_SELF_FIRST],
                          capture_output=True, text=True, timeout=90, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "started [True, True]" in done.stdout, done.stdout + done.stderr[-2000:]
