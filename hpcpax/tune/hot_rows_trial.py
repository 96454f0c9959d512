"""Hot rows, checked on live steps: keep the trees the plan chose only if they pay.

The cost model (:mod:`hpcpax.plan.hot_rows_cost`) prices links and hops;
what a tree also costs on the host (the extra exchanges of a pull and a push,
the members' bookkeeping, a relay's turn on a busy core) it does not see. So
when the plan turns trees on for some ``ps`` variables, the controller runs a
short trial, as Parallax searched partitions: ``rounds`` times, one step with
the plan's trees and one with trees off (each after a warm-up step of the
same setting), and keeps the trees only when their median step is faster.
Trees the trial could not check (a run too short for one round) are turned
off: only a trial turns them on.
Trees and today's path give the same numbers (rows are copies, sums keep the
owner's order), so the trial's steps are ordinary training steps.

**Collective** over the workers (the servers follow the ``hot_rows``
command).
"""

from __future__ import annotations

import numpy as np

from .live_search import time_steps

__all__ = ["OFF", "ROUND_STEPS", "run_hot_rows_trial"]

#: Steps of one round: a warm-up and a timed step with trees on, the same off.
ROUND_STEPS = 4

#: The setting of a variable whose trees the trial turned off (see ``HotRows.set``).
OFF = {"min_nodes": 0, "min_saved_bytes": [], "reason": "hot rows off: slower in the trial"}


def run_hot_rows_trial(engine, steps, chosen: dict, rounds: int, first_step: int) -> tuple:
    """Time ``rounds`` pairs of steps with the trees of ``chosen`` on and off.

    Args:
        engine: the :class:`~hpcpax.engine.engine.Engine` (``commands``, ``topology``).
        steps: the loop's step runner (``run(step)``, ``stopped``).
        chosen: ``{name: hot-rows entry}`` of the plan, trees on.
        rounds: pairs of timed steps (each one after a warm-up step).
        first_step: the first step the trial trains.

    Returns:
        ``(trial, next_step)``: the record for ``plan.json`` (``on_s``,
        ``off_s``: the timed steps' seconds; ``kept``: the trees of
        ``chosen`` stay in force, else :data:`OFF` is) and the first step
        after the trial. Every worker returns the same (the slowest
        worker's times).
    """
    off = {name: dict(OFF) for name in chosen}
    seconds = {"on": [], "off": []}
    step = first_step
    for _ in range(rounds):
        for label, settings in (("on", chosen), ("off", off)):
            engine.commands.run("hot_rows", settings=settings)
            seconds[label].append(time_steps(engine.topology, steps.run, step,
                                             steps=1, warmup=1))
            step += 2
            if steps.stopped:
                break
        if steps.stopped:
            break
    kept = bool(seconds["on"] and seconds["off"]
                and np.median(seconds["on"]) < np.median(seconds["off"]))
    engine.commands.run("hot_rows", settings=chosen if kept else off)
    trial = {"on_s": [round(s, 6) for s in seconds["on"]],
             "off_s": [round(s, 6) for s in seconds["off"]], "kept": kept,
             "steps": [first_step, step - 1]}
    return trial, step
