"""Building a run from its config: run directory, sparse specs, dense variables.

(The model and the data readers: :mod:`hpcpax.app.datasets`.)

Each function does one part of :meth:`hpcpax.app.trainer.Trainer.run`'s
set-up and says whether it is collective.
"""

from __future__ import annotations

import json
import os
import time

import numpy as np

from ..errors import CheckpointError, ConfigError
from ..sync.methods import method_of

__all__ = ["prepare_run_dir", "run_in", "sparse_specs", "dense_variables", "dense_shapes",
           "check_dense_memory",
           "config_lines"]


def prepare_run_dir(topology, config) -> tuple:
    """Create or check the run directory on rank 0; ``(path, job id, note)`` everywhere.

    A directory that already holds a run (metrics, checkpoints or a summary)
    is never silently started over: ``resume`` continues it (refused when
    there is no checkpoint to continue from), ``overwrite`` keeps the old run
    under ``RUN_DIR.replaced-<time>`` and starts a new one, and anything else
    is refused. Then a probe file is written into ``checkpoints/`` and the
    directory itself. **Collective** over ``topology.comm``; errors raise
    :class:`~hpcpax.errors.ConfigError` (the write probe's
    :class:`~hpcpax.errors.CheckpointError`) on every rank.
    """
    from .run_checkpoints import check_writable

    path = error = note = None
    disk = False  # the error is the write check's (a CheckpointError)
    if topology.rank == 0:
        try:
            path, note = _claim_run_dir(config)
            check_writable(path)  # before config.json: a read-only --resume stops in one line
        except CheckpointError as exc:
            error, disk = str(exc), True
        except (OSError, ConfigError) as exc:
            error = str(exc) if isinstance(exc, ConfigError) else \
                f"cannot create run directory {config['run_dir'] or 'runs/'}: {exc}"
    path, error, note, disk = topology.comm.bcast((path, error, note, disk), root=0)
    if error:
        raise (CheckpointError if disk else ConfigError)(error)
    job_id = topology.comm.bcast(os.environ.get("SLURM_JOB_ID")
                                 or f"{os.getpid()}-{int(time.time())}", root=0)
    return path, job_id, note


def _claim_run_dir(config) -> tuple:
    from .checkpoint_files import list_checkpoints

    path = config["run_dir"]
    if not path:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        path, n = os.path.join("runs", stamp), 1
        while os.path.exists(path):
            path, n = os.path.join("runs", f"{stamp}-{n}"), n + 1
    path, note = os.path.abspath(path), None
    held = run_in(path)
    if held and config["overwrite"]:
        kept = f"{path}.replaced-{time.strftime('%Y%m%d-%H%M%S')}"
        os.rename(path, kept)
        note = f"overwrite: the previous run ({held}) is kept as {kept}"
    elif held and config["resume"] and not list_checkpoints(path):
        raise ConfigError(f"resume: run directory {path} holds a run ({held}) but no complete "
                          "checkpoint to continue from; --overwrite starts it over (the old run "
                          "is kept), or choose another --run-dir")
    elif held and not config["resume"]:
        raise ConfigError(f"run directory {path} already holds a run ({held}); pass --resume to "
                          "continue it, --overwrite to start over (the old run is kept), or "
                          "another --run-dir")
    os.makedirs(path, exist_ok=True)
    return path, note


def run_in(path) -> str | None:
    """What run ``path`` holds, in words (None when it holds none). Local."""
    from .checkpoint_files import list_checkpoints
    from .metrics import read_metrics

    found = []
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        steps = [r["step"] for r in read_metrics(metrics) if "loss" in r]
        found.append(f"metrics up to step {max(steps)}" if steps else "metrics.jsonl")
    checkpoints = list_checkpoints(path) if os.path.isdir(path) else []
    if checkpoints:
        found.append(f"checkpoints up to step {checkpoints[-1][0]}")
    if os.path.isfile(os.path.join(path, "summary.json")):
        found.append("summary.json")
    return ", ".join(found) or None


def sparse_specs(model, config) -> list:
    """The model's sparse variables as :class:`~hpcpax.ps.spec.SparseVariableSpec` s. Local."""
    from ..ps.spec import SparseVariableSpec

    return [SparseVariableSpec(
        s.name, rows=s.rows, dim=s.dim, dtype=config["dtype"],
        initializer="uniform" if s.init_scale > 0 else "zeros",
        init_scale=float(s.init_scale), optimizer=config["sparse_optimizer"],
        optimizer_params={"lr": config["sparse_lr"]},
        eviction=config.get("table_eviction") or "none") for s in model.sparse_specs()]


def dense_variables(topology, model, config, xp) -> tuple:
    """``(params, optimizer, optimizer state)`` of the dense variables. Local.

    Servers get empty dicts (the workers hold the dense replicas); the
    allreduce is the engine's (:func:`~hpcpax.engine.engine.build_engine`).
    """
    from ..ops.optimizers import make_optimizer

    optimizer = make_optimizer(config["optimizer"], lr=config["lr"])
    check_dense_memory(model.dense_shapes(), model.dtype, len(optimizer.row_slots))
    if not topology.is_worker:
        return {}, optimizer, {}
    params = {k: xp.asarray(v) for k, v in model.init_dense().items()}
    state = {name: optimizer.init_state(p.shape, p.dtype, xp) for name, p in params.items()}
    return params, optimizer, state


def dense_shapes(model) -> dict:
    """``{name: (shape, dtype)}`` of the model's dense parameters, in order. Local."""
    return {name: (tuple(shape), model.dtype) for name, shape in model.dense_shapes().items()}


def check_dense_memory(shapes, dtype, row_slots) -> None:
    """Refuse dense layers whose replica does not fit ``HPCPAX_REPLICA_MEMORY``.

    Every worker holds the parameters, their gradients, ``row_slots``
    optimizer arrays of the same shapes and the allreduce's fusion buffers,
    which hold the tensors below ``DIRECT_BYTES`` (larger ones are reduced
    in place: :mod:`hpcpax.comm.fusion`); checked before anything is
    allocated, identically on every rank (a pure function of the config).

    Raises:
        ConfigError: naming the largest layers and the sizes.
    """
    from ..comm.allreduce import DIRECT_BYTES
    from ..options import format_bytes, options

    itemsize = np.dtype(dtype).itemsize
    sizes = {name: int(np.prod(shape, dtype=np.int64)) * itemsize for name, shape in shapes.items()}
    fused = sum(n for n in sizes.values() if n < DIRECT_BYTES)
    need = sum(sizes.values()) * (2 + int(row_slots)) + fused  # params, grads, slots, buffers
    if need > options.replica_memory:
        largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
        raise ConfigError(
            f"dense layers need {format_bytes(need)} on every worker (parameters, gradients, "
            f"{row_slots} optimizer slots and the allreduce buffer; largest: "
            + ", ".join(f"{n} {tuple(shapes[n])} {format_bytes(sizes[n])}" for n in largest)
            + f"), above HPCPAX_REPLICA_MEMORY ({format_bytes(options.replica_memory)}): "
            "reduce --hidden/--context/--emb-dim or raise HPCPAX_REPLICA_MEMORY")


def config_lines(topology, run_dir, model, config, plan) -> str:
    """The lines the first worker prints before training."""
    lines = [f"hpcpax.train: {topology.counts()}, run dir {run_dir}",
             f"  model: {model!r}"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in config.items() if v is not None]
    lines.append("  plan: " + ", ".join(
        f"{n}={e['method']}" + (f"/{e['partitions']}" if method_of(e["method"]).on_servers
                                else "")
        for n, e in plan.items()))
    return "\n".join(lines)
