"""IdMap: the Numba hash table and the NumPy sorted arrays against a dict."""

import numpy as np
import pytest

from hpcpax.ops import _numba
from hpcpax.ops.idmap import IdMap

IMPLEMENTATIONS = [False] + ([True] if _numba.kernels() is not None else [])


@pytest.mark.parametrize("use_numba", IMPLEMENTATIONS)
@pytest.mark.parametrize("space", [5_000, 2**63 - 1])
def test_idmap_matches_a_dict(use_numba, space):
    rng = np.random.default_rng(space % 1000)
    idmap, reference = IdMap(numba=use_numba), {}
    next_slot = 0
    for step in range(25):
        ids = rng.integers(0, space, 2_000)  # repeats included
        slots, missing = idmap.lookup(ids)
        expected = np.array([reference.get(int(i), -1) for i in ids])
        assert np.array_equal(slots, expected)
        assert missing == int((expected < 0).sum())
        new = np.unique(ids[slots < 0])
        idmap.insert(new, np.arange(next_slot, next_slot + new.size))
        reference.update(zip(new.tolist(), range(next_slot, next_slot + new.size)))
        next_slot += new.size
        if step % 4 == 3:  # evict a strided sample, plus ids never held (ignored)
            gone = np.array(sorted(reference))[::5]
            never = [i for i in rng.integers(0, space, 8).tolist() if i not in reference]
            idmap.remove(np.concatenate([gone, never]).astype(np.int64))
            for key in gone.tolist():
                reference.pop(key)
        assert len(idmap) == len(reference)
    ids, slots = idmap.items()
    assert dict(zip(ids.tolist(), slots.tolist())) == reference
    assert np.all(np.diff(ids) > 0)


@pytest.mark.skipif(_numba.kernels() is None, reason="needs numba")
def test_hash_table_grows_and_removal_keeps_probe_chains():
    idmap = IdMap(numba=True)
    # ids that collide in the low bits: strided like one partition of a "mod" layout
    ids = np.arange(0, 64 * 50_000, 64, dtype=np.int64)
    idmap.insert(ids, np.arange(ids.size))
    assert len(idmap) == ids.size and idmap.nbytes >= 16 * ids.size / 0.7
    idmap.remove(ids[::2])
    slots, missing = idmap.lookup(ids)
    assert missing == ids[::2].size
    assert np.array_equal(slots[1::2], np.arange(1, ids.size, 2))
    assert np.all(slots[::2] == -1)


@pytest.mark.parametrize("use_numba", IMPLEMENTATIONS)
def test_bad_input_is_refused(use_numba):
    idmap = IdMap(numba=use_numba)
    with pytest.raises(TypeError, match="ids must be a 1-D integer array"):
        idmap.lookup(np.zeros(3))
    with pytest.raises(ValueError, match="slots must have 2 entries"):
        idmap.insert(np.array([1, 2]), np.array([0]))
    with pytest.raises(ValueError, match="ids must be >= 0"):
        idmap.insert(np.array([-1]), np.array([0]))


@pytest.mark.parametrize("use_numba", IMPLEMENTATIONS)
def test_lookup_or_insert_creates_each_new_id_once(use_numba):
    idmap = IdMap(numba=use_numba)
    idmap.insert(np.array([10, 20]), np.array([0, 1]))
    ids = np.array([30, 10, 2**62, 30, 20, 5], np.int64)  # repeats of a new id
    slots, new = idmap.lookup_or_insert(ids, first_slot=2)
    assert sorted(new.tolist()) == [5, 30, 2**62] and len(idmap) == 5
    held = dict(zip(*(a.tolist() for a in idmap.items())))
    assert held[10] == 0 and held[20] == 1 and sorted(held[i] for i in new.tolist()) == [2, 3, 4]
    assert [held[i] for i in ids.tolist()] == slots.tolist()
    again, none = idmap.lookup_or_insert(ids, first_slot=99)
    assert np.array_equal(again, slots) and none.size == 0
    assert [held[i] for i in new.tolist()] == list(range(2, 5))  # slots in the order of new
