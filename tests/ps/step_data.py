"""Per-worker, per-step Zipf ids and gradients of the PS tests (deterministic)."""

import numpy as np

from hpcpax.ps.sparse_grad import SparseGrad


def zipf_ids(spec, worker, step, a, count):
    """``count`` Zipf(``a``) ids of ``spec``'s table for ``worker`` at ``step``."""
    rng = np.random.default_rng([worker, step, spec.rows])
    return np.minimum(rng.zipf(a, count) - 1, spec.rows - 1).astype(np.int64)


def zipf_grad(spec, worker, step, a, count):
    """A SparseGrad on :func:`zipf_ids` with standard-normal rows."""
    ids = zipf_ids(spec, worker, step, a, count)
    rng = np.random.default_rng([worker, step, spec.dim])
    return SparseGrad(ids, rng.standard_normal((len(ids), spec.dim)).astype(spec.dtype),
                      spec.rows)
