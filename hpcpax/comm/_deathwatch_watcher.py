"""The host's watcher process of :mod:`hpcpax.comm.deathwatch` (standard library only).

Run as ``python -I -S _deathwatch_watcher.py ADDRESS NODE_RANKS WORLD [RANK:PID,...]``
by the host's first rank. ``ADDRESS`` is a socket file (an absolute path, in a
directory only the job's uid can enter; the watcher removes both once every
rank has connected, and at exit) or else an abstract socket name. It prints
``listening`` on its standard output (then closes it), takes one connection
per rank of the host, and follows each: ``hello {json}`` (rank, host, pid,
role), ``op TEXT`` (what the rank does now), ``bye`` (it ends on purpose) or
``abort`` (it ends the job with its own report). A connection that closes
with neither is a rank that ended without finishing; the first one is
reported on standard error once the host's other ranks are gone (at most
``LINGER`` seconds later). It imports nothing from hpcpax and never MPI.

Trust: a connection counts only when the kernel says (``SO_PEERCRED``) that
its process runs as this watcher's uid and, where the ``RANK:PID`` list is
given, that it is one of those processes, once; any other is closed at once
and neither takes a rank's slot nor keeps the watcher (and so the launcher,
which waits for the watcher's standard error) alive. Every line is capped at
``MAX_LINE`` bytes (a peer that sends a longer one is dropped, silently),
every field is checked (a hello that names another rank or pid, an unknown
role, anything but a JSON object is ignored) and printed only as printable
text.
"""

import json
import os
import select
import socket
import struct
import sys
import time

#: Seconds to wait for every rank of the host to connect.
ACCEPT_SECONDS = 120.0
#: Seconds to wait, after the first rank ended, for the host's other ranks.
LINGER = 2.0
#: Longest line a rank may send, in bytes (a rank's hello or note is well under 1 KiB).
MAX_LINE = 4096
#: Longest operation and host name printed, in characters.
OP_CHARS, HOST_CHARS = 200, 255
#: What a rank may say it is (None: a rank of a job with no roles).
ROLES = (None, "worker", "server")
_CREDENTIALS = struct.Struct("3i")  # struct ucred: pid, uid, gid


def printable(text, limit):
    """``text`` cut to ``limit`` characters, each unprintable one (newline, escape,
    bidirectional control) shown as ``?``: what the watcher prints is one plain line."""
    return "".join(c if c.isprintable() else "?" for c in str(text)[:limit])


def peer_credentials(sock):
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket, per the kernel."""
    return _CREDENTIALS.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                               _CREDENTIALS.size))


def parse_ranks(text):
    """``{pid: rank}`` from ``RANK:PID,...`` (empty: any process of this uid may connect)."""
    ranks = {}
    for item in filter(None, text.split(",")):
        rank, _, pid = item.partition(":")
        ranks[int(pid)] = int(rank)
    return ranks


class Rank:
    """One accepted rank's connection: what it said, and how it ended.

    Args:
        sock: the connection.
        pid: the peer's pid, from the kernel.
        world: the job's size (a hello's rank must be below it).
        expected: the rank the launcher started as ``pid``, or None when not known.
    """

    def __init__(self, sock, pid, world, expected=None):
        self.sock = sock
        self.pid = pid
        self.world = world
        self.expected = expected
        self.buffer = bytearray()
        self.info = {"pid": pid} if expected is None else {"rank": expected, "pid": pid}
        self.greeted = False
        self.op = None
        self.ending = None  # "bye" | "abort" | "died" | "dropped"
        self.ended_at = None
        self.ended_wall = None
        self.abort_at = None

    def feed(self, data):
        """Take received bytes; False when the peer broke the protocol (a line too long).

        Linear in what arrives: only the new bytes and at most one unfinished line
        are searched, and the unfinished line never grows past ``MAX_LINE``.
        """
        start = len(self.buffer)
        self.buffer += data
        line_start = 0
        while True:
            end = self.buffer.find(b"\n", start)
            if end < 0:
                break
            if end - line_start > MAX_LINE:
                return False
            self.line(bytes(self.buffer[line_start:end]))
            line_start = start = end + 1
        del self.buffer[:line_start]
        return len(self.buffer) <= MAX_LINE

    def line(self, line):
        """Act on one line (without its newline); anything malformed is ignored."""
        word, _, rest = line.decode("utf-8", errors="replace").partition(" ")
        if word == "hello":
            self.hello(rest)
        elif word == "op":
            self.op = printable(rest, OP_CHARS)
        elif word in ("bye", "abort") and not rest:
            self.ending = word
            if word == "abort":
                self.abort_at = time.monotonic()

    def hello(self, text):
        """Take the first valid hello: a JSON object naming this peer's rank and pid.

        Where the launcher's pids are not known (a rank in a pid namespace of its own
        sees another pid than the kernel shows us), any rank of the job and any pid are
        taken; the report names the pid the kernel gave.
        """
        if self.greeted:
            return
        try:
            hello = json.loads(text)
        except (ValueError, RecursionError):
            return
        if not isinstance(hello, dict):
            return
        rank, pid, role, host = (hello.get(k) for k in ("rank", "pid", "role", "host"))
        if type(rank) is not int or not 0 <= rank < self.world:
            return
        if self.expected is not None and rank != self.expected:
            return
        if type(pid) is not int or pid <= 0 or role not in ROLES or not isinstance(host, str):
            return
        if self.expected is not None and pid != self.pid:
            return
        self.info = {"rank": rank, "pid": self.pid, "role": role,
                     "host": printable(host, HOST_CHARS)}
        self.greeted = True


class Listener:
    """The watcher's listening socket, and the file and directory it removes."""

    def __init__(self, address, backlog):
        self.path = address if address.startswith("/") else None
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        os.umask(0o077)  # the socket file: this uid only (its directory is already)
        self.sock.bind(self.path or "\0" + address)
        self.sock.listen(backlog)

    def close(self):
        """Stop listening; remove the socket file and its (then empty) directory."""
        if self.sock is None:
            return
        self.sock.close()
        self.sock = None
        if self.path is not None:
            for remove, path in ((os.unlink, self.path),
                                 (os.rmdir, os.path.dirname(self.path))):
                try:
                    remove(path)
                except OSError:
                    pass


