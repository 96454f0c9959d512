"""Test helper: ``python -m hpcpax.train`` with fault-injection hooks (tests only).

Started by the reliability tests under their own ``mpirun``. Environment:

- ``RELIABILITY_PID_DIR``: each rank writes ``rank<R>.pid`` there at start;
- ``RELIABILITY_HANG_RANK`` / ``RELIABILITY_HANG_STEP``: that (worker) rank
  sleeps forever after that step, outside any guarded operation, so the
  other ranks block in the next step's first collective.
- ``RELIABILITY_SETUP_HANG_RANK``: that (worker) rank hangs in its first
  set-up phase (device selection, as a bad GPU would), so the other ranks
  block in the next set-up collective.
- ``RELIABILITY_EARLY_HANG_RANK``: that rank hangs before the trainer starts
  (as in a hung import), so the others wait for it at start-up.
- ``RELIABILITY_CRASH_IN_CHECKPOINT=STEP[:RANK]``: RANK (default the last)
  dies (``os._exit(9)``) while checkpoint STEP is half written: its files are
  in the temporary directory, the manifest is not.
- ``RELIABILITY_PAUSE_IN_CHECKPOINT=STEP:RANK``: RANK writes ``in_checkpoint``
  in ``RELIABILITY_PID_DIR`` and then sleeps inside the write of checkpoint STEP,
  for the test to kill it there.
- ``RELIABILITY_EXIT_DELAY=SECONDS:RANK``: RANK sleeps SECONDS right after
  ``MPI_Finalize`` (as a rank the OS runs late while the job ends), then says so.
- ``RELIABILITY_FILL_DISK_AT_CHECKPOINT=STEP:PATH``: rank 0 fills the file system of
  PATH (writing PATH until no byte is left) right before checkpoint STEP, so that
  every rank's write of it fails.
- ``RELIABILITY_SIGNAL_STEP=STEP``: after its step STEP the first worker sends
  ``SIGUSR1`` to every rank (the pids in ``RELIABILITY_PID_DIR``), as Slurm
  does before a time limit.

The job ends as ``python -m hpcpax.train`` does (:func:`hpcpax.train._exit`);
with ``RELIABILITY_CLI_ERRORS=1`` an error is also reported as it does (one
line for a diagnosed error, said once when every rank raised it; then the
job aborts) instead of by ``python -m mpi4py``'s traceback.
"""

import os
import signal
import sys
import time

from mpi4py import MPI

from hpcpax.train import _exit, main


def hang_hook():
    rank, step = os.environ.get("RELIABILITY_HANG_RANK"), os.environ.get("RELIABILITY_HANG_STEP")
    if rank is None or int(rank) != MPI.COMM_WORLD.Get_rank():
        return []

    def hook(trainer, done):
        if done == int(step):
            print(f"[rank {rank}] test hook: hanging after step {done}", file=sys.stderr,
                  flush=True)
            while True:
                time.sleep(1)

    return [hook]


def signal_hook():
    step = os.environ.get("RELIABILITY_SIGNAL_STEP")
    if step is None:
        return []

    def hook(trainer, done):
        if done == int(step) and trainer.is_leader:
            pid_dir = os.environ["RELIABILITY_PID_DIR"]
            for name in sorted(os.listdir(pid_dir)):
                with open(os.path.join(pid_dir, name), encoding="ascii") as handle:
                    os.kill(int(handle.read()), signal.SIGUSR1)

    return [hook]


def pause_in_checkpoint():
    spec = os.environ.get("RELIABILITY_PAUSE_IN_CHECKPOINT")
    if not spec:
        return
    from hpcpax.app import checkpoint_files as checkpoint

    pause_step, _, pause_rank = spec.partition(":")
    if int(pause_rank) != MPI.COMM_WORLD.Get_rank():
        return
    save = checkpoint.save

    def pausing_save(comm, run_dir, step, **kwargs):
        if int(step) == int(pause_step):
            marker = os.path.join(os.environ["RELIABILITY_PID_DIR"], "in_checkpoint")
            with open(marker, "w", encoding="ascii") as handle:
                handle.write(str(step))
            while True:
                time.sleep(1)
        return save(comm, run_dir, step, **kwargs)

    checkpoint.save = pausing_save


