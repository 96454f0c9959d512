"""``python -m hpcpax.cluster up|down|status|check|mpirun``: the emulated cluster's CLI.

Examples (as root)::

    python -m hpcpax.cluster up --nodes 2 --rate 2gbit        # 2 nodes, links checked
    python -m hpcpax.cluster up --nodes 16 --rate 1gbit --dilation 4   # links at 250mbit
    python -m hpcpax.cluster mpirun --ranks-per-node 2 -- python -m hpcpax.train --steps 20
    python -m hpcpax.cluster status
    python -m hpcpax.cluster down                             # idempotent

Exit status: 0, 1 when a step failed (message on stderr), 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from ..errors import ConfigError, HpcpaxError


def _parser():
    parser = argparse.ArgumentParser(prog="python -m hpcpax.cluster",
                                     description="An emulated multi-node cluster on one machine.")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_prefix(p):
        p.add_argument("--name-prefix", default="hpx",
                       help="start of every name: nodes are <prefix>1..N (default hpx)")
        return p

    up = with_prefix(sub.add_parser("up", help="bring up N nodes with shaped links"))
    up.add_argument("--nodes", type=int, required=True, help="number of nodes")
    up.add_argument("--rate", default="2gbit", help="link rate per node and direction (2gbit)")
    up.add_argument("--delay", default="0",
                    help="added one-way latency between nodes, e.g. 100us (needs netem)")
    up.add_argument("--dilation", type=float, default=1.0,
                    help="time dilation D >= 1: links D times slower (rate / D, delay x D), "
                         "for runs with --time-dilation D (default 1)")
    up.add_argument("--subnet", default="", help="IPv4 subnet (default from the prefix)")
    up.add_argument("--slurm", action="store_true", help="also start one slurmd per node")
    up.add_argument("--no-check", action="store_true",
                    help="skip the check that MPI traffic crosses the links")
    with_prefix(sub.add_parser("down", help="tear the cluster down (idempotent)"))
    status = with_prefix(sub.add_parser("status", help="nodes, links, bytes, slurmds"))
    status.add_argument("--json", action="store_true", help="one JSON object")
    check = with_prefix(sub.add_parser("check", help="are the links really used by MPI?"))
    check.add_argument("--bytes", type=int, default=32 << 20, help="payload of the probe")
    run = with_prefix(sub.add_parser("mpirun", help="run a command on the nodes under mpirun"))
    run.add_argument("--ranks-per-node", type=int, default=1)
    run.add_argument("--nodes", type=int, default=0, help="use the first N nodes (default all)")
    run.add_argument("argv", nargs=argparse.REMAINDER, help="-- COMMAND ...")
    return parser


def _print_status(info):
    if not info["up"] and "nodes" not in info:
        print(f"cluster {info['prefix']!r}: down")
        return
    delay = (f"{info['delay_us']:g} us" + ("" if info["delay_applied"] else " (NOT applied)")
             if info["delay_us"] else "none added")
    print(f"cluster {info['prefix']!r}: {'up' if info['up'] else 'PARTLY up'}, subnet "
          f"{info['subnet']} (host {info['host_address']}), links {info['rate_gbit_per_s']:g} "
          f"Gbit/s each way, delay {delay}")
    print(f"launcher: mpirun -launcher ssh -launcher-exec {info['launcher']} -hosts "
          + ",".join(n["name"] for n in info["nodes"][:2]))
    for node in info["nodes"]:
        slurmd = f", slurmd {node['slurmd_pid']}" if node["slurmd_pid"] else ""
        print(f"  {node['name']:8s} {node['address']:15s} link {node['link']}: sent "
              f"{node['sent_bytes']:,} B, received {node['received_bytes']:,} B{slurmd}")
    if info.get("slurm_partition"):
        print(f"slurm partition: {info['slurm_partition']}")
        dead = [n["name"] for n in info["nodes"] if not n["slurmd_pid"]]
        if dead:
            # e.g. the machine restarted: namespaces and state files outlive the processes
            print(f"slurmd NOT running on {', '.join(dead)}: jobs there stay pending; "
                  f"run `down`, then `up --slurm`")
    if info.get("link_check"):
        c = info["link_check"]
        print(f"links used (checked at up): {'yes' if c['used'] else 'NO'}: {c['reason']}")


def main(argv=None) -> int:
    """Run the command line; returns the exit status."""
    from . import check, down, link_counters, running, status, up
    from .launcher import mpirun_argv, mpirun_env

    args = _parser().parse_args(argv)
    try:
        if args.command == "up":
            rate, delay = args.rate, args.delay
            if args.dilation != 1.0:
                from .spec import dilate

                rate, delay = dilate(rate, delay, args.dilation)
                print(f"dilation {args.dilation:g}: links at {rate} (undilated {args.rate}), "
                      f"added delay {delay}")
            spec = up(args.nodes, rate=rate, delay=delay, prefix=args.name_prefix,
                      subnet=args.subnet, slurm=args.slurm, check_links=not args.no_check)
            _print_status(status(spec.prefix))
        elif args.command == "down":
            down(args.name_prefix)
        elif args.command == "status":
            info = status(args.name_prefix)
            print(json.dumps(info)) if args.json else _print_status(info)
        elif args.command == "check":
            result = check(args.name_prefix, nbytes=args.bytes)
            print(json.dumps(result))
            return 0 if result["used"] else 1
        elif args.command == "mpirun":
            spec = running(args.name_prefix)
            if spec is None:
                raise ConfigError(f"cluster {args.name_prefix!r} must be up, not down")
            command = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            if not command:
                raise ConfigError("mpirun needs a command after --")
            before = link_counters(spec)
            code = subprocess.call(mpirun_argv(spec, args.ranks_per_node, command,
                                               nodes=args.nodes or None), env=mpirun_env())
            after = link_counters(spec)
            moved = {n: after[n]["sent"] - before[n]["sent"] for n in spec.node_names}
            print(f"[hpcpax.cluster] bytes sent over each node's link: {moved}", file=sys.stderr)
            return code
    except ConfigError as exc:
        print(f"hpcpax.cluster: error: {exc}", file=sys.stderr)
        return 2
    except HpcpaxError as exc:
        print(f"hpcpax.cluster: failed: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
