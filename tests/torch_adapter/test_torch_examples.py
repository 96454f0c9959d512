"""The examples, 4 ranks through ``hpcpax.torch`` = 1 process of plain PyTorch.

``examples/torch_dlrm.py`` and ``examples/torch_lm.py`` run twice: as the
single-process PyTorch script (``--single-process``, in this process) and
under ``mpirun -n 4`` (the import and one call added), on the same global
batches, 50 steps; every final parameter (tables gathered by
``model.state_dict()``) must agree: ``max|a - b| / max|a| <= 1e-5`` in
float32, ``1e-10`` in float64. Layouts: 1 server + 3 workers (uneven shares
of every batch: 96 = 32 x 3 but 100 is not), and 4 ranks as 2 virtual nodes
with ``plan auto`` (tables move between methods mid-run).

Float32 settings: Adagrad with ``initial_accumulator_value=0.1`` (with
torch's default 0 the first update of a row is ``lr * sign(g)``, so a row
whose gradient sums to about zero flips with the summation order: the
adapter then differs from the single process by up to ``2 lr`` there, as a
float32 single process differs from its own float64 run), and 8 negatives
per sample for the LM's SGD (frequent rows' gradients are sums of hundreds
of terms; their rounding is the reference's own, measured in docs/measurements.md).

Serial only: it starts its own MPI job, one for every case
(``tests/torch_adapter/run_examples.py`` runs them one after the other in the
same four ranks, each case's output kept apart; a job per case cost four
interpreters importing torch, hpcpax and Numba each time).
"""

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

ROOT = Path(__file__).resolve().parents[2]
SMALL = {"dlrm": ["--rows-scale", "0.01", "--dim", "8"],
         "lm": ["--vocab", "5000", "--dim", "16", "--hidden", "32", "--negatives", "8"]}
CASES = [
    # example, optimizer, dtype, plan, ranks per node, global batch
    ("dlrm", "sgd", "float32", "ps", None, 100),
    ("dlrm", "adagrad", "float32", "auto", 2, 96),
    ("lm", "sgd", "float32", "auto", 2, 96),
    ("lm", "adagrad", "float32", "ps", None, 100),
    ("dlrm", "adagrad", "float64", "auto", 2, 96),
    ("lm", "sgd", "float64", "ps", None, 100),
]


def _outside_mpi():
    if "PMI_RANK" in os.environ or "OMPI_COMM_WORLD_RANK" in os.environ:
        pytest.skip("inside an MPI job: the test starts its own")


def _mpirun():
    path = Path(sys.executable).parent / "mpirun"
    return str(path) if path.exists() else "mpirun"


def _compare(reference, distributed):
    a, b = np.load(reference), np.load(distributed)
    assert sorted(a.files) == sorted(b.files)
    return {k: float(np.abs(a[k] - b[k]).max() / np.abs(a[k]).max()) for k in a.files}


def _args(example, optimizer, dtype, batch):
    return SMALL[example] + ["--steps", "50", "--batch", str(batch), "--optimizer", optimizer,
                             "--dtype", dtype, "--log-every", "25"]


@pytest.fixture(scope="module")
def distributed(tmp_path_factory):
    """Every case under ``mpirun -n 4``, in one job: ``(exit status, job output, folder)``;
    case ``i``'s parameters in ``folder/four<i>.npz``, its ranks' output in
    ``folder/case<i>.rank<r>.out``."""
    _outside_mpi()
    folder = tmp_path_factory.mktemp("four")
    cases = [{"example": example, "ranks_per_node": rpn,
              "args": _args(example, optimizer, dtype, batch)
              + ["--plan", plan, "--dump", str(folder / f"four{i}.npz")]}
             for i, (example, optimizer, dtype, plan, rpn, batch) in enumerate(CASES)]
    (folder / "cases.json").write_text(json.dumps(cases))
    env = {**os.environ, "MPIEXEC_TIMEOUT": "600", "OMP_NUM_THREADS": "1",
           "PYTHONWARNINGS": "ignore"}
    env.pop("HPCPAX_RANKS_PER_NODE", None)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    done = subprocess.run([_mpirun(), "-n", "4", sys.executable, "-m", "mpi4py",
                           str(Path(__file__).with_name("run_examples.py")),
                           str(folder / "cases.json"), str(folder)],
                          capture_output=True, text=True, timeout=620, cwd=ROOT, env=env)
    return done.returncode, done.stdout[-3000:] + done.stderr[-3000:], folder


@pytest.mark.timeout(700)
@pytest.mark.parametrize("example,optimizer,dtype,plan,rpn,batch", CASES)
def test_four_ranks_equal_one_process(tmp_path, distributed, example, optimizer, dtype, plan,
                                      rpn, batch):
    index = CASES.index((example, optimizer, dtype, plan, rpn, batch))
    script = ROOT / "examples" / f"torch_{example}.py"
    sys.path.insert(0, str(script.parent))
    try:
        module = importlib.import_module(f"torch_{example}")
    finally:
        sys.path.pop(0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        module.main(_args(example, optimizer, dtype, batch)
                    + ["--single-process", "--dump", str(tmp_path / "one.npz")])
    finally:
        torch.set_num_threads(threads)
    status, output, folder = distributed
    dumped = folder / f"four{index}.npz"
    assert status == 0, output
    stdout = "".join(p.read_text() for p in sorted(folder.glob(f"case{index}.rank*.out")))
    assert "hpcpax.torch: 4 ranks" in stdout, output  # the first worker's summary, once
    assert stdout.count("samples/s") == 1  # the other workers print nothing
    errors = _compare(tmp_path / "one.npz", dumped)
    tolerance = 1e-5 if dtype == "float32" else 1e-10
    assert max(errors.values()) <= tolerance, errors
