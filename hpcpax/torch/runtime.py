"""What a distributed torch model does each step, on a worker.

One :class:`Runtime` per distributed model holds its
:class:`~hpcpax.app.model_sync.ModelSync` and does the adapter's work:

- forward: :meth:`Runtime.lookup` pulls the distinct ids' rows of a table (a
  leaf tensor that requires grad) and records them for the push;
- backward: a hook on each dense parameter scales its incoming gradient
  (uneven shards) and, once the gradient is accumulated, hands it to the
  bucketed allreduce, which starts each bucket as it completes; a callback
  at the end of the backward pass finishes the reductions, so after
  ``loss.backward()`` every dense ``.grad`` holds the workers' mean, as
  with DistributedDataParallel;
- ``optimizer.step()`` (a step pre-hook): the recorded rows' gradients of
  every table go out in one batched push (the servers run the row
  optimizer), then the torch optimizer updates the dense parameters.
"""

from __future__ import annotations

import numpy as np
import torch

from ..backend import array_module, cupy_module, to_host
from ..comm.sparse_collectives import allgather_sparse_many
from ..errors import ConfigError
from ..ops import dedup_sum
from ..options import format_bytes, options
from ..ps.sparse_grad import SparseGrad
from .table_weight import caller
from .tensors import as_array, as_tensor

__all__ = ["Runtime"]


