"""Checkpoints of a distributed torch model: HDF5, no pickle, any layout.

:func:`save` writes one checkpoint directory with
:mod:`hpcpax.app.checkpoint_files`'s writer (through
:meth:`~hpcpax.app.model_sync.ModelSync.save`): every table's rows with their
row-optimizer state, by global id, from the ranks that hold them (no worker
gathers a table); the dense parameters, buffers and the torch optimizers'
state of the dense parameters from the first worker (``dense.h5``, datasets
named by ``state_dict`` key); the optimizers' hyper-parameters as JSON in
``meta.json``. :func:`load` restores it on any number of ranks, servers,
partitions or sync methods. Nothing is pickled, nothing is evaluated.
"""

from __future__ import annotations

import numpy as np
import torch

from ..errors import CheckpointError
from .distribute import session_of

__all__ = ["save", "load"]


def _param_names(model):
    return {id(p): name for name, p in model.named_parameters()}


def _json_value(value):
    if isinstance(value, torch.Tensor):
        return value.item() if value.numel() == 1 else value.tolist()
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return repr(value)


def _dense_state(session):
    """``(tensors by state_dict key, optimizer slots by parameter name, hyper-parameters)``."""
    model, layout = session.model, session.layout
    tensors = {name: t.detach().cpu().numpy() for name, t in
               list(layout.dense.items()) + list(layout.frozen.items())}
    names = _param_names(model)
    slots, groups = {}, []
    for optimizer in session.optimizers:
        for param, state in optimizer.state.items():
            slots[names[id(param)]] = {
                key: (value.detach().cpu().numpy() if isinstance(value, torch.Tensor)
                      else np.asarray(value))
                for key, value in state.items() if value is not None}
        groups.append([{**{k: _json_value(v) for k, v in group.items() if k != "params"},
                        "params": [names[id(p)] for p in group["params"]]}
                       for group in optimizer.param_groups])
    return tensors, slots, groups


def _numpy_dtype(tensor):
    """The NumPy dtype of a tensor's values (None for one NumPy lacks, e.g. bfloat16)."""
    try:
        return torch.empty(0, dtype=tensor.dtype).numpy().dtype
    except TypeError:
        return None


def _wrong_slot(slots, params):
    """What is wrong with the first saved optimizer slot that does not fit its parameter
    (a tensor slot must have the parameter's shape and dtype: torch would broadcast), or None."""
    for name, state in slots.items():
        param = params.get(name)
        if param is None:
            continue
        for key, value in state.items():
            value = np.asarray(value)
            if key == "step" or value.ndim == 0:
                continue  # counters and scalars
            dtype = _numpy_dtype(param)
            if tuple(value.shape) != tuple(param.shape) or \
                    (value.dtype.kind == "f" and dtype is not None and value.dtype != dtype):
                return (f"optimizer slot {key!r} of {name!r} is {value.dtype} "
                        f"{tuple(value.shape)}, the parameter is {dtype} {tuple(param.shape)}")
    return None


def save(model, run_dir, step, *, keep=0) -> str:
    """Write a checkpoint of the distributed ``model`` and its optimizers after ``step``.

    **Collective** over the workers (servers join). Written under
    ``run_dir/checkpoints/step_NNNNNN`` (rows by global id, a manifest of
    SHA-256 sums written last); ``keep`` keeps the newest ``keep`` (0: all).

    Returns:
        The checkpoint directory.
    """
    session = session_of(model)
    tensors, slots, groups = _dense_state(session)
    meta = {"torch": {"optimizers": groups,
                      "tables": {n: {k: info[k] for k in ("rows", "dim", "optimizer",
                                                          "optimizer_params", "modules")}
                                 for n, info in session.layout.tables.items()}}}
    return session.sync.save(run_dir, step, dense=tensors, dense_state=slots, meta=meta,
                             keep=keep)


def load(model, path) -> int:
    """Restore the distributed ``model`` and its optimizers from a checkpoint.

    **Collective** over the workers (servers join). ``path`` is a
    checkpoint directory or a run directory (its newest checkpoint). Works
    on another number of ranks, servers or partitions, and another plan.

    Returns:
        The step the checkpoint was written after.

    Raises:
        CheckpointError: on every rank: a damaged file (named), or a
            parameter, buffer, optimizer slot or table missing or of another
            shape or dtype (checked before anything is restored).
    """
    session = session_of(model)
    step, tensors, slots, meta = session.sync.load(path)
    layout = session.layout
    targets = {**layout.dense, **layout.frozen}
    problems = [name for name, t in targets.items()
                if name not in tensors or tuple(tensors[name].shape) != tuple(t.shape)
                or _numpy_dtype(t) not in (None, tensors[name].dtype)]
    if problems:
        raise CheckpointError(f"{path}: dense tensor {problems[0]!r} missing or of another "
                              f"shape or dtype ({len(problems)} such)")
    params = dict(model.named_parameters())
    wrong = _wrong_slot(slots, params)  # before anything is copied: all or nothing
    if wrong:
        raise CheckpointError(f"{path}: {wrong}")
    with torch.no_grad():
        for name, target in targets.items():
            target.copy_(torch.from_numpy(np.ascontiguousarray(tensors[name])))
    saved_groups = meta.get("torch", {}).get("optimizers", [])
    for optimizer, groups in zip(session.optimizers, saved_groups):
        for group, saved in zip(optimizer.param_groups, groups):
            for key, value in saved.items():
                if key != "params" and key in group and not isinstance(group[key], torch.Tensor):
                    group[key] = tuple(value) if isinstance(group[key], tuple) else value
        owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
        for name, state in slots.items():
            param = params.get(name)
            if param is None or id(param) not in owned:
                continue
            optimizer.state[param] = {
                key: (torch.from_numpy(np.array(value)) if key == "step"
                      else torch.from_numpy(np.array(value)).to(param.device))
                for key, value in state.items()}
    return step
