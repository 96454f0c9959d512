"""What the BSP loop decides and records at run time: balanced shares and the timeline.

:class:`RunTime` bundles the trainer's run-time pieces so the training
loop stays one call per step: the :class:`~hpcpax.app.balance.BatchBalancer`
(``--batch-shares``) and the :class:`~hpcpax.app.timeline.Timeline`
(``--trace``), whose decisions appear as instant events on the timeline,
and feeds ``--consistency auto``'s :class:`~hpcpax.app.auto_run.AutoRun`
every step's figures.
"""

from __future__ import annotations

import time

from .balance import BatchBalancer
from .timeline import ServedOps, Timeline

__all__ = ["RunTime"]


class RunTime:
    """The run-time controllers of one BSP run.

    Built in :meth:`Trainer._build` on every rank (**collective** over every
    rank when ``--trace`` is given: the timeline's start-up barrier); sets
    ``trainer.balance``, and on server ranks of a traced run wraps the
    parameter server's watchdog in :class:`~hpcpax.app.timeline.ServedOps`.
    """

    def __init__(self, trainer):
        config, topo = trainer.config, trainer.topology
        self.trainer = trainer
        self.balance = trainer.balance = BatchBalancer(
            config["batch_shares"], config["rebalance_every"], topo, config["global_batch"],
            trainer.log)
        self.auto = trainer.relaxed if hasattr(trainer.relaxed, "note") else None
        tracing = trainer.relaxed is None or self.auto is not None  # relaxed: relaxed_run
        # every rank: servers get a track of the operations they serve
        self.timeline = Timeline(config["trace"] if tracing else None, topo, comm=topo.comm)
        if self.timeline.enabled and topo.is_server:
            trainer.ps.watchdog = ServedOps(trainer.ps.watchdog, self.timeline)
        if self.auto is not None:  # auto's relaxed phases go on this timeline too
            self.auto.relaxed_run.timeline = self.timeline
        trainer.commands.handlers["trace"] = self._write_trace

    def after_step(self, step, began, times, local_batch, metrics) -> None:
        """After BSP step ``step`` (begun at ``began``, this worker's phase ``times``):
        record it, and rebalance when due; **collective** over the workers."""
        now = time.perf_counter()
        self.timeline.step(step, began, times, now)
        if self.auto is not None:  # --consistency auto measures every step
            self.auto.note(step, times, local_batch, now - began)
        decision = self.balance.observe(step, times, local_batch, metrics,
                                        step_seconds=now - began,
                                        warming=self.trainer.planning.measuring)
        if decision is not None:
            self.timeline.instant(f"batch shares {decision['to']}", decision)

    def checkpoint_meta(self) -> dict:
        """The controllers' state for a checkpoint's metadata."""
        meta = {"batch_shares": self.balance.state()}
        if self.auto is not None:
            meta["auto"] = self.auto.policy.state()
        return meta

    def resume(self, step) -> int:
        """After the trainer resumed at ``step``: continue the controllers from its
        checkpoint, if any; returns ``step``. **Collective** over the workers."""
        path = self.trainer.checkpoints.resumed_from
        if path is None:
            return step
        self.balance.resume(path)
        if self.auto is not None:
            from .checkpoint import read_meta

            topo = self.trainer.topology
            state = read_meta(path).get("auto") if topo.worker_index == 0 else None
            state = topo.workers.bcast(state, root=0)
            if state:
                self.auto.policy.load(state)
                self.balance.shares = list(self.auto.policy.shares)
        return step

    def finish(self) -> None:
        """Merge and write the trace (``summary.json`` names it); **collective** over the
        workers (the servers join through the trainer's command channel)."""
        if not self.timeline.enabled:
            return
        path = self.trainer.commands.run("trace")
        if path is not None:
            self.trainer.summary_extra["trace"] = path
            self.trainer.log(f"trace written: {path}", important=True)

    def _write_trace(self):
        if self.auto is not None:  # a server's requests of auto's relaxed phases
            self.auto.relaxed_run.server_spans()
        return self.timeline.write()  # every rank: the first worker writes the file
