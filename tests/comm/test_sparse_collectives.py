"""The batched sparse allgather (``hpcpax.comm.sparse_collectives``): equal blocks
padded, unequal ones sent as they are, the same sums either way, every byte counted."""

import numpy as np
import pytest

import hpcpax
from hpcpax.comm import sparse_collectives
from hpcpax.comm.sparse_collectives import PAD_LIMIT, allgather_sparse_many, padded_block_bytes
from hpcpax.ops.dedup import dedup_sum_reference

WIDTHS = {"a": 3, "b": 5}


def test_padded_block_is_the_largest_within_the_limit():
    assert padded_block_bytes([100, 100, 100]) == 100
    assert padded_block_bytes([100, 97, 103, 99]) == 103
    # 4 blocks of the largest against the total: (1 + PAD_LIMIT) is the edge
    assert PAD_LIMIT == 0.25
    assert padded_block_bytes([150, 110, 110, 110]) == 150  # 600 <= 1.25 x 480
    assert padded_block_bytes([151, 110, 110, 110]) is None  # 604 > 1.25 x 481
    assert padded_block_bytes([1000, 10, 10, 10]) is None
    assert padded_block_bytes([0, 0]) is None and padded_block_bytes([50]) is None


def _grads(worker, rows):
    """Deduplicated ``(ids, values)`` per table: ``rows[t]`` rows of table t, float64."""
    rng = np.random.default_rng([11, worker])
    out = {}
    for name, width in WIDTHS.items():
        ids = np.sort(rng.choice(40, rows[name], replace=False)).astype(np.int64)
        out[name] = (ids, rng.standard_normal((ids.size, width)))
    return out


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("uneven", [False, True])
def test_allgather_sums_and_bytes_padded_or_not(comm, all_ok, uneven, monkeypatch):
    """Nearly equal blocks go through one padded ``Iallgather``, very unequal ones
    through ``Iallgatherv``: the sums equal NumPy's over every worker's rows, each
    table's bytes are its own rows, and the phase adds exactly the padding."""
    calls = []
    real = padded_block_bytes
    monkeypatch.setattr(sparse_collectives, "padded_block_bytes",
                        lambda per: calls.append(real(per)) or calls[-1])
    topo = hpcpax.init(servers_per_node=0)
    try:
        size, me = topo.num_workers, topo.worker_index
        rows = [{"a": (30 if uneven and w == 0 else 4 + w % 2), "b": 2} for w in range(size)]
        grads = [_grads(w, rows[w]) for w in range(size)]
        acct = topo.accounting
        acct.reset()
        got = allgather_sparse_many(topo, list(WIDTHS), [grads[me][n][0] for n in WIDTHS],
                                    [grads[me][n][1] for n in WIDTHS])
        record = acct.as_dict()
        ok = True
        for k, name in enumerate(WIDTHS):
            want = dedup_sum_reference(np.concatenate([g[name][0] for g in grads]),
                                       np.concatenate([g[name][1] for g in grads]))
            ok &= np.array_equal(got[k][0], want[0]) and np.allclose(got[k][1], want[1],
                                                                     rtol=0, atol=1e-12)
        row = {n: 8 + 8 * w for n, w in WIDTHS.items()}  # int64 id beside float64 values
        per_worker = np.array([sum(rows[w][n] * row[n] for n in WIDTHS) for w in range(size)])
        block = real(per_worker)
        ok &= calls == [block] and (block is None) == uneven
        for name in WIDTHS:
            v = record["variables"][name]
            ok &= v["sent_bytes"] == rows[me][name] * row[name] * (size - 1)
            ok &= v["recv_bytes"] == sum(rows[w][name] for w in range(size) if w != me) \
                * row[name]
        phase = record["phases"]["allgather"]
        sent = (size - 1) * (per_worker[me] if block is None else block)
        recv = sum(per_worker[w] if block is None else block for w in range(size) if w != me)
        ok &= phase["sent_bytes"] == sent and phase["recv_bytes"] == recv
        assert all_ok(ok), (calls, record["phases"]["allgather"], sent, recv)
    finally:
        topo.free()
