#!/usr/bin/env bash
# The whole GPU check in one script, for a machine with an NVIDIA GPU and no
# package index (the device tool's H200), in about 10 minutes: environment
# facts, the kernels built by nvcc, the GPU test suite (kernels vs NumPy
# twins bit for bit, allreduce transports, GPU training vs CPU, 1 and 2
# ranks), the kernel bandwidth benchmark (benchmarks/kernels.py --gpu) and the
# model benchmark (benchmarks/gpu_models.py: DLRM- and LM-1B-shaped models,
# hpcpax GPU workers vs plain PyTorch, and the default job with --device auto
# vs CPU workers). Results go to $OUT (default ./gpu-results): logs, JUnit
# XML, JSON lines, and results-gpu.json, one object with the device, CUDA and
# CuPy versions and the issue-47 figures (also copied to
# benchmarks/results/<date>-gpu.json). It is rewritten after every section,
# so a run cut short still leaves what it measured.
#
# Usage: bash tests/gpu/run_on_device.sh      (from the repository root)
#        SECTIONS="tests kernels" bash tests/gpu/run_on_device.sh   (some only:
#        env, nvcc, tests, kernels, models; the MPI set-up always runs)
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
SECTIONS=${SECTIONS:-env nvcc tests kernels models}
log() { echo "== $(date +%T) $*" | tee -a "$OUT/steps.log"; }
want() { [[ " $SECTIONS " == *" $1 "* ]]; }
status=0
# results-gpu.json from whatever the sections below have written so far
write_results() {
$PY - "$OUT" <<'PYEOF'
import datetime, json, os, re, shutil, subprocess, sys
import xml.etree.ElementTree as ET
out = sys.argv[1]
def load(name):
    path = os.path.join(out, name)
    try:
        with open(path) as f:
            text = f.read().strip().splitlines()
        return json.loads(text[-1]) if text else None
    except (OSError, ValueError):
        return None
def junit(name):
    path = os.path.join(out, name)
    if not os.path.exists(path):
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    tests = sum(int(s.get("tests", 0)) for s in suites)
    failed = sum(int(s.get("failures", 0)) + int(s.get("errors", 0)) for s in suites)
    skipped = sum(int(s.get("skipped", 0)) for s in suites)
    kernel_failures = [c.get("name") for s in suites for c in s.iter("testcase")
                       if "test_kernels_gpu" in (c.get("classname") or "")
                       and (c.find("failure") is not None or c.find("error") is not None)]
    return {"passed": tests - failed - skipped, "failed": failed, "skipped": skipped,
            "kernel_test_failures": kernel_failures}
device = load("versions.json") or {}
try:
    device["nvidia_smi"] = open(os.path.join(out, "gpu.txt")).read().strip().splitlines()[-1]
except OSError:
    pass
try:
    device["mpi"] = open(os.path.join(out, "mpi.txt")).read().strip().splitlines()
except OSError:
    pass
kernels, models = load("kernels_gpu.json"), load("gpu_models.json")
tests = {"gpu_1rank": junit("gpu-tests-1rank.xml"), "gpu_2ranks": junit("gpu-tests-2ranks.xml")}
one = tests["gpu_1rank"]
twins = kernels.get("bit_equal_to_twin") if kernels else None
result = {
    "date": datetime.date.today().isoformat(), "device": device, "tests": tests,
    # every kernel test of tests/gpu/test_kernels_gpu.py passed, and the benchmark's own check
    "every_cuda_kernel_bit_equal_to_twin": (None if one is None or twins is None else
                                            one["passed"] > 0 and not one["kernel_test_failures"]
                                            and all(twins.values())),
    "kernel_fraction_of_copy_bw": kernels.get("kernel_fraction_of_copy_bw") if kernels else None,
    "ratio_gpu_worker_vs_plain_torch": models.get("ratio_gpu_worker_vs_plain_torch") if models else None,
    "ratio_default_auto_vs_cpu": models.get("ratio_default_auto_vs_cpu") if models else None,
    "goals": {"kernel_fraction_of_copy_bw": {"dedup_sum": 0.5, "scatter_add_rows": 0.5,
                                              "gather_rows": 0.7},
              "ratio_gpu_worker_vs_plain_torch": 0.9, "ratio_default_auto_vs_cpu": 0.95},
    "kernels": kernels, "models": models,
}
with open(os.path.join(out, "results-gpu.json"), "w") as f:
    json.dump(result, f, indent=1)
os.makedirs("benchmarks/results", exist_ok=True)
shutil.copy(os.path.join(out, "results-gpu.json"),
            f"benchmarks/results/{result['date']}-gpu.json")
PYEOF
}

if want env; then
log "environment"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee "$OUT/gpu.txt"
$PY - <<'PYEOF' 2>&1 | tee "$OUT/versions.json"
import sys, numpy
import json
facts = {"python": sys.version.split()[0], "numpy": numpy.__version__}
try:
    import cupy
    name = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    facts.update(cupy=cupy.__version__, cuda_runtime=cupy.cuda.runtime.runtimeGetVersion(),
                 cuda_driver=cupy.cuda.runtime.driverGetVersion(),
                 gpu=name.decode() if isinstance(name, bytes) else name)
except Exception as exc:  # reported, the tests then fail on it
    facts["cupy_error"] = str(exc)
try:
    import torch
    facts.update(torch=torch.__version__, torch_cuda=torch.version.cuda,
                 torch_sees_gpu=torch.cuda.is_available())
except Exception as exc:
    facts["torch_error"] = str(exc)
print(json.dumps(facts))
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
HPCPAX_DEVICE=gpu timeout 170 $PY -m pytest -q --with-mpi -m gpu tests/gpu \
    tests/comm/test_allreduce.py tests/comm/test_transport.py \
    --junitxml="$OUT/gpu-tests-1rank.xml" >"$OUT/gpu-tests-1rank.log" 2>&1 || status=1
tail -15 "$OUT/gpu-tests-1rank.log"

log "GPU tests, 2 ranks (1 server + 1 GPU worker, and 2 GPU workers)"
HPCPAX_DEVICE=gpu timeout 80 "$MPIRUN" -n 2 $PY -m mpi4py -m pytest -q --with-mpi \
    -m gpu tests/gpu/test_train_gpu.py tests/comm/test_allreduce.py \
    --junitxml="$OUT/gpu-tests-2ranks.xml" >"$OUT/gpu-tests-2ranks.log" 2>&1 || status=1
tail -8 "$OUT/gpu-tests-2ranks.log"
write_results
fi

if want kernels; then
log "kernel bandwidth (CuPy kernels, Zipf(1.05) ids, 1M and 10M x 64 and 128)"
timeout 90 $PY benchmarks/kernels.py --gpu 2>"$OUT/kernels-gpu.err" | tail -1 | tee "$OUT/kernels_gpu.json"
[ -s "$OUT/kernels_gpu.json" ] || { status=1; tail -5 "$OUT/kernels-gpu.err"; }
write_results
fi

if want models; then
log "models: DLRM and LM-1B shapes, hpcpax GPU workers vs plain PyTorch; default job auto vs cpu"
timeout 200 $PY benchmarks/gpu_models.py --skip-kernels --timeout 90 2>"$OUT/gpu-models.err" \
    | tail -1 | tee "$OUT/gpu_models.json"
[ -s "$OUT/gpu_models.json" ] || { status=1; tail -5 "$OUT/gpu-models.err"; }
write_results
fi

log "done, status $status"
exit $status
