"""The security tests' second local user, who attacks this job.

The fixture ``attacker`` is in ``conftest.py``; tests import the helpers from
here (``from conftest import`` would find whichever conftest pytest imported
last).

On a shared login or compute node another uid can see a job's processes
(``/proc``), its abstract sockets (``/proc/net/unix``) and any file the job
leaves readable. These tests create such a user (as root, with ``useradd``)
and run the attacks as that user (``setpriv``), against real jobs of the
uid running the tests. Skipped cleanly where the suite does not run as root
or ``useradd``/``setpriv`` are missing; serial suite only (the attacks start
their own jobs).
"""

import os
import shutil
import subprocess
import sys


#: The attacker's account (created once, kept: useradd is slow and idempotence is cheap).
ATTACKER = "hpcpax-attacker"


def skip_reason():
    if os.environ.get("PMI_RANK") or os.environ.get("PMI_SIZE"):
        return "starts its own jobs; serial suite only"
    if os.geteuid() != 0:
        return "needs root to create and become a second user"
    for tool in ("useradd", "setpriv"):
        if shutil.which(tool) is None and not os.path.exists(f"/usr/sbin/{tool}"):
            return f"needs {tool}"
    return None


def as_attacker(attacker, argv, **kwargs):
    """``subprocess.Popen`` of ``argv`` run as the attacker (no supplementary groups,
    an environment without the job's variables)."""
    uid, gid = attacker
    setpriv = shutil.which("setpriv") or "/usr/bin/setpriv"
    env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
    env.update(kwargs.pop("env", {}))
    return subprocess.Popen([setpriv, f"--reuid={uid}", f"--regid={gid}", "--clear-groups",
                             *argv], env=env, **kwargs)


def attacker_python(attacker, code, timeout=60, **kwargs):
    """Run Python ``code`` as the attacker (this interpreter, no hpcpax imported by it);
    returns the ``CompletedProcess``."""
    process = as_attacker(attacker, [sys.executable, "-I", "-c", code],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    out, err = process.communicate(timeout=timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, out, err)
