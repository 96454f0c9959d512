"""Where the suite's time goes, from the JUnit reports of ``run_suites.py --reports DIR``.

Usage::

    python tests/run_suites.py --reports /tmp/reports
    python tests/suite_times.py /tmp/reports              # per file, then the slowest tests
    python tests/suite_times.py /tmp/reports --write-durations tests/durations.json

Each test's wall seconds come from pytest (setup + call + teardown), its
CPU seconds from the ``cpu_s`` property ``tests/conftest.py`` records (the
test's process and the child processes it waited for; a Slurm job's ranks
run under slurmd and are not counted). ``--write-durations`` keeps every
test's wall seconds per suite in ``tests/durations.json``, from which
``tests/conftest.py`` chooses the quick tier (:data:`conftest.QUICK_SECONDS`).
"""

from __future__ import annotations

import argparse
import collections
import json
import xml.etree.ElementTree as ET
from pathlib import Path

#: Report folder of each suite, and its label.
SUITES = {"serial": "serial", "n2": "-n 2", "n3": "-n 3", "n4": "-n 4"}


def test_key(classname: str, name: str) -> str:
    """``tests/app/test_x.py::test_y[p]`` of a JUnit test case (its class left out)."""
    parts = classname.split(".")
    module = max((i for i, p in enumerate(parts) if p.startswith("test_")), default=len(parts) - 1)
    return "/".join(parts[:module + 1]) + ".py::" + name


def read(reports: Path) -> dict:
    """``{suite: {test key: (wall_s, cpu_s)}}`` of the tests that ran (not skipped)."""
    out = {}
    for suite in SUITES:
        # the serial suite may have run in parts (run_suites.py: serial-1, serial-2)
        paths = sorted(reports.glob(f"{suite}-*/rank0.xml")) if suite == "serial" else []
        paths = [p for p in [reports / suite / "rank0.xml", *paths] if p.exists()]
        if not paths:
            continue
        tests = out[suite] = {}
        for case in (c for p in paths for c in ET.parse(p).getroot().iter("testcase")):
            if case.find("skipped") is not None:
                continue
            cpu = next((float(p.get("value")) for p in case.iter("property")
                        if p.get("name") == "cpu_s"), 0.0)
            tests[test_key(case.get("classname", ""), case.get("name", ""))] = (
                float(case.get("time", 0.0)), cpu)
    return out


def table(times: dict, top: int) -> str:
    """Markdown: per file, each suite's wall / CPU seconds and test count; then totals."""
    files = collections.defaultdict(dict)
    for suite, tests in times.items():
        for key, (wall, cpu) in tests.items():
            entry = files[key.split("::")[0]].setdefault(suite, [0.0, 0.0, 0])
            entry[0] += wall
            entry[1] += cpu
            entry[2] += 1
    suites = [s for s in SUITES if s in times]
    lines = ["| file | " + " | ".join(f"{SUITES[s]} wall / CPU s (tests)" for s in suites)
             + " | wall, all |", "|---" * (len(suites) + 2) + "|"]
    ordered = sorted(files.items(), key=lambda kv: -sum(v[0] for v in kv[1].values()))
    for name, per in ordered[:top]:
        cells = [f"{per[s][0]:.1f} / {per[s][1]:.1f} ({per[s][2]})" if s in per else ""
                 for s in suites]
        lines.append(f"| {name} | " + " | ".join(cells)
                     + f" | {sum(v[0] for v in per.values()):.1f} |")
    totals = [(sum(w for w, _ in times[s].values()), sum(c for _, c in times[s].values()),
               len(times[s])) for s in suites]
    lines.append("| **all files** | " + " | ".join(f"{w:.0f} / {c:.0f} ({n})"
                                                   for w, c, n in totals) + " | |")
    return "\n".join(lines)


def slowest(times: dict, top: int) -> str:
    """The ``top`` slowest tests of each suite, wall and CPU seconds."""
    lines = []
    for suite, tests in times.items():
        lines.append(f"{SUITES[suite]}:")
        for key, (wall, cpu) in sorted(tests.items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"  {wall:7.1f} {cpu:7.1f}  {key}")
    return "\n".join(lines)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", type=Path, help="the folder given to run_suites.py --reports")
    parser.add_argument("--top", type=int, default=40, help="files and tests shown")
    parser.add_argument("--write-durations", type=Path, default=None,
                        help="write every test's wall seconds per suite to this JSON file")
    args = parser.parse_args()
    times = read(args.reports)
    print(table(times, args.top))
    print()
    print(slowest(times, min(args.top, 25)))
    if args.write_durations:
        durations = {suite: {key: round(wall, 3) for key, (wall, _) in sorted(tests.items())}
                     for suite, tests in times.items()}
        # the serial tests' CPU seconds too: run_suites.py gives the tests that mostly
        # wait (a watchdog's timeout, a Slurm queue) a lane of their own
        durations["serial_cpu"] = {key: round(cpu, 3)
                                   for key, (_, cpu) in sorted(times.get("serial", {}).items())}
        args.write_durations.write_text(json.dumps(durations, indent=0, sort_keys=True) + "\n")
        print(f"wrote {args.write_durations}")


if __name__ == "__main__":
    main()
