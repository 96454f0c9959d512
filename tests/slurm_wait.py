"""Submit a Slurm job and wait for its end by polling (tests' helper).

``sbatch --wait`` checks the job at sleeps that double up to 32 s, so a job of
20 s was seen ended after 30-60 s; polling ``scontrol`` every half second
sees it within that. ``scontrol`` keeps a finished job for ``MinJobAge``
(300 s by default), long enough to read its state here.
"""

import subprocess
import time

#: Job states a job does not leave.
ENDED = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY",
         "PREEMPTED", "BOOT_FAIL", "DEADLINE")


def job_fields(job_id: str) -> dict:
    """``scontrol show job -o``'s fields of ``job_id`` (empty once it is forgotten)."""
    out = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True,
                         text=True, timeout=15).stdout
    return dict(p.split("=", 1) for p in out.split() if "=" in p)


def submit_and_wait(argv, timeout: float, poll: float = 0.5):
    """``sbatch --parsable ARGV`` (no ``--wait``), then poll until the job ended.

    Returns ``(job id, state, exit status)``; the status is the job's (``ExitCode``'s
    first field), as ``sbatch --wait`` would return, or 124 with the job cancelled
    when it did not end within ``timeout`` seconds.
    """
    submitted = subprocess.run(["sbatch", "--parsable", *argv], capture_output=True,
                               text=True, timeout=60)
    if submitted.returncode != 0:
        raise AssertionError(f"sbatch failed: {submitted.stderr[-2000:]}")
    job_id = submitted.stdout.strip().split(";")[0]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        fields = job_fields(job_id)
        state = fields.get("JobState")
        if state in ENDED:
            return job_id, state, int(fields.get("ExitCode", "1:0").split(":")[0])
        time.sleep(poll)
    subprocess.run(["scancel", job_id], timeout=30)
    return job_id, "TIMEOUT", 124
