"""``benchmarks/data_read.py --quick``: runs, prints one JSON line with sane figures.

Never a time threshold (the machine is shared): only that every figure is
there, finite and positive, and that the read paths it compares all ran.
"""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
from mpi4py import MPI

ROOT = Path(__file__).resolve().parents[2]


def test_data_read_quick_prints_one_json_line():
    if MPI.COMM_WORLD.Get_size() > 1:
        pytest.skip("a child MPI process cannot start inside an mpirun rank")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "data_read.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.strip().splitlines()
    assert len(lines) == 1
    result = json.loads(lines[0])
    for key in ("ratio_shuffled_vs_sequential", "data_fraction_of_step",
                "train_samples_per_s_shuffled_median"):
        assert math.isfinite(result[key]) and result[key] > 0, key
    for path in ("mapped_contiguous", "mapped_chunked", "h5py_chunked"):
        entry = result[path]
        assert entry["sequential_us_per_batch"] > 0 and entry["shuffled_us_per_batch"] > 0
        low, high = entry["ratio_shuffled_vs_sequential_spread"]
        assert 0 < low <= entry["ratio_shuffled_vs_sequential_median"] <= high
    assert 0 < result["data_fraction_of_step"] < 1
