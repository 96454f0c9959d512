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
manifest is complete; :func:`latest` picks the newest such. A failed write
is one line naming the first failing rank and file, raised on every rank.
Loading checks every file's size and sha256 against the manifest first and raises
:class:`~hpcpax.errors.CheckpointError` naming the file, never loading part
of a checkpoint. Rows are restored by *global id*: each owner reads the ids
of every ``sparse_rank*.h5`` and keeps the rows it owns now
(:func:`load_matching`), so a checkpoint resumes on any number of servers
and partitions. No pickle anywhere.

A checkpoint is read as untrusted input: anyone who can write the run
directory can rewrite a file and hash the manifest again. So the manifest
names plain files of its own directory, ``meta.json`` must be an object
with an integer step, and every HDF5 file must hold plain datasets stored
in that file (no soft or external link, no external raw storage, no
virtual dataset, no storage smaller than the declared shape), each of
exactly the shape and dtype the variable or parameter has (:class:`RowsLayout`
for sparse rows; nothing is broadcast). Anything else is a
:class:`~hpcpax.errors.CheckpointError` naming the file and the dataset.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import time

import numpy as np

from ..errors import CheckpointError

__all__ = ["save", "latest", "list_checkpoints", "verify", "read_meta", "load_dense",
           "load_matching", "checkpoint_name", "refuse_links", "refuse_indirection",
           "RowsLayout", "one_line", "MANIFEST", "FORMAT"]

MANIFEST = "MANIFEST.json"
FORMAT = "hpcpax-checkpoint/1"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")  # a file of the checkpoint's folder
_READ_BLOCK_ROWS = 1 << 16  # bounded memory when selecting rows from a large file


def _h5py():
    try:
        import h5py
    except ImportError:  # pragma: no cover - h5py is a hard dependency
        from ..errors import DependencyError

        raise DependencyError("checkpoints need h5py: pip install h5py") from None
    return h5py


def one_line(text) -> str:
    """``text`` with every run of whitespace (newlines included) made one space.

    h5py's messages carry a newline (HDF5 prints the time with ``ctime``).
    """
    return " ".join(str(text).split())


def _reason(exc) -> str:
    """Why a write failed, in one line: the errno's words when there is one."""
    if isinstance(exc, OSError) and exc.errno:
        return os.strerror(exc.errno)
    return one_line(exc)


