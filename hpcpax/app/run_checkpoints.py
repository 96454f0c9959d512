"""A run's checkpoints: what every rank writes and reads, on top of :mod:`checkpoint`.

:class:`RunCheckpoints` gathers the state of a run (the sparse variables'
rows from their :class:`~hpcpax.sync.variable.VariableSync` objects, the dense
parameters and their optimizer state from the first worker) into one
:func:`hpcpax.app.checkpoint_files.save`, and puts it back after checking the
checkpoint was written by the same training setup.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import time

import numpy as np

from ..backend import to_host
from ..comm.agreement import fingerprint
from ..errors import CheckpointError, MismatchError
from ..options import format_bytes
from . import checkpoint_files as ckpt
from .config import TRAINING_KEYS

__all__ = ["RunCheckpoints", "data_fingerprint", "check_writable"]


def data_fingerprint(path) -> str:
    """Content hash of a data file: size, first and last MiB (not its path). Local.

    Cheap for any file size; a moved or copied file has the same fingerprint,
    an edited one (almost surely) not.
    """
    try:
        size = os.path.getsize(path)
        digest = hashlib.sha256(str(size).encode())
        with open(path, "rb") as handle:
            digest.update(handle.read(1 << 20))
            handle.seek(max(0, size - (1 << 20)))
            digest.update(handle.read(1 << 20))
    except OSError as exc:
        raise CheckpointError(f"cannot read data file {path}: {exc.strerror or exc}") from None
    return "sha256:" + digest.hexdigest()[:32]


def check_writable(run_dir) -> None:
    """Write and remove a probe file in ``run_dir/checkpoints`` and in ``run_dir``. Local.

    Raises:
        CheckpointError: either cannot be written (one line naming it).
    """
    root = os.path.join(run_dir, "checkpoints")
    for where in (root, run_dir):
        try:
            os.makedirs(where, exist_ok=True)
            probe = os.path.join(where, f".write-test-{os.getpid()}")
            with open(probe, "wb") as handle:
                handle.write(b"x")
            os.unlink(probe)
        except OSError as exc:
            raise _unwritable(where, exc) from None


def _unwritable(where, exc) -> CheckpointError:
    what = "checkpoints" if os.path.basename(where) == "checkpoints" else "the run's files"
    return CheckpointError(f"cannot write {what} into {where}: {exc.strerror or exc} (a "
                           "read-only or full file system?); choose another --run-dir")


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
        #: The checkpoint :meth:`resume` loaded (None: none).
        self.resumed_from = None
        self._data_fingerprint = None

    def training_fingerprint(self) -> str:
        """Hash of the config keys that define the training math.

        The data file counts by its content (:func:`data_fingerprint`), not
        its path: a run resumes with its data moved elsewhere.
        """
        keys = {k: self.config[k] for k in TRAINING_KEYS}
        keys["data"] = self.data_fingerprint
        return fingerprint(keys)

    @property
    def data_fingerprint(self) -> str | None:
        """:func:`data_fingerprint` of the run's data file (None: synthetic data)."""
        if self.config["data"] is None:
            return None
        if self._data_fingerprint is None:
            self._data_fingerprint = data_fingerprint(self.config["data"])
        return self._data_fingerprint

    def handlers(self, sync, dense, dense_state, optimizer, xp) -> dict:
        """The run's checkpoint commands, for a :class:`~hpcpax.engine.commands.CommandChannel`.

        ``save(step, meta)`` writes one; ``load(path)`` returns ``(step, None)``
        or ``(None, why)`` for a damaged checkpoint (agreed on every rank);
        ``check_disk()`` is :meth:`prepare`; ``refuse(message)`` raises
        :class:`~hpcpax.errors.CheckpointError` on every rank.
        """
        def load(path):
            try:
                return self.load(path, sync, dense, dense_state, optimizer, xp), None
            except CheckpointError as exc:  # raised on every rank together
                return None, str(exc)

        def refuse(message):
            error = CheckpointError(message)
            error.on_every_rank = True  # every rank runs this command: said once
            raise error

        return {"save": lambda step, meta: self.save(step, meta, sync, dense, dense_state),
                "load": load, "check_disk": lambda: self.prepare(sync, dense, dense_state),
                "refuse": refuse}

    def resume(self, commands, log) -> int:
        """Load the newest intact checkpoint, if any; the step to start at.

        **Collective** over the workers (each load is a ``load`` command of
        ``commands``, run by every rank; a ``refuse`` command makes every rank
        raise :class:`~hpcpax.errors.CheckpointError` when none is intact). A damaged checkpoint is skipped with
        a warning naming it, for the next older one; the run never falls
        back to step 1 while a checkpoint is left.
        """
        topo = self.topology
        found = [path for _, path in reversed(ckpt.list_checkpoints(self.run_dir))] \
            if topo.is_worker and topo.worker_index == 0 else None
        found = topo.workers.bcast(found, root=0)
        if not found:
            log(f"resume: no checkpoint in {self.run_dir}; starting at step 1")
            return 1
        for path in found:
            step, damage = commands.run("load", path=path)
            if damage is None:
                self.resumed_from = path
                log(f"resumed from {path}: continuing at step {step + 1}", important=True)
                return step + 1
            log(f"resume: WARNING: skipping damaged checkpoint {path}: {damage}", important=True)
        # raised by every rank (a ``refuse`` command), so the servers stop too
        commands.run("refuse", message=f"resume: every checkpoint in {self.run_dir} is damaged "
                     f"(the oldest, {os.path.basename(path)}: {damage}); --overwrite starts the "
                     "run over (the old one is kept)")

    def prepare(self, sync, dense, dense_state) -> list:
        """Before training: stale temporaries removed, room for a checkpoint checked.

        **Collective** over every rank. Rank 0 removes the ``.tmp-``/``.old-``
        directories a crashed save left, checks it can write into
        ``checkpoints/``, and compares the free space with the size of one
        checkpoint (every rank's rows, summed) plus 10 %; the previous
        checkpoint stays until a new one is complete, so that is what a save
        needs. Raises :class:`~hpcpax.errors.CheckpointError` on every rank
        otherwise. Returns the lines to print.
        """
        from ..comm.reductions import total

        topo = self.topology
        mine = sum(table.nbytes + sum(np.asarray(v).nbytes for v in rows.values())
                   for _, _, table, rows, _ in sync.checkpoint_rows())
        if topo.is_worker and topo.worker_index == 0:
            mine += sum(to_host(v).nbytes for v in dense.values())
            mine += sum(np.asarray(to_host(v)).nbytes for slots in dense_state.values()
                        for v in slots.values())
        need = total(topo.comm, int(mine))
        lines, error = [], None
        if topo.rank == 0:
            try:
                lines = self._check_room(int(need * 1.1) + (1 << 20))
            except CheckpointError as exc:
                error = str(exc)
        lines, error = topo.comm.bcast((lines, error), root=0)
        if error:
            raise CheckpointError(error)
        return lines

    def _check_room(self, need) -> list:
        root = os.path.join(self.run_dir, "checkpoints")
        lines = []
        try:
            os.makedirs(root, exist_ok=True)
            for name in sorted(os.listdir(root)):
                if re.fullmatch(r"step_\d+\.(tmp|old)-.*", name):
                    shutil.rmtree(os.path.join(root, name))
                    lines.append(f"checkpoints: removed {name} (left by an interrupted save)")
        except OSError as exc:
            raise _unwritable(root, exc) from None
        check_writable(self.run_dir)
        free = shutil.disk_usage(root).free
        if free < need:
            raise CheckpointError(f"no room for a checkpoint in {root}: one needs about "
                                  f"{format_bytes(need)}, the file system has "
                                  f"{format_bytes(free)} free; free space or choose another "
                                  "--run-dir")
        return lines

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

        Returns the step it was written after. Raises on every rank
        together: :class:`~hpcpax.errors.CheckpointError` when any rank finds
        it damaged or of another layout (a dataset of another shape or
        dtype, external or virtual storage, a ``meta.json`` without a step),
        :class:`~hpcpax.errors.MismatchError` when another
        training setup wrote it (other flags, or a data file of other
        content; a moved data file is fine).
        """
        topo = self.topology
        ckpt.verify(path, topo.comm)
        meta = ckpt.read_meta(path)
        if meta.get("training_fingerprint") != self.training_fingerprint():
            saved = meta.get("config") if isinstance(meta.get("config"), dict) else {}
            differ = [f"{k}={_shown(saved.get(k))} there, {_shown(self.config[k])} now"
                      for k in TRAINING_KEYS if k != "data" and saved.get(k) != self.config[k]]
            if self.config["data"] is not None and \
                    meta.get("data_fingerprint") != self.data_fingerprint:
                differ.append(f"data file {self.config['data']} has other content than "
                              f"{saved.get('data')!r} had")
            raise MismatchError(f"{path} was written by a different training setup: "
                                + ", ".join(differ[:4]))
        error = None
        try:
            sync.restore_rows(lambda name, keep: ckpt.load_matching(
                path, name, keep, layout=ckpt.RowsLayout.of(sync[name].spec)))
            if topo.is_worker:
                _load_dense(path, dense, dense_state, optimizer, xp)
        except CheckpointError as exc:
            error = str(exc)
        errors = [e for e in topo.comm.allgather(error) if e]
        if errors:
            raise CheckpointError(errors[0])
        return int(meta["step"])


def _load_dense(path, dense, dense_state, optimizer, xp) -> None:
    params, state = ckpt.load_dense(path, dense, dense_state)
    for name in dense:  # load_dense checked every name, shape and dtype before reading
        dense[name][...] = xp.asarray(params[name])
        for slot, value in dense_state[name].items():
            # the optimizer's scalar slots (Adam's step) stay host arrays
            saved = state[name][slot]
            value[...] = saved if slot in optimizer.scalar_slots else xp.asarray(saved)


def _shown(value) -> str:
    """A setting as a mismatch message shows it (None: the flag was not given)."""
    return "unset (its default)" if value is None else repr(value)
