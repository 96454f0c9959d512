"""``python -m hpcpax.jobscript``: the command line of :mod:`hpcpax.app.jobscript`."""

from .app.jobscript import main

if __name__ == "__main__":
    raise SystemExit(main())
