"""The emulated-cluster tests' fixture: a 3-node cluster, built once per session by the
first test that asks for it and always torn down (helpers: ``cluster_jobs.py``)."""

import pytest

from cluster_jobs import PREFIX, SUBNET, cluster_skip_reason


@pytest.fixture(scope="session")
def cluster():
    """A running 3-node cluster (2 Gbit/s links, checked); torn down at the end."""
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    from hpcpax import cluster as emu

    emu.down(PREFIX, log=lambda text: None)
    try:
        spec = emu.up(3, rate="2gbit", prefix=PREFIX, subnet=SUBNET)
        yield spec
    finally:
        emu.down(PREFIX, log=lambda text: None)
        assert emu.running(PREFIX) is None
