"""``--consistency auto`` in a real run: segments, decisions, exactness of the switches.

Needs a server rank and two workers (``mpirun -n 3`` or more); each run is a
tiny float64 model.
"""

import json
import os
import signal

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app.auto_channel import LEAD
from hpcpax.app.checkpoint_files import latest, read_meta
from hpcpax.app.timeline import load_trace
from hpcpax.app.trainer import Trainer
from hpcpax.plan import adaptive
from trainer_runs import first_worker as leader_value, run_trainer, shared_dir
from trainer_runs import metrics_lines as records
from trainer_runs import close as close_to

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True, "dtype": "float64", "plan": "ps",
    "servers_per_node": 1, "ranks_per_node": None,
}


def run(comm, **overrides):
    return run_trainer(comm, {**TINY, **overrides})


def close(a, b):
    return close_to(a, b, rtol=1e-9)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_switches_to_ssp0_and_back_keep_bsp_parameters(comm, tmp_path, monkeypatch):
    """Scripted decisions bsp -> ssp:0 -> bsp: ssp:0 gives BSP's updates, and the dense
    replicas and optimizer state go to the servers and back, so the parameters are plain
    BSP's (float64 round-off); each change is in metrics.jsonl and the checkpoint, and
    the --trace timeline holds every worker's steps of both kinds of segment, the
    server's BSP and relaxed requests, the decisions and the switches."""
    script = iter([("ssp", 0), ("bsp", 0), None, None, None])

    def scripted(self, step, work, batch, seconds, losses, steps, samples_per_s):
        assert np.asarray(work).shape[1] == self.workers
        self.segments += 1
        change = next(script)
        if change is None:
            return None
        decision = {"step": step, "from": self.consistency, "reason": "scripted",
                    "to": "ssp:0" if change[0] == "ssp" else "bsp",
                    "shares": list(self.shares), "measurements": {}}
        self.mode, self.staleness = change
        self.history.append(decision)
        return decision

    monkeypatch.setattr(adaptive.AutoPolicy, "decide", scripted)
    run_dir = shared_dir(comm, tmp_path, "auto")
    config = {"steps": 15, "auto_segment": 4, "checkpoint_every": 15}
    trace = os.path.join(run_dir, "trace.json")
    auto = run(comm, run_dir=run_dir, consistency="auto", trace=trace, **config)
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    ok = close(leader_value(comm, auto, auto.parameters),
               leader_value(comm, plain, plain.parameters))
    losses = leader_value(comm, auto, auto.losses)
    ok = ok and len(losses) == 15 and np.allclose(
        losses, leader_value(comm, plain, plain.losses), rtol=1e-9)
    if comm.Get_rank() == 0:
        changes = [r["auto"] for r in records(run_dir, "auto")]
        ok = ok and [(c["step"], c["to"]) for c in changes] == [(4, "ssp:0"), (8, "bsp")]
        ok = ok and [r["step"] for r in records(run_dir, "loss")] == list(range(1, 16))
        meta = read_meta(latest(run_dir))
        ok = ok and meta["auto"]["mode"] == "bsp" and len(meta["auto"]["history"]) == 2
        ok = ok and traced_both_kinds(trace, comm.size)
        # the relaxed phase's staleness records are in the summary, as a fixed ssp run's
        with open(os.path.join(run_dir, "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
        stale = summary["staleness"]["ssp:0"]
        relaxed = [r["step"] for r in records(run_dir, "loss")
                   if r.get("workers") is not None]  # the relaxed steps' lines
        ok = ok and stale["max_gap"] == 0 and stale["violations"] == 0
        ok = ok and stale["pulls"] == len(relaxed) * (comm.size - 1) > 0
        ok = ok and len(summary["servers"]) == 1
    assert comm.allreduce(bool(ok), op=MPI.LAND)


def traced_both_kinds(path, size) -> bool:
    """The trace of the bsp (1-4) -> ssp:0 -> bsp run (rank 0 serves): the decision
    taken after step 8 inside the phase applies from step 8 + 0 + LEAD: ssp:0 runs
    steps 5 to 7 + LEAD."""
    tracks = load_trace(path)
    with open(path, encoding="utf-8") as handle:
        events = json.load(handle)["traceEvents"]
    workers = range(1, size)
    steps = {(e["pid"], e["args"]["step"]) for e in events if e["name"] == "compute"}
    relaxed_pushes = [e for e in events if e["name"] == "serve push"]
    names = {e["name"] for e in events if e["pid"] in workers}
    return (steps == {(w, s) for w in workers for s in range(1, 16)}
            and {"serve push", "serve pull", "serve push_many"} <= tracks[0]
            and len(relaxed_pushes) == (4 + LEAD - 1) * len(workers)
            and {"auto: ssp:0", "auto: bsp", "auto decision", "ssp:0 phase start",
                 "ssp:0 phase end", "barrier", "dense"} <= names)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_persistent_straggler_gets_balanced_bsp(comm, tmp_path, monkeypatch):
    """A 30x straggler (of this tiny model's small compute): auto (measured decisions)
    moves to balanced BSP, giving the slow worker a smaller share; with no relaxed
    segment the run is plain BSP's. The relaxed rules are switched off (they are
    tested on recorded traces in tests/plan/test_adaptive.py): the lockstep trial,
    which this tiny oversubscribed job would make, and the transient-stall rule,
    which the straggler's 30x amplified jitter in a 3-step segment set off in 1 of
    4 CI runs."""
    monkeypatch.setattr(adaptive, "WAIT_TRIAL", 2.0)
    monkeypatch.setattr(adaptive, "MIN_STALL_FRACTION", 2.0)  # a fraction never reaches it
    run_dir = shared_dir(comm, tmp_path, "straggler")
    last = comm.Get_size() - 1
    auto = run(comm, run_dir=run_dir, consistency="auto", auto_segment=4, steps=16,
               straggler=f"{last}:30", global_batch=48)
    history = leader_value(comm, auto, auto.schedule.policy.history)
    shares = leader_value(comm, auto, auto.balance.shares)
    ok = any(h["to"] == "balanced" for h in history)
    ok = ok and shares[-1] < min(shares[:-1]) and sum(shares) == 48
    if comm.rank == 0:  # the decisions are saved with the plan too
        with open(os.path.join(run_dir, "plan.json"), encoding="utf-8") as handle:
            ok = ok and json.load(handle)["runtime"]["consistency_auto"] == history
    if not any(h["to"].startswith("ssp") for h in history):
        plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), steps=16,
                    global_batch=48)
        ok = ok and close(leader_value(comm, auto, auto.parameters),
                          leader_value(comm, plain, plain.parameters))
    assert comm.allreduce(bool(ok), op=MPI.LAND), (history, shares)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_resume_keeps_the_controller_state(comm, tmp_path, monkeypatch):
    """A scripted move to balanced shares is in the checkpoint; the resumed run reads with
    those shares from its first step and ends with plain BSP's parameters."""
    workers = comm.Get_size() - 1
    forced = [12 - 2 * (workers - 1)] + [2] * (workers - 1)

    def scripted(self, step, work, batch, seconds, losses, steps, samples_per_s):
        self.segments += 1
        if self.mode == "balanced":
            return None
        decision = {"step": step, "from": self.consistency, "to": "balanced",
                    "shares": forced, "reason": "scripted", "measurements": {}}
        self.mode, self.shares = "balanced", list(forced)
        self.history.append(decision)
        return decision

    monkeypatch.setattr(adaptive.AutoPolicy, "decide", scripted)
    run_dir = shared_dir(comm, tmp_path, "resume")
    run(comm, run_dir=run_dir, consistency="auto", auto_segment=3, steps=8, checkpoint_every=8)
    seen = []
    resumed = Trainer({**TINY, "run_dir": run_dir, "consistency": "auto", "auto_segment": 3,
                       "steps": 12, "resume": True}, comm=comm, collect=True,
                      hooks=[lambda trainer, step: seen.append(list(trainer.balance.shares))])
    resumed.run()
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), steps=12)
    ok = resumed.topology.is_server or seen == [forced] * 4
    ok = ok and close(leader_value(comm, resumed, resumed.parameters),
                      leader_value(comm, plain, plain.parameters))
    assert comm.allreduce(bool(ok), op=MPI.LAND)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_ssp0_with_balanced_shares_keeps_bsp_parameters(comm, tmp_path, monkeypatch):
    """Scripted bsp -> ssp:0 with uneven shares (the relaxed steps read each worker's
    share and weight its gradient by it) -> balanced BSP with those shares: the same
    global batches and mean gradients, so plain BSP's parameters (float64 round-off).
    The decision on step 8, taken inside the ssp phase, applies from step 8 + 0 + LEAD:
    the phase runs to the step before it on every worker."""
    workers = comm.Get_size() - 1
    forced = [12 - 2 * (workers - 1)] + [2] * (workers - 1)
    script = iter([("ssp", 0), ("balanced", 0), None, None, None])
    seen = []  # (step, this worker's samples) of the relaxed steps

    def hook(trainer, step):
        if trainer.schedule.policy.mode == "ssp":
            seen.append((step, trainer.schedule.relaxed_steps.records[-1]["batch"]))

    def scripted(self, step, work, batch, seconds, losses, steps, samples_per_s):
        self.segments += 1
        change = next(script)
        if change is None:
            return None
        before = self.consistency
        self.mode, self.staleness = change
        self.shares = list(forced)
        decision = {"step": step, "from": before, "to": self.consistency,
                    "shares": list(forced), "reason": "scripted", "measurements": {}}
        self.history.append(decision)
        return decision

    monkeypatch.setattr(adaptive.AutoPolicy, "decide", scripted)
    config = {"steps": 12, "auto_segment": 4}
    auto = Trainer({**TINY, **config, "run_dir": shared_dir(comm, tmp_path, "auto"),
                    "consistency": "auto"}, comm=comm, collect=True, hooks=[hook])
    auto.run()
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    ok = close(leader_value(comm, auto, auto.parameters),
               leader_value(comm, plain, plain.parameters))
    history = leader_value(comm, auto, auto.schedule.policy.history)
    ok = ok and [h["to"] for h in history] == ["ssp:0+balanced", "balanced"]
    switch = 8 + LEAD
    ok = ok and history[1]["step"] == 8 and history[1]["applies_from"] == switch
    if not auto.topology.is_server:  # the relaxed steps 5..switch-1 read the forced share
        ok = ok and seen == [(s, forced[auto.topology.worker_index])
                             for s in range(5, switch)]
    assert comm.allreduce(bool(ok), op=MPI.LAND), (history, seen)


