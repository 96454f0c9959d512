"""CUDA kernels against their NumPy references, bit for bit.

Skipped without CuPy and a CUDA device, unless ``HPCPAX_TEST_GPU=1``, in
which case a missing GPU fails. Sums run in one fixed order on every path
(hpcpax.ops.summation: chunks of SUM_CHUNK rows, a fixed tree), so every
comparison here is bit-exact, except ``apply_dense`` (CuPy's own
elementwise kernels may fuse multiply-adds). ``tests/ops/test_ops_cuda_emulated.py``
runs these same tests on the CPU, the kernels compiled by g++ (no GPU needed).
"""

import re
import sys
from pathlib import Path

import numpy as np
import pytest

from hpcpax.backend import cupy_module
from hpcpax.errors import SparseIndexError
from hpcpax.ops import (
    dedup_sum,
    dedup_sum_reference,
    gather_rows,
    gather_rows_reference,
    make_optimizer,
    partition_pack,
    partition_pack_reference,
    scatter_add_rows,
    scatter_add_rows_reference,
)
from hpcpax.ops.partitioning import Partitioning
from hpcpax.ops.summation import SUM_CHUNK

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "ops"))
from ops_strategies import slow_dedup  # noqa: E402

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float64]
CASES = ["empty", "one_row", "all_same", "max_index", "uniform", "zipf", "heavy", "wide"]


@pytest.fixture(scope="module")
def cp(need_gpu):
    return cupy_module()


def bits(a):
    a = np.ascontiguousarray(a)
    return a.view({4: np.uint32, 8: np.uint64}[a.dtype.itemsize])


def make_case(case, dtype, num_rows=1000, dim=7, seed=0):
    """(ids, values) on the host for one edge case."""
    rng = np.random.default_rng(seed)
    n = {"empty": 0, "one_row": 1, "heavy": 50_000}.get(case, 3000)
    if case == "all_same":
        ids = np.full(n, num_rows // 2, np.int64)
    elif case == "max_index":
        ids = rng.integers(0, num_rows, n)
        ids[::3] = num_rows - 1
    elif case in ("zipf", "heavy"):  # heavy: long segments exercise the batched loop
        ids = np.minimum(rng.zipf(1.2, n) - 1, num_rows - 1)
    else:
        ids = rng.integers(0, num_rows, n)
    values = rng.standard_normal((n, dim)).astype(dtype)
    if n:
        values[::7] = -0.0
        values[1::11] *= 1e7
    return ids.astype(np.int64), values


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES)
def test_dedup_sum(cp, case, dtype):
    ids, values = make_case(case, dtype)
    if case == "wide":  # ids far apart and negative: nothing assumes a small range
        ids = ids * 7_000_000_000 - 3
    unique, summed = dedup_sum(cp.asarray(ids), cp.asarray(values))
    assert isinstance(unique, cp.ndarray) and isinstance(summed, cp.ndarray)
    assert unique.dtype == np.int64 and summed.dtype == dtype
    ref_unique, ref_summed = dedup_sum_reference(ids, values)
    np.testing.assert_array_equal(unique.get(), ref_unique)
    assert summed.shape == ref_summed.shape
    np.testing.assert_array_equal(bits(summed.get()), bits(ref_summed))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[:-1])
def test_gather_rows(cp, case, dtype):
    ids, _ = make_case(case, dtype)
    table = np.random.default_rng(1).standard_normal((1000, 5)).astype(dtype)
    got = gather_rows(cp.asarray(table), cp.asarray(ids))
    assert isinstance(got, cp.ndarray)
    np.testing.assert_array_equal(bits(got.get()), bits(gather_rows_reference(table, ids)))
    out = cp.full((ids.size, 5), np.nan, dtype)
    assert gather_rows(cp.asarray(table), cp.asarray(ids), out=out) is out
    np.testing.assert_array_equal(bits(out.get()), bits(got.get()))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", CASES[:-1])
