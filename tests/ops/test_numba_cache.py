"""Numba's on-disk cache shared by processes that compile at once (hpcpax.ops._numba_cache).

Unguarded, two processes compiling two signatures of one kernel together can
leave the index sending one signature to the other's machine code (seen here
in 3 of 25 races of six processes); later processes then run code compiled
for other types.
"""

import json
import os
import pickle
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

numba = pytest.importorskip("numba")

from hpcpax.ops import _numba_cache  # noqa: E402

DTYPES = ("float32", "float64", "int32", "int64", "int16", "uint8")

KERNEL = textwrap.dedent("""
    import os

    import numba


    @numba.njit(cache=True)
    def total(a):
        s = 0.0
        for i in range(a.size):
            s += a[i]
        return s + a.size


    if os.environ.get("GUARD") == "1":
        from hpcpax.ops._numba_cache import guard_module

        guard_module(globals())
""")

COMPILE = textwrap.dedent("""
    import sys, time
    import numpy as np
    import kernel
    while time.time() < float(sys.argv[2]):
        pass
    print(kernel.total(np.arange(5, dtype=sys.argv[1])))
""")


def _module(tmp_path):
    (tmp_path / "kernel.py").write_text(KERNEL)
    (tmp_path / "compile.py").write_text(COMPILE)
    return tmp_path


def _run(directory, code_or_file, *args, guard=True):
    env = dict(os.environ, GUARD="1" if guard else "0", PYTHONPATH=os.pathsep.join(
        [str(directory), str(Path(__file__).resolve().parents[2])]))
    env.pop("NUMBA_CACHE_DIR", None)
    argv = [sys.executable, code_or_file, *args] if code_or_file.endswith(".py") \
        else [sys.executable, "-c", code_or_file, *args]
    return subprocess.Popen(argv, cwd=directory, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


INSPECT = textwrap.dedent("""
    import json, pickle, sys
    from pathlib import Path
    cache = Path("__pycache__")
    with open(sys.argv[1], "rb") as f:
        pickle.load(f)
        _, overloads = pickle.loads(f.read())
    out = {}
    for key, name in overloads.items():
        data = pickle.loads((cache / name).read_bytes())
        stored = next(item for item in data if type(item).__name__ == "Signature")
        out[str(key[0])] = str(tuple(stored.args))
    print(json.dumps(out))
""")


def _index(directory):
    """``({signature args: args of the code in its data file}, index path, overloads)``
    of the cache (the data files unpickle only where ``kernel`` imports)."""
    index = next((directory / "__pycache__").glob("kernel.total-*.nbi"))
    out, err = _run(directory, INSPECT, str(index)).communicate(timeout=120)
    assert out, err
    with open(index, "rb") as f:
        pickle.load(f)
        _, overloads = pickle.loads(f.read())
    return json.loads(out), index, overloads


def test_processes_compiling_at_once_leave_a_consistent_cache(tmp_path):
    directory = _module(tmp_path)
    for _ in range(2):
        for old in (directory / "__pycache__").glob("*"):
            old.unlink()
        start = time.time() + 3.0  # every process imported, then all compile together
        processes = [_run(directory, "compile.py", dtype, str(start)) for dtype in DTYPES]
        for process in processes:
            out, err = process.communicate(timeout=120)
            assert process.returncode == 0, err
            assert float(out) == 15.0
        index, _, _ = _index(directory)
        assert len(index) == len(DTYPES)  # no process's entry lost
        assert all(key == stored for key, stored in index.items()), index


def test_an_entry_pointing_at_another_signatures_code_is_compiled_afresh(tmp_path):
    directory = _module(tmp_path)
    for dtype in ("float64", "int64"):
        process = _run(directory, "compile.py", dtype, "0")
        assert process.communicate(timeout=120)[0].strip() == "15.0"
    _, index, overloads = _index(directory)
    # what an unguarded race leaves: each signature sent to the other's code
    keys = list(overloads)
    overloads[keys[0]], overloads[keys[1]] = overloads[keys[1]], overloads[keys[0]]
    with open(index, "rb") as f:
        version = pickle.load(f)
        stamp, _ = pickle.loads(f.read())
    with open(index, "wb") as f:
        pickle.dump(version, f, protocol=-1)
        f.write(pickle.dumps((stamp, overloads)))
    swapped, _, _ = _index(directory)
    assert all(key != stored for key, stored in swapped.items())
    check = ("import numpy as np, kernel; "
             "print(kernel.total(np.arange(5, dtype='float64')), "
             "kernel.total(np.arange(5, dtype='int64')))")
    out, err = _run(directory, check).communicate(timeout=120)
    assert out.split() == ["15.0", "15.0"], err
    healed, _, _ = _index(directory)
    assert all(key == stored for key, stored in healed.items()), healed


def test_a_cache_that_cannot_be_locked_compiles_without_it(monkeypatch, capsys):
    import fcntl

    @numba.njit(cache=True)
    def doubled(a):
        return a * 2

    _numba_cache.guard(doubled)

    def refuse(fd, operation):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", refuse)
    monkeypatch.setattr(_numba_cache, "_WARNED", set())
    assert doubled(np.int64(21)) == 42
    assert type(doubled._cache).__name__ == "NullCache"
    assert "cannot lock Numba's cache" in capsys.readouterr().err


def test_every_cached_kernel_of_hpcpax_is_guarded():
    from numba.core.dispatcher import Dispatcher

    from hpcpax.ops import _numba, _numba_idmap, _numba_initializers, _numba_kernels, \
        _numba_sums

    found = 0
    for module in (_numba_kernels, _numba_sums, _numba_idmap, _numba_initializers):
        for name, value in vars(module).items():
            if isinstance(value, Dispatcher) and value._cache.__class__.__name__ != "NullCache":
                assert getattr(value, "_hpcpax_guarded", False), f"{module.__name__}.{name}"
                found += 1
    assert found >= 20
    twin = _numba._Either(_numba_kernels.sgd_rows)
    assert twin.serial._hpcpax_guarded
