"""Row-wise (lazy) sparse optimizers, and the same math for dense variables.

Only the rows named in an update change, parameters and slots alike (lazy,
like TensorFlow's ``LazyAdamOptimizer``). Formulas, with every scalar
rounded once to the parameter dtype on the host and ``g`` the gradient:

* ``sgd``:      ``p = p - lr * g``
* ``momentum``: ``a = momentum * a + g``; ``p = p - lr * a``, or with
  ``nesterov`` ``p = p - (lr * g + (lr * momentum) * a)``
* ``adagrad``:  ``a = a + g * g``; ``p = p - lr * g / (sqrt(a) + eps)``
* ``adam``:     ``t += 1`` once per apply call (per table);
  ``lr_t = lr * sqrt(1 - beta2**t) / (1 - beta1**t)`` (float64, host);
  ``m = beta1 * m + (1 - beta1) * g``; ``v = beta2 * v + (1 - beta2) * (g * g)``;
  ``p = p - lr_t * m / (sqrt(v) + eps)``

The NumPy reference, the Numba kernels and the CUDA kernels (compiled with
``--fmad=false``) evaluate these in the same order in the parameter dtype,
so all three are bit-equal. Adam's step counter is ``state["step"]``, a
1-element int64 NumPy array even for device parameters: bias correction
then needs no device sync, and the counter checkpoints with the slots.
"""

from __future__ import annotations

import math

import numpy as np

from ..backend import array_module, is_device_array
from . import _numba
from ._validate import (
    check_bounds,
    check_float_matrix,
    check_index_array,
    check_same_device,
    check_same_dtype,
)

__all__ = ["SparseOptimizer", "apply_rows_many", "make_optimizer", "OPTIMIZERS"]


def _positive(name, value):
    value = float(value)
    if not value > 0:
        raise ValueError(f"{name} must be > 0, not {value}")
    return value


def _fraction(name, value):
    value = float(value)
    if not 0 <= value < 1:
        raise ValueError(f"{name} must be in [0, 1), not {value}")
    return value


