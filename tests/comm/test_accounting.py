"""Accounting: intra/inter split, reset, as_dict, totals (serial; also fine under mpirun)."""

import numpy as np
import pytest

from hpcpax.comm.accounting import FIELDS, Accounting


def test_record_exchange_splits_intra_and_inter():
    acc = Accounting(node_of=[0, 0, 1, 1], rank=0)
    acc.record_exchange("push", "emb", [10, 20, 30, 40], [1, 2, 3, 4], seconds=0.5)
    p = acc.phase("push")
    assert p["sent_bytes"] == 90 and p["recv_bytes"] == 9  # self (rank 0) not counted
    assert p["sent_intra_bytes"] == 20 and p["sent_inter_bytes"] == 70
    assert p["recv_intra_bytes"] == 2 and p["recv_inter_bytes"] == 7
    assert p["seconds"] == 0.5 and p["calls"] == 1
    assert acc.variable("emb") == p


def test_record_exchange_on_sub_communicator_uses_world_ranks():
    acc = Accounting(node_of=[0, 0, 1, 1], rank=2)
    # a two-rank sub-communicator holding world ranks 1 and 2
    acc.record_exchange("pull", None, [5, 7], [11, 13], ranks=[1, 2])
    p = acc.phase("pull")
    assert p["sent_inter_bytes"] == 5 and p["sent_intra_bytes"] == 0
    assert p["recv_inter_bytes"] == 11 and p["recv_bytes"] == 11
    assert acc.variable("anything")["calls"] == 0


def test_record_bytes_and_totals():
    acc = Accounting(node_of=[0, 1], rank=0)
    acc.record_bytes("dense", "w", sent=100, recv=80, sent_inter=60, recv_inter=80, seconds=1.0)
    acc.record_bytes("dense", "b", sent=4, recv=4)
    acc.record_bytes("push", None, sent=10, recv=0, sent_inter=10)
    d = acc.phase("dense")
    assert d["sent_bytes"] == 104 and d["sent_intra_bytes"] == 44 and d["sent_inter_bytes"] == 60
    assert d["recv_intra_bytes"] == 4 and d["recv_inter_bytes"] == 80 and d["calls"] == 2
    total = acc.totals()
    assert total["sent_bytes"] == 114 and total["sent_inter_bytes"] == 70
    assert total["calls"] == 3 and total["seconds"] == 1.0
    assert set(total) == set(FIELDS)


def test_timer_and_record_seconds():
    acc = Accounting()
    with acc.timer("kernel", "dedup"):
        sum(range(1000))
    acc.record_seconds("kernel", None, 2.0)
    assert acc.phase("kernel")["seconds"] >= 2.0
    assert acc.variable("dedup")["seconds"] > 0
    assert acc.phase("kernel")["calls"] == 0  # no bytes moved, no call counted


def test_reset_and_as_dict():
    acc = Accounting(node_of=[0, 0], rank=1)
    acc.record_bytes("dense", "w", sent=8, recv=8)
    d = acc.as_dict()
    assert list(d) == ["phases", "variables", "total"]
    assert d["phases"]["dense"]["sent_bytes"] == 8 and d["variables"]["w"]["recv_bytes"] == 8
    assert d["total"]["sent_bytes"] == 8
    acc.reset()
    assert acc.as_dict() == {"phases": {}, "variables": {}, "total": dict.fromkeys(FIELDS, 0)}
    assert acc.phase("dense") == dict.fromkeys(FIELDS, 0)


def test_reduce_sums_over_ranks():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    acc = Accounting(node_of=np.zeros(comm.Get_size(), np.int64), rank=comm.Get_rank())
    acc.record_bytes("dense", "w", sent=3, recv=5)
    out = acc.reduce(comm)
    assert out["phases"]["dense"]["sent_bytes"] == 3 * comm.Get_size()
    assert out["variables"]["w"]["recv_bytes"] == 5 * comm.Get_size()
    assert out["total"]["calls"] == comm.Get_size()


def test_accounting_default_is_single_node():
    acc = Accounting()
    acc.record_exchange("x", None, [0], [0])
    assert acc.phase("x")["sent_bytes"] == 0
    with pytest.raises(IndexError):
        acc.record_exchange("x", None, [1, 2], [1, 2])  # rank 1 unknown to a 1-rank layout


def test_record_empty_counts_as_a_zero_byte_exchange():
    """A one-worker push's empty exchange: the same phase and per-variable
    counters as record_batched_exchange with zero bytes, across a reset."""
    a, b = Accounting(), Accounting()
    zero = np.zeros((2, 1), np.int64)
    for _ in range(3):
        a.record_batched_exchange("allgather", ["t", "u"], zero, zero, 0.0)
        b.record_empty("allgather", ["t", "u"])
    assert a.as_dict() == b.as_dict()
    assert b.as_dict()["variables"]["u"]["calls"] == 3
    a.reset(), b.reset()
    a.record_batched_exchange("allgather", ["t", "u"], zero, zero, 0.0)
    b.record_empty("allgather", ["t", "u"])
    assert a.as_dict() == b.as_dict()
