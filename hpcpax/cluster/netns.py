"""Build and tear down the nodes: network namespaces, veth pairs, a bridge, tc.

Node I is the network namespace ``<prefix>I``: its ``eth0`` is one end of a
veth pair whose other end (``<prefix>Iv``) is a port of the bridge
``<prefix>br`` on the host. Each end has a ``tbf`` qdisc at the link rate,
so traffic into and out of a node is shaped separately (full duplex, like a
NIC), with a deep queue (:data:`QUEUE_LATENCY`) so that many senders into
one node wait instead of losing packets. The namespaces have no default
route: only the cluster's own subnet is reachable from them. Every command
runs as root with a time limit.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from ..errors import ConfigError, TopologyError
from .spec import STATE_ROOT, ClusterSpec

__all__ = ["preflight", "create", "destroy", "exists", "link_counters",
           "node_pids", "HOSTS_FILE"]

HOSTS_FILE = Path("/etc/hosts")
COMMAND_TIMEOUT = 30
#: tbf bucket: large enough for a GSO packet, small against a millisecond at 10 Gbit/s.
MIN_BURST_BYTES = 64 << 10
#: tbf queue: packets may wait this long before tbf drops them. Deep, as a switch's
#: buffers (and InfiniBand's lossless links) are: with 50 ms, the bursts of an
#: all-to-all into one node (15 senders at once) overflowed it, and the drops cost TCP
#: retransmission timeouts (9 in a 16-node test) and each exchange after such a burst
#: about 1.5x its time (``docs/measurements.md``, 2026-12-06b); with 400 ms none.
QUEUE_LATENCY = "400ms"


def _run(argv, check=True, timeout=COMMAND_TIMEOUT):
    """Run ``argv``; raise TopologyError naming it (and its stderr) when it fails."""
    try:
        result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise TopologyError(f"{' '.join(argv)} did not finish within {timeout} s") from None
    except OSError as exc:
        raise TopologyError(f"cannot run {argv[0]}: {exc}") from None
    if check and result.returncode != 0:
        raise TopologyError(f"{' '.join(argv)} failed ({result.returncode}): "
                            f"{result.stderr.strip()}")
    return result


def preflight() -> str | None:
    """Why no cluster can be built here, or None when it can (root, ip, tc, nsenter)."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, veth, tc)"
    for tool in ("ip", "tc", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (iproute2 / util-linux)"
    try:
        probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                               timeout=COMMAND_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"ip netns does not work: {exc}"
    if probe.returncode != 0:
        return f"ip netns does not work: {probe.stderr.strip()}"
    return None


def _namespaces() -> set:
    result = _run(["ip", "netns", "list"], check=False)
    return {line.split()[0] for line in result.stdout.splitlines() if line.strip()}


def _link_exists(name: str) -> bool:
    return Path("/sys/class/net", name).exists()


def exists(spec: ClusterSpec) -> dict:
    """Which parts of ``spec`` exist now: ``{"bridge": bool, "nodes": {name: bool}}``."""
    namespaces = _namespaces()
    return {"bridge": _link_exists(spec.bridge),
            "nodes": {n: n in namespaces and _link_exists(spec.veth(n)) for n in spec.node_names}}


def _check_subnet_free(spec: ClusterSpec) -> None:
    """Refuse a subnet the host already routes (it would shadow real traffic)."""
    result = _run(["ip", "-4", "route", "show"], check=False)
    import ipaddress

    for line in result.stdout.splitlines():
        words = line.split()
        # the guard route of .ci/slurm_up.sh (unreachable while down) is no conflict
        if not words or words[0] in ("default", "unreachable", "blackhole", "prohibit") \
                or spec.bridge in words:
            continue
        try:
            route = ipaddress.IPv4Network(words[0], strict=False)
        except ValueError:
            continue
        if route.overlaps(spec.network):
            raise ConfigError(f"subnet {spec.subnet} overlaps the host's route {line.strip()!r}; "
                              "choose another with --subnet")


def _shape(prefix_argv, device, spec, half_delay_s):
    """tbf at the link rate on ``device`` (and netem for the delay when the kernel has it)."""
    rate = f"{spec.rate_bps}bit"
    burst = max(MIN_BURST_BYTES, spec.rate_bps // 8 // 4000)
    tbf = ["tbf", "rate", rate, "burst", str(burst), "latency", QUEUE_LATENCY]
    if half_delay_s > 0:
        netem = _run([*prefix_argv, "tc", "qdisc", "replace", "dev", device, "root", "handle",
                      "1:", "netem", "delay", f"{half_delay_s * 1e6:.0f}us", "limit", "100000"],
                     check=False)
        if netem.returncode == 0:
            _run([*prefix_argv, "tc", "qdisc", "add", "dev", device, "parent", "1:1", "handle",
                  "10:", *tbf])
            return True
    _run([*prefix_argv, "tc", "qdisc", "replace", "dev", device, "root", "handle", "1:", *tbf])
    return False


def _edit_hosts(prefix: str, add_lines=()) -> None:
    """Drop this cluster's lines from /etc/hosts, then append ``add_lines`` (locked)."""
    STATE_ROOT.mkdir(parents=True, exist_ok=True)
    tag = f"# hpcpax-cluster {prefix}"
    with open(STATE_ROOT / "hosts.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            text = HOSTS_FILE.read_text()
        except FileNotFoundError:
            text = ""
        kept = [line for line in text.splitlines() if not line.rstrip().endswith(tag)]
        new = "\n".join(kept + list(add_lines)) + "\n"
        if new != text:
            # in place, not by rename: /etc/hosts is often a bind mount in containers
            with open(HOSTS_FILE, "w") as handle:
                handle.write(new)


def create(spec: ClusterSpec, log=None) -> ClusterSpec:
    """Build the cluster ``spec`` names. On any failure, undo everything and raise.

    Raises:
        ConfigError: the cluster (or one with its names) is already up, or the
            subnet is in use.
        TopologyError: a system command failed (its message is included).
    """
    log = log or (lambda text: print(f"[hpcpax.cluster] {text}", file=sys.stderr))
    reason = preflight()
    if reason:
        raise TopologyError(f"cannot build an emulated cluster here: {reason}")
    present = exists(spec)
    if present["bridge"] or any(present["nodes"].values()) or (spec.state_dir / "state.json").exists():
        raise ConfigError(f"cluster {spec.prefix!r} is already (partly) up; run "
                          f"`python -m hpcpax.cluster down --name-prefix {spec.prefix}` first")
    _check_subnet_free(spec)
    spec.save()  # first, so that `down` can undo a half-built cluster
    try:
        _run(["ip", "link", "add", spec.bridge, "type", "bridge"])
        _run(["ip", "addr", "add", f"{spec.host_address}/{spec.prefix_len}", "dev", spec.bridge])
        _run(["sh", "-c", f"echo 1 > /proc/sys/net/ipv6/conf/{spec.bridge}/disable_ipv6"],
             check=False)
        _run(["ip", "link", "set", spec.bridge, "up"])
        delay_applied = True
        for node in spec.node_names:
            inside = ["ip", "netns", "exec", node]
            _run(["ip", "netns", "add", node])
            _run(["ip", "link", "add", spec.veth(node), "type", "veth", "peer", "name", "eth0",
                  "netns", node])
            _run(["ip", "link", "set", spec.veth(node), "master", spec.bridge, "up"])
            _run([*inside, "ip", "addr", "add", f"{spec.address(node)}/{spec.prefix_len}",
                  "dev", "eth0"])
            _run([*inside, "ip", "link", "set", "eth0", "up"])
            _run([*inside, "ip", "link", "set", "lo", "up"])
            # no IPv6 chatter (router solicitations) on the links: their counters show MPI
            _run([*inside, "sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/eth0/disable_ipv6"],
                 check=False)
            delay_applied &= _shape([], spec.veth(node), spec, spec.delay_s / 2)
            delay_applied &= _shape(inside, "eth0", spec, spec.delay_s / 2)
        spec.delay_applied = bool(spec.delay_s > 0 and delay_applied)
        if spec.delay_s > 0 and not spec.delay_applied:
            log(f"WARNING: the delay ({spec.delay_s * 1e6:.0f} us) is NOT applied: this kernel "
                "has no netem qdisc; the links add only their own latency (see `check`)")
        _edit_hosts(spec.prefix, spec.hosts_lines())
        from .launcher import write_launcher

        write_launcher(spec)
        spec.save()
    except BaseException:
        destroy(spec.prefix, log=lambda text: None)
        raise
    log(f"up: {spec.nodes} nodes {', '.join(spec.node_names)} on {spec.subnet} "
        f"(host {spec.host_address} on {spec.bridge}), links shaped to {spec.rate_bps / 1e9:g} "
        f"Gbit/s each way")
    return spec


def node_pids(node: str) -> list:
    """Pids of the processes inside namespace ``node`` (empty when it is gone)."""
    result = _run(["ip", "netns", "pids", node], check=False)
    return [int(p) for p in result.stdout.split() if p.isdigit()] if result.returncode == 0 else []


def _kill_node_processes(nodes, log, wait_s=5.0):
    """SIGTERM, then SIGKILL, every process left in the cluster's namespaces."""
    import signal

    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = [p for n in nodes for p in node_pids(n)]
        if not pids:
            return
        log(f"{'killing' if sig == signal.SIGKILL else 'stopping'} {len(pids)} process(es) "
            f"left in the nodes: {pids}")
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(node_pids(n) for n in nodes):
            time.sleep(0.1)


def destroy(prefix: str, log=None) -> list:
    """Remove cluster ``prefix``: processes in its nodes, links, namespaces, hosts lines.

    Idempotent, and works without the state file (after a crash): it then
    removes the namespaces and links whose names are ``<prefix><digits>``
    (``v``) and the bridge ``<prefix>br``. Returns what it removed.
    """
    log = log or (lambda text: print(f"[hpcpax.cluster] {text}", file=sys.stderr))
    spec = ClusterSpec.load(prefix)
    ClusterSpec(prefix=prefix, nodes=1)  # validates the prefix
    removed = []
    names = set(spec.node_names) if spec else set()
    names |= {n for n in _namespaces() if n[len(prefix):].isdigit() and n.startswith(prefix)}
    names = sorted(names, key=lambda n: int(n[len(prefix):]))
    from .slurmd import stop_slurmds

    stop_slurmds(prefix, names, log=log)
    _kill_node_processes(names, log)
    for link in sorted(Path("/sys/class/net").iterdir()) if Path("/sys/class/net").exists() else []:
        name = link.name
        if name.startswith(prefix) and name.endswith("v") and name[len(prefix):-1].isdigit():
            _run(["ip", "link", "del", name], check=False)
            removed.append(name)
    for node in names:
        if node in _namespaces():
            _run(["ip", "netns", "del", node], check=False)
            removed.append(node)
    bridge = f"{prefix}br"
    if _link_exists(bridge):
        _run(["ip", "link", "del", bridge], check=False)
        removed.append(bridge)
    _edit_hosts(prefix)
    state_dir = STATE_ROOT / prefix
    if state_dir.exists():
        shutil.rmtree(state_dir, ignore_errors=True)
        removed.append(str(state_dir))
    log(f"down: cluster {prefix!r}: " + (f"removed {', '.join(removed)}" if removed
                                          else "nothing was up"))
    return removed


def link_counters(spec: ClusterSpec) -> dict:
    """Bytes each node has sent and received over its link so far.

    ``{node: {"sent": bytes, "received": bytes}}``, read from the host end of
    the veth (its rx is what the node sent). Local, cheap.
    """
    out = {}
    for node in spec.node_names:
        stats = Path("/sys/class/net", spec.veth(node), "statistics")
        try:
            out[node] = {"sent": int((stats / "rx_bytes").read_text()),
                         "received": int((stats / "tx_bytes").read_text())}
        except OSError:
            out[node] = {"sent": 0, "received": 0}
    return out