def test_scatter_add_rows(cp, case, dtype):
    ids, values = make_case(case, dtype)
    table = np.random.default_rng(2).standard_normal((1000, values.shape[1])).astype(dtype)
    device_table = cp.asarray(table)
    assert scatter_add_rows(device_table, cp.asarray(ids), cp.asarray(values)) is device_table
    ref = scatter_add_rows_reference(table.copy(), ids, values)
    np.testing.assert_array_equal(bits(device_table.get()), bits(ref))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,num_parts", [("mod", 1), ("mod", 7), ("range", 3), ("range", 1500)])
@pytest.mark.parametrize("case", ["empty", "one_row", "all_same", "max_index", "zipf"])
@pytest.mark.parametrize("with_values", [True, False])
@pytest.mark.parametrize("by_owner", [False, True])
def test_partition_pack(cp, case, dtype, kind, num_parts, with_values, by_owner):
    ids, values = make_case(case, dtype)
    values = values if with_values else None
    partitioning = Partitioning(kind, 1000, num_parts)
    # by owner: partitions map to 3 destinations out of order, as the PS packs them
    lut = (np.arange(num_parts)[::-1] % 3) if by_owner else None
    num_dest = 3 if by_owner else None
    got = partition_pack(cp.asarray(ids), None if values is None else cp.asarray(values),
                         partitioning, lut, num_dest)
    ref = partition_pack_reference(ids, values, partitioning, lut, num_dest)
    np.testing.assert_array_equal(got.order.get(), ref.order)
    assert isinstance(got.counts, np.ndarray) and isinstance(got.displs, np.ndarray)
    np.testing.assert_array_equal(got.counts, ref.counts)
    np.testing.assert_array_equal(got.displs, ref.displs)
    np.testing.assert_array_equal(got.indices.get(), ref.indices)
    if values is None:
        assert got.values is None
    else:
        np.testing.assert_array_equal(bits(got.values.get()), bits(ref.values))


