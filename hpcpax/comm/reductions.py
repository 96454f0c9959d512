"""Reductions over a group of ranks, by name: the layers above ``comm`` never name MPI.

The application, planning and adapter layers agree on small facts (a
preemption flag, a sample count, the slowest rank's time, a vector of
timings) through these functions instead of ``comm.allreduce(x, op=MPI.SUM)``,
so that only :mod:`hpcpax.comm` and the entry points import mpi4py, and a
transport other than MPI has one place to provide them.

Every function is **collective** over ``comm`` (an mpi4py communicator, or
anything with the same methods) and returns the same value on every rank.
Python values use mpi4py's object reductions; arrays are reduced in place,
in one message, and waited for under the one wait policy
(:mod:`hpcpax.comm.polling`) where a request is made.
"""

from __future__ import annotations

import numpy as np

__all__ = ["total", "largest", "smallest", "any_rank", "every_rank",
           "sum_in_place", "max_in_place", "start_sum_in_place", "start_max",
           "start_max_in_place", "start_allgather", "on_one_host"]


def _mpi():
    from mpi4py import MPI

    return MPI


def total(comm, value):
    """The sum of ``value`` over the ranks (numbers, or anything ``+`` adds)."""
    return comm.allreduce(value, op=_mpi().SUM)


def largest(comm, value):
    """The largest ``value`` of any rank."""
    return comm.allreduce(value, op=_mpi().MAX)


def smallest(comm, value):
    """The smallest ``value`` of any rank."""
    return comm.allreduce(value, op=_mpi().MIN)


def any_rank(comm, flag) -> bool:
    """True where ``flag`` is true on at least one rank."""
    return bool(comm.allreduce(bool(flag), op=_mpi().LOR))


def every_rank(comm, flag) -> bool:
    """True where ``flag`` is true on every rank."""
    return bool(comm.allreduce(bool(flag), op=_mpi().LAND))


def sum_in_place(comm, array: np.ndarray) -> np.ndarray:
    """``array`` replaced by its elementwise sum over the ranks (contiguous); returns it."""
    comm.Allreduce(_mpi().IN_PLACE, array, op=_mpi().SUM)
    return array


def max_in_place(comm, array: np.ndarray) -> np.ndarray:
    """``array`` replaced by its elementwise maximum over the ranks; returns it."""
    comm.Allreduce(_mpi().IN_PLACE, array, op=_mpi().MAX)
    return array


def start_sum_in_place(comm, array: np.ndarray):
    """Start :func:`sum_in_place` without waiting: a request for :func:`hpcpax.comm.polling.wait`."""
    return comm.Iallreduce(_mpi().IN_PLACE, array, op=_mpi().SUM)


def start_max_in_place(comm, array: np.ndarray):
    """Start :func:`max_in_place` without waiting: a request."""
    return comm.Iallreduce(_mpi().IN_PLACE, array, op=_mpi().MAX)


def start_max(comm, mine: np.ndarray, out: np.ndarray):
    """Start ``out`` = the elementwise maximum of every rank's ``mine``: a request."""
    return comm.Iallreduce(mine, out, op=_mpi().MAX)


def start_allgather(comm, mine: np.ndarray, everyone: np.ndarray):
    """Start gathering every rank's ``mine`` (same size everywhere) into ``everyone``,
    in rank order: a request."""
    return comm.Iallgather(mine, everyone)


def on_one_host(comm) -> bool:
    """Whether every rank of ``comm`` shares one host's memory (a shared-memory split)."""
    shared = comm.Split_type(_mpi().COMM_TYPE_SHARED)
    try:
        return smallest(comm, shared.Get_size()) == comm.Get_size()
    finally:
        shared.Free()
