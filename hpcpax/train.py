"""``python -m hpcpax.train``: the command-line trainer.

Run it under MPI as ``mpirun -n 4 python -m mpi4py -m hpcpax.train [flags]``
(``-m mpi4py`` makes an uncaught error on one rank abort the whole job
instead of hanging it); without ``mpirun`` it is a one-process run. Flags are
listed by ``--help`` and documented in :mod:`hpcpax.app.config`; the loop is
:class:`hpcpax.app.trainer.Trainer`.

Exit status: 0 on success; 3 after a preemption checkpoint (SIGTERM, SIGUSR1
or SIGINT: rerun, or requeue, with ``--resume``); 2 on a bad flag or config
file; 1 on any other error.
"""

from __future__ import annotations

import os
import sys
import time

from .app.config import parse_args
from .errors import ConfigError

__all__ = ["main"]

#: Seconds a failing rank waits between printing its error and ``MPI_Abort``.
ABORT_GRACE_S = 0.5


def _world_rank():
    try:
        from mpi4py import MPI

        return MPI.COMM_WORLD.Get_rank()
    except ImportError:  # pragma: no cover - mpi4py is a hard dependency
        return 0


def main(argv=None, *, comm=None, hooks=()) -> int:
    """Parse ``argv``, train, return the exit status. **Collective** over ``comm``.

    Args:
        argv: command-line arguments (default ``sys.argv[1:]``).
        comm: communicator to run on (default ``MPI.COMM_WORLD``).
        hooks: passed to :class:`~hpcpax.app.trainer.Trainer` (tests).
    """
    from .app.trainer import Trainer

    try:
        config = parse_args(argv)
    except ConfigError as exc:
        # Parsing is identical on every rank, so every rank stops here.
        if _world_rank() == 0:
            print(f"hpcpax.train: error: {exc}", file=sys.stderr)
        return 2
    from .app.preemption import EXIT_PREEMPTED

    trainer = Trainer(config, comm=comm, hooks=hooks)
    trainer.run()
    return EXIT_PREEMPTED if trainer.preempted else 0


def _main_aborting_on_error() -> int:
    """:func:`main`, but an uncaught error on one rank aborts every rank.

    What ``python -m mpi4py`` does, built in, so that the README's plain
    ``mpirun -n 4 python -m hpcpax.train`` cannot leave ranks waiting forever
    in a collective for one that died.
    """
    try:
        return main()
    except BaseException as exc:  # noqa: BLE001 - anything uncaught ends the job
        if isinstance(exc, SystemExit) and not exc.code:
            raise
        from .errors import HpcpaxError

        if isinstance(exc, HpcpaxError):  # a diagnosed problem: its message says it all
            # one write, newline included: another rank's abort may kill this one at once
            sys.stderr.write(f"hpcpax.train: error on rank {_world_rank()}: {exc}\n")
        else:
            import traceback

            traceback.print_exc()
        sys.stderr.flush()
        try:
            from mpi4py import MPI

            if MPI.Is_initialized() and not MPI.Is_finalized() and MPI.COMM_WORLD.Get_size() > 1:
                # mpiexec forwards each rank's stderr; an immediate abort can kill the job
                # before the message above is through (seen with errors raised on every rank)
                time.sleep(ABORT_GRACE_S)
                MPI.COMM_WORLD.Abort(1)
        except ImportError:  # pragma: no cover
            pass
        return 1


def _exit(status: int) -> None:
    """Leave with ``status``, also under ``python -m mpi4py``.

    mpi4py's runner calls ``MPI_Abort`` for any ``SystemExit`` with a
    non-zero code, which would turn the documented preemption status into a
    killed job. Every rank reaches this with the same status (the stop is
    agreed), so MPI is finalized cleanly first and the process exits directly.
    """
    if status == 0:
        sys.exit(0)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            MPI.Finalize()
    except ImportError:  # pragma: no cover
        pass
    os._exit(status)


if __name__ == "__main__":
    _exit(_main_aborting_on_error())
