"""Sparse optimizers: hand formulas, laziness, Numba == reference bit for bit."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

sys.path.insert(0, str(Path(__file__).parent))  # ops_strategies, under any import mode
from ops_strategies import bits  # noqa: E402

from hpcpax.errors import SparseIndexError
from hpcpax.ops import OPTIMIZERS, make_optimizer

CONFIGS = [
    ("sgd", {"lr": 0.1}),
    ("momentum", {"lr": 0.1, "momentum": 0.9}),
    ("momentum", {"lr": 0.05, "momentum": 0.5, "nesterov": True}),
    ("adagrad", {"lr": 0.1}),
    ("adagrad", {"lr": 0.3, "initial_accumulator": 0.0, "eps": 1e-7}),
    ("adam", {"lr": 0.01}),
    ("adam", {"lr": 0.1, "beta1": 0.5, "beta2": 0.9, "eps": 1e-6}),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CONFIGS)]


def hand_update(name, hp, p, g, slots, t):
    """One scalar step written out from the textbook formulas (float64)."""
    if name == "sgd":
        return p - hp["lr"] * g, slots
    if name == "momentum":
        a = hp.get("momentum", 0.9) * slots["momentum"] + g
        step = hp["lr"] * g + hp["lr"] * hp.get("momentum", 0.9) * a if hp.get("nesterov") else hp["lr"] * a
        return p - step, {"momentum": a}
    if name == "adagrad":
        a = slots["accumulator"] + g * g
        return p - hp["lr"] * g / (math.sqrt(a) + hp.get("eps", 1e-10)), {"accumulator": a}
    b1, b2, eps = hp.get("beta1", 0.9), hp.get("beta2", 0.999), hp.get("eps", 1e-8)
    m = b1 * slots["m"] + (1 - b1) * g
    v = b2 * slots["v"] + (1 - b2) * g * g
    lr_t = hp["lr"] * math.sqrt(1 - b2**t) / (1 - b1**t)
    return p - lr_t * m / (math.sqrt(v) + eps), {"m": m, "v": v}


@pytest.mark.parametrize("numba", ["0", "1"])
@pytest.mark.parametrize("name,hp", CONFIGS, ids=IDS)
def test_against_hand_formulas(monkeypatch, numba, name, hp):
    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    opt = make_optimizer(name, **hp)
    param = np.array([[1.0, -2.0], [3.0, 4.0], [5.0, 6.0]])
    state = opt.init_state(param.shape, param.dtype)
    expected_p = param.copy()
    expected_slots = [
        {k: float(state[k][r, c]) for k in opt.state_names if k != "step"}
        for r in range(3) for c in range(2)
    ]
    grads_per_step = [np.array([[0.5, -0.25]]), np.array([[0.125, 2.0]]), np.array([[-1.0, 0.75]])]
    for t, grads in enumerate(grads_per_step, start=1):
        opt.apply_rows(param, state, np.array([1]), grads)
        for c in range(2):
            slot = expected_slots[1 * 2 + c]
            expected_p[1, c], new = hand_update(name, hp, expected_p[1, c], grads[0, c], slot, t)
            slot.update(new)
    np.testing.assert_allclose(param, expected_p, rtol=1e-12, atol=0)
    for c in range(2):
        for k, v in expected_slots[2 + c].items():
            np.testing.assert_allclose(state[k][1, c], v, rtol=1e-12)
    if name == "adam":
        assert state["step"].tolist() == [3]


@settings(max_examples=30, deadline=None)
@given(
    config=st.sampled_from(CONFIGS),
    dtype=st.sampled_from([np.float32, np.float64]),
    num_rows=st.integers(1, 60),
    dim=st.sampled_from([1, 4, 9]),
    seed=st.integers(0, 2**32 - 1),
)
def test_numba_equals_reference_bitwise_and_lazy(config, dtype, num_rows, dim, seed):
    name, hp = config
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(seed)
    p1 = rng.standard_normal((num_rows, dim)).astype(dtype)
    p2 = p1.copy()
    s1, s2 = opt.init_state(p1.shape, dtype), opt.init_state(p1.shape, dtype)
    for _ in range(3):
        rows = rng.choice(num_rows, rng.integers(0, num_rows + 1), replace=False).astype(np.int64)
        grads = (rng.standard_normal((rows.size, dim)) * 10).astype(dtype)
        before = {k: v.copy() for k, v in s1.items()}
        p_before = p1.copy()
        opt.apply_rows(p1, s1, rows, grads)
        opt.apply_rows_reference(p2, s2, rows, grads)
        untouched = np.setdiff1d(np.arange(num_rows), rows)
        np.testing.assert_array_equal(bits(p1[untouched]), bits(p_before[untouched]))
        for k in opt.state_names:
            if k != "step":
                np.testing.assert_array_equal(bits(s1[k][untouched]), bits(before[k][untouched]))
    np.testing.assert_array_equal(bits(p1), bits(p2))
    for k in opt.state_names:
        np.testing.assert_array_equal(s1[k], s2[k])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("name,hp", CONFIGS, ids=IDS)
def test_dense_equals_rows_on_every_row(name, hp, dtype):
    opt = make_optimizer(name, **hp)
    rng = np.random.default_rng(4)
    p1 = rng.standard_normal((5, 3)).astype(dtype)
    p2 = p1.copy()
    s1, s2 = opt.init_state(p1.shape, dtype), opt.init_state(p1.shape, dtype)
    for _ in range(2):
        g = rng.standard_normal((5, 3)).astype(dtype)
        opt.apply_dense(p1, s1, g)
        opt.apply_rows(p2, s2, np.arange(5), g)
    np.testing.assert_array_equal(bits(p1), bits(p2))


def test_dense_any_shape():
    opt = make_optimizer("adam", lr=0.1)
    p = np.ones((2, 3, 4), np.float32)
    state = opt.init_state(p.shape, p.dtype)
    opt.apply_dense(p, state, np.ones_like(p))
    np.testing.assert_allclose(p, 1 - 0.1 / (1 + 1e-8), rtol=1e-6)
    assert state["step"].dtype == np.int64 and state["step"].tolist() == [1]


def test_adam_step_counts_calls_not_rows():
    opt = make_optimizer("adam", lr=0.1)
    p = np.zeros((4, 2))
    state = opt.init_state(p.shape, p.dtype)
    opt.apply_rows(p, state, np.array([0]), np.ones((1, 2)))
    opt.apply_rows(p, state, np.empty(0, np.int64), np.empty((0, 2)))
    opt.apply_rows(p, state, np.array([1, 2]), np.ones((2, 2)))
    assert state["step"].tolist() == [3]


@pytest.mark.parametrize("name,hp", CONFIGS, ids=IDS)
def test_metadata(name, hp):
    opt = make_optimizer(name, **hp)
    assert opt.name == name and name in OPTIMIZERS
    assert json.loads(json.dumps(opt.hparams))["lr"] == hp["lr"]
    state = opt.init_state((3, 2), np.float32)
    assert tuple(state) == opt.state_names
    if name == "adagrad":
        np.testing.assert_array_equal(state["accumulator"], np.float32(hp.get("initial_accumulator", 0.1)))


@pytest.mark.parametrize(
    "name,hp,error,message",
    [
        ("rmsprop", {"lr": 0.1}, ValueError, "optimizer must be one of"),
        ("sgd", {"lr": 0.0}, ValueError, "lr must be > 0, not 0.0"),
        ("momentum", {"lr": 0.1, "momentum": 1.5}, ValueError, r"momentum must be in \[0, 1\), not 1.5"),
        ("adam", {"lr": 0.1, "beta3": 0.5}, TypeError, "beta3"),
        ("adagrad", {}, TypeError, "lr"),
    ],
)
def test_bad_hparams(name, hp, error, message):
    with pytest.raises(error, match=message):
        make_optimizer(name, **hp)


def test_bad_rows():
    opt = make_optimizer("adagrad", lr=0.1)
    p = np.zeros((4, 2), np.float32)
    state = opt.init_state(p.shape, p.dtype)
    with pytest.raises(SparseIndexError, match="rows must be in .*not 4"):
        opt.apply_rows(p, state, np.array([4]), np.ones((1, 2), np.float32))
    with pytest.raises(TypeError, match="grads must have the dtype of param"):
        opt.apply_rows(p, state, np.array([0]), np.ones((1, 2)))
    with pytest.raises(ValueError, match="grads must have 1 rows, not 2"):
        opt.apply_rows(p, state, np.array([0]), np.ones((2, 2), np.float32))
    with pytest.raises(ValueError, match="state must hold"):
        opt.apply_rows(p, {}, np.array([0]), np.ones((1, 2), np.float32))
    np.testing.assert_array_equal(p, 0)


@pytest.mark.parametrize("numba", ["0", "1"])
@pytest.mark.parametrize("check", [True, False])
def test_apply_rows_many_equals_apply_rows_one_by_one(monkeypatch, numba, check):
    """Every optimizer, both dtypes, tables of several sizes (one large enough for
    the parallel kernels): the same tables and slots bit for bit, over 3 steps."""
    from hpcpax.ops.optimizers import apply_rows_many

    monkeypatch.setenv("HPCPAX_NUMBA", numba)
    rng = np.random.default_rng(5)
    cases = []
    for k, (name, hp) in enumerate(CONFIGS * 2):
        dtype = np.float32 if k % 2 else np.float64
        rows, dim = (20000, 16) if k == 3 else (int(rng.integers(1, 50)), int(rng.integers(1, 9)))
        p = rng.standard_normal((rows, dim)).astype(dtype)
        opts = make_optimizer(name, **hp), make_optimizer(name, **hp)
        states = opts[0].init_state(p.shape, dtype), opts[1].init_state(p.shape, dtype)
        cases.append((opts, [p, p.copy()], states))
    for _ in range(3):
        updates = []
        for opts, params, states in cases:
            n = params[0].shape[0]
            rows = rng.choice(n, rng.integers(0, n + 1), replace=False).astype(np.int64)
            grads = (rng.standard_normal((rows.size, params[0].shape[1])) * 3).astype(params[0].dtype)
            opts[0].apply_rows(params[0], states[0], rows, grads)
            updates.append((opts[1], params[1], states[1], rows, grads))
        apply_rows_many(updates, check=check)
    for _, params, states in cases:
        np.testing.assert_array_equal(bits(params[0]), bits(params[1]))
        for k in states[0]:
            np.testing.assert_array_equal(np.asarray(states[0][k]), np.asarray(states[1][k]))


def test_apply_rows_many_checks_each_update_before_changing_any():
    from hpcpax.ops.optimizers import apply_rows_many

    opt = make_optimizer("sgd", lr=0.1)
    a, b = np.zeros((4, 2), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(SparseIndexError, match="rows must be in .*not 3"):
        apply_rows_many([(opt, a, {}, np.array([1]), np.ones((1, 2), np.float32)),
                         (opt, b, {}, np.array([3]), np.ones((1, 2), np.float32))])
    np.testing.assert_array_equal(a, 0)
