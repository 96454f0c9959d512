"""DenseAllreduce: sums and means against NumPy, fusion, wire dtypes, hierarchy, bytes."""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.comm.allreduce import DenseAllreduce
from hpcpax.comm.wire import bfloat16_decode, bfloat16_encode, wire_error_bound
from hpcpax.errors import ConfigError, MismatchError

WORLD = MPI.COMM_WORLD
SHAPES = [(), (0,), (1,), (7,), (3, 4), (2, 3, 5), (1000,), (0, 3), (65, 33)]
DTYPES = ["float32", "float64", "int32", "int64", "float16"]



@pytest.fixture
def topo():
    t = hpcpax.init(servers_per_node=0)
    yield t
    t.free()


def _spec(dtypes=DTYPES, shapes=SHAPES):
    return {f"{d}_{i}": (s, d) for d in dtypes for i, s in enumerate(shapes)}


def _data(spec, rank, integer=True, seed=0):
    """Rank ``rank``'s gradients, reproducible on every rank (integer-valued by default)."""
    rng = np.random.default_rng([seed, rank])
    out = {}
    for name, (shape, dtype) in spec.items():
        if integer:
            scale = 16 if dtype == "float16" else 1000
            out[name] = rng.integers(-scale, scale, size=shape).astype(dtype)
        else:
            out[name] = rng.standard_normal(size=shape).astype(dtype)
    return out


def _reference(spec, size, integer=True, seed=0):
    """Sum over all ranks' data in float64 (exact for integer values)."""
    total = {n: np.zeros(s, np.float64) for n, (s, _) in spec.items()}
    for r in range(size):
        for name, value in _data(spec, r, integer, seed).items():
            total[name] += value
    return total


@pytest.mark.parametrize("bucket_bytes", [1, 256, 1 << 20])
def test_sum_equals_numpy(topo, bucket_bytes, all_ok):
    spec = _spec()
    n = topo.num_workers
    grads = _data(spec, topo.worker_index)
    dense = DenseAllreduce(topo, spec, op="sum", bucket_bytes=bucket_bytes)
    out = dense.allreduce(grads)
    expect = _reference(spec, n)
    ok = out is grads
    for name, (shape, dtype) in spec.items():
        ok &= out[name].dtype == np.dtype(dtype) and out[name].shape == tuple(np.empty(shape).shape)
        ok &= np.array_equal(out[name], expect[name].astype(dtype))
    assert all_ok(topo.workers, ok)


def test_mean_equals_numpy(topo, all_ok):
    spec = _spec(dtypes=["float32", "float64"])
    grads = _data(spec, topo.worker_index, integer=False, seed=3)
    dense = DenseAllreduce(topo, spec, op="mean", bucket_bytes=4096)
    dense.allreduce(grads)
    expect = _reference(spec, topo.num_workers, integer=False, seed=3)
    ok = True
    for name, (_, dtype) in spec.items():
        rtol = 1e-5 if dtype == "float32" else 1e-12
        ok &= np.allclose(grads[name], expect[name] / topo.num_workers, rtol=rtol, atol=rtol)
    assert all_ok(topo.workers, ok)


def test_fused_equals_unfused_bit_for_bit(topo, all_ok):
    """float64 sum: one bucket, small buckets and one MPI_Allreduce per tensor agree exactly."""
    spec = _spec(dtypes=["float64"])
    results = []
    for bucket_bytes in (1 << 22, 100, 1):
        grads = _data(spec, topo.worker_index)
        for i, name in enumerate(grads):  # integer values times powers of two: exact
            grads[name] *= 2.0 ** (i % 20 - 10)
        DenseAllreduce(topo, spec, op="sum", bucket_bytes=bucket_bytes).allreduce(grads)
        results.append(grads)
    grads = _data(spec, topo.worker_index)
    for i, name in enumerate(grads):
        grads[name] *= 2.0 ** (i % 20 - 10)
        topo.workers.Allreduce(MPI.IN_PLACE, grads[name])
    results.append(grads)
    ok = all(np.array_equal(r[n], results[0][n]) for r in results for n in spec)
    assert all_ok(topo.workers, ok)


