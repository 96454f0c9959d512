"""Numba's on-disk cache made safe for many ranks compiling at once.

Numba's cache updates a function's index (signature -> data file) by
read-modify-write, without a lock. Two processes that compile two signatures
of one kernel at the same moment can both pick data file ``1``; the index
then sends one signature to the other's machine code. Every later process
that loads that signature runs code compiled for other types: float64 rows
read as int64, or float32 code writing 8-byte rows into a 4-byte table,
which corrupts the heap. Four ranks compiling on their first run made this
happen here (a race of six processes left such an index in 3 of 25 tries).

:func:`guard_module` wraps each cached kernel of a module so that

- loading a signature the cache holds takes a *shared* ``flock`` on one lock
  file in the cache's directory (the ranks of a node load at once; loading
  costs each process about 0.6 s of Numba's own set-up, which an exclusive
  lock made the ranks pay one after the other);
- compiling a signature the cache lacks, and writing it, holds the lock
  *exclusively* (one rank compiles, the others then load its result);
- an entry whose stored signature is not the one asked for is ignored and
  compiled afresh (an index left wrong by an earlier, unguarded run heals).

What the job does not trust (its trust boundary: its own user and run
directory): a cache directory or lock file that another user may write (Numba's
cache files are pickles, run on load) is not used, and a lock that another
process holds for longer than ``HPCPAX_NUMBA_LOCK_SECONDS`` (60) is given up with a warning
naming its holder. In both cases, and where the directory refuses the lock (a
filesystem without ``flock``), the kernels of that directory compile without
the cache in this process, once a run (``NUMBA_CACHE_DIR`` on a local disk of
your own avoids it).
"""

from __future__ import annotations

import os
import stat
import sys
import threading
import time
from contextlib import contextmanager

__all__ = ["guard", "guard_module", "LOCK_NAME"]

#: The lock file's name in each cache directory.
LOCK_NAME = "hpcpax-numba-cache.lock"

_HELD = threading.local()  # lock files this thread holds (a compile nests others)
_WARNED = set()
_UNTRUSTED = {}  # cache directory -> why its kernels compile uncached here


class _Miss(Exception):
    """Raised in place of compiling while only the shared (loading) lock is held."""


def guard(dispatcher):
    """Make ``dispatcher``'s (a ``numba.njit(cache=True)`` function) use of the
    on-disk cache safe against other processes and users; returns it.
    Idempotent; a dispatcher without a cache is returned as is."""
    cache = getattr(dispatcher, "_cache", None)
    path = getattr(cache, "_cache_path", None)
    if path is None or getattr(dispatcher, "_hpcpax_guarded", False):
        return dispatcher
    compile_ = dispatcher.compile
    index = cache._cache_file
    load = index.load

    def compile(sig):
        if not _in_cache(dispatcher):  # untrusted or given up: Numba's own compile
            return compile_(sig)
        lock = os.path.join(cache._cache_path, LOCK_NAME)
        if lock in _held():  # a nested compile: the outer one holds the lock
            return compile_(sig)
        try:
            with _locked(dispatcher, cache, shared=True), _loading_only(dispatcher):
                return compile_(sig)
        except _Miss:
            pass
        with _locked(dispatcher, cache, shared=False):
            return compile_(sig)

    def load_entry(key):
        data = load(key)
        if data is not None and not _same_args(data, key):
            return None  # another signature's code: compile this one afresh
        return data

    dispatcher.compile = compile
    index.load = load_entry
    dispatcher._hpcpax_guarded = True
    return dispatcher


def guard_module(namespace) -> None:
    """:func:`guard` every cached Numba function in ``namespace`` (a module's
    ``globals()``)."""
    from numba.core.dispatcher import Dispatcher  # noqa: PLC0415

    for value in list(namespace.values()):
        if isinstance(value, Dispatcher):
            guard(value)


def _same_args(data, key) -> bool:
    """Whether a cache entry's stored signature (an item of its data) is the
    index key's (its first item); True where none is found to compare."""
    from numba.core.typing.templates import Signature  # noqa: PLC0415

    stored = next((item for item in data if isinstance(item, Signature)), None)
    return stored is None or tuple(stored.args) == tuple(key[0])


def _held() -> set:
    held = getattr(_HELD, "paths", None)
    if held is None:
        held = _HELD.paths = set()
    return held


@contextmanager
def _loading_only(dispatcher):
    """Within it, a cache miss raises :class:`_Miss` instead of compiling."""
    compiler = dispatcher._compiler
    real = compiler.compile

    def refuse(*args, **kwargs):
        raise _Miss()

    compiler.compile = refuse
    try:
        yield
    finally:
        compiler.compile = real


def _in_cache(dispatcher) -> bool:
    """Whether ``dispatcher`` still uses its on-disk cache (checks its directory's
    owner and mode once a process; an untrusted one switches it to no cache)."""
    from numba.core.caching import NullCache  # noqa: PLC0415

    cache = dispatcher._cache
    if isinstance(cache, NullCache):
        return False
    directory = cache._cache_path
    if directory not in _UNTRUSTED:
        _UNTRUSTED[directory] = _untrusted_reason(directory)
    if _UNTRUSTED[directory]:
        _uncached(dispatcher, directory, _UNTRUSTED[directory])
        return False
    return True


