"""PhaseClock: each lap charges the wall and CPU seconds since the previous lap to one phase."""

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


def test_laps_charge_cpu_seconds_to_the_phase_that_spent_them():
    clock = PhaseClock(("busy", "idle"))
    end = time.process_time() + 0.05
    while time.process_time() < end:  # burn 50 ms of CPU
        pass
    clock.lap("busy")
    time.sleep(0.05)  # holds no CPU
    clock.lap("idle")
    assert clock.cpu["busy"] >= 0.05 and clock.cpu["idle"] < 0.02
    assert clock.times["idle"] >= 0.05 and clock.cpu["busy"] <= clock.times["busy"] + 0.01
