"""The whole test suite: serially, then under ``mpirun -n 2``, ``-n 3``, ``-n 4``.

Usage: ``python tests/run_suites.py`` (the README's test command). Each run
has a wall-clock limit (``timeout`` + ``MPIEXEC_TIMEOUT``) and every test a
pytest-timeout, so nothing hangs. Multi-rank runs execute only the tests
marked ``mpi``; a failure on any rank fails the run. The last line is the
total over all runs: ``total: N passed, N failed, N skipped``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: A rank's log is printed after a failed run when it holds one of these:
#: a failure, an error, or stacks (a timeout; see ``mpi_pytest.StacksBeforeTimeout``).
LOG_MARKS = ("FAILED", "Error", "most recent call first", "Timeout")


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


def run(cmd, limit, env):
    print("+", " ".join(cmd), flush=True)
    try:
        return subprocess.run(cmd, cwd=ROOT, env=env, timeout=limit).returncode
    except subprocess.TimeoutExpired:
        print(f"TIMEOUT after {limit} s: {' '.join(cmd)}", flush=True)
        return 124


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", default="2,3,4", help="rank counts of the MPI runs")
    parser.add_argument("--limit", type=int, default=1500, help="seconds per run")
    parser.add_argument("--reports", default=None,
                        help="keep the JUnit reports and rank logs in this folder (default: a temporary one)")
    parser.add_argument("pytest_args", nargs="*", help="extra pytest arguments")
    args = parser.parse_args()
    env = dict(os.environ, MPIEXEC_TIMEOUT=str(args.limit), PYTHONUNBUFFERED="1")
    mpirun = str(Path(sys.executable).parent / "mpirun")
    if not Path(mpirun).exists():
        mpirun = "mpirun"
    totals = [0, 0, 0]
    failures = []
    with tempfile.TemporaryDirectory(prefix="hpcpax-tests-") as tmp:
        if args.reports:
            tmp = str(Path(args.reports).resolve())
        runs = [("serial", f"{tmp}/serial", [sys.executable, "-m", "pytest", "-q", "--with-mpi",
                            f"--junitxml={tmp}/serial/rank0.xml", *args.pytest_args])]
        for n in [int(x) for x in args.ranks.split(",") if x]:
            runs.append((f"mpirun -n {n}", f"{tmp}/n{n}", [mpirun, "-n", str(n), sys.executable, "-m", "mpi4py",
                                            str(ROOT / "tests" / "mpi_pytest.py"), f"{tmp}/n{n}",
                                            "-q", "--only-mpi", *args.pytest_args]))
        for label, report, cmd in runs:
            code = run(cmd, args.limit, env)
            report = Path(report)
            per_rank = [count(p) for p in sorted(report.glob("rank*.xml"))]
            if per_rank:
                # every rank runs the same tests: count rank 0, fail if any rank failed
                passed, _, skipped = per_rank[0]
                failed = max(f for _, f, _ in per_rank)
            else:
                passed, failed, skipped = 0, 1, 0
            if code != 0 and failed == 0:
                failed = 1  # crashed, hung or aborted outside a test
            totals = [totals[0] + passed, totals[1] + failed, totals[2] + skipped]
            print(f"{label}: {passed} passed, {failed} failed, {skipped} skipped (exit {code})",
                  flush=True)
            if failed:
                failures.append(label)
                for log in sorted(report.glob("rank*.log")):
                    text = log.read_text(errors="replace")
                    if any(mark in text for mark in LOG_MARKS):
                        print(f"--- {log.name} ---\n{brief(text)[-6000:]}", flush=True)
    if failures:
        print(f"failing runs: {', '.join(failures)}", flush=True)
    print(f"total: {totals[0]} passed, {totals[1]} failed, {totals[2]} skipped", flush=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
