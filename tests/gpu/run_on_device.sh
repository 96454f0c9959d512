#!/usr/bin/env bash
# The whole GPU check in one script, for a machine with an NVIDIA GPU and no
# package index (the device tool's H200): environment facts, the GPU test
# suite (kernels vs NumPy twins, allreduce transports, GPU training vs CPU,
# 1 and 2 ranks), and the kernel bandwidth benchmark. Results go to $OUT
# (default ./gpu-results): one JSON summary, the logs, the benchmark line.
#
# Usage: bash tests/gpu/run_on_device.sh      (from the repository root)
# Wheels missing there (pytest-mpi, mpich) are taken from .gpu_wheels/,
# filled here beforehand with:
#   pip download --no-deps -d .gpu_wheels pytest-mpi mpich
set -u
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD HPCPAX_TEST_GPU=1 HPCPAX_DEVICE=gpu
PY=${PYTHON:-python3}
log() { echo "== $*" | tee -a "$OUT/steps.log"; }

log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import sys, numpy, cupy
print("python", sys.version.split()[0], "numpy", numpy.__version__, "cupy", cupy.__version__)
print("gpu", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
PYEOF

log "MPI: use the image's mpi4py if it finds an MPI library, else the mpich wheel"
if ! timeout 60 $PY -c "from mpi4py import MPI; print(MPI.Get_library_version())" >"$OUT/mpi.txt" 2>&1; then
    $PY -m pip install -q --no-index --find-links .gpu_wheels mpich 2>&1 | tail -2
    timeout 60 $PY -c "from mpi4py import MPI; print(MPI.Get_library_version())" >"$OUT/mpi.txt" 2>&1
fi
$PY -m pip install -q --no-index --find-links .gpu_wheels pytest-mpi 2>&1 | tail -2
cat "$OUT/mpi.txt"
MPIRUN=$(dirname "$(command -v $PY)")/mpirun
[ -x "$MPIRUN" ] || MPIRUN=mpirun
$PY -c "from hpcpax.comm.transport import cuda_aware_mpi; print('cuda_aware_mpi', cuda_aware_mpi())" \
    | tee -a "$OUT/mpi.txt"

status=0
log "GPU tests, 1 rank"
timeout 420 $PY -m pytest -q --with-mpi -m gpu tests/gpu tests/test_allreduce.py tests/test_transport.py \
    --junitxml="$OUT/gpu-tests-1rank.xml" 2>&1 | tail -40 | tee "$OUT/gpu-tests-1rank.log" || status=1

log "GPU tests, 2 ranks (1 server + 1 GPU worker, and 2 GPU workers)"
timeout 300 "$MPIRUN" -n 2 $PY -m mpi4py -m pytest -q --with-mpi -m gpu tests/gpu/test_train_gpu.py \
    tests/test_allreduce.py 2>&1 | tail -20 | tee "$OUT/gpu-tests-2ranks.log" || status=1

log "kernel bandwidth"
timeout 300 $PY benchmarks/kernels.py --gpu 2>"$OUT/kernels-gpu.err" | tail -1 | tee "$OUT/kernels_gpu.json" || status=1

log "done, status $status"
exit $status
