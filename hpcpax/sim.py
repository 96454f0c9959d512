"""``python -m hpcpax.sim``: the command line of :mod:`hpcpax.plan.sim`."""

from .plan.sim import main

if __name__ == "__main__":
    raise SystemExit(main())
