"""The emulated cluster: names and parsing (anywhere), then a live 2-node cluster (root).

Live tests train across two network-namespace nodes under ``mpirun`` and
check three independent witnesses: the topology saw 2 nodes, the accounting
counted inter-node bytes, and those bytes (at least) crossed the veth links.
"""

import json
import subprocess
import sys

import pytest

from cluster_jobs import PREFIX, ROOT, TINY, cluster_skip_reason, run_env, run_on_cluster
from hpcpax.cluster import ClusterSpec, parse_delay, parse_rate
from hpcpax.cluster.launcher import TRANSPORT_ENV, mpirun_argv
from hpcpax.cluster.slurmd import cluster_partition, node_conf_text
from hpcpax.errors import ConfigError

pytestmark = pytest.mark.cluster


# ------------------------------------------------------------- no root needed
def test_rates_and_delays_parse_in_tc_notation():
    assert parse_rate("2gbit") == 2_000_000_000
    assert parse_rate("500mbit") == 500_000_000
    assert parse_rate("0.5gbit") == 500_000_000
    assert parse_rate("125mbps") == 1_000_000_000  # tc: bps is bytes per second
    assert parse_delay("100us") == pytest.approx(1e-4)
    assert parse_delay("0") == 0.0
    for bad in ("fast", "2 gigabit", "-1gbit", "10kbit"):
        with pytest.raises(ConfigError, match="rate must be"):
            parse_rate(bad)
    with pytest.raises(ConfigError, match="delay must be"):
        parse_delay("soon")


def test_spec_names_and_addresses():
    spec = ClusterSpec(prefix="hpx", nodes=3, subnet="10.213.0.0/24")
    assert spec.node_names == ["hpx1", "hpx2", "hpx3"]
    assert spec.bridge == "hpxbr" and spec.veth("hpx2") == "hpx2v"
    assert spec.host_address == "10.213.0.1"
    assert [spec.address(n) for n in spec.node_names] == ["10.213.0.11", "10.213.0.12",
                                                          "10.213.0.13"]
    assert spec.hosts_lines()[0] == "10.213.0.11 hpx1  # hpcpax-cluster hpx"
    assert ClusterSpec.from_dict(json.loads(json.dumps(spec.to_dict()))) == spec


