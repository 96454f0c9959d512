"""Building a run from its config: run directory, model, data, plan requests.

Each function does one part of :meth:`hpcpax.app.trainer.Trainer.run`'s
set-up and says whether it is collective.
"""

from __future__ import annotations

import json
import os
import time

from ..errors import ConfigError
from .config import PLAN_MODES, load_plan_file, model_kwargs, normalize_plan

__all__ = ["make_run_dir", "build_model", "open_data", "plan_requests", "sparse_specs",
           "dense_variables", "config_lines"]


def make_run_dir(topology, config) -> tuple:
    """Create the run directory on rank 0; ``(absolute path, job id)`` everywhere.

    **Collective** over ``topology.comm``; a directory that cannot be made
    raises :class:`~hpcpax.errors.ConfigError` on every rank.
    """
    path = error = None
    if topology.rank == 0:
        path = config["run_dir"]
        if not path:
            stamp = time.strftime("%Y%m%d-%H%M%S")
            path, n = os.path.join("runs", stamp), 1
            while os.path.exists(path):
                path, n = os.path.join("runs", f"{stamp}-{n}"), n + 1
        try:
            os.makedirs(path, exist_ok=True)
        except OSError as exc:
            error = f"cannot create run directory {path}: {exc}"
        path = os.path.abspath(path)
    path, error = topology.comm.bcast((path, error), root=0)
    if error:
        raise ConfigError(error)
    job_id = topology.comm.bcast(os.environ.get("SLURM_JOB_ID")
                                 or f"{os.getpid()}-{int(time.time())}", root=0)
    return path, job_id


def build_model(config):
    """The model the config asks for; sizes the data file fixes unless given. Local."""
    from ..data import open_dataset
    from ..models import build_model as build

    kwargs = model_kwargs(config)
    if config["data"] is not None:
        options = {"context": kwargs.get("context", 4)} if config["model"] == "lm" else {}
        with open_dataset(config["data"], config["model"], **options) as reader:
            if config["model"] == "lm":
                kwargs.setdefault("vocab_size", int(reader.vocab_size))
            else:
                kwargs.setdefault("n_dense", int(reader.n_dense))
                kwargs.setdefault("n_fields", int(reader.n_fields))
    return build(config["model"], **kwargs)


def open_data(config, model):
    """The training data reader (the HDF5 file, or synthetic data). Local."""
    from ..data import open_dataset

    options = {"shuffle": config["shuffle"], "seed": config["seed"]}
    if config["model"] == "lm":
        options["context"] = model.context
        if config["data"] is None:
            return open_dataset("synthetic", "lm", num_tokens=config["synthetic_samples"],
                                vocab_size=model.vocab_size, **options)
        return open_dataset(config["data"], "lm", **options)
    if config["data"] is None:
        return open_dataset("synthetic", "ctr", num_samples=config["synthetic_samples"],
                            n_dense=model.n_dense, n_fields=model.n_fields,
                            cardinality=list(model.table_rows), **options)
    return open_dataset(config["data"], "ctr", **options)


def plan_requests(spec, names) -> tuple:
    """``(mode, {name: request})`` for a ``--plan`` value (or a plan override). Local.

    ``mode`` is ``auto``/``hybrid`` (measured: every variable starts on the
    parameter server) or None; requests are
    :func:`~hpcpax.app.config.normalize_plan` entries.

    Raises:
        ConfigError: the plan names a variable the model does not have.
    """
    if isinstance(spec, str) and spec in PLAN_MODES:
        return spec, {name: {"method": "ps"} for name in names}
    if isinstance(spec, str) and spec in ("ps", "allgather", "allreduce"):
        return None, {name: {"method": spec} for name in names}
    plan = load_plan_file(spec) if isinstance(spec, str) else normalize_plan(dict(spec))
    unknown = sorted(set(plan) - set(names))
    if unknown:
        raise ConfigError(f"plan names unknown sparse variable {unknown[0]!r}; the model "
                          f"has {names}")
    return None, {name: plan.get(name, {"method": "ps"}) for name in names}


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
    """``(params, optimizer, optimizer state, DenseAllreduce)`` of the dense variables.

    **Collective** over the workers (the allreduce checks every worker
    registered the same tensors); servers get empty dicts and no allreduce.
    """
    from ..comm.allreduce import DenseAllreduce
    from ..ops.optimizers import make_optimizer

    optimizer = make_optimizer(config["optimizer"], lr=config["lr"])
    if not topology.is_worker:
        return {}, optimizer, {}, None
    params = {k: xp.asarray(v) for k, v in model.init_dense().items()}
    state = {name: optimizer.init_state(p.shape, p.dtype, xp) for name, p in params.items()}
    allreduce = DenseAllreduce(topology, {n: (p.shape, p.dtype) for n, p in params.items()},
                               op="mean", bucket_bytes=config["bucket_bytes"] or None)
    return params, optimizer, state, allreduce


def config_lines(topology, run_dir, model, config, plan) -> str:
    """The lines the first worker prints before training."""
    lines = [f"hpcpax.train: {topology.size} ranks ({len(topology.server_ranks)} servers, "
             f"{topology.num_workers} workers, {topology.num_nodes} nodes), run dir {run_dir}",
             f"  model: {model!r}"]
    lines += [f"  {k} = {json.dumps(v)}" for k, v in config.items() if v is not None]
    lines.append("  plan: " + ", ".join(
        f"{n}={e['method']}" + (f"/{e['partitions']}" if e["method"] == "ps" else "")
        for n, e in plan.items()))
    return "\n".join(lines)
