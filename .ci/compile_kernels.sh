#!/usr/bin/env bash
# Compile every kernels/*.cu to PTX for sm_90 with nvcc, so a syntax error in
# a kernel fails CI even on machines without a GPU. Skips when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
NVCC="${NVCC:-$(command -v nvcc || true)}"
if [ -z "$NVCC" ] && [ -x /usr/local/cuda/bin/nvcc ]; then NVCC=/usr/local/cuda/bin/nvcc; fi
if [ -z "$NVCC" ]; then
    echo "compile_kernels: SKIP (no nvcc found)"
    exit 0
fi
out="$(mktemp -d /tmp/hpcpax_ptx.XXXXXX)"
trap 'rm -rf "$out"' EXIT
status=0
for src in kernels/*.cu; do
    name="$(basename "$src" .cu)"
    # Same flags as the NVRTC path in hpcpax/ops/_cuda.py (no fused multiply-add).
    if "$NVCC" --ptx -arch=sm_90 -std=c++17 --fmad=false -Ikernels -o "$out/$name.ptx" "$src"; then
        entries=$(grep -c '^\.visible \.entry' "$out/$name.ptx" || true)
        if [ "$entries" -eq 0 ]; then
            echo "compile_kernels: FAIL $src emitted no kernels"; status=1
        else
            echo "compile_kernels: ok $src ($entries kernels)"
        fi
    else
        echo "compile_kernels: FAIL $src"; status=1
    fi
done
exit $status
