"""BucketedAllreduce: buckets start in order whatever order gradients arrive.

Every worker makes its tensors ready in its own random order; the results
must equal the mean over workers computed here from every worker's values.
A gradient made ready twice in a step is refused; tensors never made ready
are filled at ``wait``.
"""

import numpy as np
import pytest

import hpcpax
from hpcpax.sync.dense_buckets import BucketedAllreduce

SHAPES = {"a": (3,), "b": (100,), "c": (2, 5), "d": (50,), "e": (7,)}


def values(worker, dtype=np.float64):
    rng = np.random.default_rng(worker)
    return {n: rng.standard_normal(s).astype(dtype) for n, s in SHAPES.items()}


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("op", ["mean", "sum"])
def test_any_ready_order_gives_the_mean(comm, all_ok, op):
    topo = hpcpax.init(servers_per_node=0)
    try:
        reducer = BucketedAllreduce(topo, {n: (s, np.float64) for n, s in SHAPES.items()},
                                    bucket_bytes=400, op=op)
        ok = len(reducer.buckets) > 1 and [n for b in reducer.buckets for n in b] == list(SHAPES)
        everyone = [values(w) for w in range(topo.num_workers)]
        for step in range(3):
            mine = values(topo.worker_index)
            order = np.random.default_rng([topo.worker_index, step]).permutation(list(SHAPES))
            for name in order:
                reducer.ready(str(name), mine[str(name)])
            reducer.wait()
            for name in SHAPES:
                want = sum(v[name] for v in everyone)
                if op == "mean":
                    want = want / topo.num_workers
                ok &= np.allclose(mine[name], want, rtol=1e-12, atol=1e-12)
    finally:
        topo.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_twice_ready_is_refused_and_missing_ones_are_filled(comm, all_ok):
    topo = hpcpax.init(servers_per_node=0)
    try:
        reducer = BucketedAllreduce(topo, {n: (s, np.float64) for n, s in SHAPES.items()},
                                    bucket_bytes=400)
        mine = values(topo.worker_index)
        reducer.ready("a", mine["a"])
        try:
            reducer.ready("a", mine["a"])
            ok = False
        except RuntimeError as exc:
            ok = "made ready twice" in str(exc)
        reducer.wait(fill=lambda name: mine[name])  # the other tensors, filled here
        everyone = [values(w) for w in range(topo.num_workers)]
        for name in SHAPES:
            ok &= np.allclose(mine[name], sum(v[name] for v in everyone) / topo.num_workers)
        with pytest.raises(RuntimeError, match="never made ready"):
            reducer.wait()  # local check, before any reduction starts
        reducer.allreduce(values(topo.worker_index))  # a full step still works after it
    finally:
        topo.free()
    assert all_ok(ok)