class SparseOptimizer:
    """One optimizer rule: hyper-parameters, slot layout, and the update.

    The optimizer owns its state layout: :attr:`row_slots` are arrays shaped
    like the variable (one row per table row: gathered, moved and
    checkpointed with the rows), :attr:`scalar_slots` are per-variable
    host scalars (Adam's step), identical on every holder of the variable.
    Everything that stores, moves or budgets optimizer state asks here.

    Attributes:
        name: ``"sgd"``, ``"momentum"``, ``"adagrad"`` or ``"adam"``.
        hparams: JSON-able dict of hyper-parameters (defaults filled in).
        row_slots: names of the state arrays shaped like the variable.
        scalar_slots: names of the per-variable scalar state entries.
    """

    name = ""
    row_slots: tuple = ()
    scalar_slots: tuple = ()

    @property
    def state_names(self) -> tuple:
        """Every state entry :meth:`init_state` creates (row slots, then scalars)."""
        return self.row_slots + self.scalar_slots

    def split_state(self, state) -> tuple:
        """``(row slots, scalar slots)`` of ``state``: two dicts, same arrays."""
        return ({k: state[k] for k in self.row_slots},
                {k: state[k] for k in self.scalar_slots})

    def state_bytes_per_row(self, dim: int, itemsize: int) -> int:
        """Bytes of optimizer state per table row of ``dim`` values."""
        return len(self.row_slots) * dim * itemsize

    def __init__(self, **hparams):
        self.hparams = hparams

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in self.hparams.items())
        return f"make_optimizer({self.name!r}, {args})"

    # -- state -----------------------------------------------------------
    def init_state(self, shape, dtype, xp=np) -> dict:
        """Fresh slots for a variable of ``shape`` and ``dtype``.

        Slot arrays live on ``xp``'s device; ``"step"`` (adam) is always a
        host NumPy int64 array of shape ``(1,)``.
        """
        return {}

    # -- math shared by every path ----------------------------------------
    def _scalars(self, dtype, state) -> tuple:
        raise NotImplementedError

    def _update(self, p, slots, g, scalars):
        """New ``(p, slots)`` from arrays (whole, or rows gathered); xp code."""
        raise NotImplementedError

    def _advance(self, state) -> None:
        """Per-call bookkeeping (adam's step) before the scalars are made."""

    def _kernel_flags(self) -> tuple:
        """Integer switches passed to the CUDA kernel after the scalars."""
        return ()

    # -- public updates ------------------------------------------------------
    def apply_dense(self, param, state, grad) -> None:
        """Update a whole (dense) variable in place; any shape, NumPy or CuPy.

        Not collective; the result stays on the parameter's device.
        """
        if grad.shape != param.shape:
            raise ValueError(f"grad must have shape {tuple(param.shape)}, not {tuple(grad.shape)}")
        check_same_device("grad", grad, "param", param)
        check_same_dtype("grad", grad, "param", param)
        self._advance(state)
        scalars = self._scalars(param.dtype, state)
        slots = {k: state[k] for k in self.row_slots}
        new_p, new_slots = self._update(param, slots, grad, scalars)
        param[...] = new_p
        for k, v in new_slots.items():
            state[k][...] = v

    def _check_rows(self, param, state, rows, grads):
        if not hasattr(param, "flags") or not param.flags.c_contiguous:
            raise ValueError("param must be a C-contiguous array, not strided")
        check_float_matrix("param", param)
        rows = check_index_array("rows", rows)
        check_same_device("rows", rows, "param", param)
        grads = check_float_matrix("grads", grads, rows=rows.shape[0], dim=param.shape[1])
        check_same_device("grads", grads, "param", param)
        check_same_dtype("grads", grads, "param", param)
        for k in self.row_slots:
            if k not in state:
                raise ValueError(f"state must hold {list(self.state_names)}, not {sorted(state)}")
            slot = state[k]
            if tuple(slot.shape) != tuple(param.shape) or not slot.flags.c_contiguous:
                raise ValueError(f"state[{k!r}] must be C-contiguous with shape {tuple(param.shape)}")
            check_same_device(f"state[{k!r}]", slot, "param", param)
            check_same_dtype(f"state[{k!r}]", slot, "param", param)
        check_bounds("rows", rows, param.shape[0])
        return rows, grads

    def apply_rows_reference(self, param, state, rows, grads) -> None:
        """Plain-NumPy twin of :meth:`apply_rows` (gather, update, scatter)."""
        rows, grads = self._check_rows(param, state, rows, grads)
        self._apply_rows_reference(param, state, rows, grads)

    def _apply_rows_reference(self, param, state, rows, grads) -> None:
        self._advance(state)
        scalars = self._scalars(param.dtype, state)
        slots = {k: state[k][rows] for k in self.row_slots}
        new_p, new_slots = self._update(param[rows], slots, grads, scalars)
        param[rows] = new_p
        for k, v in new_slots.items():
            state[k][rows] = v

    def apply_rows(self, param, state, rows, grads) -> None:
        """Update rows ``rows`` of a 2-D variable and its slots, in place.

        Dispatches: CuPy runs ``kernels/sparse_optimizers.cu``; NumPy runs the
        Numba kernel (parallel over rows) or :meth:`apply_rows_reference`.
        All paths are bit-equal. Other rows are not touched. Not collective.

        Args:
            param: C-contiguous ``[rows, dim]`` float32/float64 array.
            state: dict from :meth:`init_state` for this variable.
            rows: 1-D integer array of UNIQUE local row indices (as
                :func:`~hpcpax.ops.dedup_sum` returns); duplicates race.
            grads: ``[len(rows), dim]`` gradient rows of ``param``'s dtype.
        """
        rows, grads = self._check_rows(param, state, rows, grads)
        if is_device_array(param):
            self._advance(state)
            from . import _cuda  # noqa: PLC0415

            # the kernel takes the row slots in the optimizer's declared order
            _cuda.launch_optimizer_rows(self.name, param, tuple(state[k] for k in self.row_slots),
                                        rows, grads, self._scalars(param.dtype, state),
                                        self._kernel_flags())
            return
        if not _numba.enabled():
            self.apply_rows_reference(param, state, rows, grads)
            return
        self._advance(state)
        if rows.size:
            with _numba.threads_for(grads.size):
                self._numba_rows(_numba.kernels(), param, state, rows, grads,
                                 self._scalars(param.dtype, state))