@pytest.mark.parametrize("kwargs, match", [
    ({"prefix": "Bad"}, "name prefix"),
    ({"prefix": "hpx1"}, "name prefix"),
    ({"prefix": "averylongprefix"}, "name prefix"),
    ({"nodes": 0}, "nodes must be"),
    ({"nodes": True}, "nodes must be"),
    ({"subnet": "8.8.8.0/24"}, "private"),
    ({"subnet": "10.213.0.0/30"}, "too small"),
    ({"subnet": "10.213.0.5/24"}, "subnet must be"),
])
def test_spec_rejects_bad_input(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        ClusterSpec(**kwargs)


def test_mpirun_argv_places_ranks_in_blocks_with_the_transport():
    spec = ClusterSpec(prefix="hpx", nodes=3)
    argv = mpirun_argv(spec, 2, ["python", "x.py"], nodes=2)
    assert argv[argv.index("-hosts") + 1] == "hpx1,hpx2"
    assert argv[argv.index("-ppn") + 1] == "2" and argv[argv.index("-n") + 1] == "4"
    assert argv[argv.index("-launcher-exec") + 1] == str(spec.launcher)
    for key, value in TRANSPORT_ENV.items():
        i = argv.index(key)
        assert argv[i - 1] == "-genv" and argv[i + 1] == value
    assert argv[-2:] == ["python", "x.py"]
    with pytest.raises(ConfigError, match="nodes must be"):
        mpirun_argv(spec, 1, ["x"], nodes=["hpx9"])
    with pytest.raises(ConfigError, match="ranks_per_node"):
        mpirun_argv(spec, 0, ["x"])


HOST_CONF = """ClusterName=hpcpax-ci
SlurmctldHost=vm(127.0.0.1)
SlurmdPidFile=/run/slurmd.pid
SlurmdSpoolDir=/var/spool/slurmd
SlurmdLogFile=/var/log/slurm/slurmd.log
NodeName=vm NodeAddr=127.0.0.1 CPUs=4 State=UNKNOWN
NodeName=hpx1 NodeAddr=10.213.0.11 CPUs=4 State=UNKNOWN
NodeName=hpx2 NodeAddr=10.213.0.12 CPUs=4 State=UNKNOWN
PartitionName=debug Nodes=vm Default=YES
PartitionName=cluster Nodes=hpx[1-2] State=UP
"""


def test_node_slurm_conf_points_at_the_bridge_with_per_node_files():
    spec = ClusterSpec(prefix="hpx", nodes=2)
    text = node_conf_text(spec, HOST_CONF)
    assert "SlurmctldHost=vm(10.213.0.1)" in text and "127.0.0.1)" not in text.split("\n")[1]
    assert text.count("SlurmdPidFile=") == 1 and "slurmd-%n.pid" in text
    assert "SlurmdSpoolDir=/run/hpcpax-cluster/hpx/spool-%n" in text
    assert "TaskProlog=/run/hpcpax-cluster/hpx/task_prolog" in text
    assert "NodeName=hpx2 NodeAddr=10.213.0.12" in text  # the rest is the host's, verbatim
    assert cluster_partition(spec, HOST_CONF) == "cluster"
    with pytest.raises(ConfigError, match="NodeName=hpx3"):
        cluster_partition(ClusterSpec(prefix="hpx", nodes=3), HOST_CONF)
    with pytest.raises(ConfigError, match="NodeAddr of hpx1 must be 10.213.7.11"):
        cluster_partition(ClusterSpec(prefix="hpx", nodes=2, subnet="10.213.7.0/24"), HOST_CONF)


def test_cli_rejects_bad_arguments_before_touching_the_system():
    result = subprocess.run([sys.executable, "-m", "hpcpax.cluster", "up", "--nodes", "2",
                             "--rate", "fast", "--name-prefix", "hpz"], capture_output=True,
                            text=True, timeout=60, cwd=ROOT)
    assert result.returncode == 2 and "rate must be" in result.stderr


# ------------------------------------------------------------------ live (root)
def test_up_checked_that_mpi_crosses_the_links(cluster):
    check = cluster.extra["link_check"]
    assert check["used"], check
    assert check["hosts"] == ["hpt1", "hpt2"]
    # the payload crossed the sender's link and arrived on the receiver's
    assert check["link_bytes"] >= check["payload_bytes"] <= check["link_bytes_received"]
    assert check["gbit_per_s"] <= 1.15 * 2.0


def test_launcher_runs_each_node_in_its_namespace_with_its_hostname(cluster, tmp_path):
    code = ("import os, socket, sys; open(os.path.join(sys.argv[1], str(os.getpid())), 'w')"
            ".write(socket.gethostname() + ' ' + str(open('/proc/net/dev').read().count('eth0')))")
    result, moved = run_on_cluster(cluster, 2, [sys.executable, "-c", code, str(tmp_path)],
                                   timeout=60, nodes=2)
    assert result.returncode == 0, result.stderr
    seen = sorted(p.read_text() for p in tmp_path.iterdir())
    assert seen == ["hpt1 1", "hpt1 1", "hpt2 1", "hpt2 1"]


def test_launcher_refuses_a_host_that_is_not_a_node(cluster):
    result = subprocess.run([str(cluster.launcher), "-x", "vm", "true"], capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 255 and "not a node of cluster hpt" in result.stderr


def test_training_across_two_nodes_counts_what_crosses_the_links(cluster, tmp_path):
    run_dir = tmp_path / "run"
    result, moved = run_on_cluster(
        cluster, 2, [sys.executable, "-m", "hpcpax.train", *TINY, "--steps", "5",
                     "--run-dir", str(run_dir)], timeout=120, nodes=2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["steps_run"] == 5
    assert summary["topology"]["num_nodes"] == 2
    assert summary["topology"]["node_of"] == [0, 0, 1, 1]
    inter = summary["total"]["sent_inter_bytes"]
    assert inter > 0 and summary["total"]["sent_intra_bytes"] > 0
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(sum(p.get("sent_inter", 0) for p in s["bytes"].values()) > 0 for s in steps)
    # every byte the accounting sent between nodes crossed a veth (plus headers and set-up)
    assert sum(moved.values()) >= inter, (moved, inter)
    assert moved["hpt1"] > 0 and moved["hpt2"] > 0


def test_down_is_idempotent_and_cleans_up_after_a_crash():
    reason = cluster_skip_reason()
    if reason:
        pytest.skip(f"emulated cluster unavailable: {reason}")
    from hpcpax import cluster as emu
    from hpcpax.cluster.netns import HOSTS_FILE, exists

    prefix = "hpu"
    emu.down(prefix, log=lambda text: None)
    spec = emu.up(1, rate="1gbit", prefix=prefix, subnet="10.213.251.0/24", check_links=False)
    try:
        assert emu.running(prefix) is not None
        assert "10.213.251.11 hpu1" in HOSTS_FILE.read_text()
        # already up: refused, nothing touched
        with pytest.raises(ConfigError, match="already"):
            emu.up(1, prefix=prefix, subnet="10.213.251.0/24", check_links=False)
        # a crash: the state file is lost and a process is left in the node
        sleeper = subprocess.Popen(["nsenter", "--net=/run/netns/hpu1", "sleep", "600"])
        (spec.state_dir / "state.json").unlink()
    finally:
        removed = emu.down(prefix, log=lambda text: None)
    assert {"hpu1v", "hpu1", "hpubr"} <= set(removed)
    assert sleeper.wait(10) != 0
    assert exists(spec) == {"bridge": False, "nodes": {"hpu1": False}}
    assert "hpu1" not in HOSTS_FILE.read_text()
    assert emu.down(prefix, log=lambda text: None) == []
    result = subprocess.run([sys.executable, "-m", "hpcpax.cluster", "status",
                             "--name-prefix", prefix], capture_output=True, text=True,
                            timeout=60, env=run_env())
    assert result.returncode == 0 and "down" in result.stdout


def test_the_link_check_catches_mpi_bypassing_the_links(cluster):
    """UCX's default transports reach the other namespace through shared memory."""
    from hpcpax.cluster.probe import check_links

    result = check_links(cluster, nbytes=8 << 20, transport={"UCX_TLS": "all"})
    assert not result["used"] and "bypasses the links" in result["reason"], result
    assert result["link_bytes"] < result["payload_bytes"] // 10


def test_cli_mpirun_reports_the_bytes_on_each_link(cluster):
    result = subprocess.run([sys.executable, "-m", "hpcpax.cluster", "mpirun", "--name-prefix",
                             PREFIX, "--nodes", "2", "--", sys.executable, "-m",
                             "hpcpax.cluster.probe", str(1 << 20)], capture_output=True,
                            text=True, timeout=120, cwd=ROOT, env=run_env())
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.splitlines()[-1])["hosts"] == ["hpt1", "hpt2"]
    moved = result.stderr.split("bytes sent over each node's link: ")[1]
    assert int(moved.split("'hpt1': ")[1].split(",")[0]) >= 1 << 20


INCAST = """
import numpy as np
from mpi4py import MPI
comm = MPI.COMM_WORLD
block = np.ones((comm.size, 4 << 20), np.uint8)  # 4 MiB to every peer, all at once
out = np.empty_like(block)
for _ in range(3):
    comm.Alltoall(block, out)
assert (out == 1).all()
"""


def _qdisc_drops(spec):
    """Packets each node's host-end tbf has dropped (what the node would receive)."""
    import re

    text = subprocess.run(["tc", "-s", "qdisc", "show"], capture_output=True, text=True,
                          timeout=30).stdout
    drops, device = {}, None
    for line in text.splitlines():
        if line.startswith("qdisc "):
            device = line.split(" dev ")[1].split()[0]
        found = re.search(r"dropped (\d+)", line)
        if found and device in {spec.veth(n) for n in spec.node_names}:
            drops[device] = drops.get(device, 0) + int(found.group(1))
    return drops


def test_links_queue_an_all_to_all_burst_without_dropping_it(cluster):
    """Two nodes sending into the third at once: the links' queues are deep (as a switch's
    buffers; InfiniBand is lossless), so the burst waits instead of costing TCP timeouts.
    At this test's 2 Gbit/s the old 50 ms queue (12.5 MB) also held this burst: the
    configured depth is what tells the two apart, the drop count is the behaviour."""
    from hpcpax.cluster.netns import QUEUE_LATENCY

    text = subprocess.run(["tc", "qdisc", "show", "dev", cluster.veth(cluster.node_names[0])],
                          capture_output=True, text=True, timeout=30).stdout
    assert "tbf" in text and f"lat {QUEUE_LATENCY}" in text, text
    before = _qdisc_drops(cluster)
    result, sent = run_on_cluster(cluster, 1, [sys.executable, "-c", INCAST], timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert all(moved >= 2 * (4 << 20) * 3 for moved in sent.values()), sent
    after = _qdisc_drops(cluster)
    assert after == before, (before, after)
