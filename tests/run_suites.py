"""The whole test suite: serially, and under ``mpirun -n 2``, ``-n 3``, ``-n 4``.

Usage: ``python tests/run_suites.py`` (the README's test command);
``python tests/run_suites.py --quick`` for the edit-test loop (the tests
marked ``quick``: every layer's unit tests and one end-to-end run per entry
point, about 3 minutes here). Each run has a wall-clock limit (``timeout`` +
``MPIEXEC_TIMEOUT``, :data:`LIMITS`) and every test a pytest-timeout, so
nothing hangs. Multi-rank runs execute only the tests marked ``mpi``; a
failure on any rank fails the run.

The serial suite runs in parts beside the MPI suites (``--lanes 3``, the
default): the tests that mostly wait (a watchdog's timeout, a Slurm queue,
emulated compute; with those that share the emulated cluster or Slurm) in one
lane, the busy ones in two lanes of equal recorded length, the second followed
by ``-n 2``, ``-n 3``, ``-n 4`` (``tests/durations.json``, written by
``tests/suite_times.py``). Each run's output is kept in its report folder and
printed when it fails. Each run ends with a line of its time against its
limit, with a ``WARNING`` where it took more than half of it, so that growth
shows long before it breaks CI. The last line is the total over all runs:
``total: N passed, N failed, N skipped``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: A rank's log is printed after a failed run when it holds one of these:
#: a failure, an error, or stacks (a timeout; see ``mpi_pytest.StacksBeforeTimeout``).
LOG_MARKS = ("FAILED", "Error", "most recent call first", "Timeout")
#: Wall-clock seconds each run may take (the whole suite; ``--quick`` runs get a quarter).
LIMITS = {"serial": 1200, 2: 600, 3: 600, 4: 600}
#: Share of its limit past which a run's timing line carries a warning.
WARN_SHARE = 0.5


def brief(text):
    """A log without pytest's and Python's own frames (stacks keep the project's)."""
    keep, skipping = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("File "):
            skipping = any(m in line for m in ("site-packages", "<frozen", "/lib/python3"))
        elif not line.startswith("    "):
            skipping = False  # a source line follows its File line; anything else ends it
        if not skipping:
            keep.append(line)
    return "\n".join(keep)


def count(xml_path):
    """(passed, failed, skipped) from a JUnit file."""
    root = ET.parse(xml_path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = failed = skipped = 0
    for s in suites:
        tests += int(s.get("tests", 0))
        failed += int(s.get("failures", 0)) + int(s.get("errors", 0))
        skipped += int(s.get("skipped", 0))
    return tests - failed - skipped, failed, skipped


def timing_line(label, seconds, limit):
    """``serial: 412 s of its 1200 s limit (34 %)``, with a warning past :data:`WARN_SHARE`."""
    share = seconds / limit
    line = f"{label}: {seconds:.0f} s of its {limit} s limit ({100 * share:.0f} %)"
    if share > WARN_SHARE:
        line += (f"  WARNING: more than {100 * WARN_SHARE:.0f} % of its limit; "
                 "make it faster before it breaks CI")
    return line


def _stop(pid, fired):
    """End a run that passed its limit: its whole session, politely first."""
    fired.set()
    for sig, pause in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 0.0)):
        try:
            os.killpg(pid, sig)
        except ProcessLookupError:
            return
        time.sleep(pause)


