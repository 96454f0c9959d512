"""A per-rank timeline of a BSP run (``--trace FILE``): Chrome/Perfetto trace events.

Every worker records, per step, its phases as complete (``"ph": "X"``)
events on its own track (``pid`` = its world rank): ``data``, ``pull``,
``compute`` (a straggler's sleep included), ``push``, ``dense`` (the fused
allreduce: where a worker waits for the slowest), ``optimizer`` and
``barrier`` (the step's closing allreduce of losses and counters: what is
left of the wait for the others), plus instant (``"ph": "i"``) events for
the run-time decisions (batch shares). Timestamps are microseconds since a
start-up barrier that every worker leaves at (nearly) the same moment:
each worker's clock offset is taken there, so tracks line up to the
barrier's skew (tens of microseconds on one node). At the end of the run
the first worker gathers every track and writes ``FILE`` as a JSON object
``{"traceEvents": [...], "displayTimeUnit": "ms"}`` that chrome://tracing
and https://ui.perfetto.dev load. Recording costs a few dict appends per
step (about 10 events).

Relaxed runs (``--consistency ssp|asp|psp``) are traced too, over every
rank (the start-up barrier and the merge include the servers): each worker's
steps (``data``, ``pull`` -- where a worker waits for the staleness bound --,
``compute``, ``push``, ``optimizer``: the local dense updates of a refresh
period), the dense period's changes as instant events, and one track per
server rank with each request it handled (``serve push``, ``serve pull``,
...) and each pull it held back until its condition held (``pull waits``,
with the puller's clock and the slowest group's). In BSP runs each server's track holds the
operations it served (``serve pull``, ``serve push``, ... : the
parameter server's loop times each one inside its watchdog guard, which
:class:`ServedOps` wraps); the gaps between them are the workers' compute.
Under ``--consistency auto`` both kinds of segment are on one timeline: the
BSP steps as above, the relaxed phases' steps and the servers' relaxed
requests as in a relaxed run, the decisions as instant events, and what a
switch costs as ``auto`` spans (``auto decision`` after a BSP segment,
``ssp:S phase start`` and ``ssp:S phase end`` around a relaxed phase).
"""

from __future__ import annotations

import contextlib
import json
import os
import time

from .metrics import json_safe

__all__ = ["Timeline", "ServedOps", "PHASE_ORDER", "load_trace"]

#: The order in which :meth:`hpcpax.app.bsp_step.BSPSteps.step` runs its
#: phases (each phase's seconds are contiguous laps of one clock).
PHASE_ORDER = ("data", "pull", "compute", "push", "dense", "optimizer")


