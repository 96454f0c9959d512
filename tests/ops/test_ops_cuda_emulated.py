"""The CUDA path on the CPU: tests/gpu/test_kernels_gpu.py against the kernels built by g++.

``cuda_emulator.FakeCupy`` stands in for CuPy: the launchers and op bodies
of ``hpcpax/ops/_cuda.py`` run as on a GPU, and every ``kernels/*.cu``
kernel runs as C++ on the host, thread by thread. So the summation order of
the CUDA kernels (stable sort, segments, chunks, the fixed tree), their
vector widths and team sizes, and every launcher's arguments are checked
bit for bit against the NumPy twins without a GPU. Skipped without g++.
"""

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))
import cuda_emulator  # noqa: E402
import test_kernels_gpu  # noqa: E402
from test_kernels_gpu import *  # noqa: E402,F401,F403  (the GPU tests, run here on the emulator)

pytestmark = []  # not "gpu": no device needed


@pytest.fixture(scope="module")
def cp():
    """The emulated ``cupy``, installed as hpcpax's CuPy for this module's tests."""
    if cuda_emulator.compiler() is None:
        pytest.skip("needs a C++ compiler (g++) for the CUDA emulator")
    from hpcpax import backend, ops

    saved = backend._CUPY, backend._CUPY_TRIED
    fake = cuda_emulator.FakeCupy()
    backend._CUPY, backend._CUPY_TRIED = fake, True
    sys.modules.pop("hpcpax.ops._cuda", None)
    importlib.import_module("hpcpax.ops._cuda")
    try:
        yield fake
    finally:
        backend._CUPY, backend._CUPY_TRIED = saved
        sys.modules.pop("hpcpax.ops._cuda", None)
        if hasattr(ops, "_cuda"):
            delattr(ops, "_cuda")


def test_emulator_refuses_a_python_int(cp):
    from hpcpax.ops import _cuda

    kernel = _cuda.get_function("gather_rows.cu", "gather_rows<float, 1>")
    table, ids, out = cp.zeros((4, 2), cp.float32), cp.zeros(3, cp.int64), cp.zeros((3, 2), cp.float32)
    with pytest.raises(TypeError, match="argument 2 must be an array or a NumPy scalar, not int"):
        kernel((1,), (32,), (table, ids, 3, np.int64(2), np.int32(2), out))
    with pytest.raises(TypeError, match="argument 2 must be a 8-byte scalar, not int32"):
        kernel((1,), (32,), (table, ids, np.int32(3), np.int64(2), np.int32(2), out))
    with pytest.raises(TypeError, match="takes 6 arguments, not 5"):
        kernel((1,), (32,), (table, ids, np.int64(3), np.int64(2), out))


def test_emulated_kernels_really_run(cp):
    # the bit-equal results above come from the kernels: count their launches
    from hpcpax.ops import _cuda, dedup_sum

    ids = np.repeat(np.arange(3), [1, 70, 200])
    values = np.random.default_rng(0).standard_normal((ids.size, 8)).astype(np.float32)
    dedup_sum(cp.asarray(ids), cp.asarray(values))
    module = _cuda._MODULES[("dedup_sum.cu", 0)]
    launched = {name: k.launches for name, k in module.kernels.items()}
    assert launched["segment_sum_short<float, 4>"] >= 1
    assert launched["segment_chunk_sums<float, 4>"] >= 1
    assert launched["segment_tree<float, 4>"] >= 1


def test_the_gpu_module_is_what_runs_here():
    assert test_kernels_gpu.pytestmark.name == "gpu"


def _round_trips(fn):
    """(syncs, uploads) the device path of ``fn()`` makes (inputs already uploaded)."""
    before = dict(cuda_emulator.COUNTS)
    fn()
    return tuple(cuda_emulator.COUNTS[k] - before[k] for k in ("syncs", "uploads"))


