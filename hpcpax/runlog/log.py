"""The run log: one SQLite record per training run or benchmark run.

Every ``python -m hpcpax.train`` run and every cost-model benchmark appends
one record: the model's variables (sizes, measured sparsity and duplicate
ratios), the layout, the fabric measurement, the strategy of each variable,
the measured seconds per phase and, when the run could price itself, the
analytic model's prediction. :mod:`hpcpax.runlog.learned` fits a correction
of the model on these records (AutoSync's idea: learn from recorded runs).

Where: ``$HPCPAX_RUN_LOG`` if set (``off`` disables the log), else
``$XDG_CACHE_HOME/hpcpax/runs.sqlite`` (``~/.cache/hpcpax/runs.sqlite``);
:func:`run_log_path` is the one place that reads it.

Schema (version :data:`SCHEMA_VERSION`)::

    meta(key TEXT PRIMARY KEY, value TEXT)      -- 'schema_version' -> '1'
    runs(id INTEGER PRIMARY KEY AUTOINCREMENT,
         created_utc TEXT,   -- ISO 8601
         source TEXT,        -- 'train' or the benchmark's name
         model TEXT,         -- 'lm', 'ctr', ...
         workers INTEGER, nodes INTEGER, servers INTEGER,
         step_s REAL,        -- measured seconds per step (median)
         predicted_s REAL,   -- analytic prediction, NULL when none
         record TEXT)        -- the whole record as JSON

Robustness: the log must never stop training. A corrupt file, a malformed
record (a JSON list, a non-numeric schema version, ...), a lock held longer
than :data:`LOCK_BUDGET_S`, a schema newer than this code or an unsafe place
gives one warning (:class:`RunLogWarning`, one line) and the call returns
``None`` (append) or the well-formed records (read); the planner then uses
the analytic model alone. Writers take SQLite's write lock for one short
transaction each (``BEGIN IMMEDIATE``), so concurrent jobs lose no record;
every lock wait of one call together is bounded by :data:`LOCK_BUDGET_S`
seconds, independent of ``HPCPAX_TIMEOUT``. Not collective: call it from
one rank.

Trust: the log is this user's alone. Its directory (created 0700) must be
owned by this user (or root) and writable by no other user (group-writable
only by the user's own private group): in a directory others can write,
such as a shared sticky ``/tmp``, they could plant a link at the log's path
or at SQLite's ``-journal`` beside it, so the log is not used there. The
file is opened with ``O_NOFOLLOW`` and must be a regular file of this user
with no other hard link; it is created 0600 (SQLite gives its journal the
same mode) and an older, wider mode is narrowed. SQLite locks the log file
itself (``fcntl``): there is no separate lock file.
"""

from __future__ import annotations

import errno
import grp
import json
import math
import os
import pwd
import sqlite3
import stat
import time
import warnings

__all__ = ["SCHEMA_VERSION", "LOCK_BUDGET_S", "RunLog", "run_log_path", "RunLogWarning"]

SCHEMA_VERSION = 1
#: Seconds one run-log call may wait for other writers' locks, in all (then it warns and
#: skips): small, so that a held lock never costs a run its end (the summary line)
LOCK_BUDGET_S = 5.0
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "created_utc TEXT NOT NULL, source TEXT NOT NULL, model TEXT, workers INTEGER, "
    "nodes INTEGER, servers INTEGER, step_s REAL, predicted_s REAL, record TEXT NOT NULL)",
)
_OFF = ("off", "0", "none", "false", "no")
#: SQLite's companions of a database file (rollback journal, write-ahead log and its index)
_COMPANIONS = ("-journal", "-wal", "-shm")


class RunLogWarning(UserWarning):
    """The run log could not be used; training goes on with the analytic model."""


def run_log_path(path: str | None = None) -> str | None:
    """The run log's file: ``path``, else ``hpcpax.options.run_log``
    (``$HPCPAX_RUN_LOG``), else the user cache.

    Returns None when the log is switched off (``HPCPAX_RUN_LOG=off``).
    """
    if path is None:
        from ..options import options

        path = options.run_log
    if path is not None:
        return None if path.lower() in _OFF else os.path.expanduser(path)
    cache = os.environ.get("XDG_CACHE_HOME", "").strip() or os.path.join(
        os.path.expanduser("~"), ".cache")
    return os.path.join(cache, "hpcpax", "runs.sqlite")


def _warn(message):
    # one line: no file name or source line of ours, which say nothing to a user
    warnings.warn_explicit(" ".join(str(message).split()), RunLogWarning, "hpcpax", 0,
                           module="hpcpax.runlog.log")


class _Unsafe(Exception):
    """The log's place or file is not this user's alone (the message says why)."""


