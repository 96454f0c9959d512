"""How a buffer reaches MPI: straight from host memory, straight from the GPU, or staged.

One class per transport (ChainerMN style), all with the same methods:

- :class:`CpuTransport`: NumPy buffers go straight to MPI.
- :class:`CudaAwareTransport`: CuPy buffers go straight to a CUDA-aware MPI,
  after the current stream is synchronized.
- :class:`HostStagedTransport`: CuPy buffers are copied to pinned host staging
  buffers (grow-only, reused), reduced by MPI on the host and copied back.

:func:`make_transport` picks one for an array or a device kind, importing CuPy
only when a GPU transport is asked for. Every method works on a 1-D contiguous
buffer **in place** and leaves the result in the buffer's own device; all are
**collective** over the communicator they are given.

Environment:
    HPCPAX_CUDA_AWARE_MPI: ``1`` or ``0`` overrides :func:`cuda_aware_mpi`.
"""

from __future__ import annotations

import ctypes

import numpy as np

from ..backend import cupy_module, is_device_array, synchronize
from ..options import options
from .polling import wait

__all__ = [
    "CpuTransport",
    "CudaAwareTransport",
    "HostStagedTransport",
    "cuda_aware_mpi",
    "make_transport",
    "mpi_op",
]

_CUDA_AWARE = None
_TRANSPORTS = {}


def mpi_op(op):
    """The ``MPI.Op`` for ``op`` (an ``MPI.Op`` or ``"sum"``, ``"max"``, ``"min"``, ``"prod"``)."""
    from mpi4py import MPI

    if isinstance(op, MPI.Op):
        return op
    names = {"sum": MPI.SUM, "max": MPI.MAX, "min": MPI.MIN, "prod": MPI.PROD}
    if not isinstance(op, str) or op not in names:
        raise ValueError(f"op must be an MPI.Op or one of {sorted(names)}, not {op!r}")
    return names[op]


def cuda_aware_mpi() -> bool:
    """True when the MPI library accepts device pointers (cached after the first call).

    Order: ``$HPCPAX_CUDA_AWARE_MPI`` (``0``/``1``); the MPI-4.1 info key
    ``mpi_memory_alloc_kinds`` of ``COMM_WORLD`` naming ``cuda``; the
    ``MPIX_Query_cuda_support()`` extension (MPICH, Open MPI) found through
    ctypes in the loaded MPI library; otherwise False. Not collective.
    """
    global _CUDA_AWARE
    if options.cuda_aware_mpi is not None:
        return options.cuda_aware_mpi
    if _CUDA_AWARE is None:
        _CUDA_AWARE = _ask_mpi_library()
    return _CUDA_AWARE


def _ask_mpi_library() -> bool:
    from mpi4py import MPI

    try:
        info = MPI.COMM_WORLD.Get_info()
        kinds = info.Get("mpi_memory_alloc_kinds") or ""
        info.Free()
        if "cuda" in kinds.lower():
            return True
    except Exception:  # MPI older than 4.1: no such key
        pass
    try:
        query = ctypes.CDLL(MPI.__file__).MPIX_Query_cuda_support
    except (AttributeError, OSError):
        return False
    query.restype = ctypes.c_int
    query.argtypes = []
    return bool(query())


def _check_buffer(buffer):
    if not hasattr(buffer, "ndim") or buffer.ndim != 1:
        raise ValueError(f"buffer must be a 1-D array, not {getattr(buffer, 'shape', type(buffer))}")
    if not buffer.flags.c_contiguous:
        raise ValueError("buffer must be contiguous, not strided")


class _Done:
    """A request that completed already (single rank, or a blocking fallback)."""

    def __init__(self, buffer):
        self._buffer = buffer

    def test(self) -> bool:
        return True

    def wait(self):
        return self._buffer


class _Request:
    """An MPI request; ``wait()`` completes it, runs ``finish`` once, returns the buffer."""

    def __init__(self, request, buffer, finish=None):
        self._request = request
        self._buffer = buffer
        self._finish = finish
        self._done = False

    def test(self) -> bool:
        """True when the operation has completed (does not run ``finish``)."""
        return self._done or self._request.Test()

    def wait(self):
        if not self._done:
            wait([self._request])  # the one wait policy: no core held while waiting
            self._done = True
            if self._finish is not None:
                self._finish()
                self._finish = None
        return self._buffer


