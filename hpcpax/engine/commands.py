"""Commands: things every rank of a run must do together besides the steps.

Workers drive a run; server ranks follow them inside
:meth:`~hpcpax.ps.server.ParameterServer.serve`. To make *every* rank run
something (write a checkpoint, load one, switch a variable's method, stop),
the workers release the servers from ``serve()`` with ``shutdown()``, the
first worker broadcasts the command, every rank runs its handler, and the
servers go back to serving. The parameter server needs nothing new for that.
"""

from __future__ import annotations

__all__ = ["CommandChannel"]


class CommandChannel:
    """Run named handlers on every rank of ``topology.comm``.

    Args:
        topology: from :func:`hpcpax.init`.
        ps: the :class:`~hpcpax.ps.server.ParameterServer` the servers serve.
        handlers: ``{op: handler(**args)}``; the op ``stop`` ends
            :meth:`serve` (its handler may be omitted).
        watchdog: the rank's :class:`~hpcpax.comm.watchdog.Watchdog`: a rank killed
            in a command is reported in it (``checkpoint write after step 8``).
    """

    def __init__(self, topology, ps, handlers, watchdog=None):
        self.topology, self.ps, self.handlers = topology, ps, dict(handlers)
        self.watchdog = watchdog

    def run(self, op, **args):
        """Workers: run ``op`` on every rank; returns this rank's handler result.

        **Collective** over the workers (the servers join from :meth:`serve`).
        """
        self.ps.shutdown()
        command = self.topology.comm.bcast({"op": op, **args}, root=self.topology.worker_ranks[0])
        return self._dispatch(command)

    def serve(self) -> None:
        """Servers: serve the workers and run their commands until ``stop``."""
        while True:
            self.ps.serve()
            command = self.topology.comm.bcast(None, root=self.topology.worker_ranks[0])
            stop = command["op"] == "stop"
            self._dispatch(command)
            if stop:
                return

    def _dispatch(self, command):
        op = command.pop("op")
        if op == "stop" and op not in self.handlers:
            return None
        try:
            handler = self.handlers[op]
        except KeyError:
            raise RuntimeError(f"unknown trainer command {op!r}") from None
        if self.watchdog is None:
            return handler(**command)
        with self.watchdog.activity(_described(op, command)):
            return handler(**command)


def _described(op, args) -> str:
    """How a rank killed in command ``op`` is reported."""
    if op == "save":
        return f"checkpoint write after step {args.get('step')}"
    if op == "load":
        return "checkpoint load"
    return f"command {op!r}"