def _raised_everywhere(message) -> CheckpointError:
    """A CheckpointError that every rank raises with the same ``message``."""
    error = CheckpointError(message)
    error.on_every_rank = True  # the command line prints it once (rank 0)
    return error


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
            error = f"checkpoint not written: rank 0 cannot create {tmp}: {_reason(exc)}"
    error = comm.bcast(error, root=0)
    if error:
        raise _raised_everywhere(error)

    written, error, path = {}, None, tmp
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
        error = f"rank {rank} could not write {path}: {_reason(exc)}"
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
            errors.append(f"rank 0 could not complete {final}: {_reason(exc)}")
        error = None
        if errors:  # one line: the first failing rank's (every rank's copy says the same)
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            error = (f"checkpoint after step {int(step)} not written: {errors[0]}{more}; "
                     "the previous checkpoint is intact")
    error = comm.bcast(error if rank == 0 else None, root=0)
    if error:
        raise _raised_everywhere(error)
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
            except (OSError, ValueError, RecursionError):  # invalid UTF-8 or JSON, or too deep
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
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{manifest_path}: missing or unreadable ({one_line(exc)}); "
                              "the checkpoint is incomplete") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT \
            or not isinstance(manifest.get("files"), dict):
        raise CheckpointError(f"{manifest_path}: not an {FORMAT} manifest")
    for name, entry in manifest["files"].items():
        if not _FILE_NAME.match(name):
            raise CheckpointError(f"{manifest_path}: lists {name!r}, not a file of the "
                                  "checkpoint's own directory")
        if not isinstance(entry, dict) or not _is_int(entry.get("bytes")) \
                or not isinstance(entry.get("sha256"), str):
            raise CheckpointError(f"{manifest_path}: the entry of {name!r} is not "
                                  "{bytes, sha256}")
    return manifest


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _verify_file(path, name, entry):
    file_path = os.path.join(path, name)
    try:
        info = os.lstat(file_path)
    except OSError:
        return f"{file_path}: missing (listed in {MANIFEST})"
    if not stat.S_ISREG(info.st_mode):  # a link would make the hash cover another file
        return f"{file_path}: not a regular file (a link?); checkpoints hold plain files only"
    size = info.st_size
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
    """``meta.json`` of checkpoint ``path``: an object with an integer ``step``.

    Raises:
        CheckpointError: unreadable, not an object, or no step count in it.
    """
    meta_path = os.path.join(os.fspath(path), "meta.json")
    try:
        with open(meta_path, encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{meta_path}: unreadable ({one_line(exc)})") from None
    if not isinstance(meta, dict):
        raise CheckpointError(f"{meta_path}: a JSON {type(meta).__name__}, not an object")
    step = meta.get("step")
    if not _is_int(step) or step < 0:
        raise CheckpointError(f"{meta_path}: step {step!r} is not a number of steps")
    return meta


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


def _foreign_storage(dataset) -> str | None:
    """Why ``dataset``'s values are not all in its own file, or None (reads no values)."""
    if dataset.external:
        return f"keeps its values in external file {str(dataset.external[0][0])!r}"
    if dataset.is_virtual:
        sources = sorted({str(source.file_name) for source in dataset.virtual_sources()})
        return f"is a virtual dataset reading {', '.join(map(repr, sources)) or 'other files'}"
    declared = 0 if dataset.shape is None else dataset.size * dataset.dtype.itemsize
    stored = dataset.id.get_storage_size()
    if stored != declared:  # hpcpax writes whole, uncompressed datasets
        return (f"declares {declared:,} bytes but stores {stored:,} (unwritten, chunked or "
                "compressed storage)")
    return None


def refuse_indirection(h5file, file_path) -> None:
    """Raise unless every dataset of an open HDF5 file keeps its own values in that file.

    Refuses soft and external links (:func:`refuse_links`), external raw
    storage (a dataset whose bytes are another file, such as the host's
    password file), virtual datasets (reading other HDF5 files) and storage
    other than the declared shape's bytes: none of these is covered by the
    manifest's hash, and hpcpax writes none. Reads no values.
    """
    refuse_links(h5file, file_path)
    h5py = _h5py()

    def check(name, obj):  # a non-None return stops the visit
        if isinstance(obj, h5py.Dataset):
            why = _foreign_storage(obj)
            return None if why is None else f"{file_path}: dataset {name!r} {why}"
        return None

    found = h5file.visititems(check)
    if found is not None:
        raise CheckpointError(found + "; checkpoints hold plain datasets only")


def _member(group, key, kind, file_path, what):
    """``group[key]`` when it is an h5py ``kind`` (Group or Dataset); CheckpointError otherwise."""
    h5py = _h5py()
    found = group.get(key) if isinstance(group, h5py.Group) else None
    if not isinstance(found, getattr(h5py, kind)):
        where = getattr(group, "name", "/")
        raise CheckpointError(f"{file_path}: {what} missing (no {kind.lower()} {key!r} in "
                              f"{where!r})")
    return found


def _shown(shape, dtype) -> str:
    return f"{np.dtype(dtype)} {'(null)' if shape is None else tuple(shape)}"


def _check_exact(dataset, file_path, what, shape, dtype) -> None:
    """Raise unless ``dataset`` has exactly ``shape`` and ``dtype`` (nothing is broadcast)."""
    if dataset.shape is None or tuple(dataset.shape) != tuple(shape) \
            or dataset.dtype != np.dtype(dtype):
        raise CheckpointError(f"{file_path}: {what} has another shape or dtype: "
                              f"{_shown(dataset.shape, dataset.dtype)}, expected "
                              f"{_shown(shape, dtype)}")


def _dense_datasets(f, file_path, expected, expected_state):
    """``(params, slots)``: the datasets of ``dense.h5`` to read, checked before reading."""
    params_group = _member(f, "params", "Group", file_path, "the parameters")
    state_group = _member(f, "optimizer", "Group", file_path, "the optimizer state")
    params = {}
    for name in (list(params_group) if expected is None else list(expected)):
        params[name] = _member(params_group, name, "Dataset", file_path, f"parameter {name!r}")
        if expected is not None:
            like = expected[name]
            _check_exact(params[name], file_path, f"parameter {name!r}", like.shape, like.dtype)
    slots = {}
    wanted = expected_state if expected_state is not None else dict.fromkeys(state_group)
    for name, like_slots in wanted.items():
        group = _member(state_group, name, "Group", file_path, f"optimizer state of {name!r}")
        slots[name] = {}
        for slot in (list(group) if like_slots is None else list(like_slots)):
            what = f"optimizer slot {slot!r} of {name!r}"
            slots[name][slot] = _member(group, slot, "Dataset", file_path, what)
            if like_slots is not None:
                like = like_slots[slot]
                _check_exact(slots[name][slot], file_path, what, like.shape, like.dtype)
    return params, slots


def load_dense(path, expected=None, expected_state=None):
    """``(params, optimizer_state)`` from ``dense.h5``; not collective.

    Args:
        expected: ``{name: array}``: every parameter must be there with
            exactly that array's shape and dtype, checked before anything is
            read (only these are read); None reads every parameter.
        expected_state: ``{name: {slot: array}}``: the same for the
            optimizer's slots; None reads every slot.

    Raises:
        CheckpointError: the file is unreadable, holds a link, external or
            virtual storage, a parameter or slot is missing or of another
            shape or dtype, or a value is NaN or Inf (named with its index).
    """
    h5py = _h5py()
    file_path = os.path.join(os.fspath(path), "dense.h5")
    try:
        with h5py.File(file_path, "r") as f:
            refuse_indirection(f, file_path)
            params, slots = _dense_datasets(f, file_path, expected, expected_state)
            params = {name: dataset[...] for name, dataset in params.items()}
            state = {name: {slot: dataset[...] for slot, dataset in group.items()}
                     for name, group in slots.items()}
    except CheckpointError:
        raise
    except (OSError, KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
        raise CheckpointError(f"{file_path}: cannot read ({one_line(exc)})") from None
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


class RowsLayout:
    """What a sparse variable's rows must look like in every file of a checkpoint.

    Attributes:
        dim: values per row.
        dtype: the table's dtype, also every optimizer row slot's.
        row_slots: names of the optimizer's per-row slots (each shaped like the table).
        scalar_slots: ``{name: (shape, dtype)}`` of its per-variable scalars (Adam's step).
    """

    def __init__(self, dim, dtype, row_slots=(), scalar_slots=None):
        self.dim, self.dtype = int(dim), np.dtype(dtype)
        self.row_slots = tuple(row_slots)
        self.scalar_slots = {k: (tuple(s), np.dtype(d)) for k, (s, d) in
                             (scalar_slots or {}).items()}

    @classmethod
    def of(cls, spec) -> "RowsLayout":
        """The layout of a :class:`~hpcpax.ps.spec.SparseVariableSpec` and its optimizer."""
        from ..ops.optimizers import make_optimizer

        dtype = np.dtype(spec.dtype)
        optimizer = make_optimizer(spec.optimizer, **spec.optimizer_params)
        state = optimizer.init_state((0, spec.dim), dtype, np)
        return cls(spec.dim, dtype, optimizer.row_slots,
                   {k: (np.shape(state[k]), np.asarray(state[k]).dtype)
                    for k in optimizer.scalar_slots})



def _slot_members(group, declared, plural, singular, file_path, where, shape_of, note):
    """The datasets of a checkpoint's slot ``group``, by name: exactly the ``declared``
    ones (None: whatever is there), each of the shape and dtype ``shape_of(name)`` gives
    (None: not checked). Raises CheckpointError naming the file, ``where`` and the slot."""
    names = set(group)
    if declared is not None and names != set(declared):
        raise CheckpointError(f"{file_path}: {where} {plural} {sorted(names)}, "
                              f"the optimizer has {sorted(declared)}")
    members = {}
    for name in sorted(names):
        what = f"{where} {singular} {name!r}"
        members[name] = _member(group, name, "Dataset", file_path, what)
        if shape_of is not None:
            _check_exact(members[name], file_path, what + note, *shape_of(name))
    return members

def _sparse_datasets(group, file_path, name, layout, dim):
    """``(ids, table, row slots, scalar slots)`` datasets of one file's variable ``name``,
    every shape and dtype checked before anything is read."""
    where = f"variable {name!r}:"
    ids = _member(group, "ids", "Dataset", file_path, f"{where} ids")
    table = _member(group, "table", "Dataset", file_path, f"{where} table")
    row_group = _member(group, "row_state", "Group", file_path, f"{where} optimizer row state")
    scalar_group = _member(group, "scalar_state", "Group", file_path,
                           f"{where} optimizer scalar state")
    if ids.shape is None or len(ids.shape) != 1 or ids.dtype != np.int64:
        raise CheckpointError(f"{file_path}: {where} ids are {_shown(ids.shape, ids.dtype)}, "
                              "expected int64 (rows,)")
    rows = ids.shape[0]
    width = layout.dim if layout is not None else dim
    if table.shape is None or len(table.shape) != 2 or table.shape[0] != rows \
            or (width is not None and table.shape[1] != width) \
            or (layout is not None and table.dtype != layout.dtype):
        expected = (_shown((rows, width), layout.dtype) if layout is not None else
                    f"{rows} rows" + (f" of {width}" if width is not None else ""))
        raise CheckpointError(f"{file_path}: {where} the table is "
                              f"{_shown(table.shape, table.dtype)} with {rows} ids, expected "
                              f"{expected}")
    row_slots = _slot_members(row_group, None if layout is None else layout.row_slots,
                              "optimizer row slots", "optimizer slot", file_path, where,
                              lambda slot: (table.shape, table.dtype), " (shaped like the table)")
    scalars = _slot_members(scalar_group, None if layout is None else layout.scalar_slots,
                            "optimizer scalars", "optimizer scalar", file_path, where,
                            None if layout is None else layout.scalar_slots.__getitem__, "")
    return ids, table, row_slots, scalars


def load_matching(path, name, keep, dim=None, layout=None):
    """Every row of variable ``name`` whose id ``keep`` selects, from every sparse file.

    ``layout`` (a :class:`RowsLayout`), when given, is what every file's
    table, optimizer row slots and scalars must be, exactly (shape and
    dtype; ``dim`` alone checks the row width). Ids must be int64, one per
    table row, and every row slot shaped like the table. Everything is
    checked before a row is read; links, external storage and virtual
    datasets are refused (:func:`refuse_indirection`).

    Not collective: each rank reads the ids of every file, then only the
    rows it keeps, in blocks of bounded size.

    Args:
        keep: ``keep(ids) -> bool mask`` over an int64 id array.

    Returns:
        ``(ids, table, row_state, scalar_state)`` of the selected rows.

    Raises:
        CheckpointError: a file is unreadable or of another layout (named),
            no file holds ``name``, a selected id is present twice, or a
            selected row of the table or of an optimizer slot holds NaN or
            Inf (file, variable, row id and column named).
    """
    h5py = _h5py()
    pieces, scalar_state, first = [], None, None
    for file_path in _sparse_files(os.fspath(path)):
        try:
            with h5py.File(file_path, "r") as f:
                refuse_indirection(f, file_path)
                if name not in f:
                    continue
                group = _member(f, name, "Group", file_path, f"variable {name!r}")
                ids, table, row_slots, scalars = _sparse_datasets(group, file_path, name,
                                                                  layout, dim)
                shapes = ((table.shape[1:], table.dtype),
                          {k: v.dtype for k, v in row_slots.items()},
                          {k: (v.shape, v.dtype) for k, v in scalars.items()})
                if first is None:
                    first = shapes
                    scalar_state = {k: v[...] for k, v in scalars.items()}
                elif shapes != first:
                    raise CheckpointError(f"{file_path}: variable {name!r} is stored with "
                                          "another row width, dtype or optimizer state than "
                                          "in the other sparse files")
                ids = ids[...]
                chosen = np.asarray(keep(ids), bool) if len(ids) else np.zeros(0, bool)
                for start in range(0, len(ids), _READ_BLOCK_ROWS):
                    stop = min(start + _READ_BLOCK_ROWS, len(ids))
                    hit = chosen[start:stop]
                    if hit.any():  # one bounded window read, then a selection
                        piece = (ids[start:stop][hit], table[start:stop][hit],
                                 {k: v[start:stop][hit] for k, v in row_slots.items()})
                        _refuse_nonfinite(file_path, name, "table", piece[0], piece[1])
                        for slot, values in piece[2].items():
                            _refuse_nonfinite(file_path, name, f"optimizer slot {slot!r}",
                                              piece[0], values)
                        pieces.append(piece)
        except CheckpointError:
            raise
        except (OSError, KeyError, ValueError, TypeError, IndexError, RuntimeError) as exc:
            raise CheckpointError(f"{file_path}: cannot read variable {name!r} "
                                  f"({one_line(exc)})") from None
    if scalar_state is None:
        raise CheckpointError(f"{path}: no sparse file holds variable {name!r}")
    (shape, dtype), slots, _ = first
    ids = np.concatenate([p[0] for p in pieces]) if pieces else np.zeros(0, np.int64)
    table = (np.concatenate([p[1] for p in pieces]) if pieces
             else np.zeros((0,) + shape, dtype))
    row_state = {k: (np.concatenate([p[2][k] for p in pieces]) if pieces
                     else np.zeros((0,) + shape, d)) for k, d in slots.items()}
    if ids.size != np.unique(ids).size:
        raise CheckpointError(f"{path}: variable {name!r}: some rows are present twice")
    return ids, table, row_state, scalar_state
