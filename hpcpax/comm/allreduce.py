"""Fused, pipelined allreduce of dense gradients (the Horovod tensor-fusion idea).

:class:`DenseAllreduce` registers a fixed list of tensors once (a
**collective** check that every worker registered the same list), packs them
by registration order into fusion buffers of about ``bucket_bytes``, and
reduces each buffer with one nonblocking ``Iallreduce`` while the next one is
packed. Results are written back **in place** into the arrays given to
:meth:`DenseAllreduce.start`, on their own device (NumPy or CuPy).

Bucket size: the fabric decides. MPI's shared-memory bandwidth peaks for
cache-sized messages (on the 2-core CI box: ~6-9 GB/s at 1 MiB against
~2 GB/s at 64 MiB), so one giant buffer loses to a few medium ones, and
per-tensor calls lose to both on latency. Default: a short autotune over the
worker communicator (:func:`hpcpax.comm.fabric.autotune_bucket_bytes`, cached).

Byte accounting (phase ``"dense"``, one entry per tensor), by the formula of
the algorithm, with ``B`` = the tensor's bytes on the wire and ``n`` workers:

- flat (ring allreduce): each rank sends ``floor(2 (n-1) B / n)`` bytes to its
  ring successor (next worker rank) and receives as many from its
  predecessor; bytes are inter-node when that peer is on another node;
- hierarchical (``k`` workers on the node, ``L`` nodes): a non-leader sends
  ``B`` to its leader (reduce) and receives ``B`` back (bcast), intra-node; a
  leader receives ``(k-1) B`` and sends ``(k-1) B`` intra-node and runs the
  ring above among the ``L`` leaders, inter-node.

Reduced-precision wire (``wire_dtype``): floating tensors travel as float16 or
bfloat16 with a documented error bound (:mod:`hpcpax.comm.wire`); integer
tensors always travel exactly. Packing into fusion buffers:
:mod:`hpcpax.comm.fusion`.
"""

from __future__ import annotations

import time
from collections import deque

import numpy as np

from ..backend import array_module, is_device_array
from ..errors import ConfigError
from .accounting import ring_allreduce_bytes
from .agreement import check_same
from .fusion import FusionBuffers, build_buckets, parse_tensors
from .transport import make_transport
from .wire import WIRE_DTYPES, wire_op

__all__ = ["DenseAllreduce", "DIRECT_BYTES"]

#: Default of ``DenseAllreduce(direct_bytes=...)``: tensors this large are
#: reduced in place instead of packed (latency is already amortized there).
DIRECT_BYTES = 256 << 10