class CpuTransport:
    """NumPy buffers handed straight to MPI.

    Methods are **collective** over ``comm``, work in place, and return the
    buffer (result on the host). Reduce results are defined on ``root`` only.
    """

    kind = "cpu"

    def _host(self, buffer):
        return buffer

    def _blocking(self, buffer, call, copy_in=True, copy_out=True):
        """Run the blocking MPI ``call`` on the buffer MPI may see."""
        call(buffer)
        return buffer

    def allreduce(self, comm, buffer, op="sum"):
        """Sum (or ``op``) ``buffer`` over ``comm``, in place (blocking ``MPI_Allreduce``)."""
        from mpi4py import MPI

        _check_buffer(buffer)
        op = mpi_op(op)
        if comm.Get_size() == 1:
            return buffer
        return self._blocking(buffer, lambda b: comm.Allreduce(MPI.IN_PLACE, b, op))

    def iallreduce(self, comm, buffer, op="sum"):
        """Start :meth:`allreduce`; returns a request whose ``wait()`` returns the buffer."""
        from mpi4py import MPI

        _check_buffer(buffer)
        op = mpi_op(op)
        if comm.Get_size() == 1:
            return _Done(buffer)
        return _Request(comm.Iallreduce(MPI.IN_PLACE, buffer, op), buffer)

    def reduce(self, comm, buffer, op="sum", root=0):
        """Reduce ``buffer`` onto ``root``, in place there; other ranks' buffers are unchanged."""
        from mpi4py import MPI

        _check_buffer(buffer)
        op = mpi_op(op)
        if comm.Get_size() == 1:
            return buffer
        if comm.Get_rank() == root:
            return self._blocking(buffer, lambda b: comm.Reduce(MPI.IN_PLACE, b, op, root))
        return self._blocking(buffer, lambda b: comm.Reduce(b, None, op, root), copy_out=False)

    def ireduce(self, comm, buffer, op="sum", root=0):
        """Start :meth:`reduce`."""
        from mpi4py import MPI

        _check_buffer(buffer)
        op = mpi_op(op)
        if comm.Get_size() == 1:
            return _Done(buffer)
        if comm.Get_rank() == root:
            return _Request(comm.Ireduce(MPI.IN_PLACE, buffer, op, root), buffer)
        return _Request(comm.Ireduce(buffer, None, op, root), buffer)

    def bcast(self, comm, buffer, root=0):
        """Copy ``root``'s buffer into every rank's buffer."""
        _check_buffer(buffer)
        if comm.Get_size() == 1:
            return buffer
        is_root = comm.Get_rank() == root
        return self._blocking(buffer, lambda b: comm.Bcast(b, root), copy_in=is_root,
                              copy_out=not is_root)

    def ibcast(self, comm, buffer, root=0):
        """Start :meth:`bcast`."""
        _check_buffer(buffer)
        if comm.Get_size() == 1:
            return _Done(buffer)
        return _Request(comm.Ibcast(buffer, root), buffer)


class CudaAwareTransport(CpuTransport):
    """CuPy buffers handed straight to a CUDA-aware MPI, after a stream sync.

    Same methods as :class:`CpuTransport`; results stay on the GPU.
    """

    kind = "cuda_aware"

    def _blocking(self, buffer, call, copy_in=True, copy_out=True):
        synchronize(buffer)
        call(buffer)
        return buffer

    def iallreduce(self, comm, buffer, op="sum"):
        """Start an allreduce of the device ``buffer`` after its stream's work is done."""
        synchronize(buffer)
        return super().iallreduce(comm, buffer, op)

    def ireduce(self, comm, buffer, op="sum", root=0):
        """Start a reduce of the device ``buffer`` to ``root`` after its stream's work is done."""
        synchronize(buffer)
        return super().ireduce(comm, buffer, op, root)

    def ibcast(self, comm, buffer, root=0):
        """Start a broadcast of the device ``buffer`` after its stream's work is done."""
        synchronize(buffer)
        return super().ibcast(comm, buffer, root)


