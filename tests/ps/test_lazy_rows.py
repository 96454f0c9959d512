"""Rows created on first touch (one process): values, memory, budget, eviction.

The oracle is a whole table built at once (a :class:`WholeLayout` shard, as
before rows were lazy) running the same gathers and optimizer updates.
"""

import time
from types import SimpleNamespace

import numpy as np
import pytest

from hpcpax import SparseVariableSpec
from hpcpax.errors import CheckpointError, ConfigError
from hpcpax.ops.optimizers import make_optimizer
from hpcpax.ops.partitioning import Partitioning
from hpcpax.options import options
from hpcpax.ps import initializers
from hpcpax.ps.initializers import init_rows, variable_key
from hpcpax.ps.layout import VariableLayout, WholeLayout
from hpcpax.ps.memory import MemoryBudgetError, RankMemory, row_footprint
from hpcpax.ps.table import TableShard

ONE_OWNER = SimpleNamespace(owner_ranks=[0], rank=0)
HUGE = 2**63 - 1


def shard_of(spec, seed=5, memory=None, parts=3):
    layout = VariableLayout(spec, ONE_OWNER, parts)
    return TableShard(spec, make_optimizer(spec.optimizer, **spec.optimizer_params), layout,
                      seed, memory)


def test_initializer_counter_below_2_64_is_unchanged_and_128_bit_above():
    key = variable_key(3, "emb")
    small = np.concatenate([np.arange(500), [10**9, 2**40]])
    rows = small.astype(np.uint64)
    with np.errstate(over="ignore"):  # the 64-bit counter of before
        counter = rows[:, None] * np.uint64(16) + np.arange(16, dtype=np.uint64)
        bits = initializers._splitmix64(initializers._splitmix64(counter ^ key) + key)
    before = (-0.5 + 1.0 * ((bits >> np.uint64(11)).astype(np.float64) * 2.0**-53))
    for use_numba in (False, True):
        options.numba = use_numba
        try:
            now = initializers.uniform_rows(key, small, 16, -0.5, 0.5, "float64")
            far = initializers.uniform_rows(key, [2**62, 2**62 + 2**60, HUGE - 1], 16,
                                            -0.5, 0.5, "float64")
        finally:
            del options.numba
        assert np.array_equal(now, before)
        # with a 64-bit counter rows 2**60 apart (dim 16) shared every value
        assert not np.array_equal(far[0], far[1])
        assert np.all(np.abs(far) <= 0.5) and np.unique(far).size == far.size
    options.numba = False
    try:
        reference = initializers.uniform_rows(key, [2**62, 2**62 + 2**60], 16, -0.5, 0.5,
                                              "float64")
    finally:
        del options.numba
    assert np.array_equal(reference, far[:2])  # NumPy and Numba agree bit for bit


@pytest.mark.parametrize("optimizer,params", [("sgd", {"lr": 0.3}), ("adagrad", {"lr": 0.2}),
                                              ("momentum", {"lr": 0.1, "momentum": 0.9}),
                                              ("adam", {"lr": 0.05})])
def test_lazy_shard_is_bit_identical_to_a_whole_table(optimizer, params):
    spec = SparseVariableSpec("emb", rows=500, dim=3, dtype="float32", optimizer=optimizer,
                              optimizer_params=params)
    lazy = shard_of(spec)
    whole = TableShard(spec, make_optimizer(optimizer, **params), WholeLayout(spec.rows), 5)
    rng = np.random.default_rng(0)
    touched = set()
    for _ in range(12):
        ids = rng.integers(0, spec.rows, 40)  # repeats: several workers asking
        assert np.array_equal(lazy.gather(ids), whole.gather(ids))
        unique = np.unique(ids[: rng.integers(1, 40)])
        grads = rng.standard_normal((unique.size, spec.dim)).astype(spec.dtype)
        lazy.apply(unique, grads)
        whole.apply(unique, grads)
        touched |= set(ids.tolist())
    gids, table, rows, scalars = lazy.export()
    assert sorted(gids.tolist()) == sorted(touched) and lazy.rows_held == len(touched)
    assert np.array_equal(table, whole.table[gids])
    assert all(np.array_equal(rows[k], whole.state[k][gids]) for k in rows)
    assert all(np.array_equal(scalars[k], whole.state[k]) for k in scalars)