class DenseAllreduce:
    """Fused, pipelined allreduce of a fixed list of dense tensors over the workers.

    Construction is **collective** over the worker communicator: it checks
    that every worker registered the same tensors (count, names, shapes,
    dtypes) and options, raising :class:`~hpcpax.errors.MismatchError` on
    every rank otherwise, and may time a short bucket-size autotune.

    Args:
        topology_or_comm: a :class:`~hpcpax.comm.topology.Topology` (its ``workers``
            communicator; call on worker ranks only), an mpi4py communicator
            (treated as one node), or None for a single process.
        tensors: ``{name: (shape, dtype)}`` or ``{name: array}``, or a list of
            either value (names ``"0"``, ``"1"``, ...). Order = packing order.
        op: ``"mean"`` (floating tensors only) or ``"sum"``.
        bucket_bytes: fusion buffer size; None: ``fabric.allreduce_bucket_bytes``
            when ``fabric`` is given, else an autotune over the workers.
        wire_dtype: None (exact), ``"float16"`` or ``"bfloat16"`` for floating
            tensors (see the module's error bound).
        hierarchical: reduce inside each node, allreduce among node leaders,
            broadcast inside the node (needs a Topology).
        accounting: where bytes and seconds are counted; default the
            topology's, none for a bare communicator.
        fabric: a measured :class:`~hpcpax.comm.fabric.Fabric` giving the bucket size.
        max_in_flight: fusion buffers reducing at once; MPICH progresses many
            outstanding nonblocking collectives slowly, so keep it small.
        direct_bytes: a tensor at least this large (and exact on the wire) is
            reduced in place as its own bucket: it is already big enough for
            full bandwidth, and packing it would cost two extra memory passes.

    Raises:
        TypeError, ValueError, ConfigError: bad arguments (before any communication).
        MismatchError: workers registered different tensors or options.
    """

    def __init__(self, topology_or_comm, tensors, *, op="mean", bucket_bytes=None,
                 wire_dtype=None, hierarchical=False, accounting=None, fabric=None,
                 max_in_flight=2, direct_bytes=DIRECT_BYTES):
        if op not in ("mean", "sum"):
            raise ValueError(f"op must be 'mean' or 'sum', not {op!r}")
        if wire_dtype is not None and wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"wire_dtype must be None, 'float16' or 'bfloat16', not {wire_dtype!r}")
        if bucket_bytes is not None and (not isinstance(bucket_bytes, (int, np.integer))
                                         or isinstance(bucket_bytes, bool) or bucket_bytes < 1):
            raise ValueError(f"bucket_bytes must be a positive int or None, not {bucket_bytes!r}")
        if not isinstance(hierarchical, bool):
            raise TypeError(f"hierarchical must be bool, not {type(hierarchical).__name__}")
        if not isinstance(max_in_flight, int) or max_in_flight < 1:
            raise ValueError(f"max_in_flight must be a positive int, not {max_in_flight!r}")
        names, shapes, dtypes = parse_tensors(tensors)
        if op == "mean":
            ints = [n for n, d in zip(names, dtypes) if d.kind != "f"]
            if ints:
                raise TypeError(f"op='mean' needs floating tensors, not {dtypes[names.index(ints[0])]} "
                                f"(tensor {ints[0]!r}); use op='sum'")
        self._init_comms(topology_or_comm, hierarchical, accounting)
        self.names, self.shapes, self.dtypes = names, shapes, dtypes
        self.sizes = [int(np.prod(s, dtype=np.int64)) for s in shapes]
        self.op, self.wire_dtype, self.hierarchical = op, wire_dtype, hierarchical
        self.max_in_flight = max_in_flight
        self.direct_bytes = int(direct_bytes)
        self._list_registered = not isinstance(tensors, dict)

        check_same(self.comm, "dense allreduce options", {
            "count": len(names), "op": op, "wire_dtype": wire_dtype,
            "hierarchical": hierarchical, "bucket_bytes": bucket_bytes,
        })
        check_same(self.comm, "dense tensors", {
            f"tensor {i}": [name, list(shape), dtype.name]
            for i, (name, shape, dtype) in enumerate(zip(names, shapes, dtypes))
        })
        if bucket_bytes is None:
            if fabric is not None:
                bucket_bytes = int(fabric.allreduce_bucket_bytes)
            else:
                from .fabric import autotune_bucket_bytes

                bucket_bytes = autotune_bucket_bytes(self.comm)
        self.bucket_bytes = int(bucket_bytes)
        self._buckets = build_buckets(self.dtypes, self.sizes, wire_dtype, self.bucket_bytes,
                                      self.direct_bytes)
        self._op = wire_op(wire_dtype)
        from mpi4py import MPI

        for bucket in self._buckets:
            bucket["op"] = self._op if bucket["reduced"] else MPI.SUM
        self._fusion = FusionBuffers(self._buckets, self.shapes, wire_dtype)
        self._account = self._bytes_per_tensor()
        self._account_group = None
        self._pending = None

    # ---- set-up ---------------------------------------------------------

    def _init_comms(self, topology_or_comm, hierarchical, accounting):
        if hasattr(topology_or_comm, "worker_ranks") and hasattr(topology_or_comm, "node_of"):
            topo = topology_or_comm
            if topo.workers is None:
                raise ConfigError(f"DenseAllreduce runs on worker ranks; rank {topo.rank} "
                                  "is a server")
            self.comm = topo.workers
            self.world_ranks = list(topo.worker_ranks)
            self.node_of = np.asarray(topo.node_of)
            self.my_world_rank = topo.rank
            self.node_comm, self.leader_comm = topo.node_workers, topo.node_leaders
            self.leader_world_ranks = sorted(topo.workers_on_node(n)[0]
                                             for n in sorted(set(self.node_of[self.world_ranks])))
            self.accounting = accounting if accounting is not None else topo.accounting
            return
        if hierarchical:
            raise TypeError("hierarchical=True needs a Topology, not "
                            f"{type(topology_or_comm).__name__}")
        if topology_or_comm is None:
            from mpi4py import MPI

            topology_or_comm = MPI.COMM_SELF
        if not hasattr(topology_or_comm, "Iallreduce"):
            raise TypeError("topology_or_comm must be a Topology, an mpi4py communicator or "
                            f"None, not {type(topology_or_comm).__name__}")
        self.comm = topology_or_comm
        size = self.comm.Get_size()
        self.world_ranks = list(range(size))
        self.node_of = np.zeros(size, np.int64)
        self.my_world_rank = self.comm.Get_rank()
        self.node_comm = self.leader_comm = None
        self.leader_world_ranks = [0]
        self.accounting = accounting

    @property
    def buckets(self) -> list:
        """Tensor names of each fusion buffer, in reduction order."""
        return [[self.names[i] for i, _, _ in b["members"]] for b in self._buckets]

    @property
    def num_workers(self) -> int:
        """Ranks taking part in the allreduce."""
        return self.comm.Get_size()

    def _bytes_per_tensor(self):
        """(name, sent, recv, sent_inter, recv_inter) per tensor, by the module's formula."""
        n, me = len(self.world_ranks), self.my_world_rank

        def ring(ranks, nbytes):
            return ring_allreduce_bytes(self.node_of, list(ranks), me, nbytes)

        out = []
        for name, dtype, size in zip(self.names, self.dtypes, self.sizes):
            itemsize = 2 if self.wire_dtype is not None and dtype.kind == "f" else dtype.itemsize
            nbytes = size * itemsize
            if n < 2:
                out.append((name, 0, 0, 0, 0))
            elif not self.hierarchical:
                out.append((name, *ring(self.world_ranks, nbytes)))
            else:
                local = self.node_comm.Get_size()
                if self.my_world_rank in self.leader_world_ranks:
                    sent, recv, sent_inter, recv_inter = ring(self.leader_world_ranks, nbytes)
                    sent += (local - 1) * nbytes
                    recv += (local - 1) * nbytes
                    out.append((name, sent, recv, sent_inter, recv_inter))
                else:
                    out.append((name, nbytes, nbytes, 0, 0))
        return out

    # ---- one step -------------------------------------------------------

    def _arrays(self, grads):
        if isinstance(grads, dict):
            missing = [n for n in self.names if n not in grads]
            if missing or len(grads) != len(self.names):
                extra = [k for k in grads if k not in set(self.names)]
                raise ValueError(f"grads must hold exactly the registered tensors; missing "
                                 f"{missing[:5]}, unknown {extra[:5]}")
            arrays = [grads[n] for n in self.names]
        elif isinstance(grads, (list, tuple)):
            if len(grads) != len(self.names):
                raise ValueError(f"grads must hold {len(self.names)} tensors, not {len(grads)}")
            arrays = list(grads)
        else:
            raise TypeError(f"grads must be a dict or a list, not {type(grads).__name__}")
        # Called every step on up to thousands of tensors: one cheap pass,
        # the detailed message only when something is wrong.
        kind = type(arrays[0]) if arrays else None
        for name, shape, dtype, a in zip(self.names, self.shapes, self.dtypes, arrays):
            if type(a) is not kind or getattr(a, "shape", None) != shape or a.dtype != dtype:
                if type(a) is not kind and hasattr(a, "shape") and hasattr(arrays[0], "shape") \
                        and is_device_array(a) != is_device_array(arrays[0]):
                    raise ValueError("grads must all be NumPy arrays or all CuPy arrays, "
                                     "not a mix")
                if not hasattr(a, "shape") or tuple(a.shape) != shape or a.dtype != dtype:
                    raise ValueError(f"tensor {name!r} must be an array of shape {shape} and "
                                     f"dtype {dtype}, not {getattr(a, 'shape', type(a))} "
                                     f"{getattr(a, 'dtype', '')}")
        return arrays, bool(arrays) and is_device_array(arrays[0])

    def _divisor(self):
        """What a reduced sum is divided by: the workers for ``mean``, else None."""
        return self.num_workers if self.op == "mean" and self.num_workers > 1 else None

    def _issue(self, bucket, buffer, transport):
        if not self.hierarchical:
            return transport.iallreduce(self.comm, buffer, bucket["op"])
        return transport.ireduce(self.node_comm, buffer, bucket["op"], root=0)

    def _complete(self, item, transport, arrays, xp):
        bucket, buffer, views, request = item
        request.wait()
        if self.hierarchical:
            if self.leader_comm is not None and self.leader_comm.Get_size() > 1:
                transport.allreduce(self.leader_comm, buffer, bucket["op"])
            transport.bcast(self.node_comm, buffer, root=0)
        self._fusion.unpack(bucket, buffer, views, arrays, xp, self._divisor())

    def _prepare(self, grads):
        """Checked arrays, their module, the transport and the fusion buffers."""
        arrays, on_device = self._arrays(grads)
        xp = array_module(arrays[0]) if arrays else np
        transport = make_transport("gpu" if on_device else "cpu",
                                   cuda_aware=False if on_device and self.wire_dtype else None)
        buffers, views = self._fusion.buffers(xp, on_device)
        return arrays, xp, transport, buffers, views

    def start(self, grads):
        """Start reducing ``grads`` (dict or list as registered); returns at once-ish.

        Packs each fusion buffer and starts its reduction; at most
        ``max_in_flight`` are outstanding, older ones are completed (and
        unpacked) as new ones start, the rest overlap with whatever the caller
        does before :meth:`wait`. Do not touch ``grads`` until then.
        **Collective** over the workers.
        """
        if self._pending is not None:
            raise RuntimeError("start() called again before wait()")
        begin = time.perf_counter()
        arrays, xp, transport, buffers, views = self._prepare(grads)
        in_flight = deque()
        for bucket, buffer, bucket_views in zip(self._buckets, buffers, views):
            if bucket["direct"]:
                buffer = self._fusion.direct(bucket, arrays, xp)
            else:
                self._fusion.pack(bucket, buffer, bucket_views, arrays, xp)
            in_flight.append((bucket, buffer, bucket_views,
                              self._issue(bucket, buffer, transport)))
            if len(in_flight) > self.max_in_flight:
                self._complete(in_flight.popleft(), transport, arrays, xp)
        self._pending = (grads, arrays, in_flight, transport, xp)
        self._seconds = time.perf_counter() - begin

    def wait(self):
        """Finish the reduction started by :meth:`start`; **collective** over the workers.

        Returns:
            The ``grads`` object given to :meth:`start`, its arrays now holding
            the sum (or mean) over all workers, on their own device.
        """
        if self._pending is None:
            raise RuntimeError("wait() called without start()")
        begin = time.perf_counter()
        grads, arrays, in_flight, transport, xp = self._pending
        self._pending = None
        while in_flight:
            self._complete(in_flight.popleft(), transport, arrays, xp)
        self._account_step(self._seconds + time.perf_counter() - begin)
        return grads

    def _account_step(self, seconds):
        """Count one reduction of every tensor (bytes by the formula) and its time."""
        if self.accounting is not None:
            if self._account_group is None:
                names, sent, recv, sent_inter, recv_inter = zip(*self._account) \
                    if self._account else ((),) * 5
                self._account_group = self.accounting.add_group(
                    "dense", names, sent_bytes=sent, recv_bytes=recv,
                    sent_inter_bytes=sent_inter, recv_inter_bytes=recv_inter,
                    sent_intra_bytes=[a - b for a, b in zip(sent, sent_inter)],
                    recv_intra_bytes=[a - b for a, b in zip(recv, recv_inter)])
            self.accounting.record_group(self._account_group, seconds)

    def allreduce(self, grads):
        """Reduce ``grads`` now; **collective** over the workers.

        Nothing can overlap a synchronous call, and without an MPI progress
        thread a nonblocking collective advances only inside MPI calls, so
        each fusion buffer goes through a blocking ``Allreduce`` (MPICH's
        blocking algorithms are also faster than its nonblocking schedules).
        That wait is inside MPI under either wait policy: the one measured
        exception to :mod:`hpcpax.comm.polling` (every worker is in the call
        already; polling adds a wake-up per round of the collective).
        Use :meth:`start`/:meth:`wait` to overlap with compute or with other
        communication (the BSP step starts the dense allreduce before its
        sparse push: 16 emulated nodes, push and dense 77-79 ms together
        against 87-92 ms one after the other).
        """
        if self._pending is not None:
            raise RuntimeError("allreduce() called between start() and wait()")
        begin = time.perf_counter()
        arrays, xp, transport, buffers, views = self._prepare(grads)
        for bucket, buffer, bucket_views in zip(self._buckets, buffers, views):
            if bucket["direct"]:
                buffer = self._fusion.direct(bucket, arrays, xp)
            else:
                self._fusion.pack(bucket, buffer, bucket_views, arrays, xp)
            if not self.hierarchical:
                transport.allreduce(self.comm, buffer, bucket["op"])
            else:
                transport.reduce(self.node_comm, buffer, bucket["op"], root=0)
                if self.leader_comm is not None and self.leader_comm.Get_size() > 1:
                    transport.allreduce(self.leader_comm, buffer, bucket["op"])
                transport.bcast(self.node_comm, buffer, root=0)
            self._fusion.unpack(bucket, buffer, bucket_views, arrays, xp, self._divisor())
        self._account_step(time.perf_counter() - begin)
        return grads
