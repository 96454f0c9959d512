"""Preemption ends the job with status 3 every time, no rank cut short (serial suite only).

After step 3 the first worker sends ``SIGUSR1`` to every rank, as Slurm does
before a time limit; the run checkpoints, writes ``summary.json`` and must end
with :data:`~hpcpax.app.preemption.EXIT_PREEMPTED`, the status the job
templates requeue on. One rank (a different one each run) is held 0.3 s right
after ``MPI_Finalize``, as the OS may run one late while the job ends. The
ranks used to leave with ``os._exit``, which skips MPICH's exit hook that tells
hydra a rank finalized: hydra took the first rank to leave for a crash and
killed every rank still running, and the job ended ``Killed (signal 9)`` when
the killed rank's status reached it before the finalized one's.
"""

import json

import pytest

from hpcpax.app import checkpoint_files as ckpt
from hpcpax.app.preemption import EXIT_PREEMPTED
from reliability_jobs import TINY, run_job, serial_only

#: Runs per consistency model: 20 in all.
REPEATS = {"bsp": 8, "ssp:0": 6, "asp": 6}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("consistency", sorted(REPEATS))
def test_sigusr1_to_every_rank_exits_3_every_time(tmp_path, consistency):
    serial_only()
    outcomes, failures = [], []
    for attempt in range(REPEATS[consistency]):
        run_dir, late = tmp_path / f"run{attempt}", attempt % 4
        status, text = run_job(4, ["--steps", "400", "--consistency", consistency,
                                   "--run-dir", str(run_dir), *TINY], tmp_path, limit=120,
                               RELIABILITY_SIGNAL_STEP=3, RELIABILITY_EXIT_DELAY=f"0.3:{late}",
                               # every fourth run with Numba's threads and exit hooks, as
                               # users run it; the others on the (bit-equal) NumPy kernels
                               HPCPAX_NUMBA=int(attempt % 4 == 0))
        finished = f"[rank {late}] test hook: left 0.3 s after MPI_Finalize" in text
        # every rank said goodbye to the host's watcher: no rank is reported as killed
        finished = finished and "ended without finishing" not in text
        outcomes.append((status, finished))
        if (status, finished) != (EXIT_PREEMPTED, True):
            failures.append(text[-1500:])
            continue
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["preempted"] and summary["signal"] == "SIGUSR1", summary
        assert 3 <= summary["steps"] < 400, summary
        ckpt.verify(ckpt.latest(run_dir))
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        # asp workers stop where they are: lines through the slowest one's step, the later
        # steps' records wait in the checkpoint for the resumed run (each step one line)
        last = min(summary["worker_steps"]) if consistency == "asp" else summary["steps"]
        assert max(json.loads(line).get("step", 0) for line in lines) == last
    print(f"--- {consistency}: (exit status, late rank finished) {outcomes}")
    assert outcomes == [(EXIT_PREEMPTED, True)] * REPEATS[consistency], (outcomes, failures[:2])
