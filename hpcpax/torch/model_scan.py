"""What a torch model holds, as the adapter sees it: tables, dense, frozen.

:func:`scan` walks the model once and sorts every parameter and buffer:

- **tables**: the weight of each ``nn.Embedding`` / ``nn.EmbeddingBag`` that
  trains; its rows will live on the parameter servers (or replicas), updated
  there by the row optimizer its torch optimizer maps to
  (:mod:`~hpcpax.torch.optim_map`). Several modules sharing one weight share
  one table. ``sparse=False`` tables are fine: the adapter computes row
  gradients of the touched rows only.
- **dense**: every other parameter that trains; gradients averaged by the
  fused allreduce, updated by the torch optimizer on every worker.
- **frozen**: parameters that do not train, and buffers; copied once from
  the first worker.

Whatever the adapter cannot run the same way as one process is refused here,
named: wrapped models, batch normalization, uninitialized lazy modules,
embedding options that rewrite rows in the forward pass (``max_norm``) or
depend on the whole batch (``scale_grad_by_freq``), a table's weight also
used as a dense parameter (tied weights), dtypes without an MPI type, dense
parameters on several devices, a table no optimizer updates.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError
from .optim_map import group_of, table_optimizer
from .tensors import SUPPORTED_DTYPES, numpy_dtype

__all__ = ["ModelLayout", "scan", "TABLE_MODULES"]

TABLE_MODULES = (torch.nn.Embedding, torch.nn.EmbeddingBag)


class ModelLayout:
    """The result of :func:`scan`.

    Attributes:
        tables: ``{table: info}`` with ``modules`` (paths), ``weight``, ``rows``,
            ``dim``, ``dtype``, ``padding_idx``, ``device``, ``sparse``,
            ``optimizer``, ``optimizer_params``, ``note``.
        dense: ``{name: parameter}`` of dense parameters that train.
        frozen: ``{name: tensor}`` of parameters that do not train, and buffers.
    """

    def __init__(self):
        self.tables, self.dense, self.frozen = {}, {}, {}

    def signature(self) -> list:
        """``[name, shape, dtype, kind]`` of everything, for comparing ranks."""
        out = [[name, [info["rows"], info["dim"]], str(info["dtype"]), "table"]
               for name, info in self.tables.items()]
        out += [[name, list(p.shape), str(p.dtype), "dense"] for name, p in self.dense.items()]
        out += [[name, list(t.shape), str(t.dtype), "frozen"] for name, t in self.frozen.items()]
        return out


def _refuse_module(path, module):
    label = repr(path) if path else "the model"
    if isinstance(module, (torch.nn.DataParallel, torch.nn.parallel.DistributedDataParallel)):
        raise ConfigError(f"module {label} is a {type(module).__name__}: pass the plain model "
                          "(hpcpax.torch.distribute does the data parallelism)")
    if isinstance(module, torch.nn.modules.batchnorm._BatchNorm):
        raise ConfigError(f"module {label} ({type(module).__name__}) is not supported: its "
                          "batch statistics would come from each worker's share of the batch, "
                          "not the whole batch; use LayerNorm or GroupNorm")
    if isinstance(module, torch.nn.modules.lazy.LazyModuleMixin) and \
            module.has_uninitialized_params():
        raise ConfigError(f"module {label} ({type(module).__name__}) has uninitialized "
                          "parameters: run one forward pass before distribute()")
    if type(module).__module__.startswith("hpcpax.torch"):
        raise ConfigError(f"module {label} is already distributed; call "
                          "hpcpax.torch.distribute once per model")


def _table_info(path, module, optimizers):
    kind = next(cls for cls in TABLE_MODULES if isinstance(module, cls))
    if type(module).forward is not kind.forward:
        raise ConfigError(f"module {path!r} ({type(module).__name__}) overrides "
                          f"{kind.__name__}.forward; only plain {kind.__name__} modules "
                          "are supported")
    if module.max_norm is not None:
        raise ConfigError(f"module {path!r}: max_norm={module.max_norm} is not supported (it "
                          "rewrites table rows in the forward pass)")
    if module.scale_grad_by_freq:
        raise ConfigError(f"module {path!r}: scale_grad_by_freq=True is not supported (it "
                          "depends on counts over the whole batch)")
    weight = module.weight
    if weight.dtype not in (torch.float32, torch.float64):
        raise ConfigError(f"table {path!r} is {weight.dtype}: tables must be torch.float32 "
                          "or torch.float64")
    optimizer, group = group_of(optimizers, weight)
    if optimizer is None:
        raise ConfigError(f"table {path!r}: its weight is in no optimizer given to "
                          "distribute(); freeze it (requires_grad=False) or add it")
    name, params, note = table_optimizer(optimizer, group, path)
    return {"modules": [path], "weight": weight, "rows": int(weight.shape[0]),
            "dim": int(weight.shape[1]), "dtype": numpy_dtype(weight.dtype),
            "padding_idx": module.padding_idx, "device": weight.device,
            "sparse": bool(module.sparse), "optimizer": name, "optimizer_params": params,
            "note": note}


def scan(model, optimizers) -> ModelLayout:
    """Sort ``model``'s parameters and buffers; refuse what cannot run (local).

    Raises:
        ConfigError: naming the module or parameter that cannot be distributed.
    """
    layout = ModelLayout()
    table_of = {}  # id(weight) -> table name
    for path, module in model.named_modules(remove_duplicate=False):
        _refuse_module(path, module)
        if isinstance(module, TABLE_MODULES) and module.weight.requires_grad:
            weight = module.weight
            if id(weight) in table_of:
                layout.tables[table_of[id(weight)]]["modules"].append(path)
                continue
            if not path:
                raise ConfigError("the model itself is an embedding: wrap it in a module")
            table_of[id(weight)] = path
            layout.tables[path] = _table_info(path, module, optimizers)
    for path, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, TABLE_MODULES):
            continue
        for pname, param in module.named_parameters(recurse=False):
            if param is not None and id(param) in table_of:
                full = f"{path}.{pname}" if path else pname
                raise ConfigError(f"parameter {full!r} is the weight of table "
                                  f"{table_of[id(param)]!r} too (tied weights): a table lives "
                                  "on the parameter servers and cannot also be a dense "
                                  "parameter")
    devices = {}
    for name, param in model.named_parameters():
        if id(param) in table_of:
            continue
        if param.dtype not in SUPPORTED_DTYPES:
            raise ConfigError(f"parameter {name!r} is {param.dtype}: the adapter syncs "
                              f"{', '.join(map(str, SUPPORTED_DTYPES))}")
        if param.requires_grad:
            layout.dense[name] = param
            devices.setdefault(param.device, name)
        else:
            layout.frozen[name] = param
    if len(devices) > 1:
        (first, a), (second, b) = list(devices.items())[:2]
        raise ConfigError(f"dense parameters must be on one device: {a!r} is on {first}, "
                          f"{b!r} on {second}")
    for name, buffer in model.named_buffers():
        layout.frozen[name] = buffer
    return layout
