"""Preemption: a signal asks the run to checkpoint and exit cleanly.

Slurm sends ``SIGTERM`` (or the ``--signal=USR1@T`` of a job script) some
time before it kills a job; Ctrl-C on ``mpirun`` sends ``SIGINT``. The
handler only sets a flag; the trainer looks at it at the next step boundary,
the workers agree with one reduction (any worker signalled means all stop),
write a checkpoint and exit with status :data:`EXIT_PREEMPTED` (3), so a job
script can tell a preempted run from a finished one and requeue it (the
templates in ``jobscripts/`` do). A second ``SIGINT`` interrupts at once.
The trainer installs the handler right after ``MPI_Init`` (which installs
handlers of its own), for the whole run: a signal during set-up is honoured
at the first step boundary.
"""

from __future__ import annotations

import signal

__all__ = ["PreemptionHandler", "PREEMPT_SIGNALS", "EXIT_PREEMPTED"]

PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)
#: Exit status of a run that stopped on a preemption signal after checkpointing.
EXIT_PREEMPTED = 3


class PreemptionHandler:
    """Context manager: while active, ``SIGTERM``/``SIGUSR1``/``SIGINT`` set :attr:`requested`.

    Not collective. Handlers are installed only in the main thread (Python
    allows no other) and the previous ones are put back on exit.
    """

    def __init__(self, signals=PREEMPT_SIGNALS):
        self.signals = tuple(signals)
        self.requested = False
        self.signal_number = None
        self._previous = {}

    def _handle(self, signum, frame):
        if signum == signal.SIGINT and self.requested:
            raise KeyboardInterrupt  # a second Ctrl-C: stop now
        self.requested = True
        self.signal_number = signum

    def __enter__(self):
        import threading

        if threading.current_thread() is threading.main_thread():
            for signum in self.signals:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, previous in self._previous.items():
            signal.signal(signum, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    @property
    def signal_name(self) -> str | None:
        """Name of the signal received (``"SIGUSR1"``), or None."""
        return signal.Signals(self.signal_number).name if self.signal_number else None