def test_buckets_follow_registration_order_and_size(topo):
    spec = {"a": ((100,), "float32"), "b": ((100,), "float32"), "c": ((10,), "int64"),
            "d": ((300,), "float32"), "e": ((0,), "float32"), "f": ((1,), "float32")}
    dense = DenseAllreduce(topo, spec, op="sum", bucket_bytes=800)
    assert dense.buckets == [["a", "b"], ["c"], ["d"], ["f"]]
    assert dense.bucket_bytes == 800


@pytest.mark.parametrize("wire", ["float16", "bfloat16"])
@pytest.mark.parametrize("op", ["sum", "mean"])
def test_wire_dtype_within_bound(topo, wire, op, all_ok):
    spec = {"w": ((50, 40), "float32"), "b": ((17,), "float64"), "i": ((9,), "int32"),
            "s": ((), "float32")}
    if op == "mean":
        spec.pop("i")
    n = topo.num_workers
    grads = _data(spec, topo.worker_index, integer=False, seed=7)
    dense = DenseAllreduce(topo, spec, op=op, wire_dtype=wire, bucket_bytes=2048)
    dense.allreduce(grads)
    ok = True
    for name, (shape, dtype) in spec.items():
        parts = [_data(spec, r, integer=False, seed=7)[name].astype(np.float64) for r in range(n)]
        exact = np.sum(parts, axis=0)
        if dtype == "int32":
            ok &= np.array_equal(grads[name], exact.astype(dtype))
            continue
        bound = wire_error_bound(wire, n, np.sum(np.abs(parts), axis=0)) * 1.0001
        divide = n if op == "mean" else 1
        ok &= bool(np.all(np.abs(grads[name] - exact / divide) <= bound / divide + 1e-7 * abs(exact)))
    assert all_ok(topo.workers, ok)


def test_bfloat16_rounding():
    x = np.array([1.0, 1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -2.5, np.inf, -np.inf, 0.0, 3e38],
                 np.float32)
    got = bfloat16_decode(bfloat16_encode(x))
    assert np.array_equal(got[:7], [1.0, 1.0, 1 + 2.0 ** -6, -2.5, np.inf, -np.inf, 0.0])
    assert np.isinf(got[7]) or abs(got[7] - 3e38) <= 2.0 ** -8 * 3e38
    assert np.isnan(bfloat16_decode(bfloat16_encode(np.array([np.nan], np.float32))))[0]
    y = np.random.default_rng(1).standard_normal(10000).astype(np.float32)
    err = np.abs(bfloat16_decode(bfloat16_encode(y)) - y)
    assert np.all(err <= 2.0 ** -8 * np.abs(y))


@pytest.mark.parametrize("ranks_per_node", [1, 2, 3])
def test_hierarchical_equals_flat(ranks_per_node, all_ok):
    topo = hpcpax.init(ranks_per_node=ranks_per_node, servers_per_node=0)
    try:
        spec = _spec(dtypes=["float64", "int64", "float32"])
        flat = _data(spec, topo.worker_index)
        hier = _data(spec, topo.worker_index)
        DenseAllreduce(topo, spec, op="sum", bucket_bytes=512).allreduce(flat)
        DenseAllreduce(topo, spec, op="sum", bucket_bytes=512, hierarchical=True,
                       max_in_flight=1).allreduce(hier)
        ok = all(np.array_equal(flat[n], hier[n]) for n in spec)
        expect = _reference(spec, topo.num_workers)
        ok &= all(np.array_equal(hier[n], expect[n].astype(spec[n][1])) for n in spec)
        assert all_ok(topo.comm, ok)
    finally:
        topo.free()


def _ring(ranks, me, node_of, nbytes):
    n = len(ranks)
    if n < 2:
        return 0, 0, 0, 0
    i = ranks.index(me)
    share = 2 * (n - 1) * nbytes // n
    succ, pred = ranks[(i + 1) % n], ranks[(i - 1) % n]
    return (share, share, share * (node_of[succ] != node_of[me]),
            share * (node_of[pred] != node_of[me]))