class Run:
    """One suite run: its command, report folder, limit and, once done, its results."""

    def __init__(self, label, report, cmd, limit):
        self.label, self.report, self.cmd, self.limit = label, Path(report), cmd, limit
        self.code = self.seconds = self.cpu_seconds = None

    def execute(self, env, lock):
        """Run the command (output to ``report/output.log``), bounded by the limit."""
        self.report.mkdir(parents=True, exist_ok=True)
        with lock:
            print(f"+ {' '.join(self.cmd)}", flush=True)
        started = time.monotonic()
        with open(self.report / "output.log", "w") as log:
            process = subprocess.Popen(self.cmd, cwd=ROOT, env=env, stdout=log,
                                       stderr=subprocess.STDOUT, start_new_session=True)
            fired = threading.Event()
            timer = threading.Timer(self.limit, _stop, (process.pid, fired))
            timer.start()
            # wait4: the run's CPU seconds, its ranks' included (each waited for by its parent)
            _, status, usage = os.wait4(process.pid, 0)
            timer.cancel()
            timed_out = fired.is_set()
            process.returncode = self.code = 124 if timed_out else os.waitstatus_to_exitcode(status)
            if timed_out:
                log.write(f"\nTIMEOUT after {self.limit} s: {' '.join(self.cmd)}\n")
        self.seconds = time.monotonic() - started
        self.cpu_seconds = usage.ru_utime + usage.ru_stime
        with lock:
            self.summarize()

    def results(self):
        """(passed, failed, skipped): rank 0's counts, failed if any rank failed."""
        per_rank = [count(p) for p in sorted(self.report.glob("rank*.xml"))]
        if per_rank:
            passed, _, skipped = per_rank[0]
            failed = max(f for _, f, _ in per_rank)
        else:
            passed, failed, skipped = 0, 1, 0
        if self.code != 0 and failed == 0:
            failed = 1  # crashed, hung or aborted outside a test
        return passed, failed, skipped

    def summarize(self):
        passed, failed, skipped = self.results()
        output = (self.report / "output.log").read_text(errors="replace")
        if failed:
            print(f"--- {self.label}: output ---\n{brief(output)[-12000:]}", flush=True)
            for log in sorted(self.report.glob("rank*.log")):
                text = log.read_text(errors="replace")
                if log.name != "rank0.log" and any(mark in text for mark in LOG_MARKS):
                    print(f"--- {self.label}: {log.name} ---\n{brief(text)[-6000:]}", flush=True)
        else:  # pytest's one-line tally
            tally = [line for line in output.splitlines() if " in " in line and "passed" in line]
            if tally:
                print(f"{self.label}: {tally[-1].strip('= ')}", flush=True)
        print(f"{self.label}: {passed} passed, {failed} failed, {skipped} skipped "
              f"(exit {self.code})", flush=True)
        print(timing_line(self.label, self.seconds, self.limit)
              + f"; CPU {self.cpu_seconds:.0f} s", flush=True)


def mpi_test_files() -> list:
    """The test files that hold a test marked ``mpi`` (relative to the repository)."""
    found = []
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if "mark.mpi" in path.read_text(errors="replace"):
            found.append(str(path.relative_to(ROOT)))
    return found


#: Seconds each MPI run spends outside its tests (start-up, collection), for the split.
MPI_OVERHEAD_S = 10.0
#: Seconds assumed for a test file ``tests/durations.json`` does not know yet.
UNKNOWN_FILE_S = 2.0


def _durations() -> dict:
    try:
        return json.loads((ROOT / "tests" / "durations.json").read_text())
    except (OSError, ValueError):
        return {}


def _shares_a_resource(path: Path) -> bool:
    """Whether a test file uses the session's one emulated cluster or the one-node Slurm:
    such files run in the same serial part (a second cluster of the same prefix, or two
    Slurm jobs of two parts at once, would meet)."""
    relative = path.relative_to(ROOT).parts
    if relative[1] in ("cluster", "slurm"):
        return True
    text = path.read_text(errors="replace")
    return "mark.slurm" in text or "sbatch" in text


#: A test file whose recorded CPU seconds are below this share of its wall seconds
#: mostly waits (a watchdog's timeout, a Slurm queue, emulated compute): with
#: ``--lanes 3`` such files run in a lane of their own, beside the busy ones.
WAITING_SHARE = 0.4


def _per_file(durations: dict, suite: str) -> dict:
    out = {}
    for key, seconds in durations.get(suite, {}).items():
        name = key.split("::")[0]
        out[name] = out.get(name, 0.0) + seconds
    return out


