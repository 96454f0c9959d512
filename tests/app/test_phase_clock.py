"""PhaseClock: each lap charges the seconds since the previous lap to one phase."""

import time

from hpcpax.app.step_report import PhaseClock


def test_laps_charge_the_time_since_the_previous_lap():
    clock = PhaseClock(("a", "b"))
    time.sleep(0.02)
    clock.lap("a")
    clock.lap("b")  # almost nothing since the previous lap
    time.sleep(0.02)
    clock.lap("a")  # charged again: phases accumulate
    elapsed = time.perf_counter() - clock.began
    times = clock.times
    assert set(times) == {"a", "b"}
    assert times["a"] >= 0.04 and 0 <= times["b"] < times["a"]
    assert times["a"] + times["b"] <= elapsed
