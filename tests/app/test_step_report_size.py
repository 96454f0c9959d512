"""The cost model prices the trainer's per-step figures ``Allreduce`` at its real size."""

import numpy as np

from hpcpax.app.step_report import BYTE_PHASES, TIME_PHASES, _BYTE_FIELDS
from hpcpax.comm.accounting import OWNER_FIELDS
from hpcpax.plan.step_model import REDUCE_STEP_BYTES


def test_the_reduced_vector_has_the_priced_size():
    floats = 3 + len(TIME_PHASES) + len(BYTE_PHASES) * len(_BYTE_FIELDS) + len(OWNER_FIELDS)
    assert REDUCE_STEP_BYTES == floats * np.dtype(np.float64).itemsize
