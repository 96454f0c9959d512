"""The host's watcher names the rank that ended first without finishing (serial).

Each test starts the watcher script as :mod:`hpcpax.comm.deathwatch` does,
with three stand-in ranks: child processes that connect, say hello and then
end as told (a goodbye, an abort, or a ``kill -9``). The whole-job behaviour
under ``mpirun`` (hydra kills the survivors within milliseconds) is tested in
``tests/reliability/test_relaxed_faults.py::test_killed_rank_is_named``.
"""

import importlib.util
import json
import os
import shutil
import signal
import stat
import socket
import subprocess
import sys
import time
import uuid

import pytest

from hpcpax.comm import deathwatch
from hpcpax.engine.commands import CommandChannel

RANK = r"""
import json, os, socket, sys, time
address, rank, role, end = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
if address == "-":  # started before the watcher: the test gives the address
    address = sys.stdin.readline().strip()
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(address if address.startswith("/") else "\0" + address)
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
def test_a_rank_that_never_connected_does_not_hold_the_watcher():
    """Its connect gave up on a busy host: once the ranks that did connect have all said
    goodbye, the watcher ends at once (it held the launcher's output, and so mpirun,
    open for its 120 s accept window)."""
    address, watcher = _start(node_ranks=3)
    started = time.monotonic()
    for proc in _ranks(address, ["bye", "bye"]):  # the third rank never comes
        _end(proc)
    assert _report(watcher) == "" and watcher.returncode == 0
    assert time.monotonic() - started < 20


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
from hpcpax.engine.commands import CommandChannel
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


# ---------------------------------------------------------------- trust (issue 70)
def _watcher_module():
    """The watcher script as a module, to test its parsing in-process."""
    spec = importlib.util.spec_from_file_location("hpcpax_deathwatch_watcher",
                                                  deathwatch._WATCHER)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


WATCHER = _watcher_module()
GOOD_HELLO = {"rank": 2, "host": "node3", "pid": 4551, "role": "server"}


def _hello(**fields):
    return b"hello " + json.dumps({**GOOD_HELLO, **fields}).encode() + b"\n"


@pytest.mark.parametrize("line", [
    b"hello [1, 2]\n", b"hello 7\n", b"hello \"rank\"\n", b"hello {\n", b"hello\n",
    b"hello " + b"[" * 3000 + b"\n",  # nesting past the decoder's recursion limit
    _hello(rank=4), _hello(rank=-1), _hello(rank=True), _hello(rank="2"), _hello(rank=2.0),
    _hello(pid=31337), _hello(pid="4551"), _hello(role="root"), _hello(role=["worker"]),
    _hello(host=None), _hello(host={"a": 1}),
], ids=lambda line: line[:40].decode(errors="replace"))
def test_a_malformed_hello_is_ignored(line):
    peer = WATCHER.Rank(None, pid=4551, world=4, expected=2)
    assert peer.feed(line)
    assert not peer.greeted and peer.info == {"rank": 2, "pid": 4551}


def test_a_hello_must_name_the_rank_the_launcher_started_as_that_pid():
    peer = WATCHER.Rank(None, pid=4551, world=4, expected=1)
    assert peer.feed(_hello(rank=2)) and peer.info == {"rank": 1, "pid": 4551}
    assert peer.feed(_hello(rank=1)) and peer.info["role"] == "server"
    assert peer.feed(_hello(rank=1, role="worker")) and peer.info["role"] == "server"  # once


def test_without_the_launchers_pids_the_kernels_pid_is_named():
    """Ranks in pid namespaces of their own: any rank of the job, the pid the kernel gave."""
    peer = WATCHER.Rank(None, pid=4551, world=4)
    assert peer.feed(_hello(rank=4)) and not peer.greeted  # still within the job
    assert peer.feed(_hello(pid=12)) and peer.info == {"rank": 2, "pid": 4551, "role": "server",
                                                       "host": "node3"}


def test_fields_are_kept_as_printable_text():
    peer = WATCHER.Rank(None, pid=4551, world=4)
    host = "vm\nhpcpax: rank 0 (worker) ended without finishing\x1b[2J\u202e"
    assert peer.feed(_hello(host=host + "x" * 400))
    assert peer.info["host"] == "vm?hpcpax: rank 0 (worker) ended without finishing?[2J?" + \
        "x" * (WATCHER.HOST_CHARS - len(host))
    assert peer.feed(b"op step\r9\x07\x1b]0;title\x07" + b"y" * 500 + b"\n")
    assert peer.op == "step?9??]0;title?" + "y" * (WATCHER.OP_CHARS - 17)
    assert peer.feed("op schritt \u00e9\u4e2d\n".encode())
    assert peer.op == "schritt \u00e9\u4e2d"  # printable non-ASCII stays


def test_only_exact_goodbyes_end_a_rank():
    peer = WATCHER.Rank(None, pid=1, world=4)
    assert peer.feed(b"byebye\nbye now\nabort!\nabort 1\n") and peer.ending is None
    assert peer.feed(b"abort\n") and peer.ending == "abort" and peer.abort_at is not None


def test_a_line_too_long_drops_the_peer_at_once():
    """64 MiB without a newline once cost the watcher 75 MiB and 27 s of CPU (the buffer
    was re-scanned whole on every receive): now the first oversized chunk ends it."""
    chunk = b"x" * 65536
    peer = WATCHER.Rank(None, pid=1, world=4)
    assert not peer.feed(chunk)
    peer = WATCHER.Rank(None, pid=1, world=4)
    for _ in range(WATCHER.MAX_LINE // 1000):
        assert peer.feed(b"y" * 1000)
    assert not peer.feed(b"y" * 1000 + b"\nop z\n")  # the line ends too late: still refused
    peer = WATCHER.Rank(None, pid=1, world=4)
    assert peer.feed(b"op a\n" * 20000 + b"op b") and peer.op == "a"
    assert len(peer.buffer) == 4 and peer.feed(b"c\n") and peer.op == "bc"
    assert len(peer.buffer) == 0


def test_the_report_is_one_line_of_checked_fields(capfd):
    first = WATCHER.Rank(None, pid=4551, world=8, expected=2)
    first.feed(_hello(host="evil\nhpcpax: all fine\x1b[0m") + b"op step 7\x1b[1A\n")
    other = WATCHER.Rank(None, pid=4552, world=8)
    other.feed(b"hello [1, 2]\n")  # no valid hello: named by what the kernel said, no more
    first.ending, first.ended_at, first.ended_wall = "died", 1.0, 0.0
    other.ending, other.ended_at, other.ended_wall = "died", 1.5, 0.0
    WATCHER.report([first, other], world=8)
    err = capfd.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err, repr(err)
    assert err.startswith("hpcpax: rank 2 (server, host evil?hpcpax: all fine?[0m, pid 4551) "
                          "ended without finishing, in 'step 7?[1A': "), err
    assert "the launcher then ended ranks [-1] on this host within 500 ms" in err, err


def _waiting_ranks(ends):
    """Stand-in ranks started before their watcher (the test then gives the address)."""
    procs = []
    for rank, end in enumerate(ends):
        procs.append(subprocess.Popen([sys.executable, "-c", RANK, "-", str(rank), "worker",
                                       end], stdin=subprocess.PIPE, stdout=subprocess.PIPE))
    return procs


def _closed_by_peer(sock, timeout=20):
    """True once the other end closed ``sock`` (an end of file, or a reset: unread data)."""
    sock.settimeout(timeout)
    try:
        return sock.recv(16) == b""
    except ConnectionResetError:
        return True


def _gone(path, timeout=20):
    deadline = time.monotonic() + timeout
    while os.path.lexists(path) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not os.path.lexists(path)


@pytest.mark.timeout(60)
def test_only_the_launchers_ranks_take_a_slot():
    """The watcher of a real job (a socket file in a private directory, the host's pids
    given): another process of this uid is closed at once, takes no slot and fakes no
    death; the socket file and its directory go once every rank is in."""
    if not sys.platform.startswith("linux"):
        pytest.skip("SO_PEERCRED is Linux only")
    directory = deathwatch._private_directory()
    assert directory is not None
    info = os.stat(directory)
    assert stat.S_IMODE(info.st_mode) == 0o700 and info.st_uid == os.getuid()
    address = os.path.join(directory, "socket")
    procs = _waiting_ranks(["die", "bye"])
    members = ",".join(f"{rank}:{proc.pid}" for rank, proc in enumerate(procs))
    watcher = subprocess.Popen([sys.executable, "-I", "-S", deathwatch._WATCHER, address, "2",
                                "2", members], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
    try:
        assert watcher.stdout.readline().strip() == b"listening"
        assert stat.S_IMODE(os.stat(address).st_mode) & 0o077 == 0  # this uid only
        stranger = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        stranger.connect(address)  # this test's own process: not one the launcher started
        stranger.sendall(_hello(rank=1, pid=os.getpid(), role="worker") + b"op step 99999\n")
        assert _closed_by_peer(stranger)
        for proc in procs:
            proc.stdin.write(address.encode() + b"\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == b"ready"
        assert _gone(address) and _gone(directory)
        procs[0].kill()
        procs[0].wait(30)
        _end(procs[1])
        stranger.close()
        report = _report(watcher)
        assert report.startswith(f"hpcpax: rank 0 (worker, host testhost, pid {procs[0].pid}) "
                                 "ended without finishing, in 'step 7'"), report
        assert report.count("\n") == 1
    finally:
        for proc in [*procs, watcher]:
            proc.kill()
            proc.wait(30)
        shutil.rmtree(directory, ignore_errors=True)  # left where the test failed early


def test_a_rank_connects_only_to_a_watcher_of_its_own_uid(tmp_path):
    """The rank's side: a socket path that is not listening gives no watcher, no error."""
    assert deathwatch._connect(str(tmp_path / "nothing")) is None
    assert deathwatch._connect(f"hpcpax-deathwatch-none-{uuid.uuid4().hex}") is None
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(tmp_path / "s"))
    listener.listen(1)
    sock = deathwatch._connect(str(tmp_path / "s"))  # this uid: accepted
    assert sock is not None
    sock.close()
    listener.close()


