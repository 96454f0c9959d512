"""Pull every table of a forward pass in one exchange, from the model's inputs.

Each table's lookup is a collective pull, so a model with T tables would make
T exchanges per forward pass. Most models look tables up with ids taken from
their inputs: the input itself (``emb(ids)``), one ``select`` of it
(``tables[i](fields[:, i])``), one tensor of a list or dict argument
(DLRM's ``lS_i[k]``), or a range of columns cast to integers (DeepCTR's
``X[:, a:b].long()``). :class:`Prefetch` learns that on the first forward
pass. From then on, a forward pre-hook on the model pulls the rows of all
those tables in one batched exchange before the forward runs, and each
lookup takes its rows if its input is what was prefetched for it (the same
view, or for a cast range the same values, checked); any other lookup pulls
on its own, as before.

Where a source is found by its values (a cast range), a coincidence in one
worker's batch could teach that worker something the others did not learn:
the workers keep only what every one of them learned (one small collective
after the first forward pass), so the batched pull stays matched.
"""

from __future__ import annotations

import torch

__all__ = ["Prefetch"]

#: Lists, tuples and dicts in a forward's arguments are searched this deep.
_DEPTH = 2


def _tensors(args, kwargs) -> list:
    """``(path, tensor)`` of every tensor in ``args``/``kwargs`` (containers searched)."""
    found = []

    def visit(value, path, depth):
        if isinstance(value, torch.Tensor):
            found.append((path, value))
        elif depth < _DEPTH and isinstance(value, (list, tuple)):
            for i, item in enumerate(value):
                visit(item, path + (i,), depth + 1)
        elif depth < _DEPTH and isinstance(value, dict):
            for key, item in value.items():
                visit(item, path + (key,), depth + 1)

    for i, arg in enumerate(args):
        visit(arg, (i,), 0)
    for key, arg in kwargs.items():
        visit(arg, (key,), 0)
    return found


def _follow(args, kwargs, path):
    """The value at ``path`` (from :func:`_tensors`), or None where the call has none."""
    head, rest = path[0], path[1:]
    try:
        value = args[head] if isinstance(head, int) else kwargs[head]
        for key in rest:
            value = value[key]
    except (IndexError, KeyError, TypeError):
        return None
    return value if isinstance(value, torch.Tensor) else None


def _view_of(input, arg):
    """``None`` (``input`` is ``arg``), ``("select", dim, position)``, or False."""
    if input is arg:
        return None
    if input.dim() != arg.dim() - 1 or input.device != arg.device or \
            input.untyped_storage().data_ptr() != arg.untyped_storage().data_ptr():
        return False
    for dim in range(arg.dim()):
        position, rest = divmod(input.storage_offset() - arg.storage_offset(),
                                max(1, arg.stride(dim)))
        if rest == 0 and 0 <= position < arg.shape[dim] and \
                arg.select(dim, position).stride() == input.stride() and \
                arg.select(dim, position).shape == input.shape:
            return ("select", dim, position)
    return False


def _columns_of(input, arg):
    """``("columns", start, stop, 1-D?)`` where ``input`` equals a range of ``arg``'s
    columns cast to its dtype (``X[:, a:b].long()``), else False."""
    if arg.dim() != 2 or input.dim() not in (1, 2) or input.shape[0] != arg.shape[0] or \
            input.device != arg.device or arg.dtype == torch.bool:
        return False
    width = 1 if input.dim() == 1 else input.shape[1]
    for start in range(arg.shape[1] - width + 1):
        part = arg[:, start] if input.dim() == 1 else arg[:, start:start + width]
        if torch.equal(part.to(input.dtype), input):
            return ("columns", start, start + width, input.dim() == 1, input.dtype)
    return False


def _source(input, found):
    """``(path, how)`` of the first tensor among ``found`` that ``input`` comes from."""
    for path, arg in found:
        how = _view_of(input, arg)
        if how is not False:
            return path, how
    if input.dtype in (torch.int64, torch.int32):
        for path, arg in found:
            how = _columns_of(input, arg)
            if how is not False:
                return path, how
    return None


def _build(arg, how):
    """The ids the learned source ``how`` takes from ``arg``."""
    if how is None:
        return arg
    if how[0] == "select":
        return arg.select(how[1], how[2])
    _, start, stop, one_column, dtype = how
    if arg.dim() != 2 or arg.shape[1] < stop:
        return None
    return (arg[:, start] if one_column else arg[:, start:stop]).to(dtype)


def _same_view(a, b) -> bool:
    return (a is b) or (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
                        and a.storage_offset() == b.storage_offset()
                        and a.shape == b.shape and a.stride() == b.stride())


def _same_ids(pulled, input, how) -> bool:
    """Whether the lookup's ``input`` is what was pulled for it."""
    if how is None or how[0] == "select":
        return _same_view(pulled, input)
    return pulled.shape == input.shape and pulled.dtype == input.dtype and \
        torch.equal(pulled, input)


class Prefetch:
    """Batched pulls of a model's tables before its forward pass.

    Args:
        runtime: the :class:`~hpcpax.torch.runtime.Runtime` (its
            :meth:`~hpcpax.torch.runtime.Runtime.pull_many` pulls).
        model: the distributed model (hooks on its forward).
    """

    def __init__(self, runtime, model):
        self.runtime = runtime
        self.sources = None  # {table: (path, how)} once learned
        self._learning = None
        self._found = None
        self._cache = {}
        self.handles = [model.register_forward_pre_hook(self._before, with_kwargs=True),
                        model.register_forward_hook(self._after)]

    def _before(self, module, args, kwargs):
        if self.sources is None:
            self._learning = {}
            self._found = _tensors(args, kwargs)
            return None
        wanted, how_of = {}, {}
        for name, (path, how) in self.sources.items():
            if self.runtime.replica(name) is not None:
                continue  # read in place, nothing to pull
            arg = _follow(args, kwargs, path)
            ids = None if arg is None else _build(arg, how)
            if ids is not None:
                wanted[name], how_of[name] = ids, how
        if wanted:
            pulled = self.runtime.pull_many(wanted)
            self._cache = {name: (how_of[name], entry) for name, entry in pulled.items()}
        return None

    def _after(self, module, args, output):
        if self._learning is not None:
            self.sources = self._agreed(self._learning)
            self._learning = self._found = None
        self._cache = {}

    def _agreed(self, learned) -> dict:
        """What every worker learned (**collective** over the workers, once)."""
        comm = self.runtime.topology.workers
        if comm is None or comm.Get_size() == 1:
            return learned
        keys = {name: (path, how if how is None else tuple(str(v) for v in how))
                for name, (path, how) in learned.items()}
        everyone = comm.allgather(keys)
        return {name: learned[name] for name in learned
                if all(other.get(name) == keys[name] for other in everyone)}

    def take(self, name, input):
        """The prefetched ``(ids, inverse, rows)`` of ``name`` if ``input`` is what was pulled."""
        if self._learning is not None and name not in self._learning:
            source = _source(input, self._found)
            if source is not None:
                self._learning[name] = source
        entry = self._cache.pop(name, None)
        if entry is None:
            return None
        how, (pulled, *rest) = entry
        return tuple(rest) if _same_ids(pulled, input, how) else None

    def close(self) -> None:
        """Remove the hooks (local)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []
