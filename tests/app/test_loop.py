"""The one training loop (:mod:`hpcpax.app.loop`): segments, guards, hooks, the runner.

Pure Python (no MPI): a schedule of recorded strategies, and a watchdog
whose guards are recorded, show the order the loop promises in its module
doc. The real strategies run in tests/app/test_trainer.py,
test_relaxed_train.py and test_consistency_auto.py.
"""

import contextlib

from hpcpax.app.loop import StepFigures, TrainingLoop


class Guards:
    def __init__(self, log):
        self.log = log

    @contextlib.contextmanager
    def guard(self, name):
        self.log.append(("guard", name))
        yield


class Strategy:
    """Steps to ``end``; ``extra`` steps asked of the runner after step ``ask_at``."""

    def __init__(self, name, log, ask_at=None, extra=0, stop_at=None, loop=None):
        self.name, self.log, self.ask_at, self.extra = name, log, ask_at, extra
        self.stop_at, self.loop, self.end_step = stop_at, loop, None

    def label(self, step):
        return f"{self.name} {step}"

    def begin(self, first, end):
        self.log.append(("begin", self.name, first, end))
        self.end_step = end

    def stop_before(self, step):
        return step > self.end_step or self.loop.stopped

    def step(self, step):
        self.log.append(("step", self.name, step))
        return StepFigures(step, 0.0, {}, 1, 0.5, kind=self.name)

    def record(self, figures):
        self.log.append(("record", self.name, figures.step))
        if figures.step == self.stop_at:
            self.loop.stopped = True

    def after(self, step, runner):
        self.log.append(("after", self.name, step))
        if step == self.ask_at:
            for s in range(step + 1, step + 1 + self.extra):
                runner.run(s)
            return step + self.extra
        return step

    def user_hooks(self, step):
        self.log.append(("user", self.name, step))

    def end(self, last):
        self.log.append(("end", self.name, last))
        return last


class Schedule:
    def __init__(self, segments, steps):
        self.segments, self.steps = list(segments), steps

    def finished(self, step):
        return step > self.steps or not self.segments

    def next_segment(self, step):
        strategy, length = self.segments.pop(0)
        return strategy, min(self.steps, step + length - 1)


class Hook:
    def __init__(self, log):
        self.log = log

    def after_step(self, figures):
        self.log.append(("hook", figures.kind, figures.step))


def make(segments, steps, log):
    schedule = Schedule([], steps)
    loop = TrainingLoop(Guards(log), schedule, [Hook(log), None])
    for strategy, length in segments:
        strategy.loop = loop
        schedule.segments.append((strategy, length))
    return loop


def test_a_step_is_guarded_hooked_recorded_then_followed():
    log = []
    loop = make([(Strategy("bsp", log), 5)], 2, log)
    assert loop.run(1) == 2
    assert log == [("begin", "bsp", 1, 2),
                   ("guard", "bsp 1"), ("step", "bsp", 1), ("hook", "bsp", 1),
                   ("record", "bsp", 1), ("after", "bsp", 1),
                   ("guard", "bsp 2"), ("step", "bsp", 2), ("hook", "bsp", 2),
                   ("record", "bsp", 2), ("after", "bsp", 2),
                   ("guard", "bsp 3"),  # stop_before says the segment is over
                   ("end", "bsp", 2)]


def test_segments_follow_each_other_from_where_the_last_ended():
    log = []
    loop = make([(Strategy("bsp", log), 2), (Strategy("relaxed", log), 3),
                 (Strategy("bsp", log), 10)], 6, log)
    assert loop.run(1) == 6
    steps = [(e[1], e[2]) for e in log if e[0] == "step"]
    assert steps == [("bsp", 1), ("bsp", 2), ("relaxed", 3), ("relaxed", 4), ("relaxed", 5),
                     ("bsp", 6)]
    assert [e for e in log if e[0] == "begin"] == [("begin", "bsp", 1, 2),
                                                   ("begin", "relaxed", 3, 5),
                                                   ("begin", "bsp", 6, 6)]


def test_the_planner_asks_the_runner_for_steps_and_the_loop_runs_them():
    log = []
    loop = make([(Strategy("bsp", log, ask_at=2, extra=2), 10)], 6, log)
    assert loop.run(1) == 6
    # steps 3 and 4 run inside step 2's after(), each guarded, hooked and recorded, and
    # the user's hooks see them (the planner is not asked again)
    inner = log[log.index(("after", "bsp", 2)) + 1:log.index(("after", "bsp", 5))]
    assert inner == [("guard", "bsp 3"), ("step", "bsp", 3), ("hook", "bsp", 3),
                     ("record", "bsp", 3), ("user", "bsp", 3),
                     ("guard", "bsp 4"), ("step", "bsp", 4), ("hook", "bsp", 4),
                     ("record", "bsp", 4), ("user", "bsp", 4), ("guard", "bsp 5"),
                     ("step", "bsp", 5), ("hook", "bsp", 5), ("record", "bsp", 5)]
    assert [e[2] for e in log if e[0] == "step"] == [1, 2, 3, 4, 5, 6]


def test_a_stop_ends_the_segment_and_the_run():
    log = []
    loop = make([(Strategy("bsp", log, stop_at=3), 10), (Strategy("bsp2", log), 10)], 8, log)
    assert loop.run(1) == 3
    assert loop.stopped
    assert [e[2] for e in log if e[0] == "step"] == [1, 2, 3]
    assert ("end", "bsp", 3) in log and not any(e[1] == "bsp2" for e in log)


def test_a_resumed_run_starts_at_its_first_step():
    log = []
    loop = make([(Strategy("bsp", log), 10)], 7, log)
    assert loop.run(5) == 7
    assert [e[2] for e in log if e[0] == "step"] == [5, 6, 7]


def test_nothing_runs_past_the_end():
    log = []
    loop = make([(Strategy("bsp", log), 10)], 4, log)
    assert loop.run(5) == 4
    assert log == []
