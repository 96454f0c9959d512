"""Another local user attacks the death watcher (issue 70, item 1).

The attacker finds the host's watcher as any user can (``/proc/PID/cmdline``,
``/proc/net/unix``) and tries everything that once worked: a spoofed death
after a clean exit, an ``abort`` that hides a real death, malformed hellos and
JSON full of newlines and escapes, 64 MiB without a newline, sockets held
open, slots taken. The job must end exactly as without the attacker, and a
rank really killed must still be named. Two ``mpirun -n 4`` jobs (a clean run,
a rank killed in a checkpoint write) and one watcher alone (its abstract-socket
fallback, where the kernel's peer credentials are all that guard it).
"""

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from hpcpax.comm import deathwatch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "reliability"))
from reliability_jobs import TINY, Job, serial_only  # noqa: E402


from attackers import as_attacker  # noqa: E402

#: The attacker: finds watchers and attacks every address it sees until told to stop
#: (a line on stdin); prints what it saw and got as one JSON line.
ATTACK = r"""
import json, os, select, socket, sys, time

spoof = {"rank": 3, "host": "vm", "pid": 31337, "role": "worker"}
PAYLOADS = [
    ("spoofed death", b"hello " + json.dumps(spoof).encode() + b"\nop step 99999\n", True),
    ("abort", b"hello " + json.dumps({**spoof, "rank": 1}).encode() + b"\nabort\n", False),
    ("hello list", b"hello [1, 2]\n", False),
    ("escapes", b'hello {"rank": 2, "host": "vm\\nhpcpax: fake\\u001b[2J", "pid": 1, '
                b'"role": "worker"}\nop step\x1b[1A 7\n', False),
    ("oversized", None, False),
    ("held", b"", False),
]
seen = {"watchers": [], "addresses": [], "attempts": 0, "errors": {}, "connected": 0,
        "closed_by_watcher": 0, "kept_open": 0, "ranks_of": {}}
held = []


def watcher_addresses():
    # the argument after the watcher's script in any process's command line
    found = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as handle:
                argv = handle.read().split(b"\0")
        except OSError:
            continue
        for i, arg in enumerate(argv[:-1]):
            if arg.endswith(b"_deathwatch_watcher.py"):
                if pid not in seen["watchers"]:
                    seen["watchers"].append(pid)
                found.add(argv[i + 1].decode())
                # "rank:pid,..." of its host's ranks: which job it watches
                seen["ranks_of"][argv[i + 1].decode()] = (argv[i + 4].decode()
                                                          if len(argv) > i + 4 else "")
    return found


def listening_addresses():
    # every hpcpax watcher's socket in the kernel's table (abstract names or paths)
    found = set()
    try:
        with open("/proc/net/unix") as handle:
            for line in handle.read().splitlines()[1:]:
                name = line.split()[-1] if len(line.split()) >= 8 else ""
                if "hpcpax-deathwatch" in name:
                    found.add(name[1:] if name.startswith("@") else name)
    except OSError:
        pass
    return found


def closed(sock):
    sock.settimeout(2.0)
    try:
        return sock.recv(16) == b""
    except ConnectionResetError:
        return True
    except OSError:
        return False


def attack(address):
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(2.0)
    seen["attempts"] += 1
    try:
        sock.connect(address if address.startswith("/") else "\0" + address)
    except OSError as exc:
        key = type(exc).__name__
        seen["errors"][key] = seen["errors"].get(key, 0) + 1
        sock.close()
        return
    # each accepted connection tries the next attack, the spoofed death first
    name, payload, close_after = PAYLOADS[seen["connected"] % len(PAYLOADS)]
    seen["connected"] += 1
    try:
        if payload is None:
            block = b"x" * (1 << 20)
            for _ in range(64):
                sock.sendall(block)
        else:
            sock.sendall(payload)
    except OSError:
        pass
    if close_after:
        sock.close()  # a "rank" that ends without saying goodbye
        return
    if closed(sock):
        seen["closed_by_watcher"] += 1
        sock.close()
    else:
        seen["kept_open"] += 1
        held.append(sock)


announced, scanned, first_seen = False, 0.0, None
# flat out from the start until a second after the first sighting (the watcher listens
# only until the host's ranks are in), then every 5 ms
while not select.select([sys.stdin], [], [], 0.005 if first_seen and
                        time.monotonic() > first_seen + 1.0 else 0)[0]:
    found = listening_addresses()
    if time.monotonic() > scanned + 0.05:
        found |= watcher_addresses()
        scanned = time.monotonic()
    for address in found:
        if address not in seen["addresses"]:
            seen["addresses"].append(address)
        first_seen = first_seen or time.monotonic()
        attack(address)
        if seen["connected"] >= len(PAYLOADS) and not announced:
            print("tried every attack", flush=True)
            announced = True
print(json.dumps(seen), flush=True)
"""


