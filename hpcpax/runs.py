"""``python -m hpcpax.runs list|export``: the command line of :mod:`hpcpax.plan.runs_cli`."""

from .plan.runs_cli import main

if __name__ == "__main__":
    raise SystemExit(main())
