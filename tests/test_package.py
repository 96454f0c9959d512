"""The package surface: flat public names, documented, cheap to import."""

import subprocess
import sys

import hpcpax


def test_import_loads_no_gpu_jit_or_mpi_library():
    code = ("import sys, hpcpax; print(sorted({m.split('.')[0] for m in sys.modules} & "
            "{'cupy', 'numba', 'torch', 'matplotlib', 'mpi4py'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True)
    assert out.stdout.strip() == "[]"


def test_every_public_name_is_documented():
    missing = [name for name in hpcpax.__all__ if not (getattr(hpcpax, name).__doc__ or "").strip()]
    assert not missing, missing
