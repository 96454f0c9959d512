"""An emulated multi-node cluster on one Linux machine (a tool, not the library).

Each node is a network namespace with its own hostname, linked by a veth
pair to a bridge on the host; every link is shaped by ``tc`` to a chosen
rate. MPI runs across the nodes through an ssh stand-in for MPICH's hydra
(:mod:`hpcpax.cluster.launcher`), Slurm through one slurmd per node
(:mod:`hpcpax.cluster.slurmd`), and :func:`check` proves that inter-node
traffic really crosses the shaped links. Needs root.

Command line: ``python -m hpcpax.cluster up|down|status|check|mpirun``.
This package imports nothing from the rest of hpcpax but its errors.
"""

from __future__ import annotations

from .launcher import TRANSPORT_ENV, mpirun_argv, mpirun_env
from .netns import link_counters, preflight
from .spec import ClusterSpec, parse_delay, parse_rate

__all__ = ["ClusterSpec", "TRANSPORT_ENV", "check", "down", "link_counters", "mpirun_argv",
           "mpirun_env", "preflight", "status", "up", "parse_rate", "parse_delay", "running"]


def up(nodes: int, rate="2gbit", delay="0", prefix="hpx", subnet="", slurm=False,
       check_links=True, log=None) -> ClusterSpec:
    """Bring up ``nodes`` nodes; optionally start Slurm on them and check the links.

    Args:
        nodes: number of nodes.
        rate: link rate per node and direction, tc notation (``2gbit``).
        delay: added one-way latency between nodes (``100us``); needs netem.
        prefix: start of every name (nodes ``<prefix>1..N``).
        subnet: the cluster's IPv4 subnet (default from the prefix).
        slurm: also start one slurmd per node (see :mod:`.slurmd`).
        check_links: run :func:`check` (needs 2+ nodes); failure tears down and raises.

    Returns:
        The :class:`ClusterSpec`; ``spec.extra["link_check"]`` holds the check.

    Raises:
        ConfigError: bad arguments, or a cluster with this prefix is up.
        TopologyError: a system command failed, or the links are not used.
    """
    from ..errors import TopologyError
    from .netns import create, destroy

    spec = ClusterSpec(prefix=prefix, nodes=nodes, rate_bps=parse_rate(rate),
                       delay_s=parse_delay(delay), subnet=subnet)
    create(spec, log=log)
    try:
        if slurm:
            from .slurmd import start_slurmds

            start_slurmds(spec, log=log)
        if check_links and nodes >= 2:
            result = check(spec)
            spec.extra["link_check"] = result
            spec.save()
            if not result["used"]:
                raise TopologyError(f"the links are not used: {result['reason']}")
    except BaseException:
        destroy(prefix, log=lambda text: None)
        raise
    return spec


def down(prefix="hpx", log=None) -> list:
    """Tear cluster ``prefix`` down (idempotent, also after a crash). Returns what was removed."""
    from .netns import destroy

    return destroy(prefix, log=log)


def running(prefix="hpx") -> ClusterSpec | None:
    """The spec of the running cluster ``prefix``, or None."""
    spec = ClusterSpec.load(prefix)
    if spec is None:
        return None
    from .netns import exists

    present = exists(spec)
    return spec if present["bridge"] and all(present["nodes"].values()) else None


def status(prefix="hpx") -> dict:
    """What is up: nodes, addresses, rate, bytes on each link, slurmds. Local."""
    from .netns import exists
    from .slurmd import slurmd_pid

    spec = ClusterSpec.load(prefix)
    if spec is None:
        return {"prefix": prefix, "up": False}
    present = exists(spec)
    counters = link_counters(spec)
    return {
        "prefix": prefix, "up": present["bridge"] and all(present["nodes"].values()),
        "subnet": spec.subnet, "host_address": spec.host_address,
        "rate_gbit_per_s": spec.rate_bps / 1e9, "delay_us": spec.delay_s * 1e6,
        "delay_applied": spec.delay_applied, "launcher": str(spec.launcher),
        "nodes": [{"name": n, "address": spec.address(n), "link": spec.veth(n),
                   "present": present["nodes"][n], "slurmd_pid": slurmd_pid(prefix, n),
                   **{f"{k}_bytes": v for k, v in counters[n].items()}}
                  for n in spec.node_names],
        "slurm_partition": spec.extra.get("slurm_partition"),
        "link_check": spec.extra.get("link_check"),
    }


def check(spec_or_prefix="hpx", nbytes=32 << 20) -> dict:
    """Stream ``nbytes`` over MPI between the first two nodes; are the links used? Not collective.

    See :func:`hpcpax.cluster.probe.check_links` for the result's keys.
    """
    from ..errors import ConfigError
    from .probe import check_links

    spec = spec_or_prefix
    if not isinstance(spec, ClusterSpec):
        spec = running(spec_or_prefix)
        if spec is None:
            raise ConfigError(f"cluster {spec_or_prefix!r} must be up, not down")
    if spec.nodes < 2:
        raise ConfigError(f"check needs a cluster of 2+ nodes, not {spec.nodes}")
    return check_links(spec, nbytes=nbytes)
