"""``python -m hpcpax.runs list|export``: the command line of :mod:`hpcpax.runlog.cli`."""

from .runlog.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
