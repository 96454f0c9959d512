"""Reuse a calibration measured by an earlier job of the same layout on the same hosts.

``--plan auto`` times the cost model's constants at start-up
(:func:`~hpcpax.tune.calibrate.calibrate`: a few seconds with every rank
busy). Jobs that start again and again with the same shape on the same
hosts (a sweep, a debugging session, a test suite) measure the same
constants each time. With ``HPCPAX_CALIBRATION_CACHE=DIR`` the first such
job keeps its calibration in ``DIR`` and later jobs whose *layout key* is
equal take it from there instead of measuring.

The layout key is everything the measurement depends on that a job can
know: the ranks' hosts and network namespaces, each rank's role and
(virtual) node, the MPI library, hpcpax's version and the source of the
measuring modules (an edited calibration re-measures), every ``HPCPAX_*``
option that changes how ranks run or wait, the fabric budget and the
start-up budget. A file whose key differs, that is older than
:data:`MAX_AGE_S`, or that fails any check is not used: the job measures
(and replaces the file). Off by default: a job measures its own machine.

Trust: the directory must belong to this job's user and be writable by
nobody else; a file must be a regular file of this user (no symbolic link),
at most :data:`MAX_BYTES`, and hold finite numbers where the cost model
reads numbers. Anything else is named in one line on rank 0 and ignored.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import stat
import sys
import tempfile
import time

__all__ = ["MAX_AGE_S", "MAX_BYTES", "calibrate_or_reuse", "layout_key", "load", "store"]

#: Seconds after which a kept calibration is measured again.
MAX_AGE_S = 7 * 24 * 3600.0
#: Largest calibration file read (a real one is a few kB).
MAX_BYTES = 1 << 20
#: Version of the file's layout.
SCHEMA = 1
#: Options that do not change what a calibration measures (left out of the key).
_NOT_MEASURED = ("calibration_cache", "run_log", "timeout", "device")
#: The top-level entries of a calibration (:func:`~hpcpax.tune.calibrate.calibrate`).
_ENTRIES = {"fabric", "kernels", "handoff", "software", "software_scope",
            "partition_overhead_s", "partition_overhead_per", "one_host", "budgets"}
#: Modules whose source is part of the key (a changed measurement re-measures).
_MEASURING = ("tune/calibrate.py", "tune/operation_costs.py", "tune/caches.py",
              "plan/kernel_rates.py", "comm/fabric.py")


def _source_digest() -> str:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    digest = hashlib.sha256()
    for name in _MEASURING:
        try:
            with open(os.path.join(root, name), "rb") as handle:
                digest.update(handle.read())
        except OSError:
            digest.update(b"?")
    return digest.hexdigest()[:16]


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("hpcpax")
    except Exception:  # noqa: BLE001  (not installed: a source checkout)
        return "source"


def layout_key(topology, fabric_seconds: float, budget_s, dim: int) -> dict:
    """What a calibration measured depends on, the same dict on every rank;
    **collective** over ``topology.comm``."""
    from ..comm.fabric import host_facts
    from ..options import options

    places = topology.comm.allgather(host_facts())
    settings = {name: value for name, value in sorted(options.as_dict().items())
                if name not in _NOT_MEASURED}
    return {"places": places, "node_of": [int(n) for n in topology.node_of],
            "server_ranks": list(topology.server_ranks),
            "hpcpax": _version(), "source": _source_digest(),
            "options": {k: v if isinstance(v, (int, float, str, bool, type(None))) else str(v)
                        for k, v in settings.items()},
            "fabric_seconds": float(fabric_seconds),
            "budget_s": None if budget_s is None else float(budget_s), "dim": int(dim),
            "threads": os.environ.get("OMP_NUM_THREADS", ""),
            "numba_threads": os.environ.get("NUMBA_NUM_THREADS", "")}


def _file_name(key: dict) -> str:
    text = json.dumps(key, sort_keys=True, separators=(",", ":"))
    return "calibration-" + hashlib.sha256(text.encode()).hexdigest()[:24] + ".json"


def _check_directory(directory: str) -> None:
    """Create ``directory`` (0700) or check it is this user's own; raises OSError."""
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not stat.S_ISDIR(info.st_mode):
        raise OSError(f"{directory} is not a directory")
    if info.st_uid != os.getuid():
        raise OSError(f"{directory} belongs to uid {info.st_uid}, not this job's {os.getuid()}")
    if info.st_mode & 0o022:
        raise OSError(f"{directory} is writable by other users (mode {info.st_mode & 0o777:o})")


