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
    except SystemExit as exc:  # argparse: --help (0) or a bad flag (2), its line printed
        return exc.code if isinstance(exc.code, int) else 2
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
            # one write, newline included: another rank's abort may kill this one at once;
            # an error every rank raised alike is said once
            if not exc.on_every_rank or _world_rank() == 0:
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
                from .comm.deathwatch import abort_job

                abort_job(1)  # this rank's report is above: the host's watcher adds none
        except ImportError:  # pragma: no cover
            pass
        return 1


def _exit(status: int) -> None:
    """Leave with ``status`` once every rank is done, also under ``python -m mpi4py``.

    Every rank agrees on one status and waits for the others
    (:func:`~hpcpax.comm.startup.leave_together`): a launcher may kill the
    ranks still running when one exits non-zero (``srun --kill-on-bad-exit``).
    MPI is then finalized before ``sys.exit``, so mpi4py's runner, which
    calls ``MPI_Abort`` for a non-zero ``SystemExit`` while MPI is active,
    leaves the status alone, and the process ends through the C library's
    ``exit``: MPICH tells its process manager that a rank finalized from an
    exit hook, and without it (``os._exit``) hydra took the exit for a crash
    and killed every rank still running (status 9 instead of 3).
    """
    from .app.preemption import EXIT_PREEMPTED

    if status == EXIT_PREEMPTED:
        import signal

        # the checkpoint is written: a second request (srun's SIGTERM to the ranks
        # still exiting once one has left) must not turn status 3 into a killed job
        for signum in (signal.SIGTERM, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_IGN)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        from mpi4py import MPI

        if MPI.Is_initialized() and not MPI.Is_finalized():
            from .comm.startup import leave_together

            status = leave_together(status)
            MPI.Finalize()
    except ImportError:  # pragma: no cover
        pass
    sys.exit(status)


if __name__ == "__main__":
    _exit(_main_aborting_on_error())
