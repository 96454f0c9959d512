"""GPU workers train exactly like CPU workers (BSP, float64).

The same tiny ``lm`` run twice in one job, workers on the CPU and then on the
GPU (servers stay on the CPU; MPI is host-staged unless CUDA-aware): losses
and final parameters agree to float64 round-off. Skipped without CuPy and a
CUDA device unless ``HPCPAX_TEST_GPU=1``, which makes a missing GPU a failure.
"""

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app.trainer import Trainer

pytestmark = pytest.mark.gpu

TINY = {
    "model": "lm", "vocab_size": 300, "context": 3, "emb_dim": 8, "hidden": [16],
    "out_dim": 8, "num_sampled": 16, "global_batch": 12, "synthetic_samples": 5000,
    "lr": 0.01, "sparse_lr": 0.2, "quiet": True, "dtype": "float64", "plan": "ps",
    "steps": 8,
}



def _run(comm, tmp_path, device):
    path = comm.bcast(str(tmp_path / device) if comm.Get_rank() == 0 else None, root=0)
    trainer = Trainer({**TINY, "device": device, "run_dir": path}, comm=comm, collect=True)
    trainer.run()
    first = trainer.topology.worker_ranks[0]
    return comm.bcast((trainer.losses, trainer.parameters), root=first)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(300)
def test_gpu_workers_equal_cpu_workers(comm, tmp_path, need_gpu):
    cpu_losses, cpu = _run(comm, tmp_path, "cpu")
    gpu_losses, gpu = _run(comm, tmp_path, "gpu")
    ok = np.allclose(cpu_losses, gpu_losses, rtol=1e-9, atol=1e-12)
    for part in ("dense", "sparse"):
        for name in cpu[part]:
            ok &= np.allclose(cpu[part][name], gpu[part][name], rtol=1e-8, atol=1e-11)
    assert comm.allreduce(bool(ok), op=MPI.LAND)