@pytest.mark.parametrize("hierarchical", [False, True])
@pytest.mark.parametrize("servers_per_node", [0, 1])
def test_bytes_follow_the_formula(hierarchical, servers_per_node, all_ok):
    if servers_per_node and WORLD.Get_size() < 2:
        pytest.skip("a server needs a second rank")
    topo = hpcpax.init(ranks_per_node=2, servers_per_node=servers_per_node)
    try:
        if topo.is_server:
            assert all_ok(topo.comm, True)
            return
        spec = {"w": ((33, 10), "float32"), "b": ((5,), "float64"), "n": ((3,), "int32")}
        dense = DenseAllreduce(topo, spec, op="sum", hierarchical=hierarchical, bucket_bytes=1024)
        topo.accounting.reset()
        for _ in range(2):
            dense.allreduce(_data(spec, topo.worker_index))
        me, node_of = topo.rank, topo.node_of
        ok = True
        total_sent = 0
        for name, (shape, dtype) in spec.items():
            nbytes = int(np.prod(shape)) * np.dtype(dtype).itemsize
            if not hierarchical:
                sent, recv, sent_inter, recv_inter = _ring(topo.worker_ranks, me, node_of, nbytes)
            else:
                local = topo.workers_on_node(topo.node)
                leaders = [topo.workers_on_node(n)[0] for n in range(topo.num_nodes)
                           if topo.workers_on_node(n)]
                if me == local[0]:
                    sent, recv, sent_inter, recv_inter = _ring(leaders, me, node_of, nbytes)
                    sent += (len(local) - 1) * nbytes
                    recv += (len(local) - 1) * nbytes
                else:
                    sent, recv, sent_inter, recv_inter = nbytes, nbytes, 0, 0
            v = topo.accounting.variable(name)
            ok &= (v["sent_bytes"], v["recv_bytes"], v["sent_inter_bytes"],
                   v["recv_inter_bytes"]) == (2 * sent, 2 * recv, 2 * sent_inter, 2 * recv_inter)
            total_sent += 2 * sent
        phase = topo.accounting.phase("dense")
        ok &= phase["sent_bytes"] == total_sent and phase["seconds"] > 0
        # what leaves one rank arrives at another
        sums = topo.workers.allreduce(np.array([phase["sent_bytes"], phase["recv_bytes"],
                                                phase["sent_inter_bytes"],
                                                phase["recv_inter_bytes"]]))
        ok &= sums[0] == sums[1] and sums[2] == sums[3]
        assert all_ok(topo.comm, ok)
    finally:
        topo.free()


def test_wire_bytes_are_two_per_element(topo):
    spec = {"w": ((100,), "float64"), "i": ((10,), "int64")}
    dense = DenseAllreduce(topo, spec, op="sum", wire_dtype="bfloat16", bucket_bytes=64)
    topo.accounting.reset()
    dense.allreduce(_data(spec, topo.worker_index))
    n = topo.num_workers
    assert topo.accounting.variable("w")["sent_bytes"] == 2 * (n - 1) * 200 // n
    assert topo.accounting.variable("i")["sent_bytes"] == 2 * (n - 1) * 80 // n


@pytest.mark.mpi(min_size=2)
def test_mismatched_registration_raises_everywhere(topo):
    rank = topo.workers.Get_rank()
    spec = {"a": ((4,), "float32"), "b": ((3, 2), "float32")}
    wrong = dict(spec, b=((2, 3), "float32")) if rank == 1 else spec
    with pytest.raises(MismatchError, match=r"tensor 1.*ranks \[1\]"):
        DenseAllreduce(topo, wrong, bucket_bytes=1024)
    fewer = {"a": spec["a"]} if rank == 0 else spec
    with pytest.raises(MismatchError, match="count"):
        DenseAllreduce(topo, fewer, bucket_bytes=1024)
    renamed = {"z": spec["a"], "b": spec["b"]} if rank == 0 else spec
    with pytest.raises(MismatchError, match="'z'"):
        DenseAllreduce(topo, renamed, bucket_bytes=1024)
    other_op = "sum" if rank == 0 else "mean"
    with pytest.raises(MismatchError, match="op"):
        DenseAllreduce(topo, spec, op=other_op, bucket_bytes=1024)
    assert topo.workers.allreduce(1) == topo.num_workers  # nobody hangs


