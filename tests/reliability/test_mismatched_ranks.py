"""MPMD launches whose ranks differ in a job-shaping setting (issue 49): every rank stops
before anything diverges, naming the setting and which ranks hold which value; no hang.

``mpirun -n 2 env A python -m hpcpax.train ... : -n 2 env B python -m hpcpax.train ...``
(Hydra's ``:`` separates the two halves of the job).
"""

import subprocess
import sys

import pytest

from reliability_jobs import TINY, clean_env, mpirun, serial_only

LIMIT_S = 90


def mpmd(tmp_path, first, second):
    """Ranks 0-1 run ``first`` (env assignments, then flags), ranks 2-3 ``second``."""
    def half(words):
        env = [w for w in words if "=" in w and w.startswith("HPCPAX_")]
        flags = [w for w in words if w not in env]
        return ["-n", "2", "env", *env, sys.executable, "-m", "hpcpax.train", *TINY,
                "--steps", "3", *flags]
    command = ["timeout", "-s", "KILL", str(LIMIT_S), mpirun(), *half(first), ":",
               *half(second)]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True,
                          timeout=LIMIT_S + 30, env=clean_env(HPCPAX_TIMEOUT=60))
    return done.returncode, done.stdout + done.stderr


@pytest.mark.parametrize("first, second, message", [
    ([], ["HPCPAX_SERVERS_PER_NODE=2"],
     "ranks disagree on HPCPAX_* settings: field 'HPCPAX_SERVERS_PER_NODE' differs "
     "(ranks [0, 1] have 'unset'; ranks [2, 3] have 2)"),
    ([], ["HPCPAX_RANKS_PER_NODE=2"],
     "ranks disagree on HPCPAX_* settings: field 'HPCPAX_RANKS_PER_NODE' differs "
     "(ranks [0, 1] have 'unset'; ranks [2, 3] have 2)"),
    (["HPCPAX_TIMEOUT=20"], ["HPCPAX_TIMEOUT=0"],  # 0: no watchdog, whose set-up is collective
     "ranks disagree on HPCPAX_* settings: field 'HPCPAX_TIMEOUT' differs "
     "(ranks [0, 1] have 20.0; ranks [2, 3] have 0.0)"),
    ([], ["HPCPAX_HOT_ROWS=two"],
     "ranks disagree on HPCPAX_* settings: field 'HPCPAX_HOT_ROWS' differs "
     "(ranks [0, 1] have 0; ranks [2, 3] have \"invalid: 'two'\")"),
    (["--run-dir", "one"], ["--run-dir", "two"], None),
], ids=["servers_per_node", "ranks_per_node", "timeout", "unparsable", "run_dir"])
def test_ranks_that_differ_stop_together_naming_the_setting(tmp_path, first, second, message):
    serial_only()
    status, output = mpmd(tmp_path, first, second)
    if message is None:  # the run dir: compared as absolute paths, before rank 0 claims one
        message = (f"ranks disagree on training config: field 'run_dir' differs (ranks [0, 1] "
                   f"have '{tmp_path / 'one'}'; ranks [2, 3] have '{tmp_path / 'two'}')")
        assert not (tmp_path / "one").exists() and not (tmp_path / "two").exists()
    assert status not in (0, 124, 137), output  # failed, and not by the time limit
    errors = [line for line in output.splitlines() if line.startswith("hpcpax.train: error")]
    assert errors and all(line.endswith(": " + message) for line in errors), output
    assert "Traceback" not in output


def test_ranks_that_agree_or_differ_only_locally_train(tmp_path):
    serial_only()
    # a variable the flag overrides on some ranks only, threads that differ: both local
    status, output = mpmd(tmp_path, ["--servers-per-node", "1", "HPCPAX_THREADS=1"],
                          ["HPCPAX_SERVERS_PER_NODE=3", "--servers-per-node", "1",
                           "HPCPAX_THREADS=2"])
    assert status == 0, output
    assert len(list((tmp_path / "runs").glob("*/summary.json"))) == 1
