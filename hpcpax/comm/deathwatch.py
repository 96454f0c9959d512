"""Name the rank that died first, from a process that outlives the job's ranks.

When a rank is killed (``kill -9``, the OOM killer, a segfault), the launcher
(MPICH's hydra) kills every other rank within milliseconds, before any of
them can notice the silence and say who went first; hydra's own banner then
often names a survivor's PID. :class:`DeathWatch` starts one small watcher
process per host (plain Python, no MPI, in a session of its own, so the
launcher's clean-up does not reach it). Every rank of the host holds a local
socket to it and sends its rank, role and current operation; a rank that
finishes says goodbye first (at exit, or before an abort it reports itself).
A socket that closes without a goodbye is a rank that ended without
finishing: its file descriptors close before the launcher can notice, so the
first such close is the rank that went first. The watcher then prints one
line on the rank's standard error, which the launcher still forwards (the
watcher holds it open), and exits::

    hpcpax: rank 2 (worker, host node3, pid 4551) ended without finishing, in 'step 130':
    killed, crashed or out of memory (it left no error of its own); the launcher then
    ended ranks [0, 1, 3] on this host within 41 ms

On a job over several hosts each host's watcher speaks for its own ranks and
stamps the line with the wall-clock time; the earliest line names the rank
that went first (the others ended by the launcher's clean-up after it).

Under Slurm the step's processes may be killed as one (its cgroup), watcher
included; ``srun``'s own ``srun: error: node3: task 2: Killed`` lines then name
the task.

Only the job's own ranks reach the watcher: its socket is a file in a new
directory of mode 0700 (under ``$XDG_RUNTIME_DIR`` or the temporary
directory; removed once every rank has connected), and the watcher takes a
connection only from a process of its own uid that is one of the host's
ranks (``SO_PEERCRED``: the pids the node's ranks gathered), each once.
Another user can neither take a rank's slot, nor fake or hide a death, nor
keep the job alive; lines are capped and their fields checked and printed
as plain text.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid

__all__ = ["DeathWatch", "start_death_watch", "announce_abort", "abort_job"]

_WATCHER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_deathwatch_watcher.py")
#: Seconds the node leader waits for its watcher to listen before going on without one.
_START_TIMEOUT = 20.0
#: Seconds a rank tries to connect to its watcher before going on unwatched.
_CONNECT_TIMEOUT = 5.0
#: Longest socket path (``sun_path`` holds 108 bytes with its terminating NUL).
_PATH_MAX = 107
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid
_ACTIVE = []  # the one DeathWatch of this process


class DeathWatch:
    """This rank's line to its host's watcher. Create with :func:`start_death_watch`.

    Attributes:
        address: the watcher's socket (a path, or an abstract name), or None when none runs.
    """

    def __init__(self, sock, address):
        self._sock = sock
        self._fd = sock.fileno() if sock is not None else -1
        self.address = address
        self._lock = threading.Lock()
        self._last = None

    def note(self, text: str) -> None:
        """Tell the watcher what this rank does now (one short line; never blocks)."""
        text = " ".join(str(text).split())[:200]
        if text == self._last:
            return
        self._last = text
        self._send(f"op {text}\n")

    def farewell(self) -> None:
        """This rank ends on purpose: the watcher stays silent about it. Idempotent."""
        self._send("bye\n")
        self._close()

    def announce_abort(self) -> None:
        """This rank is about to abort the job and has printed why: no second report."""
        self._send("abort\n")
        self._close()

    def _send(self, line: str) -> None:
        with self._lock:
            if self._sock is None:
                return
            try:
                self._sock.send(line.encode(), socket.MSG_DONTWAIT)
            except BlockingIOError:
                pass  # a full buffer: this note is dropped, the next one goes
            except OSError:
                self._sock = None  # the watcher is gone: nothing more to tell it

    def _forget(self) -> None:
        """In a forked child (a data loader's worker): drop this copy of the socket,
        silently, so that the rank's socket closes when the rank itself ends."""
        if self._sock is not None:
            try:
                self._sock.detach()
                os.close(self._fd)
            except OSError:
                pass
            self._sock = None
        self._lock = threading.Lock()

    def _close(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None


def start_death_watch(comm, role=None):
    """This process's :class:`DeathWatch` on ``comm``'s hosts; **collective** the first time.

    The first call on a communicator of the whole job (``COMM_WORLD`` or a
    duplicate) starts one watcher per host (the host's lowest rank spawns it) and connects every rank to it; later calls return
    the same object. Nothing is started on a one-rank communicator or
    where the watcher cannot start (then :attr:`DeathWatch.address` is None
    and every method does nothing).

    Args:
        comm: an mpi4py communicator, the same on every rank of it (on any
            other than the whole job's, nothing is started).
        role: what the rank is ("worker", "server"), for the report.
    """
    if _ACTIVE:
        return _ACTIVE[0]
    from mpi4py import MPI

    if not sys.platform.startswith("linux") or MPI.COMM_WORLD.Get_size() == 1:
        watch = DeathWatch(None, None)  # nothing to watch, ever
        _ACTIVE.append(watch)
        return watch
    if comm.Get_size() == 1:
        # a one-rank communicator inside a larger job (a probe on COMM_SELF): kept,
        # this one would make the job's later start skip this rank and the others
        # wait for it in the split
        return DeathWatch(None, None)
    if MPI.Comm.Compare(comm, MPI.COMM_WORLD) not in (MPI.IDENT, MPI.CONGRUENT):
        # only a call every rank of the job makes at the same point can start it
        # (a sub-communicator's ranks would wait in the split for the others)
        return DeathWatch(None, None)
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    try:
        # the watcher accepts exactly the processes the launcher started on this host
        members = node.gather((MPI.COMM_WORLD.Get_rank(), os.getpid(), _pid_namespace()),
                              root=0)
        address = None
        if node.Get_rank() == 0:
            address = _spawn_watcher(node.Get_size(), comm.Get_size(), members)
        address = node.bcast(address, root=0)
    finally:
        node.Free()
    sock = None
    if address is not None:
        sock = _connect(address)
        if sock is not None:
            hello = {"rank": MPI.COMM_WORLD.Get_rank(), "host": MPI.Get_processor_name(),
                     "pid": os.getpid(), "role": role}
            try:
                sock.sendall(("hello " + json.dumps(hello) + "\n").encode())
            except OSError:
                sock.close()
                sock = None
    watch = DeathWatch(sock, address if sock is not None else None)
    _ACTIVE.append(watch)
    atexit.register(watch.farewell)
    os.register_at_fork(after_in_child=watch._forget)
    return watch


def announce_abort() -> None:
    """Before an ``MPI_Abort`` that follows this rank's own report: keep the watcher silent."""
    if _ACTIVE:
        _ACTIVE[0].announce_abort()


def abort_job(status: int = 1, comm=None) -> None:
    """End the whole job now (``MPI_Abort``), after this rank printed why; never returns.

    The host's watcher is told first, so that it adds no second report.
    ``comm`` defaults to ``MPI.COMM_WORLD``.
    """
    from mpi4py import MPI

    announce_abort()
    (comm if comm is not None else MPI.COMM_WORLD).Abort(int(status))


def _spawn_watcher(node_ranks: int, world: int, members):
    """Start the host's watcher; its socket's address, or None if it did not start.

    ``members`` are the host's ``(rank, pid, pid namespace)``: the watcher takes no
    other process (any process of this uid where a rank's pid means another process to
    the watcher: a pid namespace of its own).
    """
    directory = _private_directory()
    if directory is not None:
        address = os.path.join(directory, "socket")
    else:  # no short private path: an abstract name, each peer's uid and pid checked
        address = f"hpcpax-deathwatch-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    # no launcher or MPI variables: the watcher is not a rank and must never look like one
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "PMIX_", "MPI", "HYDRA_", "HYDI_", "OMPI_"))}
    ranks = ""
    if all(namespace == _pid_namespace() for _, _, namespace in members):
        ranks = ",".join(f"{int(rank)}:{int(pid)}" for rank, pid, _ in members)
    try:
        process = subprocess.Popen(
            [sys.executable, "-I", "-S", _WATCHER, address, str(node_ranks), str(world), ranks],
            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, env=env,
            start_new_session=True, close_fds=True)
    except OSError:
        process = None
    ready = ""
    if process is not None:
        ready = _read_line(process.stdout, _START_TIMEOUT)
        process.stdout.close()
    if ready == "listening":
        return address
    if directory is not None:
        shutil.rmtree(directory, ignore_errors=True)
    return None


