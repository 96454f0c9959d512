"""The run log (SQLite) and the learned correction fitted on it."""

import json
import os
import re
import sqlite3
import subprocess
import sys

import numpy as np
import pytest

from hpcpax.comm.fabric import Fabric, LinkModel
from hpcpax.runlog import cli as runs_cli
from hpcpax.plan.auto import make_plan
from hpcpax.plan.cost_model import CostParams
from hpcpax.runlog.learned import FEATURES, Correction, fit_correction, load_correction
from hpcpax.runlog.log import SCHEMA_VERSION, RunLog, RunLogWarning, run_log_path


def _record(model="lm", step=0.01, resources=None):
    resources = resources or {"latency": 0.002, "client kernels": 0.003, "compute": 0.004}
    return {"model": {"name": model, "variables": []},
            "layout": {"workers": 2, "num_nodes": 1, "servers": 1},
            "strategy": {"emb": {"method": "ps", "partitions": 1, "local_aggregation": False}},
            "measured": {"step_s": step, "phases": {}},
            "predicted": {"seconds": sum(resources.values()), "resources": resources}}


def test_path_from_env_default_and_off(monkeypatch, tmp_path):
    monkeypatch.setenv("HPCPAX_RUN_LOG", str(tmp_path / "a.sqlite"))
    assert run_log_path() == str(tmp_path / "a.sqlite")
    monkeypatch.setenv("HPCPAX_RUN_LOG", "off")
    assert run_log_path() is None and RunLog().append(_record()) is None
    monkeypatch.delenv("HPCPAX_RUN_LOG")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    assert run_log_path() == str(tmp_path / "cache" / "hpcpax" / "runs.sqlite")


def test_append_and_read_back(tmp_path):
    log = RunLog(str(tmp_path / "runs.sqlite"))
    assert log.records() == []  # no file yet: nothing, no warning
    ids = [log.append(_record(m, s), source="bench") for m, s in (("lm", 0.01), ("ctr", 0.02))]
    assert ids == [1, 2]
    got = log.records()
    assert [r["model"]["name"] for r in got] == ["lm", "ctr"]
    assert got[1]["measured"]["step_s"] == 0.02 and got[1]["source"] == "bench"
    assert [r["id"] for r in log.records(model="ctr")] == [2]
    with sqlite3.connect(log.path) as db:
        assert db.execute("SELECT value FROM meta WHERE key='schema_version'").fetchone() == (
            str(SCHEMA_VERSION),)
        assert db.execute("SELECT model, step_s, predicted_s FROM runs WHERE id=1").fetchone() \
            == ("lm", 0.01, pytest.approx(0.009))


def test_corrupt_file_warns_and_never_raises(tmp_path):
    path = tmp_path / "runs.sqlite"
    path.write_bytes(b"this is not a database" * 100)
    log = RunLog(str(path))
    with pytest.warns(RunLogWarning, match="unusable"):
        assert log.append(_record()) is None
    with pytest.warns(RunLogWarning, match="unreadable"):
        assert log.records() == []
    with pytest.warns(RunLogWarning):
        correction, why = load_correction(str(path))
    assert correction is None and "0 records" in why


def test_newer_schema_is_left_alone(tmp_path):
    path = str(tmp_path / "runs.sqlite")
    assert RunLog(path).append(_record()) == 1
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value=? WHERE key='schema_version'", (str(SCHEMA_VERSION + 1),))
    with pytest.warns(RunLogWarning, match="newer"):
        assert RunLog(path).append(_record()) is None
    with pytest.warns(RunLogWarning, match="newer"):
        assert RunLog(path).records() == []
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)


def test_locked_file_warns_after_the_timeout(tmp_path):
    path = str(tmp_path / "runs.sqlite")
    RunLog(path).append(_record())
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        with pytest.warns(RunLogWarning, match="locked"):
            assert RunLog(path, timeout_s=0.2).append(_record()) is None
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(RunLog(path).records()) == 1


_WRITER = """
import sys
from hpcpax.runlog.log import RunLog
log = RunLog(sys.argv[1])
for i in range(int(sys.argv[3])):
    assert log.append({"model": {"name": sys.argv[2]}, "measured": {"step_s": i}}) is not None
"""


