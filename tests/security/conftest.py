"""The security tests' fixture: a second local user (helpers: ``attackers.py``)."""

import pwd
import shutil
import subprocess

import pytest

from attackers import ATTACKER, skip_reason


@pytest.fixture(scope="session")
def attacker():
    """``(uid, gid)`` of a second local user (created if missing); skips where impossible."""
    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    try:
        entry = pwd.getpwnam(ATTACKER)
    except KeyError:
        useradd = shutil.which("useradd") or "/usr/sbin/useradd"
        done = subprocess.run([useradd, "--system", "--no-create-home", "--shell",
                               "/usr/sbin/nologin", ATTACKER], capture_output=True, text=True,
                              timeout=60)
        if done.returncode != 0:
            pytest.skip(f"useradd failed: {done.stderr.strip()}")
        entry = pwd.getpwnam(ATTACKER)
    return entry.pw_uid, entry.pw_gid
