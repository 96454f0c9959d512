"""Shared fixtures: the world communicator, collective assertions, GPU gating."""

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


@pytest.fixture
def all_ok(comm):
    """``all_ok(ok)`` or ``all_ok(group, ok)``: True when ``ok`` holds on every rank.

    **Collective** over ``group`` (default the world): assert with it where
    ranks hold different data, so a failure on one rank fails every rank.
    """
    from mpi4py import MPI

    def check(*args):
        group, ok = (comm, args[0]) if len(args) == 1 else args
        return group.allreduce(bool(ok), op=MPI.LAND)

    return check


@pytest.fixture(scope="session")
def need_gpu():
    """Skip without CuPy and a CUDA device; fail instead when ``HPCPAX_TEST_GPU=1``."""
    from hpcpax.backend import has_gpu

    if not has_gpu():
        if os.environ.get("HPCPAX_TEST_GPU") == "1":
            pytest.fail("HPCPAX_TEST_GPU=1 but CuPy or a CUDA device is missing")
        pytest.skip("needs CuPy and a CUDA device (pip install hpcpax[gpu])")



def _cpu_seconds():
    import resource

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item._cpu_start = _cpu_seconds()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds (this process and its waited-for children) go into
    the JUnit report as the ``cpu_s`` property, beside pytest's wall ``time``."""
    if call.when == "teardown" and hasattr(item, "_cpu_start"):
        item.user_properties.append(("cpu_s", round(_cpu_seconds() - item._cpu_start, 3)))