def test_concurrent_writers_lose_no_record(tmp_path):
    path = str(tmp_path / "runs.sqlite")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, path, f"w{k}", "25"], env=env)
             for k in range(4)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0, 0, 0]
    records = RunLog(path).records()
    assert len(records) == 100
    for k in range(4):
        steps = sorted(r["measured"]["step_s"] for r in records if r["model"]["name"] == f"w{k}")
        assert steps == list(range(25))


def test_correction_recovers_known_weights():
    rng = np.random.default_rng(0)
    truth = {"latency": 3.0, "client kernels": 0.5}
    records = []
    for _ in range(40):
        resources = {"latency": rng.uniform(1e-3, 5e-3), "client kernels": rng.uniform(1e-3, 5e-3),
                     "compute": rng.uniform(1e-3, 5e-3)}
        measured = resources["compute"] + sum(truth[k] * resources[k] for k in truth)
        records.append(_record(step=measured, resources=resources))
    correction = fit_correction(records, ridge=1e-6)
    assert correction.weights["latency"] == pytest.approx(3.0, rel=1e-3)
    assert correction.weights["client kernels"] == pytest.approx(0.5, rel=1e-3)
    # mechanisms no record exercised keep the analytic weight
    assert correction.weights["inter link"] == pytest.approx(1.0)
    assert correction.apply(records[0]["predicted"]) == pytest.approx(
        records[0]["measured"]["step_s"], rel=1e-3)
    again = Correction.from_dict(json.loads(json.dumps(correction.to_dict())))
    assert again.weights == correction.weights and set(again.weights) == set(FEATURES)


def test_cross_validation_fits_each_held_out_group_once(monkeypatch):
    from hpcpax.runlog import learned

    rng = np.random.default_rng(1)
    truth = {"latency": 3.0, "client kernels": 0.5}
    records = []
    for model in ("a", "b", "c"):
        for _ in range(20):
            resources = {k: rng.uniform(1e-3, 5e-3) for k in ("latency", "client kernels",
                                                             "compute")}
            measured = resources["compute"] + sum(truth[k] * resources[k] for k in truth)
            records.append(_record(model=model, step=measured, resources=resources))
    solves = []
    original = learned._solve
    monkeypatch.setattr(learned, "_solve", lambda *a: solves.append(1) or original(*a))
    correction = fit_correction(records)
    v = correction.validation
    assert v["groups"] == 3 and v["helps"] and v["learned_error"] < 0.1 * v["analytic_error"]
    # one solve per (ridge, held-out group), one on every record for the weights
    assert len(solves) == len(learned.RIDGES) * 3 + 1
    # the ridge pulls towards the analytic 1: between it and the truth
    assert 2.5 < correction.weights["latency"] <= 3.0
    assert 0.5 <= correction.weights["client kernels"] < 0.7
    assert correction.weights["inter link"] == pytest.approx(1.0)


def test_plan_says_whether_the_correction_was_used(tmp_path):
    fabric = Fabric(LinkModel(1e-6, 5e9), LinkModel(1e-6, 5e9), 1 << 20)
    variables = [{"name": "emb", "kind": "sparse", "shape": (50_000, 32), "alpha": 0.01}]
    topo = {"num_nodes": 2, "workers_per_node": 2, "servers_per_node": 1}
    path = str(tmp_path / "runs.sqlite")
    for _ in range(7):
        RunLog(path).append(_record())
    correction, why = load_correction(path)
    assert correction is None and why == "not used: 7 records with a prediction < 8"
    plan = make_plan(variables, "auto", topo, fabric, params=CostParams(),
                     correction=(correction, why))
    assert plan.search["cost_model"]["learned_correction"] is False
    assert plan.search["cost_model"]["why"] == why
    RunLog(path).append(_record())
    correction, why = load_correction(path)
    assert correction is not None and why == "used: fitted on 8 records"
    plan = make_plan(variables, "auto", topo, fabric, params=CostParams(),
                     correction=(correction, why))
    assert plan.search["cost_model"]["learned_correction"] is True
    assert plan.search["cost_model"]["correction"]["records"] == 8
    hybrid = make_plan(variables, "hybrid", topo, fabric, params=CostParams(),
                       correction=(correction, why))
    assert hybrid.search["cost_model"]["learned_correction"] is False


