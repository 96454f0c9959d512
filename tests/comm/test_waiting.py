"""The one wait policy (``hpcpax.comm.polling``): no core held while waiting, by default.

- :class:`Backoff` with a fraction polls for ``SPIN_SECONDS`` (at most 20
  polls), then sleeps at most that fraction of the wait so far, up to its cap.
- :func:`wait` completes requests polling under ``HPCPAX_WAIT=sleep`` (the
  default) and inside MPI under ``spin``; the results are the same.
- A BSP parameter server that waits 2 s for the workers' next operation, at
  default settings, uses a small fraction of a core (inside MPI it would
  spin: ~100 %).
"""

import time

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.comm import polling
from hpcpax.comm.polling import Backoff, wait
from hpcpax.options import options
from hpcpax.ps.sparse_grad import SparseGrad


def test_a_proportional_backoff_spins_briefly_then_sleeps_a_share_of_the_wait(monkeypatch):
    clock = {"now": 50.0}
    slept = []
    monkeypatch.setattr(polling.time, "perf_counter", lambda: clock["now"])

    def sleep(seconds):
        slept.append((seconds, clock["now"] - 50.0))
        clock["now"] += seconds

    monkeypatch.setattr(polling.time, "sleep", sleep)
    backoff = Backoff(cap=0.002, fraction=0.1)
    polls = 0
    while not slept:  # the clock does not move while spinning: a bounded number of polls
        backoff.pause()
        polls += 1
    assert polls == polling._MAX_SPINS + 1
    for _ in range(400):
        clock["now"] += 1e-6  # each poll itself takes a microsecond
        backoff.pause()
    sleeps = [s for s, _ in slept]
    assert max(sleeps) == pytest.approx(0.002)  # reached the cap
    assert all(s <= max(polling._FIRST_SLEEP, 0.1 * waited) + 1e-12 for s, waited in slept)
    # waiting ~0.4 s costs a few hundred polls, not one per microsecond
    assert clock["now"] - 50.0 > 0.3 and len(slept) < 450


def test_a_proportional_backoff_does_not_sleep_within_its_spin_time():
    backoff = Backoff(cap=0.001, fraction=0.1)
    start = time.perf_counter()
    for _ in range(5):
        backoff.pause()
    assert time.perf_counter() - start < polling.SPIN_SECONDS + 0.01
    assert backoff._since is not None


def test_waits_inside_an_operation_spin_long_only_while_they_end_that_fast(monkeypatch):
    monkeypatch.setattr(polling, "_WITHIN_HISTORY", {})
    long, short = polling.WITHIN_SPIN_SECONDS, polling.SPIN_SECONDS
    slow = 10 * long
    assert polling.within_spin_seconds("rows") == long  # nothing known yet
    for _ in range(polling.HISTORY // 2 - 1):
        polling._remember_within("rows", slow)
    assert polling.within_spin_seconds("rows") == long  # too few to judge
    polling._remember_within("rows", slow)
    assert polling.within_spin_seconds("rows") == short  # they outlast the spin
    assert polling.within_spin_seconds("counts") == long  # each kind on its own
    # the waits become short again: once they are the median of the last HISTORY
    for i in range(polling.HISTORY // 2):
        assert polling.within_spin_seconds("rows") == short
        polling._remember_within("rows", long / 10)
    assert polling.within_spin_seconds("rows") == short  # 8 long, 8 short: median long
    polling._remember_within("rows", long / 10)
    assert polling.within_spin_seconds("rows") == long


def test_a_wait_inside_an_operation_records_its_duration(monkeypatch):
    monkeypatch.setattr(polling, "_WITHIN_HISTORY", {})
    comm = MPI.COMM_SELF
    send, recv = np.arange(3.0), np.zeros(3)
    request = comm.Irecv(recv, source=0, tag=7)
    comm.Send(send, dest=0, tag=7)
    wait([request], within="test")
    np.testing.assert_array_equal(recv, send)
    assert len(polling._WITHIN_HISTORY["test"]) == 1
    assert 0.0 <= polling._WITHIN_HISTORY["test"][0] < 1.0
    wait([comm.Ibarrier()])  # a wait outside an operation keeps no history
    assert list(polling._WITHIN_HISTORY) == ["test"]


def test_the_policy_is_an_option_with_a_checked_value(monkeypatch):
    from hpcpax.errors import ConfigError

    assert options.wait == "sleep" and not polling.spinning()
    monkeypatch.setenv("HPCPAX_WAIT", "spin")
    assert polling.spinning()
    monkeypatch.setenv("HPCPAX_WAIT", "busy")
    with pytest.raises(ConfigError, match="HPCPAX_WAIT must be sleep or spin, not 'busy'"):
        polling.spinning()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["sleep", "spin"])
def test_wait_completes_requests_under_either_policy(comm, mode):
    options.wait = mode
    try:
        mine = np.full(3, comm.Get_rank(), np.int64)
        everyone = np.empty(3 * comm.Get_size(), np.int64)
        if comm.Get_rank() == 0:
            time.sleep(0.05)  # the others wait for rank 0
        wait([comm.Iallgather(mine, everyone), None])
    finally:
        del options.wait
    expected = np.repeat(np.arange(comm.Get_size()), 3)
    assert comm.allreduce(bool(np.array_equal(everyone, expected)), op=MPI.LAND)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_an_idle_bsp_server_does_not_spin_at_default_settings(comm, all_ok):
    """The workers compute for 2 s between two operations; each server rank, waiting
    for the next header at default settings, uses under a tenth of a core (the goal
    of ``cpu_busy_server_idle``)."""
    assert options.wait == "sleep" and options.server_poll_seconds is None
    topo = hpcpax.init(servers_per_node=1)
    spec = SparseVariableSpec("emb", rows=50, dim=4, optimizer="sgd",
                              optimizer_params={"lr": 0.1})
    busy = None
    for idle_seconds in (0.0, 2.0):  # the first job loads the kernels
        ps = ParameterServer(topo)
        ps.register([spec])
        if topo.is_server:
            start_wall, start_cpu = time.perf_counter(), time.process_time()
            ps.serve()
            busy = (time.process_time() - start_cpu) / (time.perf_counter() - start_wall)
        else:
            ids = np.arange(5, dtype=np.int64)
            ps.pull("emb", ids)
            time.sleep(idle_seconds)  # "forward and backward"
            ps.push("emb", SparseGrad(ids, np.ones((5, 4), np.float32), 50))
            ps.shutdown()
    topo.free()
    assert all_ok(busy is None or busy < 0.1), busy
