#!/usr/bin/env bash
# Bring up (or tear down) the emulated multi-node cluster with Slurm on it:
# network namespaces hpx1..hpxN with tc-shaped links (python -m hpcpax.cluster)
# and one slurmd per node, in the partition "cluster" that .ci/slurm_up.sh
# lists in slurm.conf (run first if that partition is missing). Needs root.
# The tests do this themselves (tests/cluster); this script is for people.
#
# Usage:  .ci/cluster_up.sh [up|down|status]
#   env CLUSTER_NODES=3        nodes (at most SLURM_UP_CLUSTER_NODES of slurm_up.sh)
#       CLUSTER_RATE=2gbit     link rate per node and direction
#       PYTHON=.venv/bin/python   a Python with hpcpax installed
# Then:   sbatch -p cluster -N 2 job.sbatch
set -euo pipefail
cd "$(dirname "$0")/.."
export PATH=$PATH:/usr/sbin:/sbin
python=${PYTHON:-.venv/bin/python}
[[ -x $python ]] || python=python3
action=${1:-up}

case $action in
    up)
        if ! timeout 15 sinfo -h -p cluster -o '%D' 2>/dev/null | grep -q '[0-9]'; then
            bash .ci/slurm_up.sh
        fi
        "$python" -m hpcpax.cluster down --name-prefix hpx
        "$python" -m hpcpax.cluster up --name-prefix hpx --nodes "${CLUSTER_NODES:-3}" \
            --rate "${CLUSTER_RATE:-2gbit}" --slurm
        timeout 15 sinfo
        ;;
    down) "$python" -m hpcpax.cluster down --name-prefix hpx ;;
    status) "$python" -m hpcpax.cluster status --name-prefix hpx ;;
    *) echo "usage: $0 [up|down|status]" >&2; exit 2 ;;
esac
