"""Transports: CPU path everywhere, GPU paths where a device exists."""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.comm import transport as tr
from hpcpax.backend import has_gpu




def _exercise(transport, comm, xp):
    """allreduce, iallreduce, reduce, bcast on ``xp`` buffers; collective checks."""
    rank, size = comm.Get_rank(), comm.Get_size()
    n = 1000
    buf = xp.arange(n, dtype=xp.float64) + rank
    out = transport.allreduce(comm, buf, MPI.SUM)
    expect = size * np.arange(n) + size * (size - 1) / 2
    ok = out is buf and np.array_equal(hpcpax.backend.to_host(out), expect)
    buf = xp.full(n, rank + 1, dtype=xp.int64)
    request = transport.iallreduce(comm, buf, "max")
    ok &= hpcpax.backend.to_host(request.wait())[0] == size
    buf = xp.full(7, rank + 1, dtype=xp.float32)
    transport.reduce(comm, buf, "sum", root=size - 1)
    value = hpcpax.backend.to_host(buf)
    ok &= value[0] == (size * (size + 1) // 2 if rank == size - 1 else rank + 1)
    buf = xp.full(5, rank, dtype=xp.int32)
    transport.bcast(comm, buf, root=size - 1)
    ok &= bool((hpcpax.backend.to_host(buf) == size - 1).all())
    # requests in flight at once, completed out of order
    bufs = [xp.full(3, rank * 10 + i, dtype=xp.float64) for i in range(3)]
    requests = [transport.iallreduce(comm, b, "sum") for b in bufs]
    for i in (2, 0, 1):
        got = hpcpax.backend.to_host(requests[i].wait())
        ok &= got[0] == 10 * size * (size - 1) / 2 + i * size
    return ok


def test_cpu_transport(all_ok):
    transport = tr.make_transport("cpu")
    assert isinstance(transport, tr.CpuTransport) and transport is tr.make_transport(np.zeros(1))
    assert all_ok(MPI.COMM_WORLD, _exercise(transport, MPI.COMM_WORLD, np))


def test_cpu_transport_rejects_bad_buffers():
    transport = tr.CpuTransport()
    with pytest.raises(ValueError):
        transport.allreduce(MPI.COMM_WORLD, np.zeros((2, 2)), "sum")
    with pytest.raises(ValueError):
        transport.allreduce(MPI.COMM_WORLD, np.zeros(8)[::2], "sum")
    with pytest.raises(ValueError):
        transport.allreduce(MPI.COMM_WORLD, np.zeros(2), "average")


def test_make_transport_bad_kind():
    with pytest.raises(ValueError):
        tr.make_transport("tpu")


def test_cuda_aware_env_override(monkeypatch):
    monkeypatch.setenv("HPCPAX_CUDA_AWARE_MPI", "1")
    assert tr.cuda_aware_mpi() is True
    monkeypatch.setenv("HPCPAX_CUDA_AWARE_MPI", "0")
    assert tr.cuda_aware_mpi() is False
    monkeypatch.setenv("HPCPAX_CUDA_AWARE_MPI", "yes")
    with pytest.raises(hpcpax.ConfigError):
        tr.cuda_aware_mpi()


def test_cuda_aware_detection_is_a_bool(monkeypatch):
    monkeypatch.delenv("HPCPAX_CUDA_AWARE_MPI", raising=False)
    assert isinstance(tr.cuda_aware_mpi(), bool)


def test_gpu_transport_without_cupy_names_the_fix():
    if has_gpu():
        pytest.skip("CuPy present")
    if hpcpax.backend.cupy_module() is None:
        with pytest.raises(hpcpax.DependencyError, match="hpcpax\\[gpu\\]"):
            tr.make_transport("gpu")


@pytest.mark.gpu
def test_host_staged_transport_on_gpu(all_ok, need_gpu):
    import cupy

    transport = tr.make_transport("gpu", cuda_aware=False)
    assert isinstance(transport, tr.HostStagedTransport)
    assert all_ok(MPI.COMM_WORLD, _exercise(transport, MPI.COMM_WORLD, cupy))
    # staging buffers are reused: a second round allocates nothing bigger
    before = sorted(cap for cap, _ in transport._pool._free)
    _exercise(transport, MPI.COMM_WORLD, cupy)
    assert sorted(cap for cap, _ in transport._pool._free) == before
    result = transport.allreduce(MPI.COMM_WORLD, cupy.ones(4, cupy.float32), "sum")
    assert isinstance(result, cupy.ndarray)


@pytest.mark.gpu
def test_cuda_aware_transport_on_gpu(all_ok, need_gpu):
    import cupy

    if not tr.cuda_aware_mpi() and MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("MPI library is not CUDA-aware")
    transport = tr.make_transport("gpu", cuda_aware=True)
    assert isinstance(transport, tr.CudaAwareTransport)
    assert all_ok(MPI.COMM_WORLD, _exercise(transport, MPI.COMM_WORLD, cupy))
