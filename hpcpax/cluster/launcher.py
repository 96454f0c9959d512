"""``mpirun`` across the emulated nodes: an ssh stand-in for MPICH's hydra.

``mpirun -launcher ssh -launcher-exec LAUNCHER -hosts hpx1,hpx2 -n 4 CMD``
makes hydra call ``LAUNCHER -x hpx1 "<hydra_pmi_proxy ...>"`` once per node,
as it would call ssh. The launcher (a shell script written by ``up``) runs
that proxy inside the node's network namespace with its own hostname
(``unshare --uts``), so ``MPI.COMM_TYPE_SHARED`` sees one node per
namespace. It also points the proxy at the host's address on the bridge
(hydra names itself by the host's hostname, which is 127.0.0.1 inside a
node).

Transport: the ``mpich`` wheel's network module is UCX, and UCX reaches the
other namespaces of the same machine through shared memory unless it is told
not to; :data:`TRANSPORT_ENV` (TCP only, over ``eth0``) makes inter-node
traffic cross the shaped links, while ranks inside one node keep MPICH's own
shared memory. The launcher sets it for the ranks it starts.

It also turns off UCX's rendezvous protocol (``UCX_RNDV_THRESH=inf``: every
message goes eagerly). Over the ``tcp`` transport on shaped links, a
rendezvous under load now and then stalls for about 1.3 s: 4 of 16 loaded
exchanges stalled with it, 0 of 16 without, in the same run; plain TCP
sockets never stall (``docs/measurements.md``, 2026-12-06). Those stalls are
this emulation's, not a cluster's: on InfiniBand, rendezvous is UCX's RDMA
path and stays on.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys
from pathlib import Path

from ..errors import ConfigError
from .spec import ClusterSpec

__all__ = ["TRANSPORT_ENV", "write_launcher", "mpirun_argv", "mpirun_env", "find_mpirun",
           "node_argv"]

#: What the ranks need so that inter-node MPI traffic crosses the shaped links.
TRANSPORT_ENV = {"UCX_TLS": "tcp,self", "UCX_NET_DEVICES": "eth0", "UCX_RNDV_THRESH": "inf"}

_SCRIPT = """#!/bin/sh
# hpcpax emulated cluster {prefix!r}: an ssh stand-in for MPICH's hydra
# (mpirun -launcher ssh -launcher-exec {path} -hosts {example}).
# Called as: {path} [-x] NODE COMMAND...; written by `python -m hpcpax.cluster up`.
while [ "${{1#-}}" != "$1" ]; do shift; done
node=$1; shift
case " {nodes} " in
    *" $node "*) ;;
    *) echo "hpcpax cluster launcher: $node is not a node of cluster {prefix} ({nodes})" >&2
       exit 255 ;;
esac
# hydra's proxy calls back to mpiexec by the host's name, which is 127.0.0.1
# inside a node: use the host's address on the bridge instead.
command=$(printf '%s ' "$@" | sed 's/--control-port [^ ]*:\\([0-9]*\\)/--control-port {host}:\\1/')
{exports}
exec nsenter --net=/run/netns/"$node" unshare --uts sh -c "hostname $node; exec $command"
"""


def write_launcher(spec: ClusterSpec) -> Path:
    """Write ``spec.launcher`` (executable) and return its path. Local."""
    exports = "\n".join(f"export {k}={shlex.quote(v)}" for k, v in TRANSPORT_ENV.items())
    text = _SCRIPT.format(prefix=spec.prefix, path=spec.launcher,
                          example=",".join(spec.node_names[:2]), nodes=" ".join(spec.node_names),
                          host=spec.host_address, exports=exports)
    spec.state_dir.mkdir(parents=True, exist_ok=True)
    spec.launcher.write_text(text)
    spec.launcher.chmod(0o755)
    return spec.launcher


def find_mpirun() -> str:
    """The ``mpirun`` beside this Python (the mpich wheel's), else the one on PATH."""
    candidate = Path(sys.executable).parent / "mpirun"
    if candidate.exists():
        return str(candidate)
    found = shutil.which("mpirun")
    if not found:
        raise ConfigError("mpirun must be installed (pip install -e '.[mpich]'), not missing")
    return found


def mpirun_argv(spec: ClusterSpec, ranks_per_node: int, command, nodes=None,
                transport=None) -> list:
    """``mpirun`` argv that runs ``command`` with ``ranks_per_node`` ranks on each node.

    Ranks are placed in blocks (ranks 0..K-1 on the first node). ``nodes``:
    names or a count of the first nodes (default all). ``transport``: the
    ranks' UCX settings (default :data:`TRANSPORT_ENV`; tests pass others to
    show that the link check catches a bypass).
    """
    if isinstance(nodes, int):
        if not 1 <= nodes <= spec.nodes:
            raise ConfigError(f"nodes must be in 1..{spec.nodes}, not {nodes}")
        nodes = spec.node_names[:nodes]
    nodes = list(nodes or spec.node_names)
    for node in nodes:
        if node not in spec.node_names:
            raise ConfigError(f"nodes must be among {spec.node_names}, not {node!r}")
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) \
            or ranks_per_node < 1:
        raise ConfigError(f"ranks_per_node must be a positive int, not {ranks_per_node!r}")
    genv = [a for k, v in (TRANSPORT_ENV if transport is None else transport).items()
            for a in ("-genv", k, v)]
    return [find_mpirun(), "-launcher", "ssh", "-launcher-exec", str(spec.launcher),
            "-hosts", ",".join(nodes), "-ppn", str(ranks_per_node),
            "-n", str(ranks_per_node * len(nodes)), *genv, *command]


def mpirun_env(base=None) -> dict:
    """``base`` (default os.environ) without a parent job's MPI/PMI variables, plus the transport."""
    base = dict(os.environ if base is None else base)
    env = {k: v for k, v in base.items()
           if not k.startswith(("PMI_", "HYDRA_", "MPIR_", "OMPI_", "PMIX_", "UCX_"))}
    env.update(TRANSPORT_ENV)
    return env


def node_argv(spec: ClusterSpec, node: str, argv, *, uts=True, mount=False) -> list:
    """``argv`` run inside ``node``: its network namespace, its hostname.

    Uses ``nsenter --net`` + ``unshare --uts`` (not ``ip netns exec``, which
    remounts /sys and breaks slurmd's cgroup detection). ``mount=True`` also
    gives the command a private mount namespace.
    """
    if node not in spec.node_names:
        raise ConfigError(f"node must be one of {spec.node_names}, not {node!r}")
    outer = ["nsenter", f"--net=/run/netns/{node}"]
    if uts or mount:
        outer += ["unshare"] + (["--uts"] if uts else []) + \
                 (["--mount", "--propagation", "private"] if mount else [])
        script = (f"hostname {node}; " if uts else "") + 'exec "$@"'
        return [*outer, "sh", "-c", script, "sh", *argv]
    return [*outer, *argv]
