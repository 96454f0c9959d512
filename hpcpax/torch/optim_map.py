"""A torch optimizer's hyper-parameters as the servers' row optimizer.

The rows of an embedding table are updated where they live (on the parameter
servers, or on every replica), by :mod:`hpcpax.ops.optimizers`. Each torch
optimizer maps onto one of those rules, hyper-parameter by hyper-parameter:

============================  ===============  ==============================================
torch                         hpcpax           form
============================  ===============  ==============================================
``SGD(lr)``                   ``sgd``          ``p -= lr * g``: identical
``SGD(lr, momentum,           ``momentum``     ``a = momentum * a + g``; ``p -= lr * a``
nesterov)``                                    (nesterov: ``p -= lr * g + lr * momentum * a``),
                                               torch's form with ``dampening=0``; *lazy*: only
                                               the rows a step touches move (torch moves every
                                               row whose buffer is non-zero)
``Adagrad(lr, eps,            ``adagrad``      ``a += g * g``; ``p -= lr * g / (sqrt(a) + eps)``:
initial_accumulator_value)``                   identical (``initial_accumulator`` = torch's
                                               ``initial_accumulator_value``, default 0; eps added
                                               after the square root, as torch)
``SparseAdam(lr, betas, eps)``  ``adam``       ``m, v`` as torch; ``p -= lr * sqrt(1 - beta2^t) /
                                               (1 - beta1^t) * m / (sqrt(v) + eps)``: identical
                                               (lazy, eps added to ``sqrt(v)`` before the bias
                                               correction, ``t`` counted per table)
``Adam(lr, betas, eps)``,     ``adam``         as ``SparseAdam``, which differs from torch's
``AdamW(weight_decay=0)``                      dense Adam twice: only touched rows move (torch
                                               decays ``m`` and moves every row), and torch adds
                                               eps to ``sqrt(v) / sqrt(1 - beta2^t)``
                                               (hpcpax's eps is torch's ``eps *
                                               sqrt(1 - beta2^t)``)
============================  ===============  ==============================================

Refused, with the table and the setting named: weight decay, ``dampening``,
``lr_decay``, ``amsgrad``, ``maximize`` (a row update depending on rows the
step does not touch cannot be lazy), and any other optimizer class.
"""

from __future__ import annotations

import torch

from ..errors import ConfigError

__all__ = ["table_optimizer", "SUPPORTED"]

SUPPORTED = ("SGD", "Adagrad", "SparseAdam", "Adam", "AdamW")


def _number(value):
    return float(value.item()) if isinstance(value, torch.Tensor) else float(value)


def _refuse_nonzero(table, group, keys):
    for key in keys:
        if key in group and _number(group[key]) != 0:
            raise ConfigError(f"table {table!r}: {key}={group[key]} is not supported for "
                              f"embedding tables (the servers update only the rows a step "
                              f"touches); give the table a parameter group with {key}=0")
    if group.get("maximize"):
        raise ConfigError(f"table {table!r}: maximize=True is not supported for embedding tables")


def table_optimizer(optimizer, group, table) -> tuple:
    """``(hpcpax optimizer name, hyper-parameters, difference or None)`` for one table.

    Args:
        optimizer: the torch optimizer holding the table's weight.
        group: the parameter group holding it.
        table: the table's name (for messages).

    Raises:
        ConfigError: an optimizer class or setting the servers cannot run.
    """
    kind = type(optimizer).__name__
    lr = _number(group["lr"])
    if isinstance(optimizer, torch.optim.SGD):
        _refuse_nonzero(table, group, ("weight_decay", "dampening"))
        momentum = _number(group.get("momentum", 0))
        if momentum == 0:
            return "sgd", {"lr": lr}, None
        return ("momentum", {"lr": lr, "momentum": momentum,
                             "nesterov": bool(group.get("nesterov", False))},
                "SGD momentum is lazy on tables: only the rows a step touches move")
    if isinstance(optimizer, torch.optim.Adagrad):
        _refuse_nonzero(table, group, ("weight_decay", "lr_decay"))
        return ("adagrad", {"lr": lr, "initial_accumulator":
                            _number(group.get("initial_accumulator_value", 0)),
                            "eps": _number(group.get("eps", 1e-10))}, None)
    if isinstance(optimizer, (torch.optim.SparseAdam, torch.optim.Adam)):
        _refuse_nonzero(table, group, ("weight_decay",))
        if group.get("amsgrad"):
            raise ConfigError(f"table {table!r}: amsgrad=True is not supported for embedding "
                              "tables")
        beta1, beta2 = (_number(b) for b in group["betas"])
        params = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": _number(group["eps"])}
        if isinstance(optimizer, torch.optim.SparseAdam):
            return "adam", params, None
        return ("adam", params, f"torch.optim.{kind} on a table runs as SparseAdam: only "
                "touched rows move, and eps is added to sqrt(v) before the bias correction")
    raise ConfigError(f"table {table!r}: optimizer {kind} is not supported for embedding "
                      f"tables (supported: {', '.join(SUPPORTED)}); give the tables their own "
                      "optimizer, e.g. torch.optim.SparseAdam or torch.optim.Adagrad")


def group_of(optimizers, param):
    """``(optimizer, group)`` holding ``param``, or ``(None, None)``."""
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            if any(p is param for p in group["params"]):
                return optimizer, group
    return None, None
