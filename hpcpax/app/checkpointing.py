"""A run's checkpoints: what every rank writes and reads, on top of :mod:`checkpoint`.

:class:`RunCheckpoints` gathers the state of a run (the sparse variables'
rows from their :class:`~hpcpax.sync.variable.VariableSync` objects, the dense
parameters and their optimizer state from the first worker) into one
:func:`hpcpax.app.checkpoint.save`, and puts it back after checking the
checkpoint was written by the same training setup.
"""

from __future__ import annotations

import time

from ..backend import to_host
from ..comm.agreement import fingerprint
from ..errors import CheckpointError
from . import checkpoint as ckpt
from .config import TRAINING_KEYS

__all__ = ["RunCheckpoints"]


class RunCheckpoints:
    """Save and load the checkpoints of one run.

    Args:
        topology: from :func:`hpcpax.init`.
        run_dir: the run directory.
        config: the resolved config (its training keys are fingerprinted).
        job_id: suffix of temporary checkpoint directories.
    """

    def __init__(self, topology, run_dir, config, job_id):
        self.topology, self.run_dir, self.config, self.job_id = topology, run_dir, config, job_id
        #: Seconds spent writing checkpoints.
        self.seconds = 0.0
        #: The newest checkpoint written (None before the first).
        self.last = None

    def training_fingerprint(self) -> str:
        """Hash of the config keys that define the training math."""
        return fingerprint({k: self.config[k] for k in TRAINING_KEYS})

    def save(self, step, meta, sync, dense, dense_state) -> str:
        """Write a checkpoint after ``step``; **collective** over every rank."""
        topo = self.topology
        payload = None
        if topo.is_worker and topo.worker_index == 0:
            payload = ({k: to_host(v) for k, v in dense.items()},
                       {k: {s: to_host(v) for s, v in slots.items()}
                        for k, slots in dense_state.items()})
        start = time.perf_counter()
        path = ckpt.save(topo.comm, self.run_dir, step, dense=payload,
                         sparse=sync.checkpoint_rows(), meta=meta,
                         keep=self.config["keep_checkpoints"], job_id=self.job_id)
        self.seconds += time.perf_counter() - start
        self.last = path
        return path

    def load(self, path, sync, dense, dense_state, optimizer, xp) -> int:
        """Restore a checkpoint into the run; **collective** over every rank.

        Returns the step it was written after. Raises
        :class:`~hpcpax.errors.CheckpointError` on every rank when any rank
        finds it damaged or written by another training setup.
        """
        topo = self.topology
        ckpt.verify(path, topo.comm)
        meta = ckpt.read_meta(path)
        if meta.get("training_fingerprint") != self.training_fingerprint():
            saved = meta.get("config", {})
            differ = [k for k in TRAINING_KEYS if saved.get(k) != self.config[k]]
            raise CheckpointError(
                f"{path} was written by a different training setup: "
                + ", ".join(f"{k}={saved.get(k)!r} there, {self.config[k]!r} now"
                            for k in differ[:4]))
        error = None
        try:
            sync.restore_rows(lambda name, keep: ckpt.load_matching(path, name, keep))
            if topo.is_worker:
                _load_dense(path, dense, dense_state, optimizer, xp)
        except CheckpointError as exc:
            error = str(exc)
        errors = [e for e in topo.comm.allgather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        return int(meta["step"])


def _load_dense(path, dense, dense_state, optimizer, xp) -> None:
    params, state = ckpt.load_dense(path)
    for name in dense:
        if name not in params or params[name].shape != dense[name].shape:
            raise CheckpointError(f"{path}/dense.h5: parameter {name!r} missing or "
                                  f"of another shape")
        dense[name][...] = xp.asarray(params[name])
        for slot, value in dense_state[name].items():
            # the optimizer's scalar slots (Adam's step) stay host arrays
            saved = state[name][slot]
            value[...] = saved if slot in optimizer.scalar_slots else xp.asarray(saved)
