"""Kernel tests exercise the multi-threaded Numba paths even at tiny sizes.

Outside these tests small inputs run on one thread (``SERIAL_BELOW``); here
every size goes through the parallel regions, which are the harder code.
"""

from hpcpax.ops import _numba

_numba.SERIAL_BELOW = 0
