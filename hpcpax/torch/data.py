"""The script's batches, each worker taking its share of every global batch.

A single-process script iterates over *global* batches. Distributed, each
worker takes a contiguous share of every one (sizes differ by at most one;
the first ``n % workers`` workers take one more), in the same order, so the
workers together see exactly the batches the single process saw:

- a ``torch.utils.data.DataLoader`` that batches is rebuilt around the same
  dataset with a batch sampler that keeps this worker's share of each
  batch's indices: a worker loads only its own samples;
- any other iterable (a generator, a list of batches) is read whole on every
  worker and each batch cut: tensors and arrays along their first dimension,
  through tuples, lists and dicts.

Where the samples are not along the first dimension, ``batch_dim`` names it:
one int for every tensor, or a structure shaped like the batch with, per
tensor, its dimension, ``None`` (every worker takes it whole) or a function
``f(tensor, start, stop, total)`` that cuts it. Where no per-tensor rule
fits (ragged ``EmbeddingBag`` inputs, targets flattened across time and
batch), ``split(batch, start, stop)`` cuts the whole batch; :func:`cut_bags`
cuts indices and offsets (and per-sample weights) by sample. A ``DataLoader``
is then read whole like any iterable.

Every worker must draw the same global batches: the first batch of each pass
is compared between workers (one small collective), and a shuffle seeded
differently stops with :class:`~hpcpax.errors.MismatchError`. Each batch also
sets the gradient weight of an uneven share (:meth:`Runtime.set_batch`), so
the workers' mean equals the single process's batch mean.
"""

from __future__ import annotations

import zlib
from collections import deque

import numpy as np
import torch

from ..comm.agreement import check_same
from ..errors import ConfigError

__all__ = ["shard", "share", "cut_bags", "ShardedIterable", "ShardedLoader"]


def share(total, index, count) -> tuple:
    """``(start, stop)`` of worker ``index``'s share of ``total`` samples among ``count``."""
    base, extra = divmod(int(total), int(count))
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _is_array(value) -> bool:
    return isinstance(value, (torch.Tensor, np.ndarray))


