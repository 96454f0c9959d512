"""The balancer's decisions on simulated workers (local, no MPI)."""

from types import SimpleNamespace

import pytest

from hpcpax.app.balance import BatchBalancer
from hpcpax.errors import ConfigError


def balancer(workers=3, global_batch=600, spec="speed"):
    topology = SimpleNamespace(num_workers=workers, worker_index=0, workers=None)
    return BatchBalancer(spec, 10, topology, global_batch)


def work_of(shares, fixed, per_sample):
    return [f + s * t for s, f, t in zip(shares, fixed, per_sample)]


def test_converges_with_fixed_costs():
    """A straggler whose per-step cost does not shrink with its share: the shares settle
    where every worker finishes together instead of oscillating."""
    fixed, per_sample = [0.01, 0.01, 0.02], [1e-4, 1e-4, 2e-4]
    b = balancer()
    seen = []
    for evaluation in range(8):
        decision = b.decide(10 * (evaluation + 1), work_of(b.shares, fixed, per_sample))
        if decision is not None:
            b.shares = decision["to"]
        seen.append(list(b.shares))
    times = work_of(b.shares, fixed, per_sample)
    assert max(times) - min(times) <= 2 * max(per_sample)  # within a sample or two
    assert seen[-1] == seen[-2] == seen[-3]  # settled
    assert b.shares == [260, 260, 80]  # 0.01 + 260e-4 = 0.02 + 80 x 2e-4 = 0.036 s
    assert seen[0] == [240, 240, 120]  # first: proportional (one share seen per worker)


def test_recorded_oversubscribed_evaluations_move_shares_boundedly():
    """The first two evaluations of a measured run (2-core node, 1 server + 3 workers,
    worker 2 sleeping as long as it computes, lm with hidden 512-512 and 6144 samples
    per step): the workers' median work seconds at even shares, then at the first
    balanced shares (to the printed 3 digits). A line through those two points per
    worker had handed worker 0 3398 samples and worker 2 756 (its fit: 0.9 us per
    sample and a 0.2 s fixed part); now the second correction is proportional at the
    shares in force, and bounded."""
    b = balancer(global_batch=6144)
    first = b.decide(10, [0.2130, 0.2130, 0.4055])
    assert first["to"] == [2433, 2433, 1278] and first["fixed_seconds"] == [0.0] * 3
    b.shares = first["to"]
    second = b.decide(20, [0.2111, 0.2217, 0.2905])
    assert second["fixed_seconds"] == [0.0] * 3
    per_sample = [0.2111 / 2433, 0.2217 / 2433, 0.2905 / 1278]
    assert second["seconds_per_sample"] == pytest.approx(per_sample)
    # proportional to 1 / per_sample: 2632.5, 2506.6, 1004.8 (floored, the rest by finish time)
    assert second["to"] == [2632, 2507, 1005]
    assert all(abs(n - o) <= 0.25 * o for n, o in zip(second["to"], first["to"]))


def test_a_correction_of_uneven_shares_is_bounded():
    """A worker measured 4x slower per sample at once: its share falls by a quarter per
    correction, not to a third in one evaluation."""
    b = balancer()
    b.shares = [250, 250, 100]
    decision = b.decide(10, [0.025, 0.025, 0.04])  # 1e-4, 1e-4, 4e-4 s per sample
    assert decision["to"][2] == 75 and sum(decision["to"]) == 600


def test_noise_below_the_gain_keeps_the_shares():
    b = balancer()
    assert b.decide(10, [0.0601, 0.06, 0.0599]) is None and b.shares == [200, 200, 200]


def test_fixed_shares_and_even_reading():
    b = balancer(spec="300,200,100")
    assert b.shares == [300, 200, 100] and not b.even and not b.adaptive
    with pytest.raises(ConfigError, match="summing to the global batch"):
        balancer(spec="300,200,99")
    assert balancer(spec=None).even


def test_state_round_trip():
    b = balancer()
    b.shares = b.decide(10, [0.02, 0.02, 0.06])["to"]
    other = balancer()
    other.load(b.state())
    assert other.shares == b.shares and other.state() == b.state()
    other.load({"shares": [1, 2]})  # another worker count: ignored
    assert other.shares == b.shares


def test_a_change_is_checked_against_the_next_window():
    """The first window after a change is measured against the window it was decided on;
    a change that paid stays, with its measured and predicted step gains side by side."""
    b = balancer()
    first = b.decide(10, [0.02, 0.02, 0.04], [0.05, 0.05, 0.05])
    # proportional: 1e-4, 1e-4, 2e-4 s per sample -> [240, 240, 120]: work 0.04 -> 0.024
    assert first["to"] == [240, 240, 120]
    assert first["predicted_step_gain"] == pytest.approx(0.4 * 0.04 / 0.05)
    b.shares = first["to"]
    assert b.decide(20, [0.024, 0.024, 0.024], [0.04, 0.041, 0.039]) is None
    assert b.history[-1] is first and first["checked_at"] == 20
    assert first["measured_step_gain"] == pytest.approx(1 - 0.04 / 0.05)
    # checked once: a later window does not overwrite it
    b.decide(30, [0.024, 0.024, 0.024], [0.06, 0.06, 0.06])
    assert first["checked_at"] == 20 and not any(d.get("undo") for d in b.history)


