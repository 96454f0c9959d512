"""``HPCPAX_CALIBRATION_CACHE``: a calibration kept by one job is taken by the next job
of the same layout key, bit for bit, and refused (named, then measured) when its
file or directory cannot be trusted or its key, age or figures are wrong."""

import json
import os

import pytest
from mpi4py import MPI

from hpcpax.comm.topology import init
from hpcpax.tune import calibration_cache as cache
from hpcpax.tune.calibrate import cost_params

KEY = {"places": [["host", "net:[1]"]], "node_of": [0], "server_ranks": [], "dim": 64}
CALIBRATION = {"fabric": {"intra": [1e-6, 1e9]}, "kernels": {"dedup": {"call_s": 1e-6,
                                                                       "unit_s": 1e-9}},
               "handoff": {"handoff_s": 0.0}, "software": {"ps_pull": {"call_s": 1e-4}},
               "software_scope": "job", "partition_overhead_s": 1e-5,
               "partition_overhead_per": "exchange", "one_host": True,
               "budgets": {"fabric_s": 1.0}}


def test_kept_calibration_comes_back_equal(tmp_path):
    directory = str(tmp_path / "cache")
    path = cache.store(directory, KEY, CALIBRATION)
    assert oct(os.stat(path).st_mode & 0o777) == "0o600"
    assert oct(os.stat(directory).st_mode & 0o777) == "0o700"
    assert cache.load(directory, KEY) == (CALIBRATION, None)


def test_no_file_is_no_reason(tmp_path):
    assert cache.load(str(tmp_path / "cache"), KEY) == (None, None)


def test_another_layout_is_not_taken(tmp_path):
    directory = str(tmp_path / "cache")
    path = cache.store(directory, KEY, CALIBRATION)
    other = {**KEY, "node_of": [1]}
    assert cache.load(directory, other) == (None, None)  # another file name
    # the same name with another key inside (a hash collision, or a file moved by hand)
    os.rename(path, os.path.join(directory, cache._file_name(other)))
    calibration, why = cache.load(directory, other)
    assert calibration is None and "another layout" in why


def test_an_old_or_future_calibration_is_measured_again(tmp_path):
    directory = str(tmp_path / "cache")
    cache.store(directory, KEY, CALIBRATION, now=1000.0)
    assert cache.load(directory, KEY, now=1000.0 + cache.MAX_AGE_S - 1)[0] == CALIBRATION
    assert "older" in cache.load(directory, KEY, now=1000.0 + cache.MAX_AGE_S + 1)[1]
    assert "future" in cache.load(directory, KEY, now=10.0)[1]


@pytest.mark.parametrize("change,reason", [
    (lambda r: r["calibration"]["kernels"]["dedup"].update(call_s=float("nan")), "finite"),
    (lambda r: r["calibration"].update(software=[1e308 * 10]), "finite"),
    (lambda r: r["calibration"].pop("fabric"), "finite"),
    (lambda r: r["calibration"].update(extra=1), "finite"),
    (lambda r: r.update(schema=2), "schema"),
    (lambda r: r.update(measured_unix="yesterday"), "older"),
])
def test_tampered_figures_are_refused(tmp_path, change, reason):
    directory = str(tmp_path / "cache")
    path = cache.store(directory, KEY, CALIBRATION)
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    change(record)
    with open(path, "w", encoding="utf-8") as handle:
        handle.write(json.dumps(record))
    calibration, why = cache.load(directory, KEY)
    assert calibration is None and reason in why, why


@pytest.mark.parametrize("text", [b"\xff\xfe", b"[" * 100000, b"{}", b"[1, 2]"])
def test_unreadable_files_are_refused_in_one_line(tmp_path, text):
    directory = str(tmp_path / "cache")
    path = cache.store(directory, KEY, CALIBRATION)
    with open(path, "wb") as handle:
        handle.write(text)
    calibration, why = cache.load(directory, KEY)
    assert calibration is None and "\n" not in why


def test_oversized_file_is_not_read(tmp_path):
    directory = str(tmp_path / "cache")
    path = cache.store(directory, KEY, CALIBRATION)
    with open(path, "ab") as handle:
        handle.write(b" " * (cache.MAX_BYTES + 1))
    calibration, why = cache.load(directory, KEY)
    assert calibration is None and "bytes" in why


def test_a_symbolic_link_is_not_followed(tmp_path):
    directory = str(tmp_path / "cache")
    target = cache.store(str(tmp_path / "elsewhere"), KEY, CALIBRATION)
    os.makedirs(directory, mode=0o700)
    os.symlink(target, os.path.join(directory, cache._file_name(KEY)))
    calibration, why = cache.load(directory, KEY)
    assert calibration is None and why


def test_a_directory_others_may_write_is_refused(tmp_path):
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o777)
    os.chmod(directory, 0o777)
    calibration, why = cache.load(str(directory), KEY)
    assert calibration is None and "writable by other users" in why
    with pytest.raises(OSError, match="writable by other users"):
        cache.store(str(directory), KEY, CALIBRATION)


def test_a_directory_of_another_user_is_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to give a directory to another uid")
    directory = tmp_path / "cache"
    directory.mkdir(mode=0o700)
    os.chown(directory, 12345, 12345)
    calibration, why = cache.load(str(directory), KEY)
    assert calibration is None and "belongs to uid 12345" in why


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(120)
def test_the_second_job_takes_the_first_jobs_calibration(tmp_path_factory, all_ok):
    """Collective: the first call measures and keeps, the second takes it; both give the
    same cost model; a changed budget is another key (measured again)."""
    comm = MPI.COMM_WORLD
    directory = comm.bcast(str(tmp_path_factory.mktemp("cc") / "cache")
                           if comm.rank == 0 else None)
    topology = init()
    first, how_first = cache.calibrate_or_reuse(topology, fabric_seconds=0.2, budget_s=0.5,
                                                directory=directory)
    second, how_second = cache.calibrate_or_reuse(topology, fabric_seconds=0.2, budget_s=0.5,
                                                  directory=directory)
    assert how_first["source"] == "measured" and how_second["source"] == "kept"
    assert how_first["file"] == how_second["file"] and how_first["file"].endswith(".json")
    assert all_ok(cost_params(first) == cost_params(second) and first == second)
    # another budget is another key, so another file (what a third call would measure)
    other = cache.layout_key(topology, 0.2, 0.4, 64)
    assert other != cache.layout_key(topology, 0.2, 0.5, 64)
    assert cache._file_name(other) != how_first["file"]
    assert cache.load(directory, other) == (None, None)
    topology.free()


def test_off_always_measures(monkeypatch):
    """``off`` (or no directory) calls the calibration and keeps nothing."""
    calls = []
    monkeypatch.setattr("hpcpax.tune.calibrate.calibrate",
                        lambda topology, **kwargs: calls.append(kwargs) or dict(CALIBRATION))
    for directory in ("off", ""):
        calibration, how = cache.calibrate_or_reuse(None, fabric_seconds=0.2, budget_s=0.5,
                                                    directory=directory)
        assert calibration == CALIBRATION and how == {"source": "measured", "file": None}
    assert calls == [{"fabric_seconds": 0.2, "dim": 64, "budget_s": 0.5}] * 2
