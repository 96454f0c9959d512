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