def _private_group(gid) -> bool:
    """Whether group ``gid`` is this user's own: their primary group, no other member."""
    try:
        group, user = grp.getgrgid(gid), pwd.getpwuid(os.geteuid())
    except KeyError:
        return False
    return gid == user.pw_gid and set(group.gr_mem) <= {user.pw_name}


def _check_directory(directory) -> None:
    """Raise :class:`_Unsafe` unless only this user (or root) can add or replace files there."""
    info = os.stat(directory)
    if info.st_uid not in (os.geteuid(), 0):
        raise _Unsafe(f"its directory {directory} belongs to uid {info.st_uid}, not this user")
    mode = stat.S_IMODE(info.st_mode)
    if mode & stat.S_IWOTH or (mode & stat.S_IWGRP and not _private_group(info.st_gid)):
        raise _Unsafe(f"its directory {directory} (mode {mode:04o}) is writable by other users, "
                      "who could plant a link there; use a directory of your own")


def _check_file(path, fd=None) -> None:
    """Raise :class:`_Unsafe` unless ``path`` (open as ``fd``, else not followed) is a
    regular file of this user with no other hard link."""
    info = os.fstat(fd) if fd is not None else os.lstat(path)
    if not stat.S_ISREG(info.st_mode):
        kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
        raise _Unsafe(f"{path} is {kind}")
    if info.st_uid != os.geteuid():
        raise _Unsafe(f"{path} belongs to uid {info.st_uid}, not this user")
    if info.st_nlink != 1:
        raise _Unsafe(f"{path} has {info.st_nlink} hard links")


def _open_safely(path, create) -> bool:
    """Check (and create, 0600) the log file before SQLite opens it by name; False when it
    does not exist and ``create`` is False. Raises :class:`_Unsafe` or OSError."""
    directory = os.path.dirname(os.path.abspath(path))
    if create:
        os.makedirs(directory, mode=0o700, exist_ok=True)
    elif not os.path.lexists(path):
        return False
    _check_directory(directory)
    for suffix in _COMPANIONS:  # SQLite opens these by name, following links
        if os.path.lexists(path + suffix):
            _check_file(path + suffix)
    flags = os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    flags |= os.O_RDWR | os.O_CREAT if create else os.O_RDONLY
    try:
        fd = os.open(path, flags, 0o600)
    except OSError as exc:
        if exc.errno == errno.ELOOP:  # O_NOFOLLOW met a symbolic link
            raise _Unsafe(f"{path} is a symbolic link") from None
        raise
    try:
        _check_file(path, fd)
        if stat.S_IMODE(os.fstat(fd).st_mode) & 0o077:
            os.fchmod(fd, 0o600)  # written by an older hpcpax with the umask's mode
    finally:
        os.close(fd)
    return True


class _Deadline:
    """The lock-wait budget of one call, shared by all its statements."""

    def __init__(self, seconds):
        self.end = time.monotonic() + max(0.0, seconds)

    def execute(self, connection, statement, args=()):
        """``connection.execute`` waiting at most what is left of the budget for a lock."""
        left = max(0, int((self.end - time.monotonic()) * 1000))
        connection.execute(f"PRAGMA busy_timeout = {left}")
        return connection.execute(statement, args)


