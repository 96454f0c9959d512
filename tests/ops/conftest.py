"""Kernel tests exercise the multi-threaded Numba paths even at tiny sizes.

Outside these tests small inputs run on one thread
(``hpcpax.options.numba_serial_below``); here every size goes through the
parallel regions, which are the harder code.
"""

import pytest

import hpcpax


@pytest.fixture(autouse=True)
def parallel_numba_at_every_size():
    hpcpax.options.numba_serial_below = 0
    yield
    del hpcpax.options.numba_serial_below