def _untrusted_reason(directory: str) -> str | None:
    """Why the cache ``directory`` (and its lock file) cannot be trusted, or None:
    another user (but root) owns it or may write it, or may write a folder above
    it without the sticky bit (and so swap the cache for one of their own)."""
    me = os.geteuid()
    for path in (os.path.join(directory, LOCK_NAME), directory):
        try:
            info = os.lstat(path)
        except FileNotFoundError:
            continue  # Numba creates the directory, _locked the lock file (ours)
        except OSError as exc:
            return str(exc)
        if stat.S_ISLNK(info.st_mode):
            return f"{path} is a symbolic link"
        if info.st_uid not in (me, 0):
            return f"{path} belongs to uid {info.st_uid}"
        if info.st_mode & 0o022:
            return f"{path} is writable by other users (mode {info.st_mode & 0o777:o})"
    above = os.path.dirname(os.path.abspath(directory))
    while True:
        try:
            info = os.stat(above)
        except FileNotFoundError:
            info = None  # made later, by this process
        except OSError as exc:
            return str(exc)
        if info is not None:
            if info.st_uid not in (me, 0):
                return f"{above} belongs to uid {info.st_uid}"
            if info.st_mode & 0o022 and not info.st_mode & stat.S_ISVTX:
                return f"{above} is writable by other users (mode {info.st_mode & 0o777:o})"
        parent = os.path.dirname(above)
        if parent == above:
            return None
        above = parent


def _lock_holder(path: str) -> str:
    """``pid N (uid U)`` of a process holding a lock on ``path`` (``/proc/locks``)."""
    try:
        info = os.stat(path)
        wanted = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
        with open("/proc/locks", encoding="ascii") as handle:
            for line in handle:
                fields = line.split()
                if len(fields) > 5 and fields[5] == wanted and "->" not in line:
                    pid = fields[4]
                    try:
                        uid = os.stat(f"/proc/{pid}").st_uid
                    except OSError:
                        uid = "?"
                    return f"pid {pid} (uid {uid})"
    except (OSError, ValueError):
        pass
    return "an unknown process"


def _acquire(fd, mode, path, budget_s=None) -> bool:
    """``flock(fd, mode)`` within ``budget_s`` (default ``HPCPAX_NUMBA_LOCK_SECONDS``: one
    kernel's compile takes seconds, its default 60 s is far beyond it); False when
    another process held the lock all that time."""
    import fcntl  # noqa: PLC0415  (POSIX only)

    if budget_s is None:
        from ..options import options  # noqa: PLC0415

        budget_s = options.numba_lock_seconds
    deadline, pause = time.monotonic() + budget_s, 0.001
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.05)


@contextmanager
def _locked(dispatcher, cache, shared=False):
    """Hold the cache directory's lock, shared (to load) or exclusive (to compile and
    write); re-entrant within a thread (compiling a kernel compiles the kernels it
    calls)."""
    try:
        import fcntl  # noqa: PLC0415  (POSIX only)
    except ImportError:  # no flock here: Numba's own, unlocked cache
        yield
        return
    held = _held()
    path = os.path.join(cache._cache_path, LOCK_NAME)
    if path in held:
        yield
        return
    try:
        cache._impl.locator.ensure_cache_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o600)
        info = os.fstat(fd)
        if info.st_uid == os.geteuid() and info.st_mode & 0o077:
            os.fchmod(fd, 0o600)  # one an older hpcpax left readable: others could flock it
    except OSError as exc:
        _uncached(dispatcher, path, exc)
        yield
        return
    try:
        try:
            acquired = _acquire(fd, fcntl.LOCK_SH if shared else fcntl.LOCK_EX, path)
        except OSError as exc:
            _uncached(dispatcher, path, exc)
            yield
            return
        if not acquired:
            from ..options import options  # noqa: PLC0415

            reason = (f"its lock {path} was held by {_lock_holder(path)} for over "
                      f"{options.numba_lock_seconds:g} s")
            _UNTRUSTED[cache._cache_path] = reason  # the module's other kernels too
            _uncached(dispatcher, path, reason)
            yield
            return
        held.add(path)
        try:
            yield
        finally:
            held.discard(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _uncached(dispatcher, path, exc) -> None:
    """No lock to be had, or a cache not to trust: this kernel compiles without the
    shared cache."""
    from numba.core.caching import NullCache  # noqa: PLC0415

    dispatcher._cache = NullCache()
    directory = path if os.path.isdir(path) else os.path.dirname(path)
    if directory not in _WARNED:
        _WARNED.add(directory)
        verb = "cannot lock" if isinstance(exc, OSError) else "not using"
        print(f"hpcpax: {verb} Numba's cache in {directory} ({exc}); its kernels compile "
              "in each process instead (set NUMBA_CACHE_DIR to a local directory of your own)",
              file=sys.stderr, flush=True)
