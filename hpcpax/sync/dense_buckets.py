"""Dense gradients reduced bucket by bucket, as they become ready.

A framework's backward pass produces dense gradients one by one, roughly in
the reverse order of the parameters. :class:`BucketedAllreduce` groups the
registered tensors, in the order given (the order they are expected to be
ready), into buckets of about ``bucket_bytes``, each one
:class:`~hpcpax.comm.allreduce.DenseAllreduce`. :meth:`~BucketedAllreduce.ready`
is called as each gradient is produced; when a bucket holds all its tensors
it starts reducing (``Iallreduce``) while the backward pass goes on, so
communication overlaps compute (PyTorch DDP's gradient buckets, on hpcpax's
fused allreduce). Buckets always start in bucket order, on every worker the
same, whatever order the gradients come in: MPI matches nonblocking
collectives by issue order.

Without an MPI progress thread a started reduction advances inside MPI calls
(the next bucket's start, the sparse push, :meth:`~BucketedAllreduce.wait`),
so the overlap is as good as the MPI library's progress allows.
"""

from __future__ import annotations

import numpy as np

from ..comm.allreduce import DenseAllreduce
from ..comm.fusion import parse_tensors

__all__ = ["BucketedAllreduce"]


class BucketedAllreduce:
    """Dense tensors reduced in buckets started during the backward pass.

    Construction is **collective** over the workers (each bucket's
    :class:`~hpcpax.comm.allreduce.DenseAllreduce` checks every worker
    registered the same tensors; a mismatch raises
    :class:`~hpcpax.errors.MismatchError` naming the tensor).

    Args:
        topology: from :func:`hpcpax.init` (worker ranks only).
        tensors: ``{name: (shape, dtype)}`` or ``{name: array}`` in the order
            the gradients are expected to become ready.
        bucket_bytes: bytes per bucket (at least one tensor each); None:
            ``fabric.allreduce_bucket_bytes`` or the measured fusion size.
        op: ``mean`` or ``sum`` over the workers.
        fabric: a measured :class:`~hpcpax.comm.fabric.Fabric`.

    With a single worker nothing is reduced and nothing is communicated.
    """

    def __init__(self, topology, tensors, *, bucket_bytes=None, op="mean", fabric=None):
        names, shapes, dtypes = parse_tensors(tensors)
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', not {op!r}")
        self.names, self.op = names, op
        self.num_workers = topology.num_workers
        if bucket_bytes is None:
            if fabric is not None:
                bucket_bytes = int(fabric.allreduce_bucket_bytes)
            elif self.num_workers > 1:
                from ..comm.fabric import autotune_bucket_bytes

                bucket_bytes = autotune_bucket_bytes(topology.workers)
            else:
                bucket_bytes = 1 << 20
        self.bucket_bytes = int(bucket_bytes)
        groups, size = [], None
        for name, shape, dtype in zip(names, shapes, dtypes):
            nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if size is None or size + nbytes > self.bucket_bytes:
                groups.append({})
                size = 0
            groups[-1][name] = (shape, dtype)
            size += nbytes
        #: Tensor names of each bucket, in start order.
        self.buckets = [list(g) for g in groups]
        self._bucket_of = {name: i for i, group in enumerate(groups) for name in group}
        self._reducers = []
        if self.num_workers > 1:
            # one fusion buffer per bucket: its tensors start together
            self._reducers = [DenseAllreduce(topology, group, op=op,
                                             bucket_bytes=max(self.bucket_bytes, sum(
                                                 int(np.prod(s, dtype=np.int64)) * d.itemsize
                                                 for s, d in group.values())))
                              for group in groups]
        self._reset()

    def _reset(self):
        self._arrays = [dict() for _ in self.buckets]
        self._next = 0  # the next bucket to start

    @property
    def started(self) -> int:
        """Buckets started in the current step."""
        return self._next

    def bucket_of(self, name) -> int:
        """Index of the bucket holding tensor ``name``."""
        return self._bucket_of[name]

    def ready(self, name, array) -> None:
        """Gradient ``name`` is final for this step: ``array`` (NumPy or CuPy).

        Starts every complete bucket whose predecessors have started.
        **Collective** over the workers in effect (the reductions it starts
        are); every worker must make the same calls, in any order within a step.

        Raises:
            RuntimeError: ``name`` was already given this step (its bucket
                may be reducing: a second gradient cannot be added).
        """
        index = self._bucket_of[name]
        arrays = self._arrays[index]
        if name in arrays:
            raise RuntimeError(f"dense gradient {name!r} was made ready twice in one step; "
                               "reduce once per step (no gradient accumulation across "
                               "backward calls)")
        arrays[name] = array
        self._start_complete()

    def _start_complete(self):
        while self._next < len(self.buckets) and \
                len(self._arrays[self._next]) == len(self.buckets[self._next]):
            if self._reducers:
                self._reducers[self._next].start(self._arrays[self._next])
            self._next += 1

    def missing(self) -> list:
        """Names not yet made ready this step."""
        return [n for i, names in enumerate(self.buckets) for n in names
                if n not in self._arrays[i]]

    def wait(self, fill=None) -> None:
        """Finish the step's reductions; **collective** over the workers.

        Args:
            fill: ``fill(name) -> array`` for every tensor not made ready this
                step (e.g. a zero gradient of a parameter the step did not
                use), so every bucket can start; None requires all to be ready.

        Afterwards every array given holds the mean (or sum) over the workers.
        """
        missing = self.missing()
        if missing:
            if fill is None:
                raise RuntimeError(f"dense gradients never made ready: {missing[:5]}")
            for name in missing:
                self._arrays[self._bucket_of[name]][name] = fill(name)
            self._start_complete()
        try:
            for reducer in self._reducers:
                reducer.wait()
        finally:
            self._reset()

    def start(self, arrays) -> None:
        """Start reducing ``{name: array}`` (every registered name): :meth:`ready` for each;
        :meth:`wait` finishes. **Collective** over the workers."""
        for name, array in arrays.items():
            self.ready(name, array)

    def allreduce(self, arrays) -> None:
        """Reduce ``{name: array}`` (every registered name) now; **collective** (workers)."""
        self.start(arrays)
        self.wait()
