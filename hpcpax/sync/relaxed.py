"""A model's step under a relaxed consistency model: sparse rows and dense replicas.

:class:`RelaxedSync` drives one step's traffic through the
:class:`~hpcpax.ps.relaxed.RelaxedParameterServer`: the sparse variables'
rows, and the dense variables too. The fused dense allreduce is a
collective, so it cannot run at different speeds on different workers;
under a relaxed model each dense variable is therefore also held by the
servers, as a table ``dense/<name>`` (its rows are the tensor reshaped to
2-D), with the dense optimizer running there:

- inside a group (a node in the hierarchical mode) the workers' dense
  gradients are summed by the node-local aggregation, as the sparse ones:
  BSP inside the group;
- across groups the dense variables follow the job's consistency model
  like a sparse variable: each group's summed gradient is one push, applied
  by the server's optimizer (per clock under ``ssp``, on arrival under
  ``asp``/``psp``), and every step each group refreshes its replica from the
  server (a pull of every row, answered under the same condition). So by
  default the replicas are averaged across groups every step; the
  per-clock sums make ``ssp:0`` give exactly the parameters of ``bsp``.

With a refresh period ``k`` (``--dense-period``, chosen by
:class:`~hpcpax.plan.dense_period.DensePeriod` in
:mod:`hpcpax.app.relaxed_run`), :meth:`RelaxedSync.pull` refreshes the
replicas only when asked (``refresh=True``); in between, each worker
applies its own gradient (the mean over its local batch) to its replica
with a local copy of the dense optimizer (:meth:`RelaxedSync.local_update`).
The servers still receive every push, so their table is the average the
next refresh brings back; at a refresh :attr:`RelaxedSync.divergence` is
measured: ``|w_local - w_server| / |w_server|`` over all dense variables.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..ps.sparse_grad import SparseGrad
from ..ps.spec import SparseVariableSpec

__all__ = ["RelaxedSync", "DENSE_PREFIX", "dense_table_shape"]

#: Prefix of the server tables that hold dense variables under relaxed models.
DENSE_PREFIX = "dense/"


def dense_table_shape(shape) -> tuple:
    """``(rows, dim)`` of the table holding a dense tensor of ``shape``."""
    shape = tuple(int(s) for s in shape)
    if len(shape) == 0:
        return 1, 1
    if len(shape) == 1:
        return 1, shape[0]
    return shape[0], int(np.prod(shape[1:]))


class RelaxedSync:
    """The sparse and dense traffic of a relaxed step, on every rank.

    Args:
        relaxed: the job's :class:`~hpcpax.ps.relaxed.RelaxedParameterServer`.
        sparse: the model's :class:`~hpcpax.sync.sparse_set.SparseSync` (every
            variable on method ``ps``).
        dense_shapes: ``{name: shape}`` of the dense variables.
        dtype: their dtype.
        optimizer, lr: the dense optimizer (run on the servers).
    """

    def __init__(self, relaxed, sparse, dense_shapes, dtype, optimizer, lr):
        for name, var in sparse.variables.items():
            if not var.sync_method.relaxed:
                raise ConfigError(f"consistency {relaxed.default} needs every sparse variable "
                                  f"on the parameter server; {name!r} is synced by "
                                  f"{var.method!r} (use --plan ps)")
        self.relaxed, self.sparse = relaxed, sparse
        self.ps = relaxed.ps
        #: Local dense optimizer state (:meth:`local_update`), made on first use.
        self.local_state = None
        #: Local updates since the last refresh.
        self.local_steps = 0
        #: ``|w_local - w_server| / |w_server|`` at the last refresh after local
        #: updates (None before).
        self.divergence = None
        self.dense_specs = {}
        for name, shape in dense_shapes.items():
            rows, dim = dense_table_shape(shape)
            self.dense_specs[name] = SparseVariableSpec(
                DENSE_PREFIX + name, rows=rows, dim=dim, dtype=str(np.dtype(dtype)),
                initializer="zeros", optimizer=optimizer, optimizer_params={"lr": lr})
        self._all_rows = {name: np.arange(spec.rows, dtype=np.int64)
                          for name, spec in self.dense_specs.items()}

    # -------------------------------------------------------------- set-up
    def register_dense(self) -> None:
        """Create the dense tables on the servers; **collective** (workers; servers serve)."""
        self.ps.register(list(self.dense_specs.values()))

    def load_dense(self, dense, dense_state) -> None:
        """Every rank: set the dense tables from the first worker's replica and state.

        **Collective** over ``topology.comm`` (run it as a command).
        """
        topo = self.ps.topology
        payload = None
        if topo.is_worker and topo.worker_index == 0:
            payload = {}
            for name, spec in self.dense_specs.items():
                state = dense_state[name]
                payload[name] = (_host(dense[name]).reshape(spec.rows, spec.dim),
                                 {k: _host(v).reshape(spec.rows, spec.dim)
                                  for k, v in state.items() if k != "step"},
                                 {k: np.array(_host(v)) for k, v in state.items() if k == "step"})
        payload = topo.comm.bcast(payload, root=topo.worker_ranks[0])
        for name, (table, rows, scalars) in payload.items():
            self.ps.load_table(DENSE_PREFIX + name, table, rows, scalars)

    def fetch_dense(self, dense, dense_state) -> None:
        """Every rank: the dense replicas and their optimizer state from the servers.

        **Collective** over ``topology.comm`` (run it as a command, e.g.
        before a checkpoint, an evaluation or the end).
        """
        for name in self.dense_specs:
            table, rows, scalars = self.ps.gather_table(DENSE_PREFIX + name)
            if name not in dense:
                continue  # servers
            xp = _module(dense[name])
            dense[name][...] = xp.asarray(table.reshape(dense[name].shape))
            for key, value in dense_state[name].items():
                if key in rows:
                    value[...] = xp.asarray(rows[key].reshape(value.shape))
                elif key in scalars:
                    value[...] = scalars[key]

    # ---------------------------------------------------------------- step
    def pull(self, ids_by_name, dense, refresh=True) -> dict:
        """Rows of the step's sparse ids; with ``refresh`` the dense replicas too, in place.

        Not collective over the job (see :meth:`RelaxedClient.pull`; in the
        hierarchical mode every worker of a node must pass the same
        ``refresh``). A refresh after local updates sets :attr:`divergence`.
        """
        request = dict(ids_by_name)
        if refresh:
            for name, ids in self._all_rows.items():
                request[DENSE_PREFIX + name] = ids
        got = self.relaxed.pull(request)
        if not refresh:
            return got
        diff = norm = 0.0
        for name in self.dense_specs:
            _, rows = got.pop(DENSE_PREFIX + name)
            param = dense[name]
            server = rows.reshape(param.shape)
            if self.local_steps:
                local = _host(param).astype(np.float64)
                diff += float(np.sum((local - server) ** 2))
                norm += float(np.sum(server.astype(np.float64) ** 2))
            param[...] = _module(param).asarray(server)
        if self.local_steps:
            self.divergence = float(np.sqrt(diff / norm)) if norm > 0 else float(diff > 0)
        self.local_steps = 0
        return got

    def local_update(self, dense, dense_grads, optimizer) -> None:
        """Apply this worker's ``{name: gradient}`` to its replicas (local, between refreshes).

        ``optimizer`` is the job's dense optimizer; its state here is a
        local copy (:attr:`local_state`), fresh at the first call.
        """
        if self.local_state is None:
            self.local_state = {name: optimizer.init_state(param.shape, param.dtype,
                                                           _module(param))
                                for name, param in dense.items()}
        for name, grad in dense_grads.items():
            optimizer.apply_dense(dense[name], self.local_state[name], grad)
        self.local_steps += 1

    def push(self, sparse_grads, dense_grads) -> bool:
        """Push ``{name: (indices, values)}`` and the dense gradients; the clock advances."""
        grads = {}
        for name, (indices, values) in sparse_grads.items():
            grads[name] = SparseGrad(indices, values, self.sparse[name].spec.rows)
        for name, grad in dense_grads.items():
            spec = self.dense_specs[name]
            xp = _module(grad)
            grads[DENSE_PREFIX + name] = SparseGrad(xp.asarray(self._all_rows[name]),
                                                    grad.reshape(spec.rows, spec.dim),
                                                    spec.rows)
        return self.relaxed.push(grads)


def _host(x) -> np.ndarray:
    from ..backend import to_host

    return to_host(x)


def _module(x):
    from ..backend import array_module

    return array_module(x)