def test_bad_arguments_before_communication(topo):
    spec = {"a": ((4,), "float32")}
    with pytest.raises(ValueError, match="op must be"):
        DenseAllreduce(topo, spec, op="avg")
    with pytest.raises(ValueError, match="wire_dtype"):
        DenseAllreduce(topo, spec, wire_dtype="float8")
    with pytest.raises(ValueError, match="bucket_bytes"):
        DenseAllreduce(topo, spec, bucket_bytes=0)
    with pytest.raises(TypeError, match="mean"):
        DenseAllreduce(topo, {"i": ((2,), "int32")}, op="mean")
    with pytest.raises(TypeError, match="dtype"):
        DenseAllreduce(topo, {"c": ((2,), "complex64")})
    with pytest.raises(TypeError, match="tensors must be"):
        DenseAllreduce(topo, "a")
    with pytest.raises(TypeError, match="Topology"):
        DenseAllreduce(topo.workers, spec, hierarchical=True)
    dense = DenseAllreduce(topo, spec, bucket_bytes=64)
    with pytest.raises(ValueError, match="shape"):
        dense.start({"a": np.zeros(5, np.float32)})
    with pytest.raises(ValueError, match="missing"):
        dense.start({"b": np.zeros(4, np.float32)})
    with pytest.raises(RuntimeError):
        dense.wait()


def test_start_wait_overlap_and_list_registration(topo, all_ok):
    arrays = [np.full((64, 64), topo.worker_index + 1.0), np.arange(10.0)]
    dense = DenseAllreduce(topo.workers, arrays, op="mean", bucket_bytes=4096, max_in_flight=1)
    assert dense.accounting is None  # a bare communicator counts nothing
    grads = [a.copy() for a in arrays]
    dense.start(grads)
    with pytest.raises(RuntimeError, match="before wait"):
        dense.start(grads)
    busy = np.linalg.norm(np.ones((200, 200)) @ np.ones((200, 200)))  # "compute" meanwhile
    out = dense.wait()
    n = topo.num_workers
    ok = out is grads and busy > 0
    ok &= np.all(grads[0] == (n + 1) / 2) and np.array_equal(grads[1], np.arange(10.0))
    assert all_ok(topo.workers, ok)


def test_single_process_without_comm():
    dense = DenseAllreduce(None, {"x": ((3,), "float64")}, op="mean")
    g = {"x": np.array([1.0, 2.0, 3.0])}
    assert np.array_equal(dense.allreduce(g)["x"], [1.0, 2.0, 3.0])


def test_server_rank_cannot_allreduce():
    if WORLD.Get_size() < 2:
        pytest.skip("needs a server rank")
    topo = hpcpax.init(servers_per_node=1)
    try:
        if topo.is_server:
            with pytest.raises(ConfigError, match="server"):
                DenseAllreduce(topo, {"a": ((1,), "float32")})
    finally:
        topo.free()



@pytest.mark.gpu
@pytest.mark.parametrize("wire", [None, "float16", "bfloat16"])
@pytest.mark.parametrize("aware", ["0", "auto"])
def test_cupy_matches_numpy(topo, monkeypatch, wire, aware, all_ok, need_gpu):
    import cupy

    if aware == "0":
        monkeypatch.setenv("HPCPAX_CUDA_AWARE_MPI", "0")
    spec = _spec(dtypes=["float32", "float64"])
    host = _data(spec, topo.worker_index)
    device = {n: cupy.asarray(v) for n, v in host.items()}
    DenseAllreduce(topo, spec, op="mean", wire_dtype=wire, bucket_bytes=4096).allreduce(host)
    out = DenseAllreduce(topo, spec, op="mean", wire_dtype=wire, bucket_bytes=4096).allreduce(device)
    ok = all(isinstance(out[n], cupy.ndarray) and np.array_equal(out[n].get(), host[n])
             for n in spec)
    assert all_ok(topo.workers, ok)