def test_runs_cli_list_and_export(tmp_path, capsys):
    path = str(tmp_path / "runs.sqlite")
    RunLog(path).append(_record("ctr", 0.0123), source="cost_model_check")
    assert runs_cli.main(["list", "--path", path]) == 0
    out = capsys.readouterr().out
    assert ": 1 run\n" in out and "cost_model_check" in out and "12.30" in out
    target = tmp_path / "out.jsonl"
    assert runs_cli.main(["export", "--path", path, "--out", str(target)]) == 0
    lines = target.read_text().splitlines()
    assert len(lines) == 1 and json.loads(lines[0])["model"]["name"] == "ctr"


def test_runs_cli_lists_the_newest_runs_unless_asked_for_all(tmp_path, capsys):
    path = str(tmp_path / "runs.sqlite")
    log = RunLog(path)
    for i in range(5):
        log.append(_record("lm", 0.001 * (i + 1)), source=f"bench{i}")
    assert runs_cli.main(["list", "--path", path, "--last", "2"]) == 0
    out = capsys.readouterr().out
    assert "5 runs, the newest 2 shown (--last 0: all)" in out
    assert "bench3" in out and "bench4" in out and "bench2" not in out
    assert runs_cli.main(["list", "--path", path, "--last", "0"]) == 0
    out = capsys.readouterr().out
    assert ": 5 runs\n" in out and all(f"bench{i}" in out for i in range(5))
    with pytest.raises(SystemExit):
        runs_cli.main(["list", "--path", path, "--last", "-1"])


def test_runs_cli_into_a_closed_pipe_exits_quietly(tmp_path):
    """``python -m hpcpax.runs list | head -1``: status 0, no traceback."""
    import subprocess
    import sys

    path = str(tmp_path / "runs.sqlite")
    RunLog(path).append(_record("lm", 0.001), source="train")
    child = subprocess.Popen([sys.executable, "-m", "hpcpax.runs", "list", "--path", path],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    child.stdout.close()  # the reader is gone before the first line
    _, err = child.communicate(timeout=60)
    assert child.returncode == 0 and b"Error" not in err, err


def test_a_training_run_appends_one_record(tmp_path, monkeypatch):
    from mpi4py import MPI

    from hpcpax.app.trainer import Trainer

    path = str(tmp_path / "runs.sqlite")
    monkeypatch.setenv("HPCPAX_RUN_LOG", path)
    config = {"vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
              "num_sampled": 8, "global_batch": 16, "synthetic_samples": 3000, "steps": 12,
              "plan_steps": 3, "quiet": True, "run_dir": str(tmp_path / "run")}
    Trainer(config, comm=MPI.COMM_SELF).run()
    (record,) = RunLog(path).records()
    assert record["source"] == "train" and record["model"]["name"] == "lm"
    assert record["layout"]["workers"] == 1 and record["plan_mode"] == "auto"
    names = {v["name"] for v in record["model"]["variables"] if v["kind"] == "sparse"}
    assert set(record["strategy"]) == names
    assert all(0 < v["alpha"] <= 1 for v in record["model"]["variables"] if v["kind"] == "sparse")
    assert record["measured"]["steps"] == 12 - 3 - 2 and record["measured"]["step_s"] > 0
    assert record["predicted"]["seconds"] > 0 and "compute" in record["predicted"]["resources"]


# ---------------------------------------------------------------- issue 70, item 2
def _one_line(caught):
    """The caught RunLogWarnings, each checked to print as one line."""
    import warnings

    out = [w for w in caught if issubclass(w.category, RunLogWarning)]
    for w in out:
        shown = warnings.formatwarning(w.message, w.category, w.filename, w.lineno, w.line)
        assert shown.count("\n") == 1 and shown.endswith("\n"), shown
    return [str(w.message) for w in out]


def _store_raw(path, *texts):
    """Rows whose ``record`` column is ``texts`` as given (what another writer could leave)."""
    with sqlite3.connect(path) as db:
        for text in texts:
            db.execute("INSERT INTO runs (created_utc, source, model, record) "
                       "VALUES ('2026-01-01T00:00:00Z', 'train', 'lm', ?)", (text,))


def test_malformed_records_are_one_warning_and_left_out(tmp_path, recwarn, capsys):
    path = str(tmp_path / "runs.sqlite")
    log = RunLog(path)
    for _ in range(8):
        log.append(_record())
    _store_raw(path, "[1, 2]", "{not json", '"text"', "[" * 100_000 + "]" * 100_000, 7,
               json.dumps(_record(step=float("nan")), allow_nan=True))
    # JSON objects whose fields are not what a record holds
    _store_raw(path, json.dumps({"predicted": [1], "measured": "fast", "layout": [2],
                                 "model": "lm", "strategy": {"emb": 3}}),
               json.dumps({**_record(), "predicted": {"resources": {"latency": "slow"}}}),
               json.dumps(_record(step=0)))
    records = log.records()
    assert len(records) == 8 + 3
    (said,) = _one_line(recwarn)
    assert said == (f"run log {path}: 6 malformed record(s) ignored (record 9: a JSON list, "
                    "not an object)"), said
    recwarn.clear()
    correction, why = load_correction(path)  # was an AttributeError
    assert correction is not None and why == "used: fitted on 8 records"
    said = _one_line(recwarn)
    assert len(said) == 2 and said[1] == (
        "run log: 2 malformed record(s) left out of the learned correction (record 16: 'slow' "
        "is not a number of seconds)"), said
    assert runs_cli.main(["list", "--path", path]) == 0
    listed = capsys.readouterr().out
    assert ": 11 runs\n" in listed and "   15  " in listed


def test_a_non_numeric_schema_version_is_one_warning(tmp_path, recwarn):
    path = str(tmp_path / "runs.sqlite")
    assert RunLog(path).append(_record()) == 1
    with sqlite3.connect(path) as db:
        db.execute("UPDATE meta SET value='abc' WHERE key='schema_version'")
    assert RunLog(path).append(_record()) is None  # was a ValueError traceback
    assert RunLog(path).records() == []
    assert _one_line(recwarn) == [
        f"run log {path} has schema 'abc', not a number: record not saved",
        f"run log {path} has schema 'abc', not a number: ignored"]
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)