def _pid_namespace() -> str:
    """This process's pid namespace (``pid:[4026531836]``), or "" where none is shown."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _private_directory():
    """A new directory only this uid can enter (mode 0700), under ``$XDG_RUNTIME_DIR``
    or the temporary directory, whose socket path fits ``sun_path``; None if none does.

    A parent that another uid could rename our directory in (writable by others,
    not sticky) is passed over.
    """
    uid = os.getuid()
    for base in (os.environ.get("XDG_RUNTIME_DIR"), tempfile.gettempdir(), "/tmp"):
        if not base or not os.path.isabs(base):
            continue
        try:
            info = os.stat(base)
        except OSError:
            continue
        shared = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if not stat.S_ISDIR(info.st_mode) or (shared and not info.st_mode & stat.S_ISVTX) \
                or (info.st_uid not in (uid, 0)):
            continue
        if len(os.path.join(base, "hpcpax-deathwatch-XXXXXXXX", "socket").encode()) > _PATH_MAX:
            continue
        try:
            return tempfile.mkdtemp(prefix="hpcpax-deathwatch-", dir=base)  # mode 0700
        except OSError:
            continue
    return None


def _connect(address):
    """A socket connected to the watcher at ``address``, or None.

    The watcher must run as this uid (a socket another user listens on is never
    told anything), and a connect that does not go through within
    ``_CONNECT_TIMEOUT`` seconds (a flooded backlog) leaves this rank unwatched.
    """
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + _CONNECT_TIMEOUT
    try:
        sock.setblocking(False)
        while True:
            try:
                sock.connect(address if address.startswith("/") else "\0" + address)
                break
            except (BlockingIOError, InterruptedError):
                if time.monotonic() > deadline:
                    raise TimeoutError("the watcher's backlog stayed full") from None
                time.sleep(0.01)
        sock.setblocking(True)
        _, uid, _ = _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                        _CREDENTIALS.size))
        if uid != os.getuid():
            raise PermissionError("the watcher's socket belongs to another user")
    except OSError:
        sock.close()
        return None
    return sock


def _read_line(stream, timeout: float) -> str:
    import select

    ready, _, _ = select.select([stream], [], [], timeout)
    return stream.readline().decode().strip() if ready else ""
