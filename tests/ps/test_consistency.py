"""Consistency models, their barrier conditions, the relaxed wire format, stragglers (serial)."""

import time

import numpy as np
import pytest

from hpcpax.app.stragglers import Stragglers, check_straggler_ranks, parse_stalls, parse_straggler
from hpcpax.comm.polling import Backoff
from hpcpax.errors import ConfigError
from hpcpax.ps.relaxed import wire
from hpcpax.ps.relaxed.clocks import StalenessLog, merge_staleness
from hpcpax.ps.relaxed.consistency import Consistency, parse_consistency, parse_consistency_spec


@pytest.mark.parametrize("text,model", [
    ("bsp", Consistency("bsp")), ("asp", Consistency("asp")),
    ("ssp:3", Consistency("ssp", 3)), ("SSP:0", Consistency("ssp", 0)),
    ("psp:2", Consistency("psp", 0, 2)), ("psp:2,1", Consistency("psp", 1, 2)),
])
def test_parse_forms(text, model):
    assert parse_consistency(text) == model
    assert parse_consistency(str(model)) == model  # str() round-trips


@pytest.mark.parametrize("text,message", [
    ("ssp", "bsp, ssp:S, asp or psp:B"), ("ssp:-1", "S must be an int >= 0"),
    ("ssp:x", "S must be an int >= 0"), ("psp:", "bsp, ssp:S"), ("psp:a,1", "B must be"),
    ("bsp:1", "bsp, ssp:S"), ("tsp", "bsp, ssp:S"),
])
def test_parse_errors_name_the_forms(text, message):
    with pytest.raises(ConfigError, match=message):
        parse_consistency(text)
    with pytest.raises(ConfigError, match="must be a str"):
        parse_consistency(3)


def test_per_variable_spec():
    default, per = parse_consistency_spec("ssp:3; softmax_b=asp ;emb=psp:1,2",
                                          ["emb", "softmax_b"])
    assert default == Consistency("ssp", 3)
    assert per == {"softmax_b": Consistency("asp"), "emb": Consistency("psp", 2, 1)}
    assert parse_consistency_spec("asp") == (Consistency("asp"), {})
    with pytest.raises(ConfigError, match="unknown sparse variable 'x'"):
        parse_consistency_spec("ssp:1; x=asp", ["emb"])
    with pytest.raises(ConfigError, match="the job's model comes first"):
        parse_consistency_spec("emb=asp; ssp:1")


def test_ssp_condition_is_the_slowest_clock():
    model = Consistency("ssp", 2)
    clocks = np.array([5, 7, 9])
    assert model.ready(7, 1, clocks) and model.ready(6, 0, clocks)
    assert not model.ready(8, 2, clocks)  # 8 - 5 > 2
    assert Consistency("bsp").ready(5, 0, clocks) and not Consistency("bsp").ready(6, 0, clocks)
    assert Consistency("asp").ready(100, 0, clocks)
    assert model.per_clock and model.bounded and not Consistency("asp").per_clock


def test_psp_waits_for_the_sampled_peers_only():
    model = Consistency("psp", staleness=1, sample=1)
    rng = np.random.default_rng(0)
    clocks = np.array([2, 9, 9, 9])
    draws = [tuple(model.draw(rng, 1, 4)) for _ in range(300)]
    assert all(len(d) == 1 and 1 not in d for d in draws)  # never itself
    assert {d[0] for d in draws} == {0, 2, 3}  # every peer gets drawn
    assert model.ready(9, 1, clocks, np.array([2])) and not model.ready(9, 1, clocks,
                                                                        np.array([0]))
    everyone = Consistency("psp", 0, 10).draw(rng, 0, 4)
    assert everyone.tolist() == [1, 2, 3]  # B >= peers: ssp's wait
    assert Consistency("psp", 0, 0).draw(rng, 0, 4).size == 0  # psp:0 is asp


def test_staleness_log_counts_violations():
    log = StalenessLog(Consistency("ssp", 1))
    log.record(5, np.array([4, 5]), np.zeros(0, np.int64), 0.0)
    log.record(7, np.array([4, 7]), np.zeros(0, np.int64), 0.5)
    figures = log.as_dict()
    assert figures["max_gap"] == 3 and figures["violations"] == 1
    assert figures["histogram"] == {"1": 1, "3": 1} and figures["waited_pulls"] == 1
    merged = merge_staleness([figures, figures])
    assert merged["pulls"] == 4 and merged["histogram"]["3"] == 2 and merged["max_gap"] == 3
    psp = StalenessLog(Consistency("psp", 0, 1))
    psp.record(6, np.array([1, 6, 6]), np.array([2]), 0.0)
    assert psp.as_dict()["max_sampled_gap"] == 0 and psp.as_dict()["violations"] == 0