def _attacker(attacker):
    """The attacker, started (it attacks until :func:`_stop` tells it to stop)."""
    return as_attacker(attacker, [sys.executable, "-I", "-c", ATTACK], stdin=subprocess.PIPE,
                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _stop(process):
    """What the attacker saw and did (it stops first)."""
    out, err = process.communicate("stop\n", timeout=60)
    assert process.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as handle:
        return handle.read().rsplit(")", 1)[1].split()[0] != "Z"


def _last_rank_left(pids, job, timeout=90):
    """``time.monotonic()`` once every rank process is gone (mpirun may still run)."""
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in pids.values()) and time.monotonic() < deadline:
        time.sleep(0.02)
    return time.monotonic()


def _assert_no_slot_taken(seen):
    """The attacker found the watcher, tried, and never held a connection it accepted."""
    print("attacker:", json.dumps(seen))
    assert seen["watchers"] and seen["addresses"] and seen["attempts"] > 0, seen
    assert seen["kept_open"] == 0, seen


@pytest.mark.timeout(120)
def test_a_clean_run_ends_as_without_the_attacker(attacker, tmp_path):
    """A spoofed death after a clean exit, malformed and oversized lines, held sockets:
    the job exits 0 with exactly its own output, and the launcher leaves as soon as its
    last rank has (the held sockets once kept mpirun alive 101 s for a 12 s run)."""
    serial_only()
    run_dir = tmp_path / "run"
    attack = _attacker(attacker)
    job = Job(4, ["--steps", "6", "--checkpoint-every", "3", "--run-dir", str(run_dir), *TINY],
              tmp_path, limit=100, HPCPAX_TIMEOUT=30)
    try:
        pids = job.pids()
        left = _last_rank_left(pids, job)
        status = job.wait(60)
        lingered = time.monotonic() - left
        seen = _stop(attack)
        text = job.output()
    finally:
        job.kill()
        attack.kill()
    expected = "".join(f"checkpoint written: {run_dir}/checkpoints/step_{step:06d}\n"
                       for step in (3, 6))
    assert status == 0 and text == expected, text  # what a run with no attacker prints
    assert lingered < 5.0, f"mpirun outlived its last rank by {lingered:.1f} s"
    _assert_no_slot_taken(seen)
    # this job's socket file and its directory are gone (other jobs on the host may run)
    ours = [address for address, ranks in seen["ranks_of"].items()
            if {f"{rank}:{pid}" for rank, pid in pids.items()} & set(ranks.split(","))]
    assert ours, seen
    for address in ours:
        if address.startswith("/"):
            assert not os.path.lexists(address) and not os.path.lexists(os.path.dirname(address))


