"""Shared set-up of the benchmark smoke tests."""

import os

import pytest


def cluster_benchmark_env() -> dict:
    """The environment for a benchmark that brings up its own emulated cluster and
    ``mpirun``: skips the test inside ``mpirun`` (it runs in the serial suite only) and
    where no cluster can be built (root and ``ip netns``); MPI's variables removed."""
    if os.environ.get("PMI_RANK") or os.environ.get("PMI_SIZE"):
        pytest.skip("starts its own mpirun; runs in the serial suite only")
    from hpcpax.cluster import preflight

    reason = preflight()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    return {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