def late_after_finalize():
    delay, _, late_rank = os.environ.get("RELIABILITY_EXIT_DELAY", "0:-1").partition(":")
    if int(late_rank) != MPI.COMM_WORLD.Get_rank():
        return
    finalize = MPI.Finalize

    def finalize_then_wait():
        finalize()
        time.sleep(float(delay))
        print(f"[rank {late_rank}] test hook: left {delay} s after MPI_Finalize",
              file=sys.stderr, flush=True)

    MPI.Finalize = finalize_then_wait


def hang_in_setup():
    rank = os.environ.get("RELIABILITY_SETUP_HANG_RANK")
    if rank is None or int(rank) != MPI.COMM_WORLD.Get_rank():
        return
    import hpcpax.app.trainer

    def stuck_device(*args, **kwargs):
        print(f"[rank {rank}] test hook: hanging in device selection", file=sys.stderr,
              flush=True)
        while True:
            time.sleep(1)

    hpcpax.app.trainer.worker_device = stuck_device


def crash_in_checkpoint():
    spec = os.environ.get("RELIABILITY_CRASH_IN_CHECKPOINT")
    if not spec:
        return
    from hpcpax.app import checkpoint_files as checkpoint

    crash_step, _, crash_rank = spec.partition(":")
    world = MPI.COMM_WORLD
    if int(crash_rank or world.Get_size() - 1) != world.Get_rank():
        return
    save = checkpoint.save

    class DiesBeforeReporting:
        """The run's communicator, but this rank dies where it would report its files."""

        def __init__(self, comm):
            self._comm = comm

        def __getattr__(self, name):
            return getattr(self._comm, name)

        def gather(self, *args, **kwargs):
            os._exit(9)

    def crashing_save(comm, run_dir, step, **kwargs):
        if int(step) == int(crash_step):
            comm = DiesBeforeReporting(comm)
        return save(comm, run_dir, step, **kwargs)

    checkpoint.save = crashing_save


def fill_disk(path):
    """Write ``path`` until the file system has no byte left."""
    with open(path, "wb", buffering=0) as handle:
        for block in (1 << 16, 1 << 12, 1):
            try:
                while True:
                    handle.write(b"\0" * block)
            except OSError:
                pass


def fill_disk_at_checkpoint():
    spec = os.environ.get("RELIABILITY_FILL_DISK_AT_CHECKPOINT")
    if not spec:
        return
    from hpcpax.app import checkpoint_files as checkpoint

    fill_step, _, filler = spec.partition(":")
    save = checkpoint.save

    def save_on_a_full_disk(comm, run_dir, step, **kwargs):
        if int(step) == int(fill_step):
            if comm.Get_rank() == 0:
                fill_disk(filler)
            comm.Barrier()
        return save(comm, run_dir, step, **kwargs)

    checkpoint.save = save_on_a_full_disk


if __name__ == "__main__":
    pid_dir = os.environ.get("RELIABILITY_PID_DIR")
    if pid_dir:
        rank = MPI.COMM_WORLD.Get_rank()
        with open(os.path.join(pid_dir, f"rank{rank}.pid"), "w", encoding="ascii") as handle:
            handle.write(str(os.getpid()))
    if os.environ.get("RELIABILITY_EARLY_HANG_RANK") == str(MPI.COMM_WORLD.Get_rank()):
        print(f"[rank {MPI.COMM_WORLD.Get_rank()}] test hook: hanging before the trainer",
              file=sys.stderr, flush=True)
        while True:
            time.sleep(1)
    fill_disk_at_checkpoint()
    hang_in_setup()
    crash_in_checkpoint()
    pause_in_checkpoint()
    late_after_finalize()
    hooks = hang_hook() + signal_hook()
    if os.environ.get("RELIABILITY_CLI_ERRORS") == "1":
        import hpcpax.train

        hpcpax.train.main = lambda: main(hooks=hooks)
        _exit(hpcpax.train._main_aborting_on_error())
    _exit(main(hooks=hooks))