def _leaves(batch, spec=0, path="batch"):
    """``(path, leaf, its rule)`` of every tensor or array in ``batch``; ``spec`` is
    ``batch_dim`` (an int, None or a function for every leaf below, or a structure
    shaped like the batch)."""
    if isinstance(spec, (dict, list, tuple)):
        if isinstance(spec, dict) != isinstance(batch, dict) or (
                not isinstance(batch, (dict, list, tuple))) or len(spec) != len(batch):
            raise ConfigError(f"batch_dim does not match the batch at {path}: "
                              f"{_shape_of(spec)} given for {_shape_of(batch)}")
        keys = spec.keys() if isinstance(spec, dict) else range(len(spec))
        for key in keys:
            if isinstance(batch, dict) and key not in batch:
                raise ConfigError(f"batch_dim names {path}[{key!r}], which the batch lacks")
            yield from _leaves(batch[key], spec[key], f"{path}[{key!r}]")
        return
    if _is_array(batch):
        yield path, batch, spec
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _leaves(value, spec, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _leaves(value, spec, f"{path}[{i}]")


def _shape_of(value) -> str:
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {_shape_of(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        inner = ", ".join(_shape_of(v) for v in value)
        return f"({inner})" if isinstance(value, tuple) else f"[{inner}]"
    if _is_array(value):
        return f"tensor{tuple(value.shape)}"
    return repr(value) if value is None or isinstance(value, int) else type(value).__name__


def _check_spec(spec, path="batch_dim") -> None:
    """``batch_dim`` holds ints >= 0, None and functions only."""
    if isinstance(spec, dict):
        for key, value in spec.items():
            _check_spec(value, f"{path}[{key!r}]")
    elif isinstance(spec, (list, tuple)):
        for i, value in enumerate(spec):
            _check_spec(value, f"{path}[{i}]")
    elif not (spec is None or callable(spec) or
              (isinstance(spec, int) and not isinstance(spec, bool) and spec >= 0)):
        raise TypeError(f"{path} must be an int >= 0, None, a function or a structure of "
                        f"them, not {spec!r}")


def batch_size(batch, batch_dim=0) -> int:
    """Samples in ``batch``: the size every tensor leaf shares along its ``batch_dim``
    (leaves taken whole or cut by a function do not count)."""
    size, first = None, None
    for path, leaf, dim in _leaves(batch, batch_dim):
        if not isinstance(dim, int):
            continue
        if leaf.ndim <= dim:
            if leaf.ndim == 0 and dim == 0:
                continue  # a scalar: every worker takes it
            raise ConfigError(f"cannot split the batch among workers: {path} has "
                              f"{leaf.ndim} dimensions, batch_dim says dimension {dim}")
        if size is None:
            size, first = int(leaf.shape[dim]), (path, dim)
        elif int(leaf.shape[dim]) != size:
            raise ConfigError(
                f"cannot split the batch among workers: {path} has {leaf.shape[dim]} "
                f"samples along dimension {dim}, {first[0]} has {size} along dimension "
                f"{first[1]}; name each tensor's batch dimension with batch_dim=, or cut "
                "the batch yourself with split= (hpcpax.torch.cut_bags cuts EmbeddingBag "
                "inputs)")
    if size is None:
        raise ConfigError(f"cannot split a batch of {type(batch).__name__} among workers: "
                          "no tensor or array in it has a batch dimension (batch_dim)")
    return size


def _cut(batch, start, stop, spec=0, total=None):
    if isinstance(spec, (dict, list, tuple)):
        if isinstance(batch, dict):
            return type(batch)((k, _cut(v, start, stop, spec.get(k, 0), total))
                               for k, v in batch.items())
        parts = [_cut(v, start, stop, s, total) for v, s in zip(batch, spec)]
        return type(batch)(*parts) if hasattr(batch, "_fields") else type(batch)(parts)
    if _is_array(batch):
        if spec is None or (batch.ndim == 0 and spec == 0):
            return batch
        if callable(spec):
            return spec(batch, start, stop, total)
        index = (slice(None),) * spec + (slice(start, stop),)
        return batch[index]
    if isinstance(batch, dict):
        return type(batch)((k, _cut(v, start, stop, spec, total)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_cut(v, start, stop, spec, total) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cut(v, start, stop, spec, total) for v in batch)
    return batch


def cut_bags(indices, offsets, start, stop, *, include_last_offset=False,
             per_sample_weights=None):
    """Samples ``[start, stop)`` of ``EmbeddingBag`` inputs given as ``indices`` and
    ``offsets`` (1-D, the ``nn.EmbeddingBag`` convention): ``(indices, offsets)``,
    the offsets rebased to the part, with ``per_sample_weights`` cut alike as a
    third item when given. Not collective; for ``split=`` functions."""
    bags = offsets.shape[0] - (1 if include_last_offset else 0)
    if not 0 <= start <= stop <= bags:
        raise ValueError(f"start and stop must satisfy 0 <= start <= stop <= {bags} (bags), "
                         f"not {start} and {stop}")
    low = int(offsets[start]) if start < offsets.shape[0] else int(indices.shape[0])
    if include_last_offset:
        high = int(offsets[stop])
        part_offsets = offsets[start:stop + 1] - low
    else:
        high = int(offsets[stop]) if stop < bags else int(indices.shape[0])
        part_offsets = offsets[start:stop] - low
    part = (indices[low:high], part_offsets)
    if per_sample_weights is not None:
        part += (per_sample_weights[low:high],)
    return part


def _check_workers(total, workers):
    if total < workers:
        raise ConfigError(f"a batch of {total} samples cannot be shared by {workers} workers; "
                          "use larger batches (drop_last=True avoids a short last batch)")


class ShardedIterable:
    """This worker's share of each batch of ``data`` (read whole, then cut).

    Iterating is **collective** over the workers at the first batch of each
    pass (the order check).
    """

    def __init__(self, data, runtime, batch_dim=0, split=None):
        self.data, self.runtime = data, runtime
        self.batch_dim, self.split = batch_dim, split
        topo = runtime.topology
        self.index, self.count, self.workers = topo.worker_index, topo.num_workers, topo.workers

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        first = True
        for batch in self.data:
            total = batch_size(batch, self.batch_dim)
            if first and self.count > 1:
                leaf = next(leaf for _, leaf, _ in _leaves(batch) if leaf.ndim > 0)
                array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else leaf
                check_same(self.workers, "data order (every worker must iterate the same "
                           "batches: seed torch identically on every rank)",
                           {"first batch": zlib.crc32(np.ascontiguousarray(array).tobytes())})
                first = False
            _check_workers(total, self.count)
            start, stop = share(total, self.index, self.count)
            self.runtime.set_batch(stop - start, total)
            yield (self.split(batch, start, stop) if self.split is not None
                   else _cut(batch, start, stop, self.batch_dim, total))


class _ShardedBatchSampler:
    """Each global batch of indices, cut to this worker's share."""

    def __init__(self, batch_sampler, loader):
        self.batch_sampler, self.loader = batch_sampler, loader

    def __len__(self):
        return len(self.batch_sampler)

    def __iter__(self):
        loader = self.loader
        first = True
        for indices in self.batch_sampler:
            indices = list(indices)
            if first and loader.count > 1:
                check_same(loader.workers, "data order (every worker must draw the same "
                           "batches: seed torch identically on every rank, or give the "
                           "DataLoader a seeded generator)",
                           {"first batch": zlib.crc32(np.asarray(indices, np.int64).tobytes())})
                first = False
            _check_workers(len(indices), loader.count)
            start, stop = share(len(indices), loader.index, loader.count)
            loader.sizes.append((stop - start, len(indices)))
            yield indices[start:stop]


class ShardedLoader:
    """A ``DataLoader`` rebuilt to load only this worker's share of each batch.

    Iterating is **collective** over the workers at the first batch of each
    pass (the order check). ``len()`` is the original loader's.
    """

    def __init__(self, loader, runtime):
        from torch.utils.data import DataLoader

        topo = runtime.topology
        self.original, self.runtime = loader, runtime
        self.index, self.count, self.workers = topo.worker_index, topo.num_workers, topo.workers
        self.sizes = deque()
        options = {"num_workers": loader.num_workers, "collate_fn": loader.collate_fn,
                   "pin_memory": loader.pin_memory, "timeout": loader.timeout,
                   "worker_init_fn": loader.worker_init_fn,
                   "multiprocessing_context": loader.multiprocessing_context,
                   "generator": loader.generator,
                   "persistent_workers": loader.persistent_workers}
        if loader.num_workers > 0:
            options["prefetch_factor"] = loader.prefetch_factor
        self.loader = DataLoader(loader.dataset,
                                 batch_sampler=_ShardedBatchSampler(loader.batch_sampler, self),
                                 **options)

    def __len__(self):
        return len(self.original)

    def __iter__(self):
        self.sizes.clear()
        for batch in self.loader:
            local, total = self.sizes.popleft()
            self.runtime.set_batch(local, total)
            yield batch


def shard(data, runtime, batch_dim=0, split=None):
    """``data`` as this worker's shares of its batches (see the module)."""
    from torch.utils.data import DataLoader, IterableDataset

    check_split(batch_dim, split)
    if isinstance(data, DataLoader) and batch_dim == 0 and split is None:
        if data.batch_sampler is not None and not isinstance(data.dataset, IterableDataset):
            return ShardedLoader(data, runtime)
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data must be a DataLoader or an iterable of batches, "
                        f"not {type(data).__name__}")
    return ShardedIterable(data, runtime, batch_dim, split)


def check_split(batch_dim, split) -> None:
    """``batch_dim`` and ``split`` as :func:`shard` takes them (TypeError otherwise)."""
    _check_spec(batch_dim)
    if split is not None and not callable(split):
        raise TypeError(f"split must be a function (batch, start, stop) -> part, not "
                        f"{type(split).__name__}")