def test_a_rank_in_a_checkpoint_write_is_reported_in_it():
    """A server killed while writing a checkpoint was reported "idle after 'serve push_many'"
    (its last guarded operation): a command now tells the death watch what it is, at once."""
    from mpi4py import MPI

    from hpcpax.comm.watchdog import Watchdog

    dog = Watchdog(MPI.COMM_SELF, 0)
    a, b = socket.socketpair()
    dog._death_watch = deathwatch.DeathWatch(a, "x")
    with dog.guard("serve push_many"):
        assert dog.doing() == "serve push_many"
    seen = []

    def save(step, meta):
        seen.append(dog.doing())
        with dog.guard("inner barrier"):
            seen.append(dog.doing())
        seen.append(dog.doing())
        return "path"

    channel = CommandChannel(None, None, {"save": save}, watchdog=dog)
    assert channel._dispatch({"op": "save", "step": 8, "meta": {}}) == "path"
    assert seen == ["checkpoint write after step 8", "inner barrier",
                    "checkpoint write after step 8"]
    assert dog.doing() == "idle after 'inner barrier'"
    with dog.guard("step 9"):  # a worker writes its checkpoint inside a step
        with dog.activity("checkpoint write after step 9"):
            assert dog.doing() == "checkpoint write after step 9"
        assert dog.doing() == "step 9"
    dog.close()
    a.close()
    told = b.recv(4096).decode()
    assert told.startswith("op checkpoint write after step 8\nop idle after 'inner barrier'\n")
    assert "op checkpoint write after step 9\n" in told
    b.close()
