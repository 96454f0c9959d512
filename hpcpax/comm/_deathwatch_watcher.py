"""The host's watcher process of :mod:`hpcpax.comm.deathwatch` (standard library only).

Run as ``python -I -S _deathwatch_watcher.py ADDRESS NODE_RANKS WORLD`` by
the host's first rank: listens on the abstract socket ``ADDRESS``, prints
``listening`` on its standard output (then closes it), takes one connection
per rank of the host, and follows each: ``hello {json}`` (rank, host, pid,
role), ``op TEXT`` (what the rank does now), ``bye`` (it ends on purpose) or
``abort`` (it ends the job with its own report). A connection that closes
with neither is a rank that ended without finishing; the first one is
reported on standard error once the host's other ranks are gone (at most
``LINGER`` seconds later). It imports nothing from hpcpax and never MPI.
"""

import json
import os
import select
import socket
import sys
import time

#: Seconds to wait for every rank of the host to connect.
ACCEPT_SECONDS = 120.0
#: Seconds to wait, after the first rank ended, for the host's other ranks.
LINGER = 2.0


class Rank:
    def __init__(self, sock):
        self.sock = sock
        self.buffer = b""
        self.info = {}
        self.op = None
        self.ending = None  # "bye" | "abort" | "died"
        self.ended_at = None
        self.ended_wall = None
        self.abort_at = None

    def feed(self, data):
        self.buffer += data
        while b"\n" in self.buffer:
            line, self.buffer = self.buffer.split(b"\n", 1)
            word, _, rest = line.decode(errors="replace").partition(" ")
            if word == "hello":
                try:
                    self.info = json.loads(rest)
                except ValueError:
                    pass
            elif word == "op":
                self.op = rest
            elif word in ("bye", "abort"):
                self.ending = word
                if word == "abort":
                    self.abort_at = time.monotonic()


def main(argv):
    address, node_ranks, world = argv[1], int(argv[2]), int(argv[3])
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind("\0" + address)
    listener.listen(node_ranks)
    os.write(1, b"listening\n")
    os.close(1)
    os.open(os.devnull, os.O_WRONLY)  # fd 1 again, so that nothing writes to a closed pipe
    ranks = {}
    poller = select.poll()
    poller.register(listener.fileno(), select.POLLIN)
    deadline = time.monotonic() + ACCEPT_SECONDS
    first_death = None
    while True:
        if first_death is not None:
            timeout = max(0.0, first_death + LINGER - time.monotonic())
        elif len(ranks) < node_ranks:
            timeout = max(0.0, deadline - time.monotonic())
        else:
            timeout = None
        open_ranks = [r for r in ranks.values() if r.ended_at is None]
        if len(ranks) >= node_ranks or time.monotonic() > deadline:
            if listener is not None:
                poller.unregister(listener.fileno())
                listener.close()
                listener = None
            if not open_ranks:
                break
        if first_death is not None and time.monotonic() >= first_death + LINGER:
            break
        events = poller.poll(None if timeout is None else timeout * 1000.0)
        now = time.monotonic()
        for fd, _ in events:
            if listener is not None and fd == listener.fileno():
                conn, _ = listener.accept()
                ranks[conn.fileno()] = Rank(conn)
                poller.register(conn.fileno(), select.POLLIN)
                continue
            rank = ranks[fd]
            try:
                data = rank.sock.recv(65536)
            except OSError:
                data = b""
            if data:
                rank.feed(data)
                continue
            poller.unregister(fd)
            rank.sock.close()
            rank.ended_at = now
            rank.ended_wall = time.time()
            if rank.ending is None:
                rank.ending = "died"
                if first_death is None:
                    first_death = now
    report(list(ranks.values()), world)


def report(ranks, world):
    died = sorted((r for r in ranks if r.ending == "died"), key=lambda r: r.ended_at)
    if not died:
        return
    first = died[0]
    if any(r.abort_at is not None and r.abort_at <= first.ended_at for r in ranks):
        return  # a rank ended the job with its own report before any rank died
    together = [r for r in died if r.ended_at == first.ended_at]
    later = [r for r in ranks if r.ended_at is not None and r.ended_at > first.ended_at]
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