def _finite_tree(value, depth=0) -> bool:
    """Whether ``value`` is JSON of bounded depth whose numbers are all finite."""
    if depth > 8:
        return False
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return True
    if isinstance(value, (int, float)):
        return math.isfinite(value)
    if isinstance(value, list):
        return all(_finite_tree(v, depth + 1) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _finite_tree(v, depth + 1) for k, v in value.items())
    return False


def load(directory: str, key: dict, now: float | None = None):
    """``(calibration, None)`` kept in ``directory`` for ``key``, or ``(None, why)``:
    ``why`` is None when there is simply no file, else the reason it was not
    used. Local (rank 0 reads; :func:`calibrate_or_reuse` broadcasts)."""
    try:
        _check_directory(directory)
        path = os.path.join(directory, _file_name(key))
        try:
            fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        except FileNotFoundError:
            return None, None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
                return None, f"{path} is not a regular file of this user"
            if info.st_size > MAX_BYTES:
                return None, f"{path} holds {info.st_size} bytes (at most {MAX_BYTES})"
            text = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        return None, str(exc)
    try:
        record = json.loads(text.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None, f"{path} is not JSON"
    if not isinstance(record, dict) or record.get("schema") != SCHEMA:
        return None, f"{path} is not a calibration of schema {SCHEMA}"
    if record.get("key") != key:
        return None, f"{path} was measured for another layout"
    measured = record.get("measured_unix")
    now = time.time() if now is None else now
    if isinstance(measured, bool) or not isinstance(measured, (int, float)) \
            or not 0 <= now - measured <= MAX_AGE_S:
        return None, f"{path} is older than {MAX_AGE_S / 3600:.0f} h (or from the future)"
    calibration = record.get("calibration")
    if not isinstance(calibration, dict) or set(calibration) != _ENTRIES \
            or not _finite_tree(calibration):
        return None, f"{path} does not hold a calibration with finite figures"
    return calibration, None


def store(directory: str, key: dict, calibration: dict, now: float | None = None) -> str:
    """Keep ``calibration`` for ``key`` in ``directory`` (written whole, then renamed,
    mode 0600); returns its path. Local; raises OSError."""
    _check_directory(directory)
    record = {"schema": SCHEMA, "key": key, "measured_unix": time.time() if now is None else now,
              "calibration": calibration}
    fd, scratch = tempfile.mkstemp(dir=directory, prefix=".calibration-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            json.dump(record, handle, sort_keys=True)
        path = os.path.join(directory, _file_name(key))
        os.replace(scratch, path)
    except BaseException:
        try:
            os.unlink(scratch)
        except OSError:
            pass
        raise
    return path


def calibrate_or_reuse(topology, fabric_seconds: float = 1.0, dim: int = 64,
                       budget_s: float | None = None, directory: str | None = None):
    """:func:`~hpcpax.tune.calibrate.calibrate`, or the calibration an earlier job of the
    same layout key kept in ``directory`` (default ``HPCPAX_CALIBRATION_CACHE``;
    None or ``off``: always measure); **collective** over ``topology.comm``.

    Returns ``(calibration, how)``: ``how`` is ``{"source": "measured" | "kept",
    "file": name or None, "measured_unix": ...}`` (saved in ``plan.json``). Every
    rank takes the same branch: rank 0 decides and broadcasts.
    """
    from ..options import options
    from .calibrate import calibrate

    directory = options.calibration_cache if directory is None else directory
    if not directory or directory == "off":
        return (calibrate(topology, fabric_seconds=fabric_seconds, dim=dim, budget_s=budget_s),
                {"source": "measured", "file": None})
    comm = topology.comm
    key = layout_key(topology, fabric_seconds, budget_s, dim)
    found = None
    if comm.Get_rank() == 0:
        calibration, why = load(directory, key)
        if why is not None:
            print(f"hpcpax: calibration cache: {why}; measuring instead", file=sys.stderr,
                  flush=True)
        if calibration is not None:
            found = {"calibration": calibration, "file": _file_name(key)}
    found = comm.bcast(found, root=0)
    if found is not None:
        return found["calibration"], {"source": "kept", "file": found["file"]}
    calibration = calibrate(topology, fabric_seconds=fabric_seconds, dim=dim, budget_s=budget_s)
    name = None
    if comm.Get_rank() == 0:
        try:
            name = os.path.basename(store(directory, key, calibration))
        except OSError as exc:
            print(f"hpcpax: calibration cache: not kept ({exc})", file=sys.stderr, flush=True)
    return calibration, {"source": "measured", "file": comm.bcast(name, root=0)}
