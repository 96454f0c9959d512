"""Another user against Numba's kernel cache (issue 70, item 3).

- The attacker holds the cache's lock (``flock(LOCK_EX)`` on a descriptor it
  opened while an older hpcpax had left the lock readable): this user's
  process waits ``HPCPAX_NUMBA_LOCK_SECONDS``, then compiles without the cache
  with one warning naming the holder, and computes the right answer.
- A ``NUMBA_CACHE_DIR`` the attacker made (its files are pickles, run on
  load) is not used: one warning naming its owner, the right answer, nothing
  read from it.
- The lock is created 0600 (nobody else can open it to hold it), and one an
  older hpcpax left readable is narrowed to 0600.
"""

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from attackers import as_attacker

pytest.importorskip("numba")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "ops"))
import test_numba_cache as _numba_cache_tests  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
#: tests/ops/test_numba_cache.py's kernel module, guarded, printing one result.
KERNEL = _numba_cache_tests.KERNEL + "\nimport numpy as np\nprint(total(np.arange(5, dtype=np.float64)))\n"



@pytest.fixture
def shared_tmp():
    """A folder under the system temp dir that every user may write, as /tmp (1777)."""
    path = Path(tempfile.mkdtemp(prefix="hpcpax-numba-attack-"))
    os.chmod(path, 0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _run_kernel(folder, cache_dir, **env):
    """This user's process running the guarded kernel; ``(CompletedProcess, seconds)``."""
    (folder / "kernel.py").write_text(KERNEL)
    environment = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir), GUARD="1",
                       PYTHONPATH=os.pathsep.join([str(folder), str(ROOT)]), **env)
    started = time.monotonic()
    done = subprocess.run([sys.executable, str(folder / "kernel.py")], cwd=folder,
                          env=environment, capture_output=True, text=True, timeout=120)
    return done, time.monotonic() - started


def _cache_path(cache_dir):
    """The folder Numba keeps ``kernel.py``'s cache in under ``cache_dir`` (after a run)."""
    locks = list(Path(cache_dir).rglob("hpcpax-numba-cache.lock"))
    assert len(locks) == 1, locks
    return locks[0]


@pytest.mark.timeout(120)
def test_a_lock_held_by_another_user_costs_its_budget_then_compiles_uncached(shared_tmp,
                                                                            attacker):
    cache = shared_tmp / "cache"
    cache.mkdir(mode=0o755)
    os.chmod(cache, 0o755)
    first, _ = _run_kernel(shared_tmp, cache)  # makes the cache (and the lock, 0600)
    assert first.returncode == 0 and first.stdout.split() == ["15.0"], first.stderr
    lock = _cache_path(cache)
    assert oct(lock.stat().st_mode & 0o777) == "0o600"
    # an older hpcpax left the lock readable: the attacker opens it and holds it
    os.chmod(lock, 0o644)
    for folder in [cache, *[p for p in cache.rglob("*") if p.is_dir()]]:
        os.chmod(folder, 0o755)
    holder = as_attacker(attacker, [sys.executable, "-I", "-c", textwrap.dedent(f"""
        import fcntl, sys, time
        fd = open({str(lock)!r}, "rb")
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        second, seconds = _run_kernel(shared_tmp, cache, HPCPAX_NUMBA_LOCK_SECONDS="1")
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode == 0 and second.stdout.split() == ["15.0"], second.stderr
    assert f"was held by pid {holder.pid} (uid {attacker[0]}) for over 1 s" in second.stderr
    assert "compile in each process instead" in second.stderr
    assert len(second.stderr.strip().splitlines()) == 1, second.stderr  # one line, no traceback
    assert seconds < 30
    assert oct(lock.stat().st_mode & 0o777) == "0o600"  # narrowed by this user's run


@pytest.mark.timeout(120)
def test_a_cache_directory_of_another_user_is_not_used(shared_tmp, attacker):
    cache = shared_tmp / "cache"
    made = as_attacker(attacker, ["/bin/mkdir", "-m", "0777", str(cache)])
    assert made.wait(timeout=30) == 0
    planted = cache / "planted.nbi"
    writer = as_attacker(attacker, ["/bin/sh", "-c", f"echo junk > {planted}"])
    assert writer.wait(timeout=30) == 0
    done, _ = _run_kernel(shared_tmp, cache)
    assert done.returncode == 0 and done.stdout.split() == ["15.0"], done.stderr
    assert f"belongs to uid {attacker[0]}" in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    # nothing of this user's was read or written there: no lock, no index, no code (Numba's
    # locator makes an empty folder for the module when it is imported, before any guard)
    assert [p.name for p in cache.rglob("*") if not p.is_dir()] == ["planted.nbi"]