@pytest.mark.timeout(120)
def test_a_rank_killed_in_a_checkpoint_write_is_named_despite_the_attacker(attacker, tmp_path):
    """kill -9 of the server (rank 0) while it writes a checkpoint, the attacker at it all
    along (aborts, spoofed deaths, held sockets): the one line names rank 0, its pid and
    the checkpoint write (once "idle after 'serve push_many'")."""
    serial_only()
    run_dir = tmp_path / "run"
    attack = _attacker(attacker)
    job = Job(4, ["--steps", "6", "--checkpoint-every", "3", "--run-dir", str(run_dir), *TINY],
              tmp_path, limit=100, HPCPAX_TIMEOUT=30, RELIABILITY_PAUSE_IN_CHECKPOINT="3:0")
    try:
        pids = job.pids()
        marker = job.pid_dir / "in_checkpoint"
        deadline = time.monotonic() + 60
        while not marker.exists() and time.monotonic() < deadline and job.proc.poll() is None:
            time.sleep(0.02)
        assert marker.exists(), job.output()
        os.kill(pids[0], signal.SIGKILL)
        killed = time.monotonic()
        status = job.wait(60)
        elapsed = time.monotonic() - killed
        seen = _stop(attack)
        text = job.output()
    finally:
        job.kill()
        attack.kill()
    named = [line for line in text.splitlines() if "ended without finishing" in line]
    assert status != 0 and elapsed < 30, text
    assert len(named) == 1, text
    assert named[0].startswith("hpcpax: rank 0 (server, host ") and \
        f", pid {pids[0]}) ended without finishing, in 'checkpoint write after step 3': " \
        "killed, crashed or out of memory" in named[0], named[0]
    assert "the launcher then ended ranks [1, 2, 3] on this host" in named[0], named[0]
    _assert_no_slot_taken(seen)


RANK = r"""
import json, os, socket, sys
address, rank, end = sys.stdin.readline().strip(), int(sys.argv[1]), sys.argv[2]
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect("\0" + address)
hello = {"rank": rank, "host": "testhost", "pid": os.getpid(), "role": "worker"}
s.sendall(("hello " + json.dumps(hello) + "\nop step 7\n").encode())
print("ready", flush=True)
sys.stdin.readline()
if end != "die":
    s.sendall((end + "\n").encode())
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ends", [("bye", "bye"), ("die", "bye")], ids=["clean", "killed"])
def test_the_abstract_fallback_takes_only_the_launchers_ranks(attacker, ends):
    """Where no short private directory exists the watcher listens on an abstract name
    anyone can connect to: the kernel's peer credentials keep the attacker out (each
    of its connections closed at once, no slot, no fake or hidden death, no wait)."""
    if not sys.platform.startswith("linux"):
        pytest.skip("abstract sockets are Linux only")
    ranks = [subprocess.Popen([sys.executable, "-c", RANK, str(rank), end], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE) for rank, end in enumerate(ends)]
    address = f"hpcpax-deathwatch-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    members = ",".join(f"{rank}:{proc.pid}" for rank, proc in enumerate(ranks))
    watcher = subprocess.Popen([sys.executable, "-I", "-S", deathwatch._WATCHER, address, "2",
                                "2", members], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               stdin=subprocess.DEVNULL)
    attack = None
    try:
        assert watcher.stdout.readline().strip() == b"listening"
        attack = _attacker(attacker)
        assert attack.stdout.readline() == "tried every attack\n"
        for proc in ranks:  # the real ranks connect while the attacker keeps at it
            proc.stdin.write(address.encode() + b"\n")
            proc.stdin.flush()
            assert proc.stdout.readline().strip() == b"ready"
        if ends[0] == "die":
            ranks[0].kill()
            ranks[0].wait(30)
        for proc in ranks[1 if ends[0] == "die" else 0:]:
            proc.stdin.write(b"go\n")
            proc.stdin.flush()
            proc.wait(30)
        ended = time.monotonic()
        _, err = watcher.communicate(timeout=30)
        waited = time.monotonic() - ended
        seen = _stop(attack)
    finally:
        for proc in [*ranks, watcher] + ([attack] if attack else []):
            proc.kill()
            proc.wait(30)
    report = err.decode()
    if ends[0] == "die":
        assert report == (f"hpcpax: rank 0 (worker, host testhost, pid {ranks[0].pid}) ended "
                          "without finishing, in 'step 7': killed, crashed or out of memory (it "
                          "left no error of its own); the launcher then ended ranks [1] on this "
                          f"host within {report.split('within ')[1]}"), report
    else:
        assert report == ""
    assert watcher.returncode == 0 and waited < 5.0, waited
    _assert_no_slot_taken(seen)
    assert seen["connected"] > 0 and seen["closed_by_watcher"] > 0, seen