def main(argv):
    address, node_ranks, world = argv[1], int(argv[2]), int(argv[3])
    expected = parse_ranks(argv[4]) if len(argv) > 4 else {}
    try:
        listener = Listener(address, node_ranks + 16)
    except OSError:
        return  # no socket: the rank that started us sees no "listening" and goes on without
    try:
        os.write(1, b"listening\n")
        os.close(1)
        os.open(os.devnull, os.O_WRONLY)  # fd 1 again, so that nothing writes to a closed pipe
        ranks = watch(listener, node_ranks, world, expected)
    finally:
        listener.close()
    report(ranks, world)


def watch(listener, node_ranks, world, expected):
    """Follow the host's ranks until they all ended (or ``LINGER`` after a death)."""
    ranks = {}
    poller = select.poll()
    poller.register(listener.sock.fileno(), select.POLLIN)
    deadline = time.monotonic() + ACCEPT_SECONDS
    first_death = None
    uid = os.getuid()
    while True:
        if first_death is not None:
            timeout = max(0.0, first_death + LINGER - time.monotonic())
        elif len(ranks) < node_ranks:
            timeout = max(0.0, deadline - time.monotonic())
        else:
            timeout = None
        open_ranks = [r for r in ranks.values() if r.ended_at is None]
        # every rank that connected left on purpose: the job is over on this host, and a
        # rank that never connected (its connect gave up on a busy host) went unwatched;
        # waiting for it would hold the launcher's output, and so mpirun, open
        finished = bool(ranks) and all(r.ending in ("bye", "abort", "dropped")
                                       for r in ranks.values()) and not open_ranks \
            and any(r.ending in ("bye", "abort") for r in ranks.values())
        if len(ranks) >= node_ranks or time.monotonic() > deadline or finished:
            if listener.sock is not None:
                poller.unregister(listener.sock.fileno())
                listener.close()
            if not open_ranks:
                break
        if first_death is not None and time.monotonic() >= first_death + LINGER:
            break
        events = poller.poll(None if timeout is None else timeout * 1000.0)
        now = time.monotonic()
        for fd, _ in events:
            if listener.sock is not None and fd == listener.sock.fileno():
                rank = accept(listener.sock, uid, world, expected, ranks)
                if rank is not None:
                    ranks[rank.sock.fileno()] = rank
                    poller.register(rank.sock.fileno(), select.POLLIN)
                continue
            rank = ranks[fd]
            try:
                data = rank.sock.recv(65536)
            except OSError:
                data = b""
            if data and rank.feed(data):
                continue
            poller.unregister(fd)
            rank.sock.close()
            rank.ended_at = now
            rank.ended_wall = time.time()
            if data:
                rank.ending = "dropped"  # broke the protocol: not a rank of ours, say nothing
            elif rank.ending is None:
                rank.ending = "died"
                if first_death is None:
                    first_death = now
    return list(ranks.values())


def accept(listener, uid, world, expected, ranks):
    """The next connection as a :class:`Rank`, or None where it is not one of the host's
    ranks (another uid, a process the launcher did not start, a pid already connected)."""
    try:
        conn, _ = listener.accept()
    except OSError:
        return None
    try:
        pid, peer_uid, _ = peer_credentials(conn)
    except OSError:
        conn.close()
        return None
    taken = {r.pid for r in ranks.values()}
    if peer_uid != uid or pid in taken or (expected and pid not in expected):
        conn.close()
        return None
    return Rank(conn, pid, world, expected.get(pid))


def report(ranks, world):
    died = sorted((r for r in ranks if r.ending == "died"), key=lambda r: r.ended_at)
    if not died:
        return
    first = died[0]
    if any(r.abort_at is not None and r.abort_at <= first.ended_at for r in ranks):
        return  # a rank ended the job with its own report before any rank died
    together = [r for r in died if r.ended_at == first.ended_at]
    later = [r for r in ranks if r.ended_at is not None and r.ended_at > first.ended_at
             and r.ending != "dropped"]
    info = first.info
    who = (f"rank {info.get('rank', '?')} ({info.get('role') or 'rank'}, "
           f"host {info.get('host', '?')}, pid {info.get('pid', '?')})")
    if len(together) > 1:
        who = "ranks " + str(sorted(r.info.get("rank", -1) for r in together)) + \
              f" (host {info.get('host', '?')}) together, first"
    where = f", in {first.op!r}" if first.op else ""
    line = (f"hpcpax: {who} ended without finishing{where}: killed, crashed or out of "
            f"memory (it left no error of its own)")
    if later:
        span = (max(r.ended_at for r in later) - first.ended_at) * 1000.0
        line += (f"; the launcher then ended ranks "
                 f"{sorted(r.info.get('rank', -1) for r in later)} on this host "
                 f"within {span:.0f} ms")
    if len(ranks) < world:
        wall = first.ended_wall
        stamp = time.strftime("%H:%M:%S", time.localtime(wall)) + f".{int(wall * 1000) % 1000:03d}"
        line += (f" [at {stamp} on this host's clock; on a job over several hosts the "
                 f"earliest such line names the rank that went first]")
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass  # the launcher is gone: nobody left to tell


if __name__ == "__main__":
    main(sys.argv)
