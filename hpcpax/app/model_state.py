"""What a :class:`~hpcpax.app.model_sync.ModelSync` writes, reads and replaces.

- :func:`load_initial` and :func:`set_table`: whole tables from the first
  worker into the ranks that hold their rows (PS owners, or every replica),
  rows only, the optimizer state kept;
- :func:`write_checkpoint` and :func:`read_checkpoint`: the HDF5 checkpoints
  of :mod:`hpcpax.app.checkpoint` (rows by global id, so a checkpoint
  resumes on another layout or plan).

Each function says whether it is collective; the ModelSync runs them on
every rank through its command channel.
"""

from __future__ import annotations

import os

import numpy as np

from ..backend import to_host
from ..errors import CheckpointError, ConfigError
from . import checkpoint as ckpt

__all__ = ["load_initial", "set_table", "write_checkpoint", "read_checkpoint",
           "find_checkpoint"]

#: Bytes per broadcast when a table goes from the first worker to its holders.
BCAST_CHUNK = 1 << 28


def load_initial(sync, initial) -> None:
    """Starting values ``{table: array}`` of the first worker; **collective** (every rank)."""
    topo = sync.topology
    first = topo.worker_ranks[0]
    names = None
    if topo.rank == first:
        initial = dict(initial or {})
        unknown = sorted(set(initial) - set(sync.sync.variables))
        names = ([n for n in sync.sync.variables if n in initial] if not unknown
                 else f"initial values for unknown tables {unknown}")
    names = topo.comm.bcast(names, root=first)
    if isinstance(names, str):
        raise ConfigError(names)
    for name in names:
        set_table(sync, name, initial[name] if topo.rank == first else None)


def set_table(sync, name, values) -> None:
    """Whole table ``name`` from the first worker into its holders; **collective** (every rank).

    Rows only: the optimizer state stays as it is. ``values`` is read on
    the first worker only.
    """
    topo, var = sync.topology, sync.sync[name]
    spec = var.spec
    first = topo.worker_ranks[0]
    error = None
    if topo.rank == first:
        values = np.ascontiguousarray(to_host(values))
        if values.shape != (spec.rows, spec.dim) or values.dtype != np.dtype(spec.dtype):
            error = (f"table {name!r} must be {np.dtype(spec.dtype)} of shape "
                     f"{(spec.rows, spec.dim)}, not {values.dtype} {values.shape}")
    error = topo.comm.bcast(error, root=first)
    if error:
        raise ValueError(error)
    table = values if topo.rank == first else np.empty((spec.rows, spec.dim), spec.dtype)
    flat = table.reshape(-1)
    chunk = max(1, BCAST_CHUNK // flat.itemsize)
    for start in range(0, flat.size, chunk):
        topo.comm.Bcast(flat[start:start + chunk], root=first)
    var.load_whole(table)  # the owners' rows, or the replica


def write_checkpoint(sync, run_dir, step, meta, keep, dense) -> str:
    """Write one checkpoint; **collective** (every rank). ``dense`` on the first worker only."""
    topo = sync.topology
    meta = {**meta, "plan": sync.plan.to_dict(), "topology": topo.describe(),
            "tables": [var.spec.to_dict() for var in sync.sync.variables.values()]}
    return ckpt.save(topo.comm, run_dir, step, dense=dense, sparse=sync.sync.checkpoint_rows(),
                     meta=meta, keep=keep, job_id=sync.job_id)


def find_checkpoint(sync, path) -> str:
    """``path``, or the newest checkpoint of run directory ``path``; **collective** (workers)."""
    path = os.fspath(path)
    if os.path.isfile(os.path.join(path, ckpt.MANIFEST)):
        return path
    found = ckpt.latest(path) if sync.is_leader else None
    found = sync.topology.workers.bcast(found, root=0)
    if found is None:
        raise CheckpointError(f"{path}: no complete checkpoint there")
    return found


def read_checkpoint(sync, path):
    """Restore the tables' rows; **collective** (every rank).

    Returns ``(step, dense params, dense state, meta)`` on workers, None on servers.
    """
    topo = sync.topology
    ckpt.verify(path, topo.comm)
    meta = ckpt.read_meta(path)
    error = None
    try:
        sync.sync.restore_rows(lambda name, keep: ckpt.load_matching(
            path, name, keep, dim=sync.sync[name].spec.dim))
    except CheckpointError as exc:
        error = str(exc)
    errors = [e for e in topo.comm.allgather(error) if e]
    if errors:
        raise CheckpointError(errors[0])
    if not topo.is_worker:
        return None
    params, state = ckpt.load_dense(path)
    return int(meta["step"]), params, state, meta