@pytest.mark.parametrize("kind", ["mod", "range"])
def test_table_of_2_63_rows_starts_empty_and_serves_ids_near_2_62(kind):
    spec = SparseVariableSpec("hashed", rows=HUGE, dim=8, partitioning=kind,
                              optimizer="adagrad", optimizer_params={"lr": 0.1})
    started = time.perf_counter()
    shard = shard_of(spec, parts=1)
    assert time.perf_counter() - started < 5  # nothing per row (a whole table: never)
    assert shard.rows_held == 0 and shard.nbytes < 64 << 10
    ids = np.array([2**62, 2**62 + 1, 2**62 + 2**60, HUGE - 1, 0, 2**62], np.int64)
    rows = shard.gather(ids)
    expected = init_rows("uniform", 5, "hashed", ids, 8, "float32", spec.init_scale)
    assert np.array_equal(rows, expected) and shard.rows_held == 5
    assert not np.array_equal(rows[0], rows[2])
    shard.apply(np.unique(ids), np.ones((5, 8), np.float32))
    assert np.all(shard.gather(ids) < expected)
    part = Partitioning(kind, HUGE, 3)  # every layout of such a table maps ids in range
    assert np.all((part.partition_of(ids) >= 0) & (part.partition_of(ids) < 3))
    assert np.array_equal(part.global_index(0, part.local_index(ids[part.partition_of(ids)
                                                                    == 0])),
                          ids[part.partition_of(ids) == 0])


def test_budget_error_names_the_variable_and_leaves_the_shard_untouched():
    spec = SparseVariableSpec("users", rows=10**9, dim=16, optimizer="adagrad")
    per_row = row_footprint(spec, make_optimizer("adagrad", lr=0.1))
    memory = RankMemory(lambda: 3000 * per_row)
    shard = shard_of(spec, memory=memory)
    first = np.arange(0, 2000 * 7, 7)
    before = shard.gather(first).copy()
    with pytest.raises(MemoryBudgetError) as raised:
        shard.gather(np.arange(10**8, 10**8 + 1500))
    message = str(raised.value)
    for words in ("'users'", "2,000 rows held + 1,500 new", "room for 3,000 rows",
                  "budget", "eviction='lru'"):
        assert words in message, message
    assert isinstance(raised.value, ConfigError)
    assert shard.rows_held == 2000 and np.array_equal(shard.gather(first), before)


def test_lru_eviction_drops_the_oldest_rows_and_recreates_them_from_the_initializer():
    spec = SparseVariableSpec("items", rows=10**9, dim=4, optimizer="sgd",
                              optimizer_params={"lr": 1.0}, eviction="lru")
    per_row = row_footprint(spec, make_optimizer("sgd", lr=1.0), lru=True)
    memory = RankMemory(lambda: 4096 * per_row)
    shard = shard_of(spec, memory=memory)
    hot = np.arange(100, dtype=np.int64)
    shard.apply(hot, np.ones((100, 4), np.float32))
    trained = shard.gather(hot).copy()
    old = np.arange(10**6, 10**6 + 3000, dtype=np.int64)
    shard.apply(old, np.ones((3000, 4), np.float32))
    for step in range(6):  # 6 x 1000 new rows through a table of 4096: evictions
        shard.gather(hot)
        shard.gather(np.arange(10**7 + 1000 * step, 10**7 + 1000 * (step + 1)))
    stats = shard.stats()
    assert stats["rows_evicted"] >= 6000 + 3100 - 4096 and stats["evictions"] >= 1
    assert stats["rows_held"] <= 4096 and stats["capacity"] <= 4096
    assert stats["rows_created"] == 100 + 3000 + 6000
    assert np.array_equal(shard.gather(hot), trained)  # used every step: kept
    # the old rows were evicted (dropped): touched again they start over
    assert np.array_equal(shard.gather(old[:10]),
                          init_rows("uniform", 5, "items", old[:10], 4, "float32", 0.05))
    with pytest.raises(MemoryBudgetError, match="'items'"):
        shard.gather(np.arange(2 * 10**7, 2 * 10**7 + 5000))  # one request above the budget


def test_restore_keeps_the_checkpoint_rows_and_leaves_the_rest_initial():
    spec = SparseVariableSpec("emb", rows=10**6, dim=2, optimizer="adagrad")
    source = shard_of(spec)
    ids = np.array([5, 77, 999_999], np.int64)
    source.apply(ids, np.ones((3, 2), np.float32))
    saved = source.export()
    target = shard_of(spec)
    target.gather(np.array([1, 2, 3]))  # rows held before the restore are dropped

    def read(keep):
        chosen = keep(saved[0])
        return (saved[0][chosen], saved[1][chosen], {k: v[chosen] for k, v in saved[2].items()},
                saved[3])

    target.restore(read)
    assert target.rows_held == 3 and np.array_equal(target.gather(ids), source.gather(ids))
    assert np.array_equal(target.gather(np.array([1])),
                          init_rows("uniform", 5, "emb", [1], 2, "float32", 0.05))
    bad = (np.array([10**6]), saved[1][:1], {k: v[:1] for k, v in saved[2].items()}, saved[3])
    with pytest.raises(CheckpointError, match="row ids in"):
        target.restore(lambda keep: (keep(bad[0]), bad)[1])