def share_script(forced):
    """A scripted ``decide``: bsp -> ssp:0 at the first segment's end, then ssp:0 with
    ``forced`` shares (a change that keeps ssp:0, so it applies inside the phase), then
    no more changes."""
    script = iter([("ssp", None), ("ssp", forced)])

    def scripted(self, step, work, batch, seconds, losses, steps, samples_per_s):
        self.segments += 1
        change = next(script, None)
        if change is None:
            self.segment = min(self.max_segment, 2 * self.segment)
            return None
        before = self.consistency
        self.mode, self.staleness = change[0], 0
        if change[1] is not None:
            self.shares = list(change[1])
        self.segment = self.base_segment
        decision = {"step": step, "from": before, "to": self.consistency,
                    "shares": list(self.shares), "reason": "scripted", "measurements": {}}
        self.history.append(decision)
        return decision

    return scripted


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_shares_change_inside_an_ssp_phase_at_one_step_on_every_worker(comm, tmp_path,
                                                                      monkeypatch):
    """Scripted bsp -> ssp:0 (step 4) -> ssp:0 with uneven shares, decided on step 8
    inside the ssp phase: no phase ends for it (one relaxed phase), every worker reads
    the new share from step 8 + 0 + LEAD on and not before, and the parameters are
    plain BSP's (the same global batches and mean gradients; float64 round-off)."""
    workers = comm.Get_size() - 1
    forced = [12 - 2 * (workers - 1)] + [2] * (workers - 1)
    monkeypatch.setattr(adaptive.AutoPolicy, "decide", share_script(forced))
    seen = []  # (step, this worker's samples) of the relaxed steps

    def hook(trainer, step):
        if step > 4:
            seen.append((step, trainer.schedule.relaxed_steps.records[-1]["batch"]))

    config = {"steps": 20, "auto_segment": 4}
    run_dir = shared_dir(comm, tmp_path, "auto")
    auto = Trainer({**TINY, **config, "run_dir": run_dir, "consistency": "auto"},
                   comm=comm, collect=True, hooks=[hook])
    auto.run()
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), **config)
    ok = close(leader_value(comm, auto, auto.parameters),
               leader_value(comm, plain, plain.parameters))
    history = leader_value(comm, auto, auto.schedule.policy.history)
    switch = 8 + LEAD
    ok = ok and [(h["step"], h["to"]) for h in history] == [(4, "ssp:0"),
                                                            (8, "ssp:0+balanced")]
    ok = ok and history[1]["applies_from"] == switch
    if not auto.topology.is_server:
        w = auto.topology.worker_index
        even = 12 // workers + (1 if w < 12 % workers else 0)
        ok = ok and seen == [(s, even if s < switch else forced[w]) for s in range(5, 21)]
        ok = ok and auto.schedule.relaxed_steps.phase == 1  # the shares changed in place
    if comm.Get_rank() == 0:
        lines = [r["auto"] for r in records(run_dir, "auto")]
        ok = ok and [x.get("applies_from") for x in lines] == [None, switch]
    assert comm.allreduce(bool(ok), op=MPI.LAND), (history, seen)


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(240)
def test_preemption_with_a_decision_pending_inside_an_ssp_phase(comm, tmp_path, monkeypatch):
    """SIGUSR1 at the second worker's step 8, once the segment ending there sent its
    figures and before its decision applies (step 8 + LEAD): the phase stops where the
    workers agree (usually before that step), the decision is made and is in the
    checkpoint, the run exits preempted, and the resumed run ends with plain BSP's
    parameters."""
    workers = comm.Get_size() - 1
    forced = [12 - 2 * (workers - 1)] + [2] * (workers - 1)
    monkeypatch.setattr(adaptive.AutoPolicy, "decide", share_script(forced))
    run_dir = shared_dir(comm, tmp_path, "auto")
    config = {**TINY, "steps": 20, "auto_segment": 4, "run_dir": run_dir,
              "consistency": "auto"}

    def signal_once(trainer, step):
        if trainer.topology.worker_index == 1 and step == 8:
            os.kill(os.getpid(), signal.SIGUSR1)

    first = Trainer(config, comm=comm, hooks=[signal_once])
    summary = leader_value(comm, first, first.run())
    meta = read_meta(latest(run_dir)) if comm.Get_rank() == 0 else None
    monkeypatch.setattr(adaptive.AutoPolicy, "decide", share_script(forced))
    resumed = Trainer({**config, "resume": True}, comm=comm, collect=True)
    resumed.run()
    plain = run(comm, run_dir=shared_dir(comm, tmp_path, "plain"), steps=20, auto_segment=4)
    ok = close(leader_value(comm, resumed, resumed.parameters),
               leader_value(comm, plain, plain.parameters))
    ok = ok and summary["preempted"]
    if comm.Get_rank() == 0:
        stopped_at = meta["data_position"]
        ok = ok and 8 <= stopped_at < 20 and meta["auto"]["shares"] == forced
        ok = ok and [h["step"] for h in meta["auto"]["history"]] == [4, 8]
    assert comm.allreduce(bool(ok), op=MPI.LAND), (summary, meta)


def test_auto_without_server_ranks_is_refused_naming_auto(tmp_path):
    """One process (no server rank): a ConfigError that names ``auto``, not the ssp
    model its segments would use."""
    from hpcpax.errors import ConfigError

    with pytest.raises(ConfigError, match="consistency 'auto' needs server ranks"):
        Trainer({**TINY, "servers_per_node": 0, "consistency": "auto", "steps": 4,
                 "run_dir": str(tmp_path / "run")}, comm=MPI.COMM_SELF).run()
