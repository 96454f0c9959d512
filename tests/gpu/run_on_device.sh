#!/usr/bin/env bash
# The whole GPU check in one script, for a machine with an NVIDIA GPU and no
# package index (the device tool's H200): environment facts, the kernels
# built by nvcc, the GPU test suite (kernels vs NumPy twins, allreduce
# transports, GPU training vs CPU, 1 and 2 ranks), the kernel bandwidth
# benchmark, and the default job with CPU and GPU workers side by side.
# Results go to $OUT (default ./gpu-results): logs, JUnit XML, JSON lines.
#
# Usage: bash tests/gpu/run_on_device.sh      (from the repository root)
#        SECTIONS="tests kernels" bash tests/gpu/run_on_device.sh   (some only:
#        env, nvcc, tests, kernels, train; the MPI set-up always runs)
# Wheels missing there (pytest-mpi, mpich, mpi4py) are taken from
# .gpu_wheels/, filled here beforehand with (Python 3.12, x86-64):
#   pip download --no-deps --only-binary=:all: --python-version 3.12 \
#       --platform manylinux_2_28_x86_64 --platform manylinux1_x86_64 \
#       -d .gpu_wheels pytest-mpi mpich mpi4py
set -u
OUT=${OUT:-$PWD/gpu-results}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD OMP_NUM_THREADS=1
export HPCPAX_TEST_GPU=${HPCPAX_TEST_GPU:-1}
PY=${PYTHON:-python3}
SECTIONS=${SECTIONS:-env nvcc tests kernels train}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
status=0

if want env; then
log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/versions.txt"
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
try:
    import cupy
    print("cupy", cupy.__version__, "cuda runtime", cupy.cuda.runtime.runtimeGetVersion(),
          "gpu", cupy.cuda.runtime.getDeviceProperties(0)["name"].decode())
except Exception as exc:  # reported, the tests then fail on it
    print("cupy unavailable:", exc)
PYEOF
fi

log "MPI: the image's mpi4py if it finds an MPI library, else the wheels"
mpi_ok() { timeout 60 $PY -c "from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])" \
    >"$OUT/mpi.txt" 2>&1; }
if ! mpi_ok; then
    $PY -m pip install -q --no-index --find-links .gpu_wheels mpich 2>&1 | tail -2
    mpi_ok || { $PY -m pip install -q --no-index --find-links .gpu_wheels --upgrade mpi4py 2>&1 | tail -2; mpi_ok; } \
        || { echo "no working mpi4py"; status=1; }
fi
$PY -m pip install -q --no-index --find-links .gpu_wheels pytest-mpi 2>&1 | tail -2
MPIRUN=$(dirname "$(command -v $PY)")/mpirun
[ -x "$MPIRUN" ] || MPIRUN=mpirun
# The image's Open MPI refuses root without these; its shared-memory
# single-copy path (CMA) is not allowed in a container.
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
$PY -c "from hpcpax.comm.transport import cuda_aware_mpi; print('cuda_aware_mpi', cuda_aware_mpi())" \
    >>"$OUT/mpi.txt" 2>&1
cat "$OUT/mpi.txt"

if want nvcc; then
log "CUDA kernels with nvcc (sm_90 PTX, the CI's check)"
bash .ci/compile_kernels.sh 2>&1 | tee "$OUT/nvcc.log" || status=1
fi

if want tests; then
log "GPU tests, 1 rank"
HPCPAX_DEVICE=gpu timeout 240 $PY -m pytest -q --with-mpi -m gpu tests/gpu \
    tests/comm/test_allreduce.py tests/comm/test_transport.py \
    --junitxml="$OUT/gpu-tests-1rank.xml" >"$OUT/gpu-tests-1rank.log" 2>&1 || status=1
tail -15 "$OUT/gpu-tests-1rank.log"

log "GPU tests, 2 ranks (1 server + 1 GPU worker, and 2 GPU workers)"
HPCPAX_DEVICE=gpu timeout 180 "$MPIRUN" -n 2 $PY -m mpi4py -m pytest -q --with-mpi \
    -m gpu tests/gpu/test_train_gpu.py tests/comm/test_allreduce.py \
    >"$OUT/gpu-tests-2ranks.log" 2>&1 || status=1
tail -8 "$OUT/gpu-tests-2ranks.log"
fi

if want kernels; then
log "kernel bandwidth (CuPy kernels)"
timeout 120 $PY benchmarks/kernels.py --gpu 2>"$OUT/kernels-gpu.err" | tail -1 | tee "$OUT/kernels_gpu.json"
[ -s "$OUT/kernels_gpu.json" ] || { status=1; tail -5 "$OUT/kernels-gpu.err"; }
fi

if want train; then
log "default job, plan ps, CPU vs GPU workers, 3 interleaved pairs (mpirun -n 4)"
# Untimed warm-up of each side first: Numba's and NVRTC's caches start empty.
for dev in cpu gpu; do
    timeout 120 "$MPIRUN" -n 4 $PY -m hpcpax.train --device $dev --plan ps --steps 20 \
        --run-dir /tmp/hpcpax-gpu-runs/warm-$dev >"$OUT/train-warm-$dev.log" 2>&1 || tail -5 "$OUT/train-warm-$dev.log"
done
for round in 1 2 3; do
    for dev in cpu gpu; do
        dir=/tmp/hpcpax-gpu-runs/$dev-$round
        timeout 90 "$MPIRUN" -n 4 $PY -m hpcpax.train --device $dev --plan ps --steps 300 \
            --run-dir "$dir" >"$OUT/train-$dev-$round.log" 2>&1 || { status=1; tail -5 "$OUT/train-$dev-$round.log"; }
    done
done
$PY - <<'PYEOF' 2>&1 | tee "$OUT/train_cpu_vs_gpu.json"
import json, statistics, os
rows = {}
for dev in ("cpu", "gpu"):
    for r in (1, 2, 3):
        path = f"/tmp/hpcpax-gpu-runs/{dev}-{r}/summary.json"
        if os.path.exists(path):
            s = json.load(open(path))
            rows.setdefault(dev, []).append((s["mean_samples_per_s"], s["final_loss"]))
out = {"command": "mpirun -n 4 python -m hpcpax.train --device DEV --plan ps --steps 300"}
for dev, v in rows.items():
    rates = [x[0] for x in v]
    out[dev] = {"samples_per_s": [round(x) for x in rates], "median": round(statistics.median(rates)),
                "final_loss": [round(x[1], 6) for x in v]}
if len(rows) == 2:
    out["gpu_over_cpu_median"] = round(out["gpu"]["median"] / out["cpu"]["median"], 3)
print(json.dumps(out))
PYEOF
fi

log "done, status $status"
exit $status