class RunLog:
    """One run-log file. Not collective; every method is safe to call anywhere.

    Args:
        path: the SQLite file (default :func:`run_log_path`).
        timeout_s: how long one call may wait for others' locks, in all
            (default :data:`LOCK_BUDGET_S`).
    """

    def __init__(self, path: str | None = None, timeout_s: float | None = None):
        self.path = run_log_path(path)
        self.timeout_s = float(LOCK_BUDGET_S if timeout_s is None else timeout_s)

    @property
    def enabled(self) -> bool:
        """Whether runs are recorded (a path is set)."""
        return self.path is not None

    def _connect(self, create, deadline):
        """A connection, or None when there is no log yet (reading). Raises :class:`_Unsafe`."""
        if not _open_safely(self.path, create):
            return None
        return sqlite3.connect(self.path, timeout=max(0.0, deadline.end - time.monotonic()),
                               isolation_level=None)

    @staticmethod
    def _version(connection, deadline):
        """The schema version: None without one, a string when it is not a number."""
        tables = {row[0] for row in deadline.execute(
            connection, "SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" not in tables:
            return None
        row = deadline.execute(connection,
                               "SELECT value FROM meta WHERE key='schema_version'").fetchone()
        if row is None:
            return None
        try:
            return int(row[0])
        except (TypeError, ValueError, OverflowError):
            return repr(row[0])

    def append(self, record: dict, source: str = "train") -> int | None:
        """Add ``record`` (JSON data); returns its id, or None (with a one-line warning) on
        failure. Never raises."""
        if not self.enabled:
            return None
        try:
            text = json.dumps(record, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError, RecursionError) as exc:
            _warn(f"run log: record not saved, it is not JSON data ({exc})")
            return None
        row = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), str(source),
               *_columns(record), text)
        connection, deadline = None, _Deadline(self.timeout_s)
        try:
            connection = self._connect(True, deadline)
            deadline.execute(connection, "BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                deadline.execute(connection, statement)
            version = self._version(connection, deadline)
            if version is None:
                deadline.execute(connection, "INSERT OR REPLACE INTO meta VALUES "
                                 "('schema_version', ?)", (str(SCHEMA_VERSION),))
            elif not isinstance(version, int) or version > SCHEMA_VERSION:
                connection.execute("ROLLBACK")
                _warn(f"run log {self.path} has schema {version}, "
                      + ("not a number" if not isinstance(version, int) else
                         f"newer than this hpcpax's {SCHEMA_VERSION}") + ": record not saved")
                return None
            cursor = deadline.execute(
                connection, "INSERT INTO runs (created_utc, source, model, workers, nodes, "
                "servers, step_s, predicted_s, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            deadline.execute(connection, "COMMIT")
            return int(cursor.lastrowid)
        except _Unsafe as exc:
            _warn(f"run log {self.path} not used: {exc}; record not saved")
            return None
        except Exception as exc:  # noqa: BLE001  (the log never stops a run)
            _warn(f"run log {self.path} unusable ({type(exc).__name__}: {exc}); "
                  "record not saved")
            return None
        finally:
            if connection is not None:
                connection.close()

    def records(self, model: str | None = None, source: str | None = None,
                limit: int | None = None) -> list:
        """Records (dicts with their ``id`` and ``created_utc``), oldest first. Never raises.

        ``[]`` with a warning when the file is unusable or of a newer schema;
        a malformed record (not a JSON object) is left out, with one warning
        for them all.
        """
        if not self.enabled:
            return []
        connection, deadline = None, _Deadline(self.timeout_s)
        try:
            connection = self._connect(False, deadline)
            if connection is None:
                return []
            deadline.execute(connection, "BEGIN")  # one read lock for every statement
            version = self._version(connection, deadline)
            if version is None:
                return []
            if not isinstance(version, int) or version > SCHEMA_VERSION:
                _warn(f"run log {self.path} has schema {version}, "
                      + ("not a number" if not isinstance(version, int) else
                         f"newer than this hpcpax's {SCHEMA_VERSION}") + ": ignored")
                return []
            query, args = "SELECT id, created_utc, source, record FROM runs", []
            where = [(c, v) for c, v in (("model", model), ("source", source)) if v is not None]
            if where:
                query += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
                args += [v for _, v in where]
            query += " ORDER BY id"
            if limit is not None:
                query += f" LIMIT {int(limit)}"
            out, malformed = [], []
            for run_id, created, run_source, text in deadline.execute(connection, query, args):
                record = _parse(text)
                if isinstance(record, str):
                    malformed.append(f"record {run_id}: {record}")
                    continue
                record.update(id=run_id, created_utc=created, source=run_source)
                out.append(record)
            if malformed:
                _warn(f"run log {self.path}: {len(malformed)} malformed record(s) ignored "
                      f"({malformed[0]})")
            return out
        except _Unsafe as exc:
            _warn(f"run log {self.path} not used: {exc}; ignored")
            return []
        except Exception as exc:  # noqa: BLE001  (the log never stops a run)
            _warn(f"run log {self.path} unreadable ({type(exc).__name__}: {exc}); ignored")
            return []
        finally:
            if connection is not None:
                connection.close()


def _number(value):
    """``value`` when it is a finite number (not a bool), else None."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) \
            and math.isfinite(value):
        return value
    return None


def _columns(record) -> tuple:
    """The indexed columns of a record: model, workers, nodes, servers, step_s, predicted_s."""
    def part(key):
        value = record.get(key) if isinstance(record, dict) else None
        return value if isinstance(value, dict) else {}

    layout, model = part("layout"), part("model")
    name = model.get("name")
    return (name if isinstance(name, str) else None, _number(layout.get("workers")),
            _number(layout.get("num_nodes")), _number(layout.get("servers")),
            _number(part("measured").get("step_s")), _number(part("predicted").get("seconds")))


def _refuse_constant(name):
    raise ValueError(f"{name} is not a number")


def _parse(text):
    """The record stored as ``text``: a dict, or a string saying why it is malformed."""
    try:
        record = json.loads(text, parse_constant=_refuse_constant)
    except (TypeError, ValueError, RecursionError) as exc:
        return f"not JSON ({type(exc).__name__}: {' '.join(str(exc).split())[:80]})"
    if not isinstance(record, dict):
        return f"a JSON {type(record).__name__}, not an object"
    return record
