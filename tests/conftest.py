"""Shared fixtures: the world communicator, collective assertions, GPU gating."""

import os
import tempfile


import pytest

# Tests never write into the user's run log; run-log tests set their own file.
os.environ.setdefault("HPCPAX_RUN_LOG", "off")
# ``--plan auto`` jobs of one layout measure the cost model's constants once per
# suite and reuse them (tests/run_suites.py gives each suite run a fresh directory;
# the calibration's own tests and the emulated cluster's jobs measure every time).
os.environ.setdefault("HPCPAX_CALIBRATION_CACHE", os.path.join(
    tempfile.gettempdir(), f"hpcpax-test-calibration-{os.getuid()}"))


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


@pytest.fixture(autouse=True)
def _links_measured_afresh(request, monkeypatch):
    """Emulated-cluster tests shape their links differently from test to test: their
    jobs measure their own calibration instead of taking a kept one."""
    if request.node.get_closest_marker("cluster") is not None \
            or "cluster" in request.fixturenames:
        monkeypatch.delenv("HPCPAX_CALIBRATION_CACHE", raising=False)


#: The quick tier (``python tests/run_suites.py --quick``) takes the tests that took
#: under this many seconds in the suite run ``tests/durations.json`` records (per
#: suite: serial, ``-n 2``, ``-n 3``, ``-n 4``), tests that file does not know yet
#: (new ones, until the file is rewritten by ``tests/suite_times.py``), and
#: :data:`QUICK_END_TO_END`.
QUICK_SECONDS = 0.5
#: One end-to-end run per entry point, in the quick tier whatever it costs.
QUICK_END_TO_END = (
    "tests/app/test_runs.py::test_cli_subprocess_writes_metrics",           # python -m hpcpax.train
    "tests/app/test_trainer.py::test_one_rank_equals_n_ranks",              # the Trainer, N ranks
    "tests/torch_adapter/test_torch_adapter.py::test_training_equals_one_process[sgd-ps-0]",
    "tests/app/test_model_sync.py::test_loop_equals_one_process[0-auto]",   # ModelSync, plan auto
    "tests/slurm/test_sbatch_job.py::test_single_node_job_completes_and_writes_metrics",
    "tests/benchmarks/test_data_read_quick.py::test_data_read_quick_prints_one_json_line",
)


def _recorded_durations():
    import json

    path = os.path.join(os.path.dirname(__file__), "durations.json")
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except (OSError, ValueError):
        return {}


def _suite_name():
    """``serial``, ``n2``, ``n3`` or ``n4``: the suite this process runs in."""
    size = int(os.environ.get("PMI_SIZE", os.environ.get("OMPI_COMM_WORLD_SIZE", "1")))
    return "serial" if size == 1 else f"n{size}"


def pytest_collection_modifyitems(config, items):
    """Mark the quick tier (see :data:`QUICK_SECONDS`)."""
    durations = _recorded_durations().get(_suite_name(), {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for item in items:
        path = os.path.relpath(str(item.path), root)
        key = f"{path}::{item.name}"
        seconds = durations.get(key)
        if key in QUICK_END_TO_END or seconds is None or seconds < QUICK_SECONDS:
            item.add_marker(pytest.mark.quick)