def test_log_and_journal_are_created_0600_and_an_older_mode_narrowed(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        path = str(tmp_path / "new" / "runs.sqlite")
        assert RunLog(path).append(_record()) == 1
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        holder = sqlite3.connect(path, isolation_level=None)  # a write in flight: its journal
        holder.execute("BEGIN IMMEDIATE")
        holder.execute("INSERT INTO meta VALUES ('x', 'y')")
        assert stat.S_IMODE(os.stat(path + "-journal").st_mode) == 0o600
        holder.execute("ROLLBACK")
        holder.close()
        older = str(tmp_path / "older.sqlite")
        sqlite3.connect(older).close()  # as an older hpcpax made it: the umask's 0644
        assert stat.S_IMODE(os.stat(older).st_mode) == 0o644
        assert RunLog(older).append(_record()) == 1
        assert stat.S_IMODE(os.stat(older).st_mode) == 0o600
    finally:
        os.umask(old)


def test_a_symlink_at_the_log_path_is_never_followed(tmp_path, recwarn):
    private = tmp_path / "private"
    private.mkdir(mode=0o700)
    victim = private / "victim"
    victim.write_text("keep")
    for name, target in (("runs.sqlite", victim), ("dangling.sqlite", private / "created")):
        link = tmp_path / name
        link.symlink_to(target)
        assert RunLog(str(link)).append(_record()) is None
        assert RunLog(str(link)).records() == []
    assert victim.read_text() == "keep" and sorted(os.listdir(private)) == ["victim"]
    said = _one_line(recwarn)
    assert len(said) == 4 and all("is a symbolic link" in s for s in said), said
    assert said[0] == (f"run log {tmp_path}/runs.sqlite not used: {tmp_path}/runs.sqlite is a "
                       "symbolic link; record not saved")
    journal = tmp_path / "real.sqlite-journal"  # SQLite opens its journal by name
    journal.symlink_to(victim)
    assert RunLog(str(tmp_path / "real.sqlite")).append(_record()) is None
    assert victim.read_text() == "keep"


def test_a_directory_others_can_write_is_not_used(tmp_path, recwarn):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)  # a sticky /tmp-like directory
    path = str(shared / "runs.sqlite")
    assert RunLog(path).append(_record()) is None
    assert not os.path.lexists(path)
    (said,) = _one_line(recwarn)
    assert said == (f"run log {path} not used: its directory {shared} (mode 1777) is writable "
                    "by other users, who could plant a link there; use a directory of your own; "
                    "record not saved")