def apply_rows_many(updates, check=True) -> None:
    """:meth:`SparseOptimizer.apply_rows` for several host variables, bit-equal
    to calling it on each in turn.

    A model's dozens of small tables each paid the checks, the dispatch and
    a thread setting (~35 us apiece, 1.8 ms of a 12 ms DeepFM step at one
    rank); here the Numba kernels run under one thread setting, sized by the
    largest update. Not collective.

    Args:
        updates: ``(optimizer, param, state, rows, grads)`` tuples, each as
            :meth:`SparseOptimizer.apply_rows` takes it (NumPy arrays; a CuPy
            one goes through ``apply_rows`` alone).
        check: validate each update as ``apply_rows`` does. ``False`` is for
            callers whose ``rows`` are unique and in range by construction
            (:func:`~hpcpax.ops.dedup_sum` output over checked ids) and whose
            arrays they made themselves: nothing is checked then.
    """
    host = []
    for optimizer, param, state, rows, grads in updates:
        if (type(param) is not np.ndarray or type(grads) is not np.ndarray) \
                and (is_device_array(param) or is_device_array(grads)):
            optimizer.apply_rows(param, state, rows, grads)
            continue
        if check:
            rows, grads = optimizer._check_rows(param, state, rows, grads)
        host.append((optimizer, param, state, rows, grads))
    if not host:
        return
    if not _numba.enabled():
        for optimizer, param, state, rows, grads in host:
            optimizer._apply_rows_reference(param, state, rows, grads)
        return
    kernels = _numba.kernels()
    with _numba.threads_for(max(u[4].size for u in host)):
        for optimizer, param, state, rows, grads in host:
            optimizer._advance(state)
            if rows.size:
                optimizer._numba_rows(kernels, param, state, rows, grads,
                                      optimizer._scalars(param.dtype, state))


class SGD(SparseOptimizer):
    """Plain SGD: ``w -= lr * g``; no state."""
    name = "sgd"

    def __init__(self, lr):
        super().__init__(lr=_positive("lr", lr))

    def _scalars(self, dtype, state):
        return (dtype.type(self.hparams["lr"]),)

    def _update(self, p, slots, g, scalars):
        (lr,) = scalars
        return p - lr * g, {}

    def _numba_rows(self, kernels, param, state, rows, grads, scalars):
        kernels.sgd_rows(param, rows, grads, *scalars)


class Momentum(SparseOptimizer):
    """SGD with momentum: ``m = momentum * m + g``; ``w -= lr * m`` (Nesterov:
    ``w -= lr * (g + momentum * m)``)."""
    name = "momentum"
    row_slots = ("momentum",)

    def __init__(self, lr, momentum=0.9, nesterov=False):
        super().__init__(lr=_positive("lr", lr), momentum=_fraction("momentum", momentum),
                         nesterov=bool(nesterov))

    def init_state(self, shape, dtype, xp=np):
        """``{"momentum": zeros}`` of ``shape``."""
        return {"momentum": xp.zeros(shape, dtype)}

    def _scalars(self, dtype, state):
        lr, momentum = self.hparams["lr"], self.hparams["momentum"]
        return (dtype.type(lr), dtype.type(momentum), dtype.type(lr * momentum))

    def _update(self, p, slots, g, scalars):
        lr, momentum, lr_momentum = scalars
        a = momentum * slots["momentum"] + g
        if self.hparams["nesterov"]:
            return p - (lr * g + lr_momentum * a), {"momentum": a}
        return p - lr * a, {"momentum": a}

    def _kernel_flags(self):
        return (int(self.hparams["nesterov"]),)

    def _numba_rows(self, kernels, param, state, rows, grads, scalars):
        kernels.momentum_rows(param, state["momentum"], rows, grads, *scalars,
                              self.hparams["nesterov"])


