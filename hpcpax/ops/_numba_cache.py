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

- compiling or loading a new signature holds an exclusive ``flock`` on one
  lock file in the cache's directory (the ranks of a node, or of a shared
  filesystem that supports locks, take turns: one compiles, the others load);
- an entry whose stored signature is not the one asked for is ignored and
  compiled afresh (an index left wrong by an earlier, unguarded run heals).

Where the cache's directory refuses the lock (a filesystem without
``flock``), that kernel compiles without the cache in each process, once a
run, and a warning says so (``NUMBA_CACHE_DIR`` on a local disk avoids it).
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

__all__ = ["guard", "guard_module", "LOCK_NAME"]

#: The lock file's name in each cache directory.
LOCK_NAME = "hpcpax-numba-cache.lock"

_HELD = threading.local()  # lock files this thread holds (a compile nests others)
_WARNED = set()


def guard(dispatcher):
    """Make ``dispatcher``'s (a ``numba.njit(cache=True)`` function) use of the
    on-disk cache safe against other processes; returns it. Idempotent; a
    dispatcher without a cache is returned as is."""
    cache = getattr(dispatcher, "_cache", None)
    path = getattr(cache, "_cache_path", None)
    if path is None or getattr(dispatcher, "_hpcpax_guarded", False):
        return dispatcher
    compile_ = dispatcher.compile
    index = cache._cache_file
    load = index.load

    def compile(sig):
        with _locked(dispatcher, cache):
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


@contextmanager
def _locked(dispatcher, cache):
    """Hold the cache directory's lock (re-entrant within a thread: compiling a
    kernel compiles the kernels it calls)."""
    try:
        import fcntl  # noqa: PLC0415  (POSIX only)
    except ImportError:  # no flock here: Numba's own, unlocked cache
        yield
        return
    held = getattr(_HELD, "paths", None)
    if held is None:
        held = _HELD.paths = set()
    path = os.path.join(cache._cache_path, LOCK_NAME)
    if path in held:
        yield
        return
    try:
        cache._impl.locator.ensure_cache_path()
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    except OSError as exc:
        _uncached(dispatcher, path, exc)
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as exc:
            _uncached(dispatcher, path, exc)
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
    """No lock to be had: this kernel compiles without the shared cache."""
    from numba.core.caching import NullCache  # noqa: PLC0415

    dispatcher._cache = NullCache()
    directory = os.path.dirname(path)
    if directory not in _WARNED:
        _WARNED.add(directory)
        print(f"hpcpax: cannot lock Numba's cache in {directory} ({exc}); its kernels compile "
              "in each process instead (set NUMBA_CACHE_DIR to a local disk)",
              file=sys.stderr, flush=True)