def test_every_lock_wait_of_one_call_is_within_the_budget(tmp_path, monkeypatch, recwarn):
    import time

    from hpcpax.runlog import log as log_module

    assert 0 < log_module.LOCK_BUDGET_S <= 5  # a few seconds, whatever HPCPAX_TIMEOUT says
    monkeypatch.setenv("HPCPAX_TIMEOUT", "3600")
    monkeypatch.setattr(log_module, "LOCK_BUDGET_S", 0.5)
    path = str(tmp_path / "runs.sqlite")
    RunLog(path).append(_record())
    holder = sqlite3.connect(path, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for call in (lambda: RunLog(path).append(_record()), lambda: RunLog(path).records()):
            start = time.monotonic()
            assert call() in (None, [])
            assert 0.4 < time.monotonic() - start < 1.5
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    said = _one_line(recwarn)
    assert len(said) == 2 and all("database is locked" in s for s in said), said


_TRAIN = {"vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
          "num_sampled": 8, "global_batch": 16, "synthetic_samples": 3000, "steps": 6,
          "plan_steps": 3}


def test_runs_end_with_their_summary_whatever_the_log_holds(tmp_path, monkeypatch, capsys):
    """A malformed record (read by ``--plan auto``), a non-numeric schema and a held
    lock: each run finishes and prints its summary line; the log's word is one line."""
    import time
    import warnings

    from mpi4py import MPI

    from hpcpax.app import trainer as trainer_module
    from hpcpax.app.trainer import Trainer
    from hpcpax.runlog import log as log_module

    monkeypatch.setattr(log_module, "LOCK_BUDGET_S", 0.5)
    seconds = []
    record_run = trainer_module.record_run
    monkeypatch.setattr(trainer_module, "record_run",
                        lambda *a: seconds.append(time.monotonic()) or record_run(*a))

    def run(path, name, **config):
        monkeypatch.setenv("HPCPAX_RUN_LOG", path)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            Trainer({**_TRAIN, "run_dir": str(tmp_path / name), **config},
                    comm=MPI.COMM_SELF).run()
        seconds[-1] = time.monotonic() - seconds[-1]
        out = capsys.readouterr().out
        assert re.search(rf"^hpcpax.train: 6 steps in .*; outputs in {tmp_path / name}$", out,
                         re.MULTILINE), out[-500:]
        return _one_line(caught), out

    listed = str(tmp_path / "listed.sqlite")
    RunLog(listed).append(_record())
    _store_raw(listed, "[1, 2]")
    said, _ = run(listed, "a")  # --plan auto reads the log
    assert len(said) == 1 and "a JSON list, not an object" in said[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert len(RunLog(listed).records()) == 2  # its own record added

    lettered = str(tmp_path / "lettered.sqlite")
    RunLog(lettered).append(_record())
    with sqlite3.connect(lettered) as db:
        db.execute("UPDATE meta SET value='abc' WHERE key='schema_version'")
    said, _ = run(lettered, "b", plan="ps")  # only the record at the end
    assert said == [f"run log {lettered} has schema 'abc', not a number: record not saved"]

    locked = str(tmp_path / "locked.sqlite")
    RunLog(locked).append(_record())
    holder = sqlite3.connect(locked, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        said, _ = run(locked, "c", plan="ps")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(said) == 1 and "database is locked" in said[0], said
    assert seconds[-1] < 1.5  # the record's wait: the budget, not HPCPAX_TIMEOUT
