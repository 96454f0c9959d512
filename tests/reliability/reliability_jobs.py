"""Start ``mpirun -n N`` jobs from a serial test, watch them, never leave one behind."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mpi4py import MPI

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
#: A tiny language model on synthetic data, the PS plan (no fabric measurement).
TINY = ["--model", "lm", "--vocab-size", "300", "--context", "3", "--emb-dim", "8",
        "--hidden", "16", "--out-dim", "8", "--num-sampled", "16", "--global-batch", "12",
        "--synthetic-samples", "5000", "--lr", "0.01", "--sparse-lr", "0.2", "--plan", "ps",
        "--quiet"]


def mount_tmpfs(path, options):
    """Mount a tmpfs with mount ``options`` (``size=4m``) at ``path`` (created); skip
    unless root can."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("needs root to mount a tmpfs")
    Path(path).mkdir(exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")


def remount(path, options):
    """``mount -o remount,OPTIONS`` the tmpfs at ``path``."""
    subprocess.run(["mount", "-o", f"remount,{options}", str(path)], check=True,
                   capture_output=True, timeout=30)


def unmount(path):
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)


def serial_only():
    """Skip inside an mpirun rank: a child MPI job cannot start there."""
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("starts its own mpirun; runs in the serial suite only")
    if not shutil.which(mpirun()):
        pytest.skip("no mpirun")


def mpirun():
    candidate = Path(sys.executable).parent / "mpirun"
    return str(candidate) if candidate.exists() else "mpirun"


def clean_env(**extra):
    """This environment without the parent's MPI/PMI variables, plus ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPI", "OMPI_", "PMIX_"))}
    env.update({k: str(v) for k, v in extra.items()})
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.setdefault("NUMBA_NUM_THREADS", "1")
    # These jobs test processes, signals and files, not kernels: their ranks run the
    # NumPy twins (bit-equal to the Numba kernels, tests/ops), sparing each rank
    # Numba's 0.6-0.8 s of set-up (a 4-rank TINY job: 3.5 s -> 1.6 s here). Tests
    # of exit paths keep Numba (its threads and exit hooks): pass HPCPAX_NUMBA=1.
    env.setdefault("HPCPAX_NUMBA", "0")
    return env


class Job:
    """``mpirun -n N python -m mpi4py tests/reliability/run_trainer.py ARGS`` in its own session."""

    def __init__(self, n, args, tmp_path, limit=120, **env):
        self.pid_dir = tmp_path / f"pids-{time.monotonic_ns()}"
        self.pid_dir.mkdir()
        self.n = n
        self.log = tmp_path / f"job-{time.monotonic_ns()}.log"
        self.cmd = ["timeout", "-s", "KILL", str(limit), mpirun(), "-n", str(n), sys.executable,
                    "-m", "mpi4py", str(HERE / "run_trainer.py"), *args]
        self._out = open(self.log, "w")
        self.proc = subprocess.Popen(self.cmd, cwd=ROOT, stdout=self._out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     env=clean_env(RELIABILITY_PID_DIR=self.pid_dir, **env))

    def pids(self, timeout=60):
        """``{rank: pid}`` once every rank has written its pid file."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            files = list(self.pid_dir.glob("rank*.pid"))
            if len(files) == self.n:
                try:
                    return {int(f.stem[4:]): int(f.read_text()) for f in files}
                except ValueError:
                    pass
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended early:\n{self.output()}")
            time.sleep(0.1)
        raise AssertionError(f"ranks did not start within {timeout} s:\n{self.output()}")

    def wait_for_step(self, run_dir, step, timeout=90):
        """Block until ``metrics.jsonl`` holds ``step``."""
        metrics = Path(run_dir) / "metrics.jsonl"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if metrics.exists():
                steps = [json.loads(t).get("step") for t in metrics.read_text().splitlines()
                         if t.endswith("}")]
                if steps and max(steps) >= step:
                    return
            if self.proc.poll() is not None:
                raise AssertionError(f"job ended before step {step}:\n{self.output()}")
            time.sleep(0.05)
        raise AssertionError(f"no step {step} within {timeout} s:\n{self.output()}")

    def wait(self, timeout=120):
        """Exit status (kills the job's session if it outlives ``timeout``)."""
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"job did not end within {timeout} s:\n{self.output()}")

    def output(self):
        self._out.flush()
        return self.log.read_text(errors="replace")

    def kill(self):
        """Kill whatever is left of the job (its own session only)."""
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(10)
        for pid_file in self.pid_dir.glob("rank*.pid"):
            try:
                pid = int(pid_file.read_text())
                with open(f"/proc/{pid}/cmdline", "rb") as handle:
                    if b"run_trainer.py" not in handle.read():
                        continue  # gone, and the pid reused by someone else
                os.kill(pid, signal.SIGCONT)
                os.kill(pid, signal.SIGKILL)
            except (ValueError, OSError):
                pass
        self._out.close()


def run_job(n, args, tmp_path, limit=120, **env):
    """Run a job to the end; ``(exit status, output)``."""
    job = Job(n, args, tmp_path, limit=limit, **env)
    try:
        return job.wait(limit + 10), job.output()
    finally:
        job.kill()
