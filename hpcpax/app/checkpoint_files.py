"""Checkpoints: HDF5 files, a manifest written last, rows restored by global id.

One directory per save, ``RUN_DIR/checkpoints/step_000123/``:

- ``dense.h5`` (worker 0): ``/params/<name>`` and ``/optimizer/<name>/<slot>``;
- ``sparse_rank{R}.h5`` (every rank holding sparse rows: owners of ``ps``
  variables, worker 0 for replicated ones): per variable ``/<var>/ids`` (global
  row ids), ``/<var>/table``, ``/<var>/row_state/<slot>``,
  ``/<var>/scalar_state/<key>``. Owners write the rows they hold (created on
  first touch), so a table of 10^9 declared rows of which 10^6 were touched
  checkpoints 10^6 rows; a row absent from every file is at its initial
  value;
- ``meta.json``: step, config and its fingerprint, topology, plan, data
  position;
- ``MANIFEST.json``, written last: every file with its size and sha256.

Everything is written into ``step_000123.tmp-<job>`` and renamed into place
by rank 0 after a barrier, so a directory named ``step_*`` with a readable
manifest is complete; :func:`latest` picks the newest such. Loading checks
every file's size and sha256 against the manifest first and raises
:class:`~hpcpax.errors.CheckpointError` naming the file, never loading part
of a checkpoint. Rows are restored by *global id*: each owner reads the ids
of every ``sparse_rank*.h5`` and keeps the rows it owns now
(:func:`load_matching`), so a checkpoint resumes on any number of servers
and partitions. No pickle anywhere.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time

import numpy as np

from ..errors import CheckpointError

__all__ = ["save", "latest", "list_checkpoints", "verify", "read_meta", "load_dense",
           "load_matching", "checkpoint_name", "MANIFEST", "FORMAT"]

MANIFEST = "MANIFEST.json"
FORMAT = "hpcpax-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_READ_BLOCK_ROWS = 1 << 16  # bounded memory when selecting rows from a large file


def _h5py():
    try:
        import h5py
    except ImportError:  # pragma: no cover - h5py is a hard dependency
        from ..errors import DependencyError

        raise DependencyError("checkpoints need h5py: pip install h5py") from None
    return h5py


def checkpoint_name(step: int) -> str:
    """Directory name of the checkpoint after ``step`` steps."""
    return f"step_{int(step):06d}"


def _sha256(path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _file_entry(path) -> dict:
    return {"bytes": os.path.getsize(path), "sha256": _sha256(path)}


def _write_dense(path, params: dict, optimizer_state: dict) -> None:
    h5py = _h5py()
    with h5py.File(path, "w") as f:
        group = f.create_group("params")
        for name, value in params.items():
            group.create_dataset(name, data=np.asarray(value))
        group = f.create_group("optimizer")
        for name, state in optimizer_state.items():
            sub = group.create_group(name)
            for slot, value in state.items():
                sub.create_dataset(slot, data=np.asarray(value))


def _write_sparse(path, variables: list) -> None:
    h5py = _h5py()
    with h5py.File(path, "w") as f:
        for name, gids, table, row_state, scalar_state in variables:
            group = f.create_group(name)
            group.create_dataset("ids", data=np.asarray(gids, np.int64))
            group.create_dataset("table", data=table)
            rows = group.create_group("row_state")
            for slot, value in row_state.items():
                rows.create_dataset(slot, data=value)
            scalars = group.create_group("scalar_state")
            for key, value in scalar_state.items():
                scalars.create_dataset(key, data=np.asarray(value))


def save(comm, run_dir, step: int, *, dense=None, sparse=(), meta=None, keep: int = 0,
         job_id: str = "") -> str:
    """Write one checkpoint; **collective** over ``comm`` (every rank of the run).

    Args:
        comm: the run's world communicator (servers included).
        run_dir: the run directory (checkpoints go under ``checkpoints/``).
        step: completed steps.
        dense: on exactly one rank, ``(params, optimizer_state)``: dicts of
            host arrays (``optimizer_state[name][slot]``); None elsewhere.
        sparse: this rank's ``(name, global ids, table, row state, scalar
            state)`` tuples; empty on ranks holding no rows.
        meta: JSON-able dict stored in ``meta.json`` (rank 0's is used).
        keep: keep the newest ``keep`` complete checkpoints (0 = all).
        job_id: suffix of the temporary directory.

    Returns:
        The final checkpoint directory (same on every rank).

    Raises:
        CheckpointError: on every rank, when any rank failed to write.
    """
    rank = comm.Get_rank()
    root = os.path.join(os.fspath(run_dir), "checkpoints")
    final = os.path.join(root, checkpoint_name(step))
    tmp = f"{final}.tmp-{job_id or 'job'}"
    error = None
    if rank == 0:
        try:
            os.makedirs(root, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
        except OSError as exc:
            error = f"rank 0 cannot create {tmp}: {exc}"
    error = comm.bcast(error, root=0)
    if error:
        raise CheckpointError(error)

    written, error = {}, None
    try:
        if dense is not None:
            path = os.path.join(tmp, "dense.h5")
            _write_dense(path, *dense)
            written["dense.h5"] = _file_entry(path)
        if sparse:
            name = f"sparse_rank{rank}.h5"
            path = os.path.join(tmp, name)
            _write_sparse(path, list(sparse))
            written[name] = _file_entry(path)
    except (OSError, ValueError, TypeError, RuntimeError) as exc:  # h5py raises RuntimeError too
        error = f"rank {rank}: writing into {tmp} failed: {exc}"
    gathered = comm.gather((written, error), root=0)

    if rank == 0:
        errors = [e for _, e in gathered if e]
        files = {}
        for entries, _ in gathered:
            files.update(entries)
        if not errors and "dense.h5" not in files:
            errors = ["no rank wrote dense.h5"]
        try:
            if not errors:
                meta_path = os.path.join(tmp, "meta.json")
                with open(meta_path, "w", encoding="utf-8") as handle:
                    json.dump({"format": FORMAT, "step": int(step), **(meta or {})}, handle,
                              indent=2, default=str)
                files["meta.json"] = _file_entry(meta_path)
                manifest = {"format": FORMAT, "step": int(step), "written_unix": time.time(),
                            "files": dict(sorted(files.items()))}
                with open(os.path.join(tmp, MANIFEST), "w", encoding="utf-8") as handle:
                    json.dump(manifest, handle, indent=2)
                    handle.flush()
                    os.fsync(handle.fileno())
                if os.path.exists(final):
                    old = f"{final}.old-{job_id or 'job'}"
                    os.rename(final, old)
                    shutil.rmtree(old, ignore_errors=True)
                os.rename(tmp, final)
                if keep:
                    _prune(root, keep)
        except (OSError, ValueError) as exc:
            errors.append(f"rank 0: completing {final} failed: {exc}")
        error = "; ".join(errors) or None
    error = comm.bcast(error if rank == 0 else None, root=0)
    if error:
        raise CheckpointError(error)
    return final


def list_checkpoints(run_dir) -> list:
    """``[(step, path)]`` of complete checkpoints (a manifest is present), oldest first."""
    root = os.path.join(os.fspath(run_dir), "checkpoints")
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        match = _STEP_DIR.match(name)
        path = os.path.join(root, name)
        if match and os.path.isfile(os.path.join(path, MANIFEST)):
            try:
                with open(os.path.join(path, MANIFEST), encoding="utf-8") as handle:
                    json.load(handle)
            except (OSError, json.JSONDecodeError):
                continue
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest(run_dir):
    """Path of the newest complete checkpoint of ``run_dir``, or None."""
    found = list_checkpoints(run_dir)
    return found[-1][1] if found else None


def _prune(root, keep):
    complete = list_checkpoints(os.path.dirname(root))
    for _, path in complete[:-keep]:
        shutil.rmtree(path, ignore_errors=True)
    newest = complete[-1][0] if complete else -1
    for name in os.listdir(root):
        head = name.split(".tmp-")[0]
        match = _STEP_DIR.match(head)
        # Temporary directories of earlier steps are failed attempts.
        if ".tmp-" in name and match and int(match.group(1)) < newest:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def read_manifest(path) -> dict:
    """The manifest of checkpoint ``path``; CheckpointError if missing or unreadable."""
    manifest_path = os.path.join(os.fspath(path), MANIFEST)
    try:
        with open(manifest_path, encoding="utf-8") as handle:
            manifest = json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: missing or unreadable ({exc}); "
                              "the checkpoint is incomplete") from None
    if manifest.get("format") != FORMAT or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    return manifest


def _verify_file(path, name, entry):
    file_path = os.path.join(path, name)
    if not os.path.isfile(file_path):
        return f"{file_path}: missing (listed in {MANIFEST})"
    size = os.path.getsize(file_path)
    if size != entry["bytes"]:
        return f"{file_path}: {size} bytes, the manifest says {entry['bytes']} (truncated?)"
    if _sha256(file_path) != entry["sha256"]:
        return f"{file_path}: sha256 differs from the manifest (corrupted)"
    return None


def verify(path, comm=None) -> dict:
    """Check every file of checkpoint ``path`` against its manifest; returns the manifest.

    **Collective** over ``comm`` when given (the files are spread over the
    ranks, each hashes its share); local otherwise.

    Raises:
        CheckpointError: on every rank, naming the first bad file.
    """
    manifest = read_manifest(path)
    names = sorted(manifest["files"])
    rank, size = (comm.Get_rank(), comm.Get_size()) if comm is not None else (0, 1)
    errors = [error for i, name in enumerate(names) if i % size == rank
              for error in [_verify_file(path, name, manifest["files"][name])] if error]
    if comm is not None:
        errors = [e for part in comm.allgather(errors) for e in part]
    if errors:
        raise CheckpointError(errors[0] + (f" (and {len(errors) - 1} more)"
                                           if len(errors) > 1 else ""))
    return manifest


def read_meta(path) -> dict:
    """``meta.json`` of checkpoint ``path``."""
    meta_path = os.path.join(os.fspath(path), "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable ({exc})") from None


def refuse_links(h5file, file_path) -> None:
    """Raise unless every object of an open HDF5 file is a plain (hard-linked) one.

    A soft or external link would make a checked file read data from
    elsewhere: the manifest's SHA-256 covers the link, not its target.
    """
    from ..data.layouts import find_link, link_target

    found = find_link(h5file)
    if found is not None:
        raise CheckpointError(f"{file_path}: {found[0]!r} is a {type(found[1]).__name__} to "
                              f"{link_target(found[1])!r}; checkpoints hold plain datasets only")


def load_dense(path, expected=None):
    """``(params, optimizer_state)`` from ``dense.h5``; not collective.

    Args:
        expected: ``{name: shape}``: every parameter must be there with that
            shape, checked before anything is read.

    Raises:
        CheckpointError: the file is unreadable, a parameter is missing or
            of another shape, or a value is NaN or Inf (named with its index).
    """
    h5py = _h5py()
    file_path = os.path.join(os.fspath(path), "dense.h5")
    try:
        with h5py.File(file_path, "r") as f:
            refuse_links(f, file_path)
            for name, shape in (expected or {}).items():
                if name not in f["params"] or tuple(f["params"][name].shape) != tuple(shape):
                    raise CheckpointError(f"{file_path}: parameter {name!r} missing or of "
                                          f"another shape (the model's is {tuple(shape)})")
            params = {name: f["params"][name][...] for name in f["params"]}
            state = {name: {slot: f["optimizer"][name][slot][...]
                            for slot in f["optimizer"][name]}
                     for name in f["optimizer"]}
    except (OSError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{file_path}: cannot read ({exc})") from None
    named = [(f"parameter {n!r}", v) for n, v in params.items()] + \
        [(f"optimizer slot {s!r} of {n!r}", v) for n, slots in state.items()
         for s, v in slots.items()]
    for what, values in named:
        values = np.asarray(values)
        if values.dtype.kind == "f" and not np.isfinite(values).all():
            where = tuple(int(i) for i in np.argwhere(~np.isfinite(values))[0])
            raise CheckpointError(f"{file_path}: {what} value {values[where]} at index "
                                  f"{where} is not finite")
    return params, state


def _sparse_files(path):
    """The sparse files the manifest lists (an extra file dropped in is never read)."""
    listed = read_manifest(path)["files"]
    return sorted(os.path.join(path, name) for name in listed
                  if name.startswith("sparse_rank") and name.endswith(".h5"))


def _refuse_nonfinite(file_path, name, what, ids, values) -> None:
    """Raise naming the file, the variable and the row (global id) of a NaN or Inf."""
    if values.dtype.kind != "f" or np.isfinite(values).all():
        return
    where = np.argwhere(~np.isfinite(values))[0]
    column = f", column {int(where[1])}" if len(where) > 1 else ""
    raise CheckpointError(f"{file_path}: variable {name!r}: {what} value "
                          f"{values[tuple(where)]} at row {int(ids[where[0]])}{column} "
                          "is not finite")


def load_matching(path, name, keep, dim=None):
    """Every row of variable ``name`` whose id ``keep`` selects, from every sparse file.

    ``dim``, when given, is checked against each file's table before reading;
    soft and external HDF5 links are refused (:func:`refuse_links`).

    Not collective: each rank reads the ids of every file, then only the
    rows it keeps, in blocks of bounded size.

    Args:
        keep: ``keep(ids) -> bool mask`` over an int64 id array.

    Returns:
        ``(ids, table, row_state, scalar_state)`` of the selected rows.

    Raises:
        CheckpointError: a file is unreadable (named), no file holds
            ``name``, a selected id is present twice, or a selected row of the
            table or of an optimizer slot holds NaN or Inf (file, variable,
            row id and column named).
    """
    h5py = _h5py()
    pieces, scalar_state, layout = [], None, None
    for file_path in _sparse_files(os.fspath(path)):
        try:
            with h5py.File(file_path, "r") as f:
                refuse_links(f, file_path)
                if name not in f:
                    continue
                group = f[name]
                if dim is not None and (group["table"].ndim != 2
                                        or group["table"].shape[1] != dim
                                        or len(group["ids"]) != len(group["table"])):
                    raise CheckpointError(f"{file_path}: variable {name!r} is stored as "
                                          f"{group['table'].shape} with {len(group['ids'])} ids; "
                                          f"the variable has rows of {dim}")
                if scalar_state is None:
                    scalar_state = {k: group["scalar_state"][k][...]
                                    for k in group["scalar_state"]}
                    layout = ((group["table"].shape[1:], group["table"].dtype),
                              {k: (v.shape[1:], v.dtype) for k, v in group["row_state"].items()})
                ids = group["ids"][...]
                chosen = np.asarray(keep(ids), bool) if len(ids) else np.zeros(0, bool)
                for start in range(0, len(ids), _READ_BLOCK_ROWS):
                    stop = min(start + _READ_BLOCK_ROWS, len(ids))
                    hit = chosen[start:stop]
                    if hit.any():  # one bounded window read, then a selection
                        piece = (ids[start:stop][hit], group["table"][start:stop][hit],
                                 {k: group["row_state"][k][start:stop][hit]
                                  for k in group["row_state"]})
                        _refuse_nonfinite(file_path, name, "table", piece[0], piece[1])
                        for slot, values in piece[2].items():
                            _refuse_nonfinite(file_path, name, f"optimizer slot {slot!r}",
                                              piece[0], values)
                        pieces.append(piece)
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{file_path}: cannot read variable {name!r} ({exc})") from None
    if scalar_state is None:
        raise CheckpointError(f"{path}: no sparse file holds variable {name!r}")
    (shape, dtype), slots = layout
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    table = (np.concatenate([p[1] for p in pieces]) if pieces
             else np.zeros((0,) + shape, dtype))
    row_state = {k: (np.concatenate([p[2][k] for p in pieces]) if pieces
                     else np.zeros((0,) + s, d)) for k, (s, d) in slots.items()}
    if ids.size != np.unique(ids).size:
        raise CheckpointError(f"{path}: variable {name!r}: some rows are present twice")
    return ids, table, row_state, scalar_state
