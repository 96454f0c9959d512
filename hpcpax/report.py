"""``python -m hpcpax.report``: the command line of :mod:`hpcpax.app.report`."""

from .app.report import main

if __name__ == "__main__":
    raise SystemExit(main())