OPTIMIZERS = [
    ("sgd", {"lr": 0.1}),
    ("momentum", {"lr": 0.1}),
    ("momentum", {"lr": 0.05, "momentum": 0.5, "nesterov": True}),
    ("adagrad", {"lr": 0.1}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.1, "beta1": 0.5, "beta2": 0.9, "eps": 1e-6}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name,hp", OPTIMIZERS, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OPTIMIZERS)])
def test_optimizer_rows(cp, name, hp, dtype):
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(3)
    shape = (500, 9)
    host_param = rng.standard_normal(shape).astype(dtype)
    device_param = cp.asarray(host_param)
    host_state = opt.init_state(shape, dtype, np)
    device_state = opt.init_state(shape, dtype, cp)
    if name == "adam":
        assert isinstance(device_state["step"], np.ndarray)  # host counter, no sync
    for rows_count in (200, 0, 500, 1):
        rows = rng.choice(shape[0], rows_count, replace=False).astype(np.int64)
        grads = (rng.standard_normal((rows_count, shape[1])) * 10).astype(dtype)
        before = device_param.get()
        opt.apply_rows(device_param, device_state, cp.asarray(rows), cp.asarray(grads))
        opt.apply_rows_reference(host_param, host_state, rows, grads)
        untouched = np.setdiff1d(np.arange(shape[0]), rows)
        np.testing.assert_array_equal(bits(device_param.get()[untouched]), bits(before[untouched]))
    np.testing.assert_array_equal(bits(device_param.get()), bits(host_param))
    for key in opt.state_names:
        got = device_state[key]
        got = got.get() if isinstance(got, cp.ndarray) else got
        np.testing.assert_array_equal(got, host_state[key])


@pytest.mark.parametrize("name,hp", OPTIMIZERS[:5])
def test_optimizer_dense(cp, name, hp):
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(4)
    host = rng.standard_normal((4, 3, 5)).astype(np.float32)
    device = cp.asarray(host)
    host_state, device_state = opt.init_state(host.shape, host.dtype, np), opt.init_state(host.shape, host.dtype, cp)
    for _ in range(3):
        grad = rng.standard_normal(host.shape).astype(np.float32)
        opt.apply_dense(host, host_state, grad)
        opt.apply_dense(device, device_state, cp.asarray(grad))
    np.testing.assert_allclose(device.get(), host, rtol=1e-5, atol=1e-6)


def test_bounds_and_device_errors(cp):
    table = cp.zeros((10, 3), cp.float32)
    with pytest.raises(SparseIndexError, match="not 10"):
        gather_rows(table, cp.asarray([1, 10]))
    with pytest.raises(SparseIndexError, match="not -1"):
        scatter_add_rows(table, cp.asarray([-1]), cp.zeros((1, 3), cp.float32))
    with pytest.raises(TypeError, match="same device"):
        gather_rows(table, np.array([1]))
    with pytest.raises(TypeError, match="same device"):
        dedup_sum(cp.asarray([1]), np.zeros((1, 3)))
    with pytest.raises(SparseIndexError):
        partition_pack(cp.asarray([10]), None, Partitioning("mod", 10, 2))


def test_launchers_check_their_arguments(cp):
    from hpcpax.ops import _cuda

    table = cp.zeros((10, 4), cp.float32)
    ids = cp.arange(3, dtype=cp.int64)
    with pytest.raises(TypeError, match="ids must be int64, not int32"):
        _cuda.launch_gather_rows(table, ids.astype(cp.int32), cp.empty((3, 4), cp.float32))
    with pytest.raises(TypeError, match="out must be float32, not float64"):
        _cuda.launch_gather_rows(table, ids, cp.empty((3, 4), cp.float64))
    with pytest.raises(ValueError, match="out must be C-contiguous"):
        _cuda.launch_gather_rows(table, ids, cp.empty((4, 3), cp.float32).T)
    with pytest.raises(TypeError, match="table must be a cupy.ndarray, not ndarray"):
        _cuda.launch_gather_rows(np.zeros((10, 4), np.float32), ids, cp.empty((3, 4), cp.float32))


def test_modules_are_memoized_with_hash(cp):
    from hpcpax.ops import _cuda, _kernel_source

    _cuda.get_function("dedup_sum.cu", "segment_sum_short<float, 1>")
    key = ("dedup_sum.cu", cp.cuda.Device().id)
    module = _cuda._MODULES[key]
    _cuda.get_function("dedup_sum.cu", "segment_sum_short<double, 2>")
    assert _cuda._MODULES[key] is module  # compiled once per device
    assert f"-DHPCPAX_KERNELS_HASH=0x{_kernel_source.kernels_hash()}" in _kernel_source.compile_options()


def test_large_zipf_dedup(cp):
    # a long segment (hundreds of thousands of rows) and many short ones
    rng = np.random.default_rng(5)
    ids = np.minimum(rng.zipf(1.1, 400_000) - 1, 99_999).astype(np.int64)
    values = rng.standard_normal((ids.size, 16)).astype(np.float32)
    unique, summed = dedup_sum(cp.asarray(ids), cp.asarray(values))
    ref_unique, ref_summed = dedup_sum_reference(ids, values)
    np.testing.assert_array_equal(unique.get(), ref_unique)
    np.testing.assert_array_equal(bits(summed.get()), bits(ref_summed))


C = SUM_CHUNK
# rows per id around the chunk's edges, and many chunks (an odd count: a carried chunk)
LONG = [0, 1, C - 1, C, C + 1, 2 * C, 2 * C + 1, 3 * C + 5, 1000, 4096 + 3]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dim", [1, 33, 64, 70, 128])  # vector widths 1, 1, 4 (2 double), 2, 4
def test_long_segments_match_the_reference(cp, dtype, dim):
    # Segments of every length around SUM_CHUNK, interleaved with short ones,
    # for both ops; the table holds -0.0 and large values so the order of adds shows.
    rng = np.random.default_rng(6)
    ids = np.concatenate([np.full(n, 10 * k, np.int64) for k, n in enumerate(LONG)] +
                         [rng.integers(0, 200, 500)])
    rng.shuffle(ids)
    values = (rng.standard_normal((ids.size, dim)) * 10.0 ** rng.integers(-3, 8, (ids.size, 1))).astype(dtype)
    unique, summed = dedup_sum(cp.asarray(ids), cp.asarray(values))
    ref_unique, ref_summed = dedup_sum_reference(ids, values)
    np.testing.assert_array_equal(unique.get(), ref_unique)
    np.testing.assert_array_equal(bits(summed.get()), bits(ref_summed))
    np.testing.assert_array_equal(bits(summed.get()), bits(slow_dedup(ids, values)[1]))
    table = rng.standard_normal((200, dim)).astype(dtype) * 1e6
    table[::3] = -0.0
    device_table = cp.asarray(table)
    scatter_add_rows(device_table, cp.asarray(ids), cp.asarray(values))
    ref = scatter_add_rows_reference(table.copy(), ids, values)
    np.testing.assert_array_equal(bits(device_table.get()), bits(ref))


@pytest.mark.parametrize("dtype", DTYPES)
def test_results_do_not_depend_on_the_launch_shape(cp, dtype, monkeypatch):
    # fewer blocks (grid-stride loops wrap), misaligned rows (vector width 1):
    # the same bits, since each sum's order is fixed by the data alone
    from hpcpax.ops import _cuda

    rng = np.random.default_rng(8)
    ids = np.minimum(rng.zipf(1.1, 20_000) - 1, 4999).astype(np.int64)
    values = rng.standard_normal((ids.size, 64)).astype(dtype)
    table = rng.standard_normal((5000, 64)).astype(dtype)
    want = dedup_sum_reference(ids, values)[1]
    want_table = scatter_add_rows_reference(table.copy(), ids, values)
    flat = cp.empty(values.size + 1, dtype)
    flat[1:] = cp.asarray(values.reshape(-1))
    misaligned = flat[1:].reshape(values.shape)
    assert _cuda.row_layout(misaligned.dtype, 64, misaligned)[0] == 1
    device = cp.cuda.Device().id
    for sms in (1, 3):
        monkeypatch.setitem(_cuda._SM_COUNT, device, sms)
        for rows in (cp.asarray(values), misaligned):
            np.testing.assert_array_equal(bits(dedup_sum(cp.asarray(ids), rows)[1].get()), bits(want))
            device_table = cp.asarray(table)
            scatter_add_rows(device_table, cp.asarray(ids), rows)
            np.testing.assert_array_equal(bits(device_table.get()), bits(want_table))
            gathered = gather_rows(cp.asarray(table), cp.asarray(ids))
            np.testing.assert_array_equal(bits(gathered.get()), bits(table[ids]))


def test_row_layout_picks_whole_vectors(cp):
    from hpcpax.ops import _cuda

    rows = {dim: cp.empty((4, dim), cp.float32) for dim in (1, 6, 7, 64, 128, 256)}
    layout = {dim: _cuda.row_layout(cp.float32, dim, a) for dim, a in rows.items()}
    assert layout == {1: (1, 1, 1), 6: (2, 3, 4), 7: (1, 7, 8), 64: (4, 16, 16),
                      128: (4, 32, 32), 256: (4, 64, 32)}
    assert _cuda.row_layout(cp.float64, 64, cp.empty((4, 64), cp.float64)) == (2, 32, 32)


def test_segment_launchers_check_their_arguments(cp):
    from hpcpax.ops import _cuda

    starts = cp.asarray([0, 300], cp.int64)
    values = cp.zeros((300, 4), cp.float32)
    order = cp.arange(300, dtype=cp.int64)
    with pytest.raises(ValueError, match="out_rows must have one row per segment"):
        _cuda.launch_segment_sum_short(values, order, starts, cp.zeros((5, 4), cp.float32),
                                       cp.asarray([0, 1], cp.int64))
    with pytest.raises(TypeError, match="out must be float32, not float64"):
        _cuda.launch_long_segments(values, order, starts, cp.asarray([0], cp.int64),
                                   cp.zeros((1, 4), cp.float64))
    with pytest.raises(ValueError, match=r"out must have shape \(rows, 4\), not \(1, 3\)"):
        _cuda.launch_segment_sum_short(values, order, starts, cp.zeros((1, 3), cp.float32))
    with pytest.raises(ValueError, match="order must have one entry per row of values"):
        _cuda.launch_segment_sum_short(values, order[:10], starts, cp.zeros((1, 4), cp.float32))


def test_kernels_use_no_atomics():
    from hpcpax.ops import _kernel_source

    for name, text in _kernel_source.kernel_sources().items():
        assert not re.search(r"\batomic\w*\s*\(", text), name