def test_a_change_that_made_steps_slower_twice_is_undone_and_cools_down():
    """Steps >= UNDO_LOSS longer in the two windows after a change: back to the shares
    before it, no change for COOLDOWN evaluations (doubling with each undo), though the
    model keeps proposing."""
    from hpcpax.app.balance import COOLDOWN, UNDO_LOSS

    b = balancer()
    work = [0.02, 0.02, 0.04]  # worker 2 twice as slow per sample at even shares
    change = b.decide(10, work, [0.05] * 3)
    b.shares = change["to"]
    slower = 0.05 * (1 + UNDO_LOSS) + 1e-3
    # the first window: suspect, and no new change (the model would correct the shares)
    assert b.decide(20, [0.03, 0.024, 0.024], [slower] * 3) is None
    assert change["suspect"] and change["measured_step_gain"] == pytest.approx(1 - slower / 0.05)
    undo = b.decide(30, [0.024] * 3, [slower] * 3)
    assert undo["undo"] and undo["to"] == [200, 200, 200] and undo["from"] == change["to"]
    assert undo["undone_step"] == 10 and undo["cooldown"] == COOLDOWN
    assert change["confirmed_at"] == 30
    b.shares = undo["to"]
    for evaluation in range(COOLDOWN):  # the even shares' work again: still 'balance it'
        assert b.decide(40 + 10 * evaluation, work, [0.05] * 3) is None
    again = b.decide(40 + 10 * COOLDOWN, work, [0.05] * 3)
    assert again is not None and again["to"] == change["to"]
    b.shares = again["to"]
    assert b.decide(50 + 10 * COOLDOWN, [0.024] * 3, [slower] * 3) is None
    second = b.decide(60 + 10 * COOLDOWN, [0.024] * 3, [slower] * 3)
    assert second["undo"] and second["cooldown"] == 2 * COOLDOWN
    # an undo is not itself checked (its shares were measured before)
    b.shares = second["to"]
    assert b.decide(70 + 10 * COOLDOWN, work, [0.2] * 3) is None
    assert b.decide(80 + 10 * COOLDOWN, work, [0.2] * 3) is None


def test_one_slow_window_after_a_change_keeps_it():
    from hpcpax.app.balance import UNDO_LOSS

    b = balancer()
    change = b.decide(10, [0.02, 0.02, 0.04], [0.05] * 3)
    b.shares = change["to"]
    assert b.decide(20, [0.024] * 3, [0.05 * (1 + UNDO_LOSS) + 1e-3] * 3) is None
    assert b.decide(30, [0.024] * 3, [0.045] * 3) is None
    assert change["confirmed_step_gain"] == pytest.approx(0.1) and b.shares == [240, 240, 120]
    assert not any(d.get("undo") for d in b.history)


def test_a_slower_window_within_the_noise_keeps_the_change():
    from hpcpax.app.balance import UNDO_LOSS

    b = balancer()
    b.shares = b.decide(10, [0.02, 0.02, 0.04], [0.05] * 3)["to"]
    assert b.decide(20, [0.024] * 3, [0.05 * (1 + UNDO_LOSS) - 1e-3] * 3) is None
    assert b.shares == [240, 240, 120]


def test_state_keeps_the_cooldown():
    b = balancer()
    b.shares = b.decide(10, [0.02, 0.02, 0.04], [0.05] * 3)["to"]
    assert b.decide(20, [0.024] * 3, [0.07] * 3) is None  # suspect
    b.shares = b.decide(30, [0.024] * 3, [0.07] * 3)["to"]  # undone
    other = balancer()
    other.load(b.state())
    assert other.state() == b.state() and other.shares == [200, 200, 200]
    assert other.decide(30, [0.02, 0.02, 0.04], [0.05] * 3) is None  # still cooling down


class _ThreeWorkers:
    """The workers' communicator seen from worker 0 of three identical workers."""

    def __init__(self):
        self.gathered = []

    def gather(self, value, root=0):
        self.gathered.append(value)
        return [value] * 3

    def bcast(self, value, root=0):
        return value


def test_the_first_step_and_warming_steps_are_not_measured():
    """observe: the process's first step (start-up) and the plan's measured steps
    (``warming``) stay out of the window's medians; a window of warm-up only is not
    evaluated (no collective)."""
    workers = _ThreeWorkers()
    topology = SimpleNamespace(num_workers=3, worker_index=0, workers=workers)
    b = BatchBalancer("speed", 5, topology, 600)
    slow = {"data": 1.0, "compute": 1.0, "pull": 1.0}
    for step in range(1, 6):  # step 1 and the warming steps 2-5: nothing measured
        assert b.observe(step, slow, 200, warming=step > 1) is None
    assert workers.gathered == []
    for step, work in zip(range(6, 11), (0.010, 0.012, 0.011, 0.013, 0.014)):
        b.observe(step, {"data": 0.0, "compute": work, "pull": 0.002}, 200,
                  step_seconds=work + 0.005)
    assert workers.gathered == [(pytest.approx(0.012), pytest.approx(0.017))]
