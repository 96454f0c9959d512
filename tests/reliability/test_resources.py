"""The server memory budget: tables loaded whole are refused on every rank before
allocating; declared rows cost nothing (rows come on first touch, checked as
they grow: tests/ps/test_lazy_tables.py)."""

import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.errors import ConfigError
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.options import parse_bytes
from hpcpax.ps.memory import default_budget, table_bytes


def test_parse_bytes():
    assert parse_bytes("8G") == 8 << 30 and parse_bytes("512MiB") == 512 << 20
    assert parse_bytes(1000) == 1000 and parse_bytes("1.5k") == 1536 and parse_bytes(None) is None
    for bad in ("lots", "-1G", 0, "8X"):
        with pytest.raises(ConfigError, match="budget"):
            parse_bytes(bad, "budget")


def test_default_budget_from_env_and_meminfo(tmp_path, monkeypatch):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal: 2000 kB\nMemAvailable: 1000 kB\n")
    monkeypatch.delenv("HPCPAX_SERVER_MEMORY", raising=False)
    assert default_budget(4, str(meminfo)) == int(1000 * 1024 * 0.8 / 4)
    assert default_budget(1, str(tmp_path / "none")) is None
    monkeypatch.setenv("HPCPAX_SERVER_MEMORY", "3M")
    assert default_budget(4, str(meminfo)) == 3 << 20


def test_table_bytes_counts_optimizer_slots():
    adam = SparseVariableSpec("a", 100, 4, optimizer="adam", optimizer_params={"lr": 0.1},
                              num_partitions=2)
    sgd = SparseVariableSpec("s", 100, 4, optimizer="sgd", num_partitions=2)
    assert table_bytes([adam], 2) == [[800, 1600], [800, 1600]]
    assert table_bytes([sgd], 1) == [[1600, 0]]


def _register(budget, specs, env=None):
    topo = hpcpax.init(servers_per_node=1 if MPI.COMM_WORLD.Get_size() > 1 else 0)
    ps = ParameterServer(topo)
    ps.memory_budget = budget
    try:
        if topo.is_server:
            message = ""
            while True:  # a refused register leaves serve(); follow on to the shutdown
                try:
                    ps.serve()
                    return message, ps
                except ConfigError as exc:
                    message = str(exc)
        try:
            ps.register(specs)
            return "", ps
        except ConfigError as exc:
            return str(exc), ps
        finally:
            ps.shutdown()
    finally:
        topo.free()


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_tables_loaded_whole_are_refused_on_every_rank(comm):
    """A table about to be loaded whole (a switch to ps) counts every row."""
    big = SparseVariableSpec("big", 100_000, 16, optimizer="adagrad", num_partitions=1)
    topo = hpcpax.init(servers_per_node=1 if MPI.COMM_WORLD.Get_size() > 1 else 0)
    try:
        ps = ParameterServer(topo)
        ps.memory_budget = 1 << 20
        try:
            ps.register_collective([big] if topo.is_worker else [], whole=True)
            message = ""
        except ConfigError as exc:
            message = str(exc)
    finally:
        topo.free()
    words = ["owner rank", "6.1 MiB", "optimizer slots", "1.0 MiB", "big 100000x16"]
    ok = all(w in message for w in words) and not ps.variables
    assert comm.allreduce(ok, op=MPI.LAND), message


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_declared_rows_cost_nothing_at_registration(comm):
    """Rows are created on first touch: a table far above the budget registers."""
    big = SparseVariableSpec("big", 10**12, 16, optimizer="adagrad", num_partitions=1)
    message, ps = _register(1 << 20, [big])
    shard = ps.variables["big"].shard if "big" in ps.variables else None
    ok = message == "" and (shard is None or (shard.rows_held == 0 and shard.nbytes < 1 << 16))
    assert comm.allreduce(ok, op=MPI.LAND), message


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(60)
def test_tables_within_budget_register(comm):
    small = SparseVariableSpec("small", 100, 4)
    message, ps = _register(1 << 20, [small])
    assert comm.allreduce(message == "" and "small" in ps.variables, op=MPI.LAND), message
