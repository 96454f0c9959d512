"""Reductions by name (``hpcpax.comm.reductions``) against the values every rank holds."""

import numpy as np
import pytest

from hpcpax.comm import polling, reductions


@pytest.mark.mpi
def test_object_reductions_give_every_rank_the_same_answer(comm, all_ok):
    rank, size = comm.Get_rank(), comm.Get_size()
    values = [3.5 * r - 2 for r in range(size)]
    got = (reductions.total(comm, values[rank]), reductions.largest(comm, values[rank]),
           reductions.smallest(comm, values[rank]), reductions.any_rank(comm, rank == size - 1),
           reductions.any_rank(comm, False), reductions.every_rank(comm, rank >= 0),
           reductions.every_rank(comm, rank == 0))
    want = (sum(values), max(values), min(values), True, False, True, size == 1)
    assert all_ok(got == want), (got, want)


@pytest.mark.mpi
def test_array_reductions_in_place_equal_numpy(comm, all_ok):
    rank, size = comm.Get_rank(), comm.Get_size()
    every = [np.random.default_rng([7, r]).integers(-50, 50, 13).astype(np.float64)
             for r in range(size)]
    summed = reductions.sum_in_place(comm, every[rank].copy())
    biggest = reductions.max_in_place(comm, every[rank].copy())
    started = every[rank].copy()
    polling.wait([reductions.start_sum_in_place(comm, started)])
    assert all_ok(np.array_equal(summed, np.sum(every, axis=0))
                  and np.array_equal(biggest, np.max(every, axis=0))
                  and np.array_equal(started, summed))


@pytest.mark.mpi
def test_a_job_on_this_machine_is_on_one_host(comm, all_ok):
    assert all_ok(reductions.on_one_host(comm))


@pytest.mark.mpi
def test_started_max_and_allgather_equal_numpy(comm, all_ok):
    rank, size = comm.Get_rank(), comm.Get_size()
    every = [np.random.default_rng([9, r]).integers(0, 1000, 6).astype(np.int64)
             for r in range(size)]
    out, gathered = np.zeros(6, np.int64), np.zeros((size, 6), np.int64)
    in_place = every[rank].copy()
    polling.wait([reductions.start_max(comm, every[rank], out),
                  reductions.start_allgather(comm, every[rank], gathered),
                  reductions.start_max_in_place(comm, in_place)])
    assert all_ok(np.array_equal(out, np.max(every, axis=0))
                  and np.array_equal(gathered, np.array(every))
                  and np.array_equal(in_place, out))
