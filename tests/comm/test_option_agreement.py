"""Job-shaping HPCPAX_* options are agreed at hpcpax.init (issue 49): a rank with another
value stops every rank, the variable and each rank's value named."""

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.comm.agreement import check_options
from hpcpax.errors import MismatchError
from hpcpax.options import OPTIONS, Options

WORLD = MPI.COMM_WORLD
#: The options every rank must hold alike: the layout, the watchdog's collective set-up,
#: what the planner may replicate, the allreduce buckets, the hot-row trees and pieces,
#: the relays' share.
AGREED = {"timeout", "ranks_per_node", "servers_per_node", "replica_memory", "bucket_bytes",
          "hot_rows", "hot_rows_min_bytes", "hot_rows_chunk_bytes", "hot_rows_relay_share"}


def test_the_options_that_shape_the_job_are_marked():
    assert {o.name for o in OPTIONS if o.agree} == AGREED


def test_agreed_values_turn_a_bad_value_into_text(monkeypatch):
    for option in OPTIONS:
        monkeypatch.delenv(option.variable, raising=False)
    monkeypatch.setenv("HPCPAX_HOT_ROWS", "many")
    monkeypatch.setenv("HPCPAX_BUCKET_BYTES", "4096")
    values = Options().agreed_values()
    assert list(values) == [o.variable for o in OPTIONS if o.agree]
    assert values["HPCPAX_HOT_ROWS"] == "invalid: 'many'"
    assert values["HPCPAX_BUCKET_BYTES"] == 4096 and values["HPCPAX_TIMEOUT"] == 600.0


def _all_raise(call, expected):
    """Whether ``call`` raised MismatchError with ``expected`` on every rank."""
    try:
        call()
        ok = False
    except MismatchError as exc:
        ok = str(exc) == expected
    return WORLD.allreduce(ok, op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
def test_another_servers_per_node_on_some_ranks_stops_init_on_every_rank(monkeypatch):
    rank, size = WORLD.Get_rank(), WORLD.Get_size()
    monkeypatch.delenv("HPCPAX_SERVERS_PER_NODE", raising=False)
    if rank % 2:
        monkeypatch.setenv("HPCPAX_SERVERS_PER_NODE", "2")
    odd = list(range(1, size, 2))
    even = list(range(0, size, 2))
    expected = ("ranks disagree on HPCPAX_* settings: field 'HPCPAX_SERVERS_PER_NODE' differs "
                f"(ranks {even} have 'unset'; ranks {odd} have 2)")
    assert _all_raise(lambda: hpcpax.init(comm=WORLD), expected)
    # init's argument stands in for the variable: the same layout everywhere passes
    topo = hpcpax.init(servers_per_node=0 if rank % 2 else np.int64(0), comm=WORLD)
    assert WORLD.allreduce(topo.server_ranks == [], op=MPI.LAND)
    topo.free()


@pytest.mark.mpi(min_size=2)
def test_a_value_set_in_code_on_one_rank_is_compared_too(monkeypatch):
    rank = WORLD.Get_rank()
    monkeypatch.delenv("HPCPAX_HOT_ROWS_CHUNK_BYTES", raising=False)
    if rank == 0:
        hpcpax.options.hot_rows_chunk_bytes = 1024
    others = list(range(1, WORLD.Get_size()))
    expected = ("ranks disagree on HPCPAX_* settings: field 'HPCPAX_HOT_ROWS_CHUNK_BYTES' "
                f"differs (ranks [0] have 1024; ranks {others} have 262144)")
    try:
        assert _all_raise(lambda: check_options(WORLD), expected)
    finally:
        del hpcpax.options.hot_rows_chunk_bytes
    check_options(WORLD)  # alike again: no error


@pytest.mark.mpi(min_size=2)
def test_options_that_may_differ_are_not_compared(monkeypatch):
    monkeypatch.setenv("HPCPAX_THREADS", str(1 + WORLD.Get_rank()))
    monkeypatch.setenv("HPCPAX_POLL_SECONDS", str(0.001 * (1 + WORLD.Get_rank())))
    check_options(WORLD)
