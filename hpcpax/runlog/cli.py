"""``python -m hpcpax.runs list|export``: read the run log.

``list`` prints one line per recorded run (id, date, source, model, layout,
methods, measured and predicted ms per step), the newest ``--last`` of them
(default 40; 0: all); ``export`` writes every record as JSON lines (``--out
FILE``, default standard output). ``--path`` reads
another log than :func:`hpcpax.runlog.log.run_log_path`. Not collective.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..options import counted
from .log import RunLog

__all__ = ["main", "LAST"]

#: Runs ``list`` prints by default (the newest).
LAST = 40


def _part(record, key) -> dict:
    """``record[key]`` when it is a dict, else ``{}`` (a malformed record shows ``?``)."""
    value = record.get(key)
    return value if isinstance(value, dict) else {}


def _methods(record) -> str:
    counts = {}
    for entry in _part(record, "strategy").values():
        method = entry.get("method") if isinstance(entry, dict) else None
        method = method if isinstance(method, str) else "?"
        counts[method] = counts.get(method, 0) + 1
    return ",".join(f"{m}x{c}" if c > 1 else m for m, c in sorted(counts.items())) or "-"


def _ms(value) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "-" if value is None else "?"
    return f"{value * 1e3:.2f}"


def _text(value) -> str:
    """A field as one printable line (a record is data, not terminal control)."""
    return "".join(c if c.isprintable() else "?" for c in str(value))


def _line(record) -> str:
    layout = _part(record, "layout")
    shape = (f"{layout.get('num_nodes', '?')}n x {layout.get('workers_per_node', '?')}w"
             f" + {layout.get('servers', '?')}s")
    predicted = _part(record, "predicted").get("seconds")
    name = _part(record, "model").get("name") or "?"
    return _text("  ".join([f"{record['id']:>5}", str(record["created_utc"]),
                            f"{str(record['source']):<18}", f"{_text(name):<5}", f"{shape:<12}",
                            f"{_methods(record):<24}",
                            f"{_ms(_part(record, 'measured').get('step_s')):>9}",
                            f"{_ms(predicted):>9}"]))


def main(argv=None) -> int:
    """Entry point; returns the exit status (0 also when a pipe such as ``| head``
    closes early)."""
    try:
        status = _main(argv)
        sys.stdout.flush()  # inside the try: a closed pipe raises here, not at exit
        return status
    except BrokenPipeError:
        # the reader left: quiet, and no second error when Python flushes stdout at exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


def _main(argv) -> int:
    parser = argparse.ArgumentParser(prog="python -m hpcpax.runs", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=("list", "export"))
    parser.add_argument("--path", help="run log file (default: $HPCPAX_RUN_LOG or the user cache)")
    parser.add_argument("--model", help="only runs of this model")
    parser.add_argument("--source", help="only runs of this source (train, a benchmark)")
    parser.add_argument("--out", help="export: write here instead of standard output")
    parser.add_argument("--last", type=int, default=LAST, metavar="N",
                        help=f"list: the newest N runs only (default {LAST}; 0: all)")
    args = parser.parse_args(argv)
    if args.last < 0:
        parser.error(f"--last must be >= 0, not {args.last}")
    log = RunLog(args.path)
    if not log.enabled:
        print("run log is off (HPCPAX_RUN_LOG=off)", file=sys.stderr)
        return 1
    records = log.records(model=args.model, source=args.source)
    if args.command == "list":
        shown = records[-args.last:] if args.last else records
        print(f"{log.path}: {counted(len(records), 'run')}"
              + (f", the newest {len(shown)} shown (--last 0: all)"
                 if len(shown) < len(records) else ""))
        print("  ".join(["   id", "created (UTC)       ", f"{'source':<18}", "model", f"{'layout':<12}",
                         f"{'methods':<24}", " meas. ms", " pred. ms"]))
        for record in shown:
            print(_line(record))
        return 0
    handle = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for record in records:
            handle.write(json.dumps(record, sort_keys=True) + "\n")
    finally:
        if args.out:
            handle.close()
    return 0