class Adagrad(SparseOptimizer):
    """Adagrad: ``a += g * g``; ``w -= lr * g / (sqrt(a) + eps)``."""
    name = "adagrad"
    row_slots = ("accumulator",)

    def __init__(self, lr, initial_accumulator=0.1, eps=1e-10):
        initial = float(initial_accumulator)
        if initial < 0:
            raise ValueError(f"initial_accumulator must be >= 0, not {initial}")
        super().__init__(lr=_positive("lr", lr), initial_accumulator=initial,
                         eps=_positive("eps", eps))

    def init_state(self, shape, dtype, xp=np):
        """``{"accumulator": initial_accumulator}`` of ``shape``."""
        return {"accumulator": xp.full(shape, self.hparams["initial_accumulator"], dtype)}

    def _scalars(self, dtype, state):
        return (dtype.type(self.hparams["lr"]), dtype.type(self.hparams["eps"]))

    def _update(self, p, slots, g, scalars):
        lr, eps = scalars
        xp = array_module(p)
        a = slots["accumulator"] + g * g
        return p - lr * g / (xp.sqrt(a) + eps), {"accumulator": a}

    def _numba_rows(self, kernels, param, state, rows, grads, scalars):
        kernels.adagrad_rows(param, state["accumulator"], rows, grads, *scalars)


class Adam(SparseOptimizer):
    """Adam with bias correction; one shared step counter per variable."""
    name = "adam"
    row_slots = ("m", "v")
    scalar_slots = ("step",)

    def __init__(self, lr, beta1=0.9, beta2=0.999, eps=1e-8):
        super().__init__(lr=_positive("lr", lr), beta1=_fraction("beta1", beta1),
                         beta2=_fraction("beta2", beta2), eps=_positive("eps", eps))

    def init_state(self, shape, dtype, xp=np):
        """``m``, ``v`` (zeros of ``shape``) and the step counter."""
        return {"m": xp.zeros(shape, dtype), "v": xp.zeros(shape, dtype),
                "step": np.zeros(1, np.int64)}

    def _advance(self, state):
        step = state["step"]
        if is_device_array(step) or step.shape != (1,) or step.dtype != np.int64:
            raise ValueError("state['step'] must be a host int64 array of shape (1,)")
        step[0] += 1

    def _scalars(self, dtype, state):
        h = self.hparams
        t = int(state["step"][0])
        lr_t = h["lr"] * math.sqrt(1.0 - h["beta2"] ** t) / (1.0 - h["beta1"] ** t)
        return tuple(dtype.type(x) for x in (
            lr_t, h["beta1"], 1.0 - h["beta1"], h["beta2"], 1.0 - h["beta2"], h["eps"]))

    def _update(self, p, slots, g, scalars):
        lr_t, beta1, one_minus_beta1, beta2, one_minus_beta2, eps = scalars
        xp = array_module(p)
        m = beta1 * slots["m"] + one_minus_beta1 * g
        v = beta2 * slots["v"] + one_minus_beta2 * (g * g)
        return p - lr_t * m / (xp.sqrt(v) + eps), {"m": m, "v": v}

    def _numba_rows(self, kernels, param, state, rows, grads, scalars):
        kernels.adam_rows(param, state["m"], state["v"], rows, grads, *scalars)


OPTIMIZERS = {cls.name: cls for cls in (SGD, Momentum, Adagrad, Adam)}


def make_optimizer(name: str, **hparams) -> SparseOptimizer:
    """Build an optimizer by name: ``sgd``, ``momentum``, ``adagrad``, ``adam``.

    Args:
        name: the rule.
        **hparams: its hyper-parameters (``lr`` is required by all).

    Raises:
        ValueError: unknown name, or a hyper-parameter out of range.
        TypeError: an unknown or missing hyper-parameter.
    """
    if name not in OPTIMIZERS:
        raise ValueError(f"optimizer must be one of {sorted(OPTIMIZERS)}, not {name!r}")
    return OPTIMIZERS[name](**hparams)
