"""``benchmarks/torch_public_models.py --quick``: public models through hpcpax.torch.

Needs the benchmark extras (``pip install -e ".[bench]"``: DeepCTR-Torch,
transformers); skipped without them. The quick run checks what does not
depend on the machine's load: after a few steps on 4 ranks (1 server + 3
workers) every parameter of DeepFM and BERT equals the one-process run
(float64 within 1e-10, float32 within 1e-5), every rate is finite and
positive, and each adapter run names its plan. No time threshold.
"""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("deepctr_torch")
pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_public_models_train_exactly_through_the_adapter():
    mpirun = Path(sys.executable).parent / "mpirun"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "HYDRA_", "MPI"))}
    done = subprocess.run([str(mpirun if mpirun.exists() else "mpirun"), "-n", "4",
                           sys.executable, "-m", "mpi4py",
                           str(ROOT / "benchmarks" / "torch_public_models.py"), "--quick"],
                          cwd=ROOT, capture_output=True, text=True, timeout=540, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(result["models"]) == {"deepfm", "bert"}
    assert result["max_rel_diff_f64"] <= 1e-10 and result["max_rel_diff_f32"] <= 1e-5, result
    assert result["clip_max_rel_diff_f64"] <= 1e-10  # BERT clips its gradients
    for name, model in result["models"].items():
        rates = model["samples_per_s"]
        assert set(rates) == {"plain", "adapter_1rank", "adapter_2ranks", "adapter_4ranks",
                              "ddp_4ranks"}
        assert all(math.isfinite(v) and v > 0 for v in rates.values()), (name, rates)
        assert set(model["plans"]) == {"adapter_1rank", "adapter_2ranks", "adapter_4ranks"}
        assert all(sum(p.values()) > 0 for p in model["plans"].values())
