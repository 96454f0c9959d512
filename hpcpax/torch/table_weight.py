"""The original ``nn.Embedding`` weight, kept as the stand-in of its distributed table.

After :func:`~hpcpax.torch.distribute`, a table's rows live with their
holders; its original ``weight`` Parameter (the same object, so the user's
references, the module's ``parameters()`` and helpers such as
``clip_grad_norm_(model.parameters(), ...)`` still see it) becomes a
:class:`TableWeight`: its values are freed (a worker never holds a whole
table), and

- reading its ``.grad`` gives what a single process would have there: the
  workers' **mean** gradient of the step (sparse for a ``sparse=True``
  table, dense otherwise), gathered on first read after the backward pass
  (**collective** over the workers: every worker reads it, as every worker
  runs the same loop). A dense one is the same tensor every step, zeroed
  and refilled at the step's first read (as a Parameter's ``.grad`` under
  ``zero_grad(set_to_none=False)``): clone it to keep a step's values. Whatever the script then does to it in place (a
  clip's scaling, ``clamp_``) is what ``optimizer.step()`` pushes; a dense
  gradient too large for one worker (``HPCPAX_REPLICA_MEMORY``) is refused
  with an error naming the call;
- any computation with its values (``torch.square(weight)`` in a
  regularizer, ``weight @ x``) stops with an error naming the table and the
  operation, instead of silently reading nothing.
"""

from __future__ import annotations

import os
import traceback

import torch

from ..errors import ConfigError

__all__ = ["TableWeight", "caller"]

#: Tensor functions a stand-in allows: metadata, moves and conversions of its
#: (empty) storage, the attribute accessors; nothing that reads a table's values.
ALLOWED = frozenset({
    "__get__", "__set__", "__repr__", "__format__", "__hash__", "__reduce_ex__",
    "__deepcopy__", "__setstate__", "size", "dim", "numel", "element_size", "nelement",
    "is_floating_point", "is_complex", "is_contiguous", "requires_grad_", "to", "cpu",
    "cuda", "float", "double", "half", "detach", "detach_", "share_memory_", "data_ptr",
    "untyped_storage", "storage_offset", "stride", "type", "is_pinned", "pin_memory",
})


def caller() -> str:
    """``file:line (function)`` of the first frame outside hpcpax and torch."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        path = frame.filename.replace(os.sep, "/")
        if "/hpcpax/" not in path and "/torch/" not in path:
            return f"{os.path.basename(frame.filename)}:{frame.lineno} ({frame.name})"
    return "an unknown caller"


class TableWeight(torch.nn.Parameter):
    """A distributed table's original weight Parameter, turned stand-in (see the module).

    Made by :meth:`adopt` (the Parameter keeps its identity); ``.grad`` is
    read and written through the model's :class:`~hpcpax.torch.runtime.Runtime`.
    """

    @classmethod
    def adopt(cls, param, table, runtime) -> "TableWeight":
        """Turn ``param`` (a table's weight) into the stand-in of ``table``; local."""
        with torch.no_grad():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        param.__class__ = cls
        param.__dict__["_hpcpax_table"] = table
        param.__dict__["_hpcpax_runtime"] = runtime
        return param

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        if name not in ALLOWED:
            table = next((a.__dict__.get("_hpcpax_table") for a in args
                          if isinstance(a, TableWeight)), "?")
            raise ConfigError(
                f"table {table!r} lives with its holders (hpcpax.torch.distribute): its "
                f"original weight holds no values, and {name} on it at {caller()} would "
                "compute with nothing; read rows through the embedding module, or leave the "
                "table out (a regularizer on whole tables is not supported)")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))

    @property
    def grad(self):
        """The workers' mean gradient of the table this step (**collective**; see the module)."""
        runtime = self.__dict__.get("_hpcpax_runtime")
        return None if runtime is None else runtime.table_grad(self.__dict__["_hpcpax_table"])

    @grad.setter
    def grad(self, value):
        """``None`` drops the step's table gradient; a tensor replaces it (local)."""
        runtime = self.__dict__.get("_hpcpax_runtime")
        if runtime is not None:
            runtime.set_table_grad(self.__dict__["_hpcpax_table"], value)
