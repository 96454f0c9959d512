"""Fabric: alpha-beta fit, measurement agreed on all ranks, bucket autotune."""

import math

import numpy as np
import pytest
from mpi4py import MPI

import hpcpax
from hpcpax.comm.fabric import (BUCKET_CANDIDATES, DEFAULT_BUCKET_BYTES, Fabric, LinkModel,
                           autotune_bucket_bytes, default_fabric, fit_link_model, measure_fabric)



def test_fit_recovers_exact_alpha_beta():
    sizes = [8, 1024, 65536, 1 << 20]
    truth = LinkModel(latency_s=3e-6, bandwidth_Bps=7.5e9)
    fit = fit_link_model(sizes, [truth.time(n) for n in sizes])
    assert fit.latency_s == pytest.approx(3e-6, rel=1e-9)
    assert fit.bandwidth_Bps == pytest.approx(7.5e9, rel=1e-9)


def test_fit_clamps_to_finite_positive():
    fit = fit_link_model([8, 1 << 20], [1e-3, 1e-3])  # flat: no slope
    assert fit.latency_s >= 0 and math.isfinite(fit.bandwidth_Bps) and fit.bandwidth_Bps > 0
    fit = fit_link_model([0, 100], [-1e-6, 1e-6])  # negative intercept
    assert fit.latency_s == 0.0 and fit.bandwidth_Bps > 0
    with pytest.raises(ValueError):
        fit_link_model([1], [1.0])


def test_link_time_and_round_trip():
    link = LinkModel(1e-6, 1e9)
    assert link.time(1000) == pytest.approx(2e-6)
    fabric = Fabric(intra=link, inter=LinkModel(2e-6, 2e9), allreduce_bucket_bytes=4096)
    again = Fabric.from_dict(fabric.to_dict())
    assert again == fabric
    d = default_fabric()
    assert d.allreduce_bucket_bytes == DEFAULT_BUCKET_BYTES
    assert d.intra.bandwidth_Bps > 0 and d.inter.latency_s > 0


def _finite_positive(fabric):
    return all(math.isfinite(v) and v > 0 for v in (
        fabric.intra.bandwidth_Bps, fabric.inter.bandwidth_Bps, fabric.allreduce_bucket_bytes)) \
        and fabric.intra.latency_s >= 0 and fabric.inter.latency_s >= 0


@pytest.mark.parametrize("ranks_per_node", [None, 1, 2])
def test_measure_fabric_agreed_and_positive(ranks_per_node, all_ok):
    topo = hpcpax.init(ranks_per_node=ranks_per_node, servers_per_node=0)
    try:
        begin = MPI.Wtime()
        fabric = measure_fabric(topo, budget_s=0.5)
        elapsed = MPI.Wtime() - begin
        everyone = topo.comm.allgather(fabric.to_dict())
        assert all_ok(topo.comm, all(d == everyone[0] for d in everyone))
        assert all_ok(topo.comm, _finite_positive(fabric))
        assert all_ok(topo.comm, elapsed < 10.0)  # budget 0.5 s; generous on a busy CI box
        if topo.size > 1 and topo.num_nodes == 1:
            assert fabric.inter == fabric.intra  # one node: the inter link is the intra one
        if topo.size == 1:
            assert fabric == default_fabric()
    finally:
        topo.free()


def test_measure_fabric_with_servers(all_ok):
    if MPI.COMM_WORLD.Get_size() < 2:
        pytest.skip("needs a server and a worker")
    topo = hpcpax.init(servers_per_node=1)
    try:
        fabric = measure_fabric(topo, budget_s=0.3)
        everyone = topo.comm.allgather(fabric.to_dict())
        assert all_ok(topo.comm, all(d == everyone[0] for d in everyone) and _finite_positive(fabric))
    finally:
        topo.free()


def test_measure_fabric_rejects_bad_budget():
    with pytest.raises(ValueError):
        measure_fabric(None, budget_s=0)


def test_autotune_bucket_bytes_agreed(all_ok):
    comm = MPI.COMM_WORLD.Dup()
    try:
        best = autotune_bucket_bytes(comm, budget_s=0.1)
        assert all_ok(best in BUCKET_CANDIDATES or best == DEFAULT_BUCKET_BYTES)
        assert all_ok(len(set(comm.allgather(best))) == 1)
        assert autotune_bucket_bytes(comm) == best  # cached, no new measurement
    finally:
        comm.Free()


def test_autotune_env_override(monkeypatch):
    monkeypatch.setenv("HPCPAX_BUCKET_BYTES", "12345")
    assert autotune_bucket_bytes(MPI.COMM_WORLD) == 12345
    monkeypatch.setenv("HPCPAX_BUCKET_BYTES", "lots")
    with pytest.raises(hpcpax.ConfigError):
        autotune_bucket_bytes(MPI.COMM_WORLD)


def test_single_process_fabric_is_default():
    fabric = autotune_bucket_bytes(MPI.COMM_SELF)
    assert fabric == DEFAULT_BUCKET_BYTES
    assert np.isfinite(default_fabric().inter.time(1 << 20))
