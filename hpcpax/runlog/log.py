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

Robustness: the log must never stop training. A corrupt file, a lock held
too long or a schema newer than this code gives one warning and the call
returns ``None`` (append) or ``[]`` (read); the planner then uses the
analytic model alone. Writers take SQLite's write lock for one short
transaction each (``BEGIN IMMEDIATE``, 30 s busy timeout), so concurrent
jobs lose no record. Not collective: call it from one rank.
"""

from __future__ import annotations

import json
import os
import sqlite3
import time
import warnings

__all__ = ["SCHEMA_VERSION", "RunLog", "run_log_path", "RunLogWarning"]

SCHEMA_VERSION = 1
_SCHEMA = (
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS runs (id INTEGER PRIMARY KEY AUTOINCREMENT, "
    "created_utc TEXT NOT NULL, source TEXT NOT NULL, model TEXT, workers INTEGER, "
    "nodes INTEGER, servers INTEGER, step_s REAL, predicted_s REAL, record TEXT NOT NULL)",
)
_OFF = ("off", "0", "none", "false", "no")


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
    warnings.warn(message, RunLogWarning, stacklevel=3)


class RunLog:
    """One run-log file. Not collective; every method is safe to call anywhere.

    Args:
        path: the SQLite file (default :func:`run_log_path`).
        timeout_s: how long a writer waits for another's lock.
    """

    def __init__(self, path: str | None = None, timeout_s: float = 30.0):
        self.path = run_log_path(path)
        self.timeout_s = float(timeout_s)

    @property
    def enabled(self) -> bool:
        """Whether runs are recorded (a path is set)."""
        return self.path is not None

    def _connect(self, create):
        if create:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        elif not os.path.exists(self.path):
            return None
        return sqlite3.connect(self.path, timeout=self.timeout_s, isolation_level=None)

    @staticmethod
    def _version(connection):
        tables = {row[0] for row in connection.execute(
            "SELECT name FROM sqlite_master WHERE type='table'")}
        if "meta" not in tables:
            return None
        row = connection.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone()
        return int(row[0]) if row else None

    def append(self, record: dict, source: str = "train") -> int | None:
        """Add ``record`` (JSON data); returns its id, or None (with a warning) on failure."""
        if not self.enabled:
            return None
        try:
            text = json.dumps(record, sort_keys=True, allow_nan=False)
        except (TypeError, ValueError) as exc:
            _warn(f"run log: record not saved, it is not JSON data ({exc})")
            return None
        layout = record.get("layout", {})
        measured, predicted = record.get("measured", {}), record.get("predicted") or {}
        row = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), str(source),
               (record.get("model") or {}).get("name"), layout.get("workers"),
               layout.get("num_nodes"), layout.get("servers"), measured.get("step_s"),
               predicted.get("seconds"), text)
        connection = None
        try:
            connection = self._connect(create=True)
            connection.execute("BEGIN IMMEDIATE")
            for statement in _SCHEMA:
                connection.execute(statement)
            version = self._version(connection)
            if version is None:
                connection.execute("INSERT INTO meta VALUES ('schema_version', ?)",
                                   (str(SCHEMA_VERSION),))
            elif version > SCHEMA_VERSION:
                connection.execute("ROLLBACK")
                _warn(f"run log {self.path} has schema {version}, newer than this hpcpax's "
                      f"{SCHEMA_VERSION}: record not saved")
                return None
            cursor = connection.execute(
                "INSERT INTO runs (created_utc, source, model, workers, nodes, servers, step_s, "
                "predicted_s, record) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)", row)
            connection.execute("COMMIT")
            return int(cursor.lastrowid)
        except (sqlite3.Error, OSError) as exc:
            _warn(f"run log {self.path} unusable ({type(exc).__name__}: {exc}); record not saved")
            return None
        finally:
            if connection is not None:
                connection.close()

    def records(self, model: str | None = None, source: str | None = None,
                limit: int | None = None) -> list:
        """Records (dicts with their ``id`` and ``created_utc``), oldest first.

        ``[]`` with a warning when the file is unreadable or of a newer schema.
        """
        if not self.enabled:
            return []
        connection = None
        try:
            connection = self._connect(create=False)
            if connection is None:
                return []
            version = self._version(connection)
            if version is None:
                return []
            if version > SCHEMA_VERSION:
                _warn(f"run log {self.path} has schema {version}, newer than this hpcpax's "
                      f"{SCHEMA_VERSION}: ignored")
                return []
            query, args = "SELECT id, created_utc, source, record FROM runs", []
            where = [(c, v) for c, v in (("model", model), ("source", source)) if v is not None]
            if where:
                query += " WHERE " + " AND ".join(f"{c} = ?" for c, _ in where)
                args += [v for _, v in where]
            query += " ORDER BY id"
            if limit is not None:
                query += f" LIMIT {int(limit)}"
            out = []
            for run_id, created, run_source, text in connection.execute(query, args):
                record = json.loads(text)
                record.update(id=run_id, created_utc=created, source=run_source)
                out.append(record)
            return out
        except (sqlite3.Error, OSError, ValueError) as exc:
            _warn(f"run log {self.path} unreadable ({type(exc).__name__}: {exc}); ignored")
            return []
        finally:
            if connection is not None:
                connection.close()
