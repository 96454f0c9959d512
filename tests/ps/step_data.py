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


def pull_push_bytes(topo, ps, spec, ids):
    """Sent bytes per phase (``pull``, ``push``, ``relay``) and owner ``egress`` /
    ``ingress`` of this rank for one pull and one push (gradient rows of ones) of
    ``ids`` in ``spec``'s table; collective over the parameter server's ranks."""
    topo.accounting.reset()
    ps.pull_unique(spec.name, ids)
    ps.push(spec.name, SparseGrad(ids, np.ones((len(ids), spec.dim)), spec.rows))
    got = {p: topo.accounting.phase(p)["sent_bytes"] for p in ("pull", "push", "relay")}
    got.update((d, topo.accounting.owner[d]) for d in ("egress", "ingress"))
    return got
