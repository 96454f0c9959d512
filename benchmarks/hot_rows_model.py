"""What the hot-rows cost model decides on the fabric it runs on.

Measures the fabric as the trainer does (:func:`hpcpax.comm.fabric.
measure_fabric`) and prints one JSON line: the links' alpha-beta figures,
the plan's hot-rows entry (:func:`hpcpax.plan.hot_rows_cost.decide`) for
each ``--chunk-bytes`` value (0: whole groups), and for a group of
``--rows`` rows that every node touches the predicted seconds today and by
trees. Compare with
``benchmarks/hot_rows.py`` on the same layout.

    python -m hpcpax.cluster mpirun --ranks-per-node 2 -- python benchmarks/hot_rows_model.py
"""

from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

import hpcpax
from hpcpax.comm.fabric import measure_fabric
from hpcpax.plan.hot_rows_cost import decide, tree_gain


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--row-bytes", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--rows", type=int, default=2000, help="rows of a group every node touches")
    parser.add_argument("--chunk-bytes", type=int, nargs="+", default=[0, 262144])
    parser.add_argument("--links", default="", help="what the nodes and links are, for the report")
    args = parser.parse_args()
    topo = hpcpax.init()
    fabric = measure_fabric(topo, budget_s=2.0)
    k, ranks = topo.num_nodes, topo.size
    result = {"benchmark": "hot_rows_model", "ranks": ranks, "nodes": k, "links": args.links,
              "fabric": fabric.to_dict(), "group_rows": args.rows, "decisions": {}}
    for row_bytes in args.row_bytes:
        for chunk in args.chunk_bytes:
            key = f"row_bytes={row_bytes},chunk_bytes={chunk}"
            result["decisions"][key] = {
                "plan": decide(k, row_bytes, fabric, ranks, chunk_bytes=chunk),
                "group_of_every_node": tree_gain(k, args.rows, row_bytes, fabric, ranks,
                                                 chunk_bytes=chunk) if k >= 2 else None}
    _common.emit(result, topo.rank)
    topo.free()


if __name__ == "__main__":
    main()