class Timeline:
    """One worker's trace events; :meth:`write` merges them on the first worker.

    Args:
        path: the trace file (None: record nothing, every method is a no-op).
        topology: the run's topology.
        comm: the ranks traced together (default the workers'; the job's
            ``topology.comm`` to give servers tracks too); the constructor
            and :meth:`write` are collective over it.
    """

    def __init__(self, path, topology, comm=None):
        self.path = path
        self.topology = topology
        self.comm = comm if comm is not None else topology.workers
        self.events = []
        self.origin = None
        if path is not None:
            self.comm.Barrier()  # the common time origin (clock offsets)
            self.origin = time.perf_counter()
            self.wall_origin = time.time()

    @property
    def enabled(self) -> bool:
        """Whether events are recorded."""
        return self.path is not None

    def _us(self, t) -> float:
        return round((t - self.origin) * 1e6, 1)

    def step(self, step, began, times, ended) -> None:
        """Record one step: ``times`` (this worker's phase seconds) from ``began``;
        the rest up to ``ended`` is the closing ``barrier``; not collective."""
        if not self.enabled:
            return
        rank, t = self.topology.rank, began
        for phase in PHASE_ORDER:
            seconds = times.get(phase, 0.0)
            if seconds > 0:
                self.events.append({"name": phase, "cat": "step", "ph": "X", "pid": rank,
                                    "tid": 0, "ts": self._us(t), "dur": round(seconds * 1e6, 1),
                                    "args": {"step": int(step)}})
                t += seconds
        if ended > t:
            self.events.append({"name": "barrier", "cat": "wait", "ph": "X", "pid": rank,
                                "tid": 0, "ts": self._us(t), "dur": round((ended - t) * 1e6, 1),
                                "args": {"step": int(step), "with": "every worker"}})

    def span(self, name, start, end, args=None, cat="serve") -> None:
        """One complete event from ``start`` to ``end`` (``perf_counter`` seconds) on
        this rank's track; not collective."""
        if self.enabled:
            self.events.append({"name": name, "cat": cat, "ph": "X", "pid": self.topology.rank,
                                "tid": 0, "ts": self._us(start),
                                "dur": round(max(0.0, end - start) * 1e6, 1),
                                "args": json_safe(args or {})})

    def instant(self, name, args=None) -> None:
        """A decision or other point event, now, on this worker's track; not collective."""
        if self.enabled:
            self.events.append({"name": name, "cat": "decision", "ph": "i", "s": "g",
                                "pid": self.topology.rank, "tid": 0,
                                "ts": self._us(time.perf_counter()),
                                "args": json_safe(args or {})})

    def write(self) -> str | None:
        """Gather every traced rank's events; the first worker writes the file.

        **Collective** over the timeline's ``comm``. Returns the path on the
        first worker, else None.
        """
        if not self.enabled:
            return None
        topo = self.topology
        role = f"worker {topo.worker_index}" if topo.is_worker else "server"
        meta = [{"name": "process_name", "ph": "M", "pid": topo.rank, "tid": 0,
                 "args": {"name": f"rank {topo.rank} ({role})"}},
                {"name": "process_sort_index", "ph": "M", "pid": topo.rank, "tid": 0,
                 "args": {"sort_index": topo.rank}}]
        root = 0 if self.comm is topo.workers else topo.worker_ranks[0]
        gathered = self.comm.gather(meta + self.events, root=root)
        if topo.worker_index != 0:
            return None
        events = [event for rank_events in gathered for event in rank_events]
        folder = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(folder, exist_ok=True)
        tmp = self.path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as handle:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms",
                       "otherData": {"origin_unix_s": self.wall_origin,
                                     "workers": topo.num_workers}}, handle)
        os.replace(tmp, self.path)
        return self.path


class ServedOps:
    """A stand-in for a server's watchdog that also puts every ``serve ...``
    operation on the server's :class:`Timeline` track.

    Args:
        watchdog: the watchdog it wraps (None: none).
        timeline: this server rank's timeline.
    """

    def __init__(self, watchdog, timeline):
        self.watchdog, self.timeline = watchdog, timeline

    @contextlib.contextmanager
    def guard(self, name, since=None):
        """The wrapped watchdog's guard; a span on the timeline when the body ends."""
        start = time.perf_counter()
        inner = (self.watchdog.guard(name, since) if self.watchdog is not None
                 else contextlib.nullcontext())
        with inner as got:
            yield got
        if str(name).startswith("serve "):
            self.timeline.span(str(name), start, time.perf_counter(), cat="serve")

    def __getattr__(self, attribute):  # everything else is the watchdog's
        return getattr(self.watchdog, attribute)


def load_trace(path) -> dict:
    """``{rank: {phase names}}`` of a trace file (checks it is trace-event JSON).

    Raises:
        ValueError: not a JSON object with a ``traceEvents`` list of events
            that each have ``name``, ``ph``, ``pid`` and (but metadata) ``ts``.
    """
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    events = data.get("traceEvents") if isinstance(data, dict) else None
    if not isinstance(events, list):
        raise ValueError(f"{path}: not trace-event JSON (no traceEvents list)")
    tracks = {}
    for event in events:
        if not all(k in event for k in ("name", "ph", "pid")) or (
                event["ph"] != "M" and "ts" not in event):
            raise ValueError(f"{path}: malformed event {event}")
        if event["ph"] in ("X", "i"):
            tracks.setdefault(event["pid"], set()).add(event["name"])
    return tracks
