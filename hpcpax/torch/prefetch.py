"""Pull every table of a forward pass in one exchange, from the model's inputs.

Each table's lookup is a collective pull, so a model with T tables would make
T exchanges per forward pass. Most models look tables up with their inputs
as given (``emb(ids)``) or a column of one (``tables[i](fields[:, i])``).
:class:`Prefetch` learns that on the first forward pass: which lookup reads
which input argument, as the argument itself or one ``select`` of it. From
then on, a forward pre-hook on the model pulls the rows of all those tables
in one batched exchange before the forward runs, and each lookup takes its
rows if its input is exactly the view prefetched for it (same memory, shape
and strides); any other lookup pulls on its own, as before.

What is learned depends only on the model's code, so every worker learns the
same and makes the same batched pull: the collective stays matched.
"""

from __future__ import annotations

import torch

__all__ = ["Prefetch"]


def _source(input, args):
    """``(argument index, None)`` or ``(index, (dim, position))``: where ``input`` comes from."""
    for k, arg in enumerate(args):
        if not isinstance(arg, torch.Tensor):
            continue
        if input is arg:
            return k, None
        if input.dim() != arg.dim() - 1 or input.device != arg.device or \
                input.untyped_storage().data_ptr() != arg.untyped_storage().data_ptr():
            continue
        for dim in range(arg.dim()):
            position, rest = divmod(input.storage_offset() - arg.storage_offset(),
                                    max(1, arg.stride(dim)))
            if rest == 0 and 0 <= position < arg.shape[dim] and \
                    arg.select(dim, position).stride() == input.stride() and \
                    arg.select(dim, position).shape == input.shape:
                return k, (dim, position)
    return None


def _same_view(a, b) -> bool:
    return (a is b) or (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                        and a.storage_offset() == b.storage_offset()
                        and a.shape == b.shape and a.stride() == b.stride())


class Prefetch:
    """Batched pulls of a model's tables before its forward pass.

    Args:
        runtime: the :class:`~hpcpax.torch.runtime.Runtime` (its
            :meth:`~hpcpax.torch.runtime.Runtime.pull_many` pulls).
        model: the distributed model (hooks on its forward).
    """

    def __init__(self, runtime, model):
        self.runtime = runtime
        self.sources = None  # {table: (arg index, select or None)} once learned
        self._learning = None
        self._args = None
        self._cache = {}
        self.handles = [model.register_forward_pre_hook(self._before),
                        model.register_forward_hook(self._after)]

    def _before(self, module, args):
        self._args = args
        if self.sources is None:
            self._learning = {}
            return
        wanted = {}
        for name, (k, select) in self.sources.items():
            if k < len(args) and isinstance(args[k], torch.Tensor):
                view = args[k] if select is None else args[k].select(*select)
                wanted[name] = view
        if wanted:
            self._cache = self.runtime.pull_many(wanted)

    def _after(self, module, args, output):
        if self._learning is not None:
            self.sources, self._learning = self._learning, None
        self._cache, self._args = {}, None

    def take(self, name, input):
        """The prefetched ``(ids, inverse, rows)`` of ``name`` if ``input`` is what was pulled."""
        if self._learning is not None and self._args is not None and name not in self._learning:
            source = _source(input, self._args)
            if source is not None:
                self._learning[name] = source
        entry = self._cache.get(name)
        if entry is None or not _same_view(entry[0], input):
            return None
        del self._cache[name]
        return entry[1:]

    def close(self) -> None:
        """Remove the hooks (local)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