class _PinnedPool:
    """Pinned host buffers, reused and grown only when a request needs more."""

    def __init__(self):
        self._free = []  # (capacity, memory)

    def acquire(self, nbytes):
        cp = cupy_module(required=True)
        fits = [entry for entry in self._free if entry[0] >= nbytes]
        if fits:
            entry = min(fits, key=lambda e: e[0])
            self._free.remove(entry)
            return entry
        if self._free:  # replace the largest free one by a bigger one
            self._free.remove(max(self._free, key=lambda e: e[0]))
        capacity = max(int(nbytes), 4096)
        return (capacity, cp.cuda.alloc_pinned_memory(capacity))

    def release(self, entry):
        self._free.append(entry)


class HostStagedTransport(CpuTransport):
    """CuPy buffers staged through pinned host memory for an MPI without CUDA support.

    Device -> pinned host copy, MPI on the host, host -> device copy when the
    request is waited on. Staging buffers are grow-only and reused, one per
    request in flight. Same methods as :class:`CpuTransport`; results stay on
    the GPU.
    """

    kind = "host_staged"

    def __init__(self):
        self._pool = _PinnedPool()

    def _stage(self, buffer, copy_in):
        entry = self._pool.acquire(buffer.nbytes)
        host = np.frombuffer(entry[1], buffer.dtype, buffer.size)
        if copy_in:
            synchronize(buffer)
            buffer.get(out=host)
        return entry, host

    def _blocking(self, buffer, call, copy_in=True, copy_out=True):
        if not is_device_array(buffer):
            call(buffer)
            return buffer
        entry, host = self._stage(buffer, copy_in)
        try:
            call(host)
            if copy_out:
                buffer.set(host)
        finally:
            self._pool.release(entry)
        return buffer

    def _run(self, buffer, start, copy_in=True, copy_out=True):
        if not is_device_array(buffer):
            return start(buffer)
        entry, host = self._stage(buffer, copy_in)
        request = start(host)

        def finish():
            if copy_out:
                buffer.set(host)
            self._pool.release(entry)

        if isinstance(request, _Done):
            finish()
            return _Done(buffer)
        return _Request(request._request, buffer, finish)

    def iallreduce(self, comm, buffer, op="sum"):
        """Start an allreduce of ``buffer`` through a host copy (copied back on wait)."""
        _check_buffer(buffer)
        if comm.Get_size() == 1:
            return _Done(buffer)
        return self._run(buffer, lambda host: CpuTransport.iallreduce(self, comm, host, op))

    def ireduce(self, comm, buffer, op="sum", root=0):
        """Start a reduce of ``buffer`` to ``root`` through a host copy."""
        _check_buffer(buffer)
        if comm.Get_size() == 1:
            return _Done(buffer)
        is_root = comm.Get_rank() == root
        return self._run(buffer, lambda host: CpuTransport.ireduce(self, comm, host, op, root),
                         copy_out=is_root)

    def ibcast(self, comm, buffer, root=0):
        """Start a broadcast of ``buffer`` through a host copy."""
        _check_buffer(buffer)
        if comm.Get_size() == 1:
            return _Done(buffer)
        is_root = comm.Get_rank() == root
        return self._run(buffer, lambda host: CpuTransport.ibcast(self, comm, host, root),
                         copy_in=is_root, copy_out=not is_root)


def make_transport(array_or_device_kind="cpu", *, cuda_aware=None):
    """The transport for an array (NumPy or CuPy) or a device kind (``"cpu"``/``"gpu"``).

    GPU: :class:`CudaAwareTransport` when ``cuda_aware`` (default
    :func:`cuda_aware_mpi`) is true, else :class:`HostStagedTransport`.
    Instances are cached per kind, so staging buffers are shared. Not collective.
    """
    if isinstance(array_or_device_kind, str):
        kind = array_or_device_kind.lower()
        if kind not in ("cpu", "gpu"):
            raise ValueError(f"device kind must be 'cpu' or 'gpu', not {array_or_device_kind!r}")
    else:
        kind = "gpu" if is_device_array(array_or_device_kind) else "cpu"
    if kind == "cpu":
        name = "cpu"
    else:
        cupy_module(required=True)
        aware = cuda_aware_mpi() if cuda_aware is None else bool(cuda_aware)
        name = "cuda_aware" if aware else "host_staged"
    if name not in _TRANSPORTS:
        classes = {"cpu": CpuTransport, "cuda_aware": CudaAwareTransport,
                   "host_staged": HostStagedTransport}
        _TRANSPORTS[name] = classes[name]()
    return _TRANSPORTS[name]
