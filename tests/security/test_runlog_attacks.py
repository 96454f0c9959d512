"""Another local user against this user's run log (issue 70, item 2).

The attacker (a second uid, the ``attacker`` fixture of ``conftest.py``) plants symbolic links
at the log's path (to a new file in this user's 0700 directory) and at
SQLite's journal beside it (to a file there) in a shared sticky directory,
and holds the lock of a log an older hpcpax left readable (SQLite's shared
lock, and ``flock`` too). A one-rank run of this uid, in-process, must
follow no link, wait no longer than the run log's lock budget, and print
its summary line; the log's trouble is one warning line.
"""

import os
import re
import shutil
import sqlite3
import subprocess
import sys
import tempfile
import time
import warnings

import pytest
from mpi4py import MPI

from attackers import as_attacker, attacker_python
from hpcpax.app import trainer as trainer_module
from hpcpax.app.trainer import Trainer
from hpcpax.runlog import log as log_module
from hpcpax.runlog.log import RunLog, RunLogWarning

TINY = {"vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
        "num_sampled": 8, "global_batch": 16, "synthetic_samples": 3000, "steps": 4,
        "plan": "ps"}
#: The lock budget of these runs (the default is a few seconds; shorter keeps the test short).
BUDGET_S = 1.0


@pytest.fixture
def public_dir():
    """A fresh directory under /tmp that the attacker can reach (pytest's tmp tree is 0700)."""
    path = tempfile.mkdtemp(prefix="hpcpax-attack-", dir="/tmp")
    os.chmod(path, 0o755)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def run_logged(tmp_path, monkeypatch, capsys, log_path):
    """One run with ``HPCPAX_RUN_LOG=log_path``: ``(warnings said, seconds in the run log)``
    after checking it printed its summary line."""
    monkeypatch.setenv("HPCPAX_RUN_LOG", log_path)
    monkeypatch.setattr(log_module, "LOCK_BUDGET_S", BUDGET_S)
    spent = []
    record_run = trainer_module.record_run

    def timed(*args):
        start = time.monotonic()
        try:
            return record_run(*args)
        finally:
            spent.append(time.monotonic() - start)

    monkeypatch.setattr(trainer_module, "record_run", timed)
    capsys.readouterr()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Trainer({**TINY, "run_dir": str(tmp_path / "run")}, comm=MPI.COMM_SELF).run()
    out = capsys.readouterr().out
    assert re.search(rf"^hpcpax.train: 4 steps in .*; outputs in {tmp_path / 'run'}$", out,
                     re.MULTILINE), out[-800:]
    said = [str(w.message) for w in caught if issubclass(w.category, RunLogWarning)]
    assert all("\n" not in s for s in said)
    return said, spent[0]


@pytest.mark.timeout(120)
def test_links_planted_in_a_shared_sticky_directory_are_not_followed(attacker, tmp_path,
                                                                      public_dir, monkeypatch,
                                                                      capsys):
    shared = os.path.join(public_dir, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o1777)
    private = tmp_path / "private"  # this user's 0700 directory
    private.mkdir(mode=0o700)
    victim = private / "victim"
    victim.write_text("keep")
    log_path = os.path.join(shared, "runs.sqlite")
    planted = attacker_python(attacker, f"""
import os
os.symlink({str(private / 'created')!r}, {log_path!r})
os.symlink({str(victim)!r}, {log_path + '-journal'!r})
print("planted")
""")
    assert planted.stdout == "planted\n", planted.stderr
    said, seconds = run_logged(tmp_path, monkeypatch, capsys, log_path)
    assert said == [f"run log {log_path} not used: its directory {shared} (mode 1777) is "
                    "writable by other users, who could plant a link there; use a directory of "
                    "your own; record not saved"]
    assert seconds < BUDGET_S
    assert victim.read_text() == "keep" and sorted(os.listdir(private)) == ["victim"]
    assert os.readlink(log_path + "-journal") == str(victim)  # the attacker's links, untouched


_HOLD_LOCK = """
import fcntl, os, sqlite3, sys
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)  # flock: SQLite does not use it
reader = sqlite3.connect(f"file:{path}?mode=ro", uri=True, isolation_level=None)
reader.execute("BEGIN")
reader.execute("SELECT COUNT(*) FROM runs").fetchone()  # SQLite's shared lock (fcntl), held
print("held", flush=True)
sys.stdin.read()  # until the test closes it
"""


@pytest.mark.timeout(120)
def test_a_lock_held_by_another_user_costs_at_most_the_budget(attacker, tmp_path, public_dir,
                                                               monkeypatch, capsys):
    log_path = os.path.join(public_dir, "runs.sqlite")
    assert RunLog(log_path).append({"model": {"name": "lm"}}) == 1
    os.chmod(log_path, 0o644)  # as an older hpcpax left it: readable by everyone
    holder = as_attacker(attacker, [sys.executable, "-I", "-c", _HOLD_LOCK, log_path],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        assert holder.stdout.readline() == "held\n", holder.stderr.read()
        said, seconds = run_logged(tmp_path, monkeypatch, capsys, log_path)
    finally:
        holder.stdin.close()
        holder.wait(30)
    assert said == [f"run log {log_path} unusable (OperationalError: database is locked); "
                    "record not saved"]
    assert BUDGET_S * 0.8 < seconds < BUDGET_S + 1.0  # it waited, and no longer than the budget
    with sqlite3.connect(log_path) as db:
        assert db.execute("SELECT COUNT(*) FROM runs").fetchone() == (1,)
    assert os.stat(log_path).st_mode & 0o777 == 0o600  # narrowed: nobody else opens it now
    again = attacker_python(attacker, f"open({log_path!r}, 'rb')")
    assert again.returncode == 1 and "PermissionError" in again.stderr