class Runtime:
    """The adapter's per-step work for one model on this rank.

    Args:
        sync: the model's :class:`~hpcpax.app.model_sync.ModelSync`.
        tables: ``{name: {"rows", "dim", "dtype", "padding_idx", "device",
            "counts_steps"}}`` (``counts_steps``: the row optimizer keeps a
            per-table step count, so an empty push is not a no-op).
        dense: ``{name: parameter}`` of the dense parameters that train.
        loss_reduction: ``mean`` (the loss is a mean over the batch) or ``sum``.
    """

    def __init__(self, sync, tables, dense, loss_reduction="mean"):
        self.sync, self.tables, self.dense = sync, tables, dense
        self.topology = sync.topology
        self.num_workers = self.topology.num_workers
        self.loss_reduction = loss_reduction
        #: Weight of this worker's gradient in the workers' mean (1 for even
        #: shards of a mean loss); set per batch by the sharded data.
        self.scale = float(self.num_workers) if loss_reduction == "sum" else 1.0
        self.pending = {name: [] for name in tables}
        self._leaves = {}  # {table: (replica array, leaf tensor over it)}
        self._on_host = {name: info["device"].type == "cpu" for name, info in tables.items()}
        self._read, self._read_rows = {}, {}  # table gradients the script read this step
        #: Every table's workers' mean gradient ``(unique ids, rows)`` (None: no worker
        #: has one), gathered in one exchange at the step's first read of any table's
        #: ``.grad`` and not read yet (a clip reads them all, one after the other).
        self._gathered = {}
        self._dense_grads = {}  # {table: the tensor a dense table's .grad reads return}
        self._dirty = False
        self._callback_queued = False
        self._handles = []
        self.closed = False
        #: The model's :class:`~hpcpax.torch.prefetch.Prefetch` (set by distribute).
        self.prefetch = None
        # With a per-table step count (Adam's), a table no worker used this
        # step must not be pushed (torch would skip it): agree on which were.
        self._mask = any(info.get("counts_steps", True) for info in tables.values())
        if self.num_workers > 1:
            for name, param in dense.items():
                self._handles.append(param.register_hook(self._scaler()))
                self._handles.append(param.register_post_accumulate_grad_hook(
                    self._on_gradient(name)))

    # ---------------------------------------------------------------- batches
    def set_batch(self, local, total) -> None:
        """The next batch is ``local`` of ``total`` samples: set the gradient scale."""
        if self.loss_reduction == "sum":
            self.scale = float(self.num_workers)
        else:
            self.scale = local * self.num_workers / total

    def method(self, name) -> str:
        """How table ``name`` is synced now."""
        return self.sync.sync[name].method

    # ---------------------------------------------------------------- forward
    def _distinct(self, name, input):
        """``(flat ids, distinct sorted int64 ids, inverse)`` of ``input`` on its device."""
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"table {name!r}: ids must be torch.int64 or torch.int32, "
                            f"not {input.dtype}")
        flat = as_array(input.reshape(-1))
        # NumPy's (or CuPy's) sort-based unique: torch's CPU unique with
        # inverse takes 50x longer on a batch of ids
        ids, inverse = array_module(flat).unique(flat, return_inverse=True)
        return flat, (ids if ids.dtype == np.int64 else ids.astype(np.int64)), inverse

    def pull_many(self, inputs) -> dict:
        """Rows of several tables in one exchange; **collective** over the workers.

        ``inputs`` maps tables to id tensors; returns ``{table: (input, flat
        ids, distinct ids, inverse, rows)}`` (what :meth:`lookup` takes).
        """
        prepared = {name: self._distinct(name, input) for name, input in inputs.items()}
        rows = self.sync.pull({name: p[1] for name, p in prepared.items()}, record=False)
        return {name: (inputs[name], *prepared[name], rows[name][1]) for name in inputs}

    def replica(self, name):
        """Table ``name`` as a leaf tensor over this worker's whole replica, or None.

        A table synced by a replicated method (``allgather``, ``allreduce``:
        every worker holds it whole, on the host) is looked up in place as
        the plain model does, with no pull; its optimizer writes the same
        memory. None for a table on the servers or on a GPU.
        """
        if not self._on_host[name]:
            return None
        replica = getattr(self.sync.sync[name], "replica", None)
        if replica is None:
            return None
        array = replica.table
        cached = self._leaves.get(name)
        if cached is None or cached[0] is not array:
            cached = self._leaves[name] = (array, torch.from_numpy(array).requires_grad_(True))
        return cached[1]

    def lookup(self, name, input, padding_idx=None, in_place=True):
        """Rows of table ``name`` for ``input``'s ids; **collective** over the workers.

        Takes the rows :attr:`prefetch` pulled for ``input`` when there are,
        else pulls them; a replicated table is read in place
        (:meth:`replica`, not collective). Returns ``(rows, indices into
        rows shaped like input, padding index into rows)``; ``rows`` requires
        grad when grad is enabled, and is recorded for the push. ``in_place``:
        False where the lookup's gradient is dense (pulled rows keep it small).
        """
        whole = self.replica(name) if in_place else None
        if whole is not None:
            return self._lookup_in_place(name, whole, input, padding_idx)
        entry = self.prefetch.take(name, input) if self.prefetch is not None else None
        if entry is None:
            entry = self.pull_many({name: input})[name][1:]
        flat, ids, inverse, rows = entry
        training = torch.is_grad_enabled()
        if training:
            self.sync.record({name: flat})
        rows = as_tensor(rows)
        device = self.tables[name]["device"]
        if rows.device != device:
            rows = rows.to(device)
        if training:
            rows.requires_grad_(True)
            self.pending[name].append((ids, rows, self.scale))
            self._dirty = True
        local_padding = None
        if padding_idx is not None:
            where = int(array_module(ids).searchsorted(ids, padding_idx))
            if where < len(ids) and int(ids[where]) == padding_idx:
                local_padding = where
        return rows, as_tensor(inverse.reshape(input.shape)), local_padding

    def _lookup_in_place(self, name, whole, input, padding_idx):
        if input.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"table {name!r}: ids must be torch.int64 or torch.int32, "
                            f"not {input.dtype}")
        if torch.is_grad_enabled():
            if self.sync.measuring:
                self.sync.record({name: as_array(input.reshape(-1))})
            if not any(rows is whole for _, rows, _ in self.pending[name]):
                self.pending[name].append((None, whole, self.scale))
            self._dirty = True
        return whole, input, padding_idx

    # --------------------------------------------------------------- backward
    def _scaler(self):
        def scale(grad):
            return grad if self.scale == 1.0 else grad * self.scale
        return scale

    def _on_gradient(self, name):
        def ready(param):
            grad = param.grad
            if grad.is_sparse:
                raise ConfigError(f"parameter {name!r} received a sparse gradient but is not the "
                                  "weight of an nn.Embedding or nn.EmbeddingBag; make it one "
                                  "(its rows then live on the parameter servers)")
            if not grad.is_contiguous():
                param.grad = grad = grad.contiguous()
            self._dirty = True
            self.sync.ready(name, as_array(grad))
            if not self._callback_queued:
                self._callback_queued = True
                torch.autograd.Variable._execution_engine.queue_callback(self.finish_backward)
        return ready

    def finish_backward(self) -> None:
        """Finish this backward pass's dense reductions; **collective** (workers)."""
        self._callback_queued = False
        self._gathered = {}  # gathered before this backward pass: stale now
        self.sync.wait(fill=self._zero_gradient)

    def _zero_gradient(self, name):
        param = self.dense[name]
        if param.grad is None:
            param.grad = torch.zeros_like(param)
        return as_array(param.grad)

    # ------------------------------------------------------- a table's .grad
    def table_grad(self, name):
        """Table ``name``'s gradient as one process would hold it: the workers' mean, on
        the table's device, sparse for a ``sparse=True`` table, else dense. None when
        no backward pass filled it since the last push (on no worker, with several).
        **Collective** over the workers at the step's first read of any table: the
        rows of every table are gathered then, in one exchange (a clip reads every
        table's ``.grad`` in turn: one exchange, not one per table); later reads
        return the same tensor.
        """
        if name in self._read:
            return self._read[name]
        if self.num_workers > 1:
            self._check_dense_grad(name)
            if name not in self._gathered:
                self._gather_table_grads()
            gathered = self._gathered.pop(name)
            return None if gathered is None else self._hold_grad(name, *gathered)
        done = [(ids, rows.grad, scale) for ids, rows, scale in self.pending[name]
                if rows.grad is not None]
        if not done:
            return None
        self._check_dense_grad(name)
        ids, values = self._table_gradient(name, done)
        return self._hold_grad(name, *dedup_sum(to_host(ids), to_host(values)))

    def _check_dense_grad(self, name) -> None:
        """Refuse to hold a dense table's gradient over ``HPCPAX_REPLICA_MEMORY``."""
        info = self.tables[name]
        if not info["sparse"]:
            need = info["rows"] * info["dim"] * np.dtype(info["dtype"]).itemsize
            if need > options.replica_memory:
                raise ConfigError(
                    f"table {name!r}: its gradient, read at {caller()} (e.g. to clip it), "
                    f"would be a dense {info['rows']:,} x {info['dim']} tensor "
                    f"({format_bytes(need)}) on every worker, over HPCPAX_REPLICA_MEMORY "
                    f"({format_bytes(options.replica_memory)}); clip the dense "
                    "parameters only, or make the embedding sparse=True")

    def _gather_table_grads(self) -> None:
        """Every table's workers' mean gradient into ``_gathered``, in one
        :func:`~hpcpax.comm.sparse_collectives.allgather_sparse_many` (each table's
        result bit for bit what gathering it alone gives); **collective** over the
        workers (every worker passes every table not read yet, empty where its
        backward left none)."""
        names = [n for n in self.tables if n not in self._read]
        id_lists, value_lists = [], []
        for name in names:
            info = self.tables[name]
            done = [(ids, rows.grad, scale) for ids, rows, scale in self.pending[name]
                    if rows.grad is not None]
            if done:
                ids, values = self._table_gradient(name, done)
                ids, values = to_host(ids), to_host(values)
            else:
                ids = np.zeros(0, np.int64)
                values = np.zeros((0, info["dim"]), info["dtype"])
            id_lists.append(ids)
            value_lists.append(values)
        results = allgather_sparse_many(self.topology, names, id_lists, value_lists)
        for name, (unique, summed) in zip(names, results):
            if len(unique):
                summed /= self.num_workers
                self._gathered[name] = (unique, summed)
            else:
                self._gathered[name] = None

    def _hold_grad(self, name, unique, summed):
        """The tensor a read of table ``name``'s ``.grad`` returns (kept for the push)."""
        info = self.tables[name]
        rows = torch.from_numpy(summed)
        if info["sparse"]:
            grad = torch.sparse_coo_tensor(torch.from_numpy(unique)[None], rows,
                                           (info["rows"], info["dim"]), is_coalesced=True)
        else:
            # one tensor per table, zeroed at each step's read (as torch's
            # zero_grad(set_to_none=False) keeps a Parameter's): a fresh table-sized
            # tensor each step cost its page faults, ~1 ms for BERT's 20k x 64
            device = info["device"]
            grad = self._dense_grads.get(name)
            if grad is None or grad.dtype != rows.dtype:
                grad = self._dense_grads[name] = torch.zeros(
                    (info["rows"], info["dim"]), dtype=rows.dtype, device=device)
            else:
                grad.zero_()
            grad[torch.from_numpy(unique).to(device)] = rows.to(device)
        self._read[name] = grad = grad.to(info["device"])
        self._read_rows[name] = unique
        return grad

    def set_table_grad(self, name, value) -> None:
        """``weight.grad = value``: None drops this step's gradient read (model.zero_grad);
        a tensor shaped like the table is pushed in place of the recorded rows."""
        if value is None:
            self._read.pop(name, None)
            self._read_rows.pop(name, None)
            self._gathered.pop(name, None)
            if not any(rows.grad is not None for _, rows, _ in self.pending[name]):
                return
            for _, rows, _ in self.pending[name]:
                rows.grad = None  # as torch's zero_grad(set_to_none=True) would
            return
        info = self.tables[name]
        if not isinstance(value, torch.Tensor) or tuple(value.shape) != (info["rows"],
                                                                          info["dim"]):
            raise ValueError(f"table {name!r}: .grad must be a tensor of shape "
                             f"{(info['rows'], info['dim'])}, not {getattr(value, 'shape', value)}")
        self._read[name] = value
        self._read_rows[name] = None
        self._gathered.pop(name, None)
        self._dirty = True

    def _read_gradient(self, name):
        """``(ids, values)`` to push from the gradient the script read (and maybe changed)."""
        grad, rows = self._read[name], self._read_rows[name]
        if grad.is_sparse:
            grad = grad.coalesce()
            ids, values = grad.indices()[0], grad.values()
        elif rows is None:  # set by the script: every row it holds
            ids = torch.arange(grad.shape[0], device=grad.device)
            values = grad
        else:
            ids = torch.from_numpy(rows).to(grad.device)
            values = grad[ids]
        # every worker pushes the same mean; the holders' mean of equal terms is it
        return as_array(ids).astype(np.int64, copy=False), \
            as_array(values.contiguous())

    # ------------------------------------------------------------------- step
    def before_step(self) -> None:
        """Push every table's gradient (one batched push); **collective** (workers).

        Runs as the optimizers' step pre-hook; with several optimizers only
        the first step of a training step has something to push.
        """
        if not self._dirty:
            return
        self._dirty = False
        grads = {}
        for name, entries in self.pending.items():
            done = [(ids, rows.grad, scale) for ids, rows, scale in entries
                    if rows.grad is not None]
            if name in self._read:
                # what the script read: the workers' mean, the same on every worker
                # unless the script changed it unevenly (the push checks)
                grads[name] = SparseGrad(*self._read_gradient(name), self.tables[name]["rows"],
                                         agreed=True)
            elif done:
                grads[name] = self._table_gradient(name, done)
            for ids, rows, _ in entries:
                if ids is None:  # a replica read in place: its gradient is this step's only
                    rows.grad = None
        self.pending = {name: [] for name in self.tables}
        self._read, self._read_rows, self._gathered = {}, {}, {}
        used = list(grads)
        if not self._mask:
            used = list(self.tables)  # an empty push changes nothing: no need to agree
        elif self.num_workers > 1:
            mask = np.array([name in grads for name in self.tables], np.uint8)
            from ..comm.reductions import max_in_place

            max_in_place(self.topology.workers, mask)
            used = [name for name, flag in zip(self.tables, mask) if flag]
        for name in used:
            if name not in grads:  # another worker's batch used the table, not mine
                info = self.tables[name]
                xp = np if info["device"].type == "cpu" else cupy_module(required=True)
                grads[name] = (xp.zeros(0, np.int64), xp.zeros((0, info["dim"]), info["dtype"]))
        if grads:
            self.sync.push(grads)

    def _table_gradient(self, name, done):
        """``(ids, values)`` of one table from its recorded rows' gradients."""
        xp_ids, values = [], []
        for ids, grad, scale in done:
            if grad.is_sparse:  # one row per occurrence, duplicates summed by the push
                local = as_array(grad._indices())[0]  # (index on the array: a torch
                ids, grad = (local if ids is None else ids[local]), grad._values()  # view costs)
            xp_ids.append(ids)
            values.append(as_array(grad if scale == 1.0 else grad * scale))
        if len(done) == 1:
            ids, grad = xp_ids[0], values[0]
        else:
            xp = array_module(values[0])
            ids, grad = xp.concatenate(xp_ids), xp.concatenate(values)
        padding = self.tables[name]["padding_idx"]
        if padding is not None:  # torch leaves the padding row out of the gradient
            keep = ids != padding
            ids, grad = ids[keep], grad[keep]
        return ids, grad

    # ----------------------------------------------------------------- tables
    def read_table(self, name):
        """The whole table as a tensor on every worker; **collective** (workers)."""
        return as_tensor(self.sync.sync[name].read_table()).to(self.tables[name]["device"])

    def set_table(self, name, value) -> None:
        """Replace table ``name``'s rows (first worker's ``value``); **collective** (workers)."""
        self.sync.set_table(name, value.detach().cpu().numpy())

    def close(self) -> None:
        """Remove the hooks (local)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        if self.prefetch is not None:
            self.prefetch.close()
        self.closed = True

