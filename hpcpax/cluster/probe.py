"""Check that MPI traffic between nodes really crosses the shaped links.

:func:`check_links` runs ``mpirun`` with one rank on each of two nodes
(through the cluster's launcher, with its transport settings); rank 0
streams ``nbytes`` to rank 1 and they ping-pong 8 bytes for the latency.
Meanwhile the host reads the veth counters. The links are *used* when the
sender's veth carried at least the payload and the measured rate does not
beat the configured one; were UCX reaching the other namespace through
shared memory, the veth would show almost nothing and the rate would be
far above the link's.

Run as ``python -m hpcpax.cluster.probe NBYTES`` under ``mpirun`` (rank 0
prints one JSON line); :func:`check_links` does that for you.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

__all__ = ["check_links", "main"]

CHUNK_BYTES = 4 << 20
PING_PONGS = 50


def main(argv=None) -> int:
    """The probe itself (**collective** over ``MPI.COMM_WORLD``, 2 ranks)."""
    import numpy as np
    from mpi4py import MPI

    argv = sys.argv[1:] if argv is None else argv
    nbytes = int(argv[0]) if argv else 64 << 20
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    if comm.Get_size() != 2:
        if rank == 0:
            print(f"probe: needs 2 ranks, not {comm.Get_size()}", file=sys.stderr)
        return 2
    chunk = np.zeros(min(CHUNK_BYTES, nbytes), np.uint8)
    done = np.zeros(8, np.uint8)
    comm.Sendrecv(done, 1 - rank, recvbuf=done, source=1 - rank)  # warm the connection
    latencies = []
    for _ in range(PING_PONGS):
        start = time.perf_counter()
        if rank == 0:
            comm.Send(done, 1)
            comm.Recv(done, 1)
        else:
            comm.Recv(done, 0)
            comm.Send(done, 0)
        latencies.append((time.perf_counter() - start) / 2)
    comm.Barrier()
    start = time.perf_counter()
    sent = 0
    while sent < nbytes:
        count = min(chunk.size, nbytes - sent)
        if rank == 0:
            comm.Send(chunk[:count], 1)
        else:
            comm.Recv(chunk[:count], 0)
        sent += count
    if rank == 1:
        comm.Send(done, 0)
    else:
        comm.Recv(done, 1)
    seconds = time.perf_counter() - start
    hosts = comm.gather(socket.gethostname())
    if rank == 0:
        print(json.dumps({"bytes": nbytes, "seconds": seconds, "hosts": hosts,
                          "latency_s": float(np.median(latencies))}), flush=True)
    return 0


def check_links(spec, nbytes=32 << 20, nodes=None, timeout=120, transport=None) -> dict:
    """Stream ``nbytes`` between two nodes over MPI and judge the links. Not collective.

    Args:
        spec: the running cluster (:class:`~hpcpax.cluster.spec.ClusterSpec`).
        nbytes: payload of the stream.
        nodes: the two node names (default the first two).
        timeout: seconds for the whole ``mpirun``.
        transport: UCX settings of the ranks (default the cluster's, see
            :func:`~hpcpax.cluster.launcher.mpirun_argv`).

    Returns:
        ``{"used": bool, "reason": str, "payload_bytes", "link_bytes", "seconds",
        "gbit_per_s", "rate_gbit_per_s", "latency_us", "hosts"}``.
    """
    from .launcher import mpirun_argv, mpirun_env
    from .netns import link_counters

    nodes = list(nodes or spec.node_names[:2])
    if len(nodes) != 2 or nodes[0] == nodes[1]:
        raise ValueError(f"nodes must be two different nodes, not {nodes!r}")
    argv = mpirun_argv(spec, 1, [sys.executable, "-m", "hpcpax.cluster.probe", str(nbytes)],
                       nodes=nodes, transport=transport)
    before = link_counters(spec)
    result = subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                            env=mpirun_env())
    after = link_counters(spec)
    if result.returncode != 0:
        return {"used": False, "reason": f"probe failed ({result.returncode}): "
                                         f"{(result.stderr or result.stdout).strip()[-800:]}"}
    lines = [t for t in result.stdout.splitlines() if t.startswith("{")]
    figures = json.loads(lines[-1])
    link_bytes = after[nodes[0]]["sent"] - before[nodes[0]]["sent"]
    received = after[nodes[1]]["received"] - before[nodes[1]]["received"]
    gbit = figures["bytes"] * 8 / figures["seconds"] / 1e9
    rate = spec.rate_bps / 1e9
    out = {"payload_bytes": figures["bytes"], "link_bytes": link_bytes,
           "link_bytes_received": received, "seconds": figures["seconds"],
           "gbit_per_s": gbit, "rate_gbit_per_s": rate,
           "latency_us": figures["latency_s"] * 1e6, "hosts": figures["hosts"]}
    if figures["hosts"] != nodes:
        out.update(used=False, reason=f"ranks ran on {figures['hosts']}, not {nodes}")
    elif link_bytes < figures["bytes"] or received < figures["bytes"]:
        out.update(used=False, reason=f"only {link_bytes} of {figures['bytes']} bytes crossed "
                                      f"{spec.veth(nodes[0])}: MPI bypasses the links "
                                      "(is UCX_TLS=tcp,self set?)")
    elif gbit > 1.15 * rate:
        out.update(used=False, reason=f"{gbit:.2f} Gbit/s is above the link rate {rate:g} "
                                      "Gbit/s: the shaping is not in effect")
    else:
        out.update(used=True, reason=f"{figures['bytes']} payload bytes, {link_bytes} on "
                                     f"{spec.veth(nodes[0])}, {gbit:.2f} Gbit/s on a "
                                     f"{rate:g} Gbit/s link")
    return out


if __name__ == "__main__":
    sys.exit(main())