@pytest.mark.parametrize("n", [5_000, 80_000])
def test_device_round_trips_are_counted(cp, n):
    # Each op waits for the device only where the host must know a number:
    # dedup_sum the unique ids' count (and, from NARROW_SORT_MIN ids on, their
    # range, for 32-bit sort keys); scatter/gather the bounds check; packing
    # the counts MPI needs. Long segments, chunks and the device lookup table
    # of destinations cost none (a second flatnonzero, bincount's max and a
    # per-call upload of the table did before).
    from hpcpax.ops import _cuda, dedup_sum, gather_rows, partition_pack, scatter_add_rows
    from hpcpax.ops.partitioning import Partitioning

    rng = np.random.default_rng(9)
    ids = cp.asarray(np.minimum(rng.zipf(1.1, n) - 1, 9_999))  # long segments too
    values = cp.asarray(rng.standard_normal((n, 16)).astype(np.float32))
    table = cp.zeros((10_000, 16), cp.float32)
    dedup_sum(ids, values)  # compile
    narrow = 1 if n >= _cuda.NARROW_SORT_MIN else 0
    assert _round_trips(lambda: dedup_sum(ids, values)) == (1 + narrow, 0)
    assert _round_trips(lambda: scatter_add_rows(table, ids, values)) == (2, 0)
    assert _round_trips(lambda: gather_rows(table, ids)) == (1, 0)
    part, lut = Partitioning("mod", 10_000, 6), np.array([0, 2, 1, 0, 2, 1])
    partition_pack(ids, values, part, lut, 3, in_range=True)  # uploads the table once
    assert _round_trips(lambda: partition_pack(ids, values, part, lut, 3, in_range=True)) == (1, 0)
    assert _round_trips(lambda: partition_pack(ids, None, part, in_range=True)) == (1, 0)


def test_the_device_trial_runs_the_gpu_path(cp):
    # --device auto's trial on the device: batch and rows uploaded, the model's
    # step, dedup_sum on the device, gradients read back (what it counts)
    from hpcpax.app.device_choice import measure_step
    from hpcpax.models import build_model

    model = build_model("lm", vocab_size=300, context=3, emb_dim=8, hidden=[16], out_dim=8,
                        num_sampled=16)
    before = dict(cuda_emulator.COUNTS)
    seconds = measure_step(model, {"seed": 0, "optimizer": "adam", "lr": 0.01}, cp, 12, steps=2)
    assert seconds > 0
    # 3 steps (one warm-up), each: the batch (2 arrays) and 3 tables' rows (2 arrays each) up
    assert cuda_emulator.COUNTS["uploads"] - before["uploads"] >= 3 * 8
    assert cuda_emulator.COUNTS["syncs"] > before["syncs"]


def _device_rows(cp, model, batch, step):
    rows = {}
    specs = {s.name: s for s in model.sparse_specs()}
    for name, ids in model.sparse_ids(batch, step).items():
        unique = cp.unique(ids)
        rows[name] = (unique, cp.zeros((unique.size, specs[name].dim), model.dtype) + 0.01)
    return rows


@pytest.mark.parametrize("kind", ["lm", "ctr"])
def test_a_models_step_uploads_only_its_data(cp, kind):
    # A GPU worker's forward/backward uploads nothing per step but the lm's
    # negatives of that step, once for sparse_ids and the forward pass
    # together (the ctr's pair indices once per model, the masked logit never).
    from hpcpax.models import build_model

    flags = ({"vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
              "num_sampled": 16} if kind == "lm" else
             {"n_dense": 3, "n_fields": 4, "table_rows": [50, 60, 70, 80], "emb_dim": 4,
              "bottom": [8, 4], "top": [8]})
    model = build_model(kind, **flags)
    batch = {k: cp.asarray(v) for k, v in model.example_batch(12).items()}
    dense = {k: cp.asarray(v) for k, v in model.init_dense().items()}
    model.forward_backward(dense, _device_rows(cp, model, batch, 0), batch, 0)  # first step
    for step in (1, 2):
        before = cuda_emulator.COUNTS["uploads"]
        rows = _device_rows(cp, model, batch, step)  # the trainer's sparse_ids, then the pull
        model.sparse_ids(batch, step)
        model.forward_backward(dense, rows, batch, step)
        assert cuda_emulator.COUNTS["uploads"] - before == (1 if kind == "lm" else 0), step
