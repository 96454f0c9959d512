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

__all__ = ["shard", "share", "ShardedIterable", "ShardedLoader"]


def share(total, index, count) -> tuple:
    """``(start, stop)`` of worker ``index``'s share of ``total`` samples among ``count``."""
    base, extra = divmod(int(total), int(count))
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def _leaves(batch, path="batch"):
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        yield path, batch
    elif isinstance(batch, dict):
        for key, value in batch.items():
            yield from _leaves(value, f"{path}[{key!r}]")
    elif isinstance(batch, (list, tuple)):
        for i, value in enumerate(batch):
            yield from _leaves(value, f"{path}[{i}]")


def batch_size(batch) -> int:
    """Samples in ``batch``: the first dimension every tensor leaf shares."""
    size, first = None, None
    for path, leaf in _leaves(batch):
        if leaf.ndim == 0:
            continue
        if size is None:
            size, first = int(leaf.shape[0]), path
        elif int(leaf.shape[0]) != size:
            raise ConfigError(f"cannot split the batch among workers: {path} has "
                              f"{leaf.shape[0]} rows, {first} has {size}; every tensor of a "
                              "batch must hold one row per sample")
    if size is None:
        raise ConfigError(f"cannot split a batch of {type(batch).__name__} among workers: "
                          "it holds no tensor or array")
    return size


def _cut(batch, start, stop):
    if isinstance(batch, (torch.Tensor, np.ndarray)):
        return batch if batch.ndim == 0 else batch[start:stop]
    if isinstance(batch, dict):
        return type(batch)((k, _cut(v, start, stop)) for k, v in batch.items())
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_cut(v, start, stop) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_cut(v, start, stop) for v in batch)
    return batch


def _check_workers(total, workers):
    if total < workers:
        raise ConfigError(f"a batch of {total} samples cannot be shared by {workers} workers; "
                          "use larger batches (drop_last=True avoids a short last batch)")


class ShardedIterable:
    """This worker's share of each batch of ``data`` (read whole, then cut).

    Iterating is **collective** over the workers at the first batch of each
    pass (the order check).
    """

    def __init__(self, data, runtime):
        self.data, self.runtime = data, runtime
        topo = runtime.topology
        self.index, self.count, self.workers = topo.worker_index, topo.num_workers, topo.workers

    def __len__(self):
        return len(self.data)

    def __iter__(self):
        first = True
        for batch in self.data:
            total = batch_size(batch)
            if first and self.count > 1:
                leaf = next(leaf for _, leaf in _leaves(batch) if leaf.ndim > 0)
                array = leaf.detach().cpu().numpy() if isinstance(leaf, torch.Tensor) else leaf
                check_same(self.workers, "data order (every worker must iterate the same "
                           "batches: seed torch identically on every rank)",
                           {"first batch": zlib.crc32(np.ascontiguousarray(array).tobytes())})
                first = False
            _check_workers(total, self.count)
            start, stop = share(total, self.index, self.count)
            self.runtime.set_batch(stop - start, total)
            yield _cut(batch, start, stop)


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


def shard(data, runtime):
    """``data`` as this worker's shares of its batches (see the module)."""
    from torch.utils.data import DataLoader, IterableDataset

    if isinstance(data, DataLoader):
        if data.batch_sampler is not None and not isinstance(data.dataset, IterableDataset):
            return ShardedLoader(data, runtime)
    if not hasattr(data, "__iter__"):
        raise TypeError(f"data must be a DataLoader or an iterable of batches, "
                        f"not {type(data).__name__}")
    return ShardedIterable(data, runtime)
