"""Shared fixtures: the world communicator, and collective assertions."""

import os

import pytest

# Tests never write into the user's run log; run-log tests set their own file.
os.environ.setdefault("HPCPAX_RUN_LOG", "off")


def pytest_configure(config):
    # Seen at import so markers exist for `pytest --markers` too.
    config.addinivalue_line("markers", "mpi: runs on several MPI ranks (pytest-mpi)")


@pytest.fixture
def comm():
    """``MPI.COMM_WORLD`` (size 1 when run without mpirun)."""
    from mpi4py import MPI

    return MPI.COMM_WORLD


def all_ok(comm, ok: bool) -> bool:
    """True when ``ok`` holds on every rank (collective)."""
    from mpi4py import MPI

    return comm.allreduce(bool(ok), op=MPI.LAND)