def split_serial(durations: dict, mpi_suites, lanes: int = 2) -> list:
    """The serial suite's files in ``lanes - 1`` busy parts plus, with 3 lanes, a part of
    the files that mostly wait (:data:`WAITING_SHARE`) and those that share the cluster
    or Slurm (:func:`_shares_a_resource`, always in one part). The last busy part is
    followed by the MPI runs; the busy parts get about equal recorded seconds
    (``tests/durations.json``). Deterministic. Returns the parts, waiting part first."""
    wall, cpu = _per_file(durations, "serial"), _per_file(durations, "serial_cpu")
    mpi = sum(sum(durations.get(f"n{n}", {}).values()) + MPI_OVERHEAD_S for n in mpi_suites)
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    together = [f for f in files if _shares_a_resource(ROOT / f)]
    if lanes >= 3:
        waiting = [f for f in files if f in together or (
            f in cpu and wall.get(f, 0.0) > 5.0 and cpu[f] < WAITING_SHARE * wall[f])]
        parts, load = [waiting, [], []], [float("inf"), 0.0, mpi]
    else:
        parts, load = [list(together), []], [sum(wall.get(f, UNKNOWN_FILE_S)
                                                 for f in together), mpi]
    placed = set(parts[0])
    rest = sorted((f for f in files if f not in placed),
                  key=lambda f: (-wall.get(f, UNKNOWN_FILE_S), f))
    for name in rest:  # longest first, each to the busy part that ends sooner
        part = min(range(len(parts)), key=lambda k: (load[k], k))
        parts[part].append(name)
        load[part] += wall.get(name, UNKNOWN_FILE_S)
    return [sorted(p) for p in parts]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4", help="rank counts of the MPI runs")
    parser.add_argument("--no-serial", action="store_true", help="only the MPI runs")
    parser.add_argument("--quick", action="store_true",
                        help="only the tests marked quick (the edit-test loop's tier)")
    parser.add_argument("--lanes", type=int, default=3, choices=(1, 2, 3),
                        help="runs at once: 1 runs them one after the other; 2: the serial "
                             "suite in two parts, the second followed by the MPI runs; 3 (the "
                             "default): the tests that mostly wait in a third part beside them")
    parser.add_argument("--limit", type=int, default=None,
                        help="seconds per run (default: each run's own, LIMITS)")
    parser.add_argument("--reports", default=None,
                        help="keep the JUnit reports and logs in this folder (default: a "
                             "temporary one)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = parser.parse_args()
    mpirun = str(Path(sys.executable).parent / "mpirun")
    if not Path(mpirun).exists():
        mpirun = "mpirun"
    extra = (["-m", "quick"] if args.quick else []) + list(args.pytest_args)
    limits = {k: args.limit or (v // 4 if args.quick else v) for k, v in LIMITS.items()}
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="hpcpax-tests-") as tmp:
        if args.reports:
            tmp = str(Path(args.reports).resolve())
        # --plan auto jobs of one layout calibrate once per suite run (tests/conftest.py)
        env = dict(os.environ, PYTHONUNBUFFERED="1",
                   HPCPAX_CALIBRATION_CACHE=os.path.join(tmp, "calibration"))
        explicit = any(Path(a).exists() for a in args.pytest_args)
        ranks = [int(x) for x in args.ranks.split(",") if x]
        parallel = []
        # every rank collects only the files that hold multi-rank tests (collecting all
        # of them, torch and transformers imported included, cost each rank 5 s here)
        paths = [] if explicit else mpi_test_files()
        for n in ranks:
            parallel.append(Run(f"mpirun -n {n}", f"{tmp}/n{n}", [
                mpirun, "-n", str(n), sys.executable, "-m", "mpi4py",
                str(ROOT / "tests" / "mpi_pytest.py"), f"{tmp}/n{n}", "-q", "--only-mpi",
                *extra, *paths], limits[n]))

        def serial_run(label, folder, files):
            return Run(label, f"{tmp}/{folder}", [
                sys.executable, "-m", "pytest", "-q", "--with-mpi",
                f"--junitxml={tmp}/{folder}/rank0.xml", *extra, *files], limits["serial"])

        if args.no_serial:
            lanes = [parallel]
        elif args.lanes > 1 and not explicit:
            # lanes of equal recorded length: serial parts, the last followed by the MPI
            # runs (with 3 lanes, the first part holds the tests that mostly wait)
            parts = split_serial(_durations(), ranks, args.lanes)
            lanes = [[serial_run(f"serial {i + 1}/{len(parts)}", f"serial-{i + 1}", part)]
                     for i, part in enumerate(parts)]
            lanes[-1].extend(parallel)
        elif args.lanes > 1:
            lanes = [[serial_run("serial", "serial", [])], parallel]
        else:
            lanes = [[serial_run("serial", "serial", []), *parallel]]
        runs = [run for lane_runs in lanes for run in lane_runs]
        lock = threading.Lock()

        def lane(runs):
            for run in runs:
                run_env = dict(env, MPIEXEC_TIMEOUT=str(run.limit))
                run.execute(run_env, lock)

        threads = [threading.Thread(target=lane, args=(lane_runs,)) for lane_runs in lanes]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        totals = [sum(r.results()[i] for r in runs) for i in range(3)]
        failures = [r.label for r in runs if r.results()[1]]
    if failures:
        print(f"failing runs: {', '.join(failures)}", flush=True)
    print(f"all runs: {time.monotonic() - began:.0f} s", flush=True)
    print(f"total: {totals[0]} passed, {totals[1]} failed, {totals[2]} skipped", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