def test_wire_round_trip():
    ids = np.array([4, 1, 9], np.int64)
    values = np.arange(6, dtype=np.float32).reshape(3, 2)
    other = np.arange(4, dtype=np.float64).reshape(2, 2)
    buffer = wire.pack(wire.PUSH, 3, 17, [(0, ids, values), (2, ids[:2], other)], argument=5)
    kind, phase, clock, argument, sections = wire.unpack(
        buffer, {0: (2, "float32"), 2: (2, "float64")}, with_values=True)
    assert (kind, phase, clock, argument) == (wire.PUSH, 3, 17, 5)
    assert [s[0] for s in sections] == [0, 2]
    assert np.array_equal(sections[0][1], ids) and np.array_equal(sections[0][2], values)
    assert np.array_equal(sections[1][2], other)
    reply = wire.pack(wire.REPLY, 3, 17, [(0, None, values)])
    assert len(reply) == wire.reply_bytes([(0, 3)], {0: (2, "float32")})
    with pytest.raises(ValueError, match="holds"):
        wire.unpack(np.concatenate([buffer, np.zeros(8, np.uint8)]),
                    {0: (2, "float32"), 2: (2, "float64")}, with_values=True)


def test_straggler_specs():
    assert parse_straggler("2:2.0, 3:1.5") == {2: 2.0, 3: 1.5}
    assert parse_straggler(None) == {} and parse_stalls("") == (0.0, 1.0)
    assert parse_stalls("0.05:5") == (0.05, 5.0)
    for bad, message in (("2", "RANK:FACTOR"), ("x:2", "RANK must be"), ("2:0.5", "FACTOR"),
                         ("-1:2", "RANK must be")):
        with pytest.raises(ConfigError, match=message):
            parse_straggler(bad)
    for bad, message in (("0.5", "P:FACTOR"), ("2:3", "probability"), ("0.1:x", "FACTOR")):
        with pytest.raises(ConfigError, match=message):
            parse_stalls(bad)


def test_straggler_ranks_must_be_workers_of_the_job():
    check_straggler_ranks("1:2,3:2", 4, [1, 2, 3])  # servers: rank 0
    check_straggler_ranks(None, 1, [0])
    with pytest.raises(ConfigError, match="rank 9 is not in this job of 4 ranks"):
        check_straggler_ranks("9:2", 4, [1, 2, 3])
    with pytest.raises(ConfigError, match=r"rank 0 is a server rank.*\[1, 2, 3\]"):
        check_straggler_ranks({0: 2.0}, 4, [1, 2, 3])


def test_stragglers_sleep_their_factor_and_stall_the_same_steps():
    slow = Stragglers("1:3", None, rank=1)
    start = time.perf_counter()
    assert slow.delay(1, 0.02) == pytest.approx(0.04)
    assert time.perf_counter() - start >= 0.04
    assert Stragglers("1:3", None, rank=0).delay(1, 0.02) == 0.0  # another rank
    stalls = Stragglers(None, "0.25:2", rank=0, seed=4)
    hit = [s for s in range(400) if stalls.stalls_at(s)]
    assert 60 < len(hit) < 140  # about a quarter of the steps
    assert hit == [s for s in range(400) if Stragglers(None, "0.25:2", 0, 4).stalls_at(s)]
    assert hit != [s for s in range(400) if Stragglers(None, "0.25:2", 1, 4).stalls_at(s)]


def test_backoff_sleeps_up_to_its_cap():
    backoff = Backoff(cap=0.004)
    start = time.perf_counter()
    for _ in range(40):
        backoff.pause()
    elapsed = time.perf_counter() - start
    assert elapsed >= 0.004 and backoff._sleep == 0.004  # reached the cap, slept
    backoff.reset()
    assert backoff._sleep < 0.004


def test_backoff_with_a_fraction_sleeps_at_most_that_share_of_the_wait(monkeypatch):
    """Each sleep <= fraction x the time waited since the first poll (and <= the cap)."""
    from hpcpax.comm import polling

    clock = {"now": 100.0}
    slept = []
    monkeypatch.setattr(polling.time, "perf_counter", lambda: clock["now"])

    def sleep(seconds):
        slept.append(seconds)
        clock["now"] += seconds

    monkeypatch.setattr(polling.time, "sleep", sleep)
    backoff = Backoff(cap=0.001, fraction=0.1)
    waited = []
    for _ in range(polling._MAX_SPINS + 300):  # the stalled clock spins it that long
        waited.append(clock["now"] - 100.0)
        backoff.pause()
    sleeps = [(s, w) for s, w in zip(slept, [w for w in waited][-len(slept):])]
    assert slept and max(slept) == pytest.approx(0.001)  # reached the cap
    # after the first sleeps (the floor), each is a tenth of the wait before it
    assert all(s <= max(polling._FIRST_SLEEP, 0.1 * w) + 1e-12 for s, w in sleeps)
    assert any(polling._FIRST_SLEEP < s < 0.001 for s in slept)  # grew proportionally
    backoff.reset()
    assert backoff._since is None
