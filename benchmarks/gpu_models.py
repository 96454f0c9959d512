"""Realistic GPU models: hpcpax's GPU workers against plain PyTorch on the same GPU.

Prints one JSON line. On one GPU, for two models of realistic shape:

- ``dlrm``: hpcpax's ``ctr`` model with 26 tables of dim 128 (4 of 4M rows,
  8 of 1M, 14 of 100k: 28.4M rows), 13 dense features, bottom MLP 512-256-128,
  top MLP 1024-512, 16,384 samples per step, synthetic Zipf(1.1) ids;
- ``lm``: hpcpax's ``lm`` (LM-1B-shaped): 793,472 words, context 4, dim 128,
  hidden 1024, sampled softmax with 8,192 negatives, 16,384 samples per step;

samples/s of (median step after warm-up):
- ``torch``: the same model written in plain PyTorch on the GPU (tables as
  ``nn.Embedding(sparse=True)`` on the device, the same layers, loss and
  initial scales), plain SGD dense and sparse, the very batches hpcpax reads
  (its synthetic reader, same seed), each uploaded per step;
- ``hpcpax_1_server_1_worker``: ``mpirun -n 2 python -m hpcpax.train
  --device gpu --plan ps`` (tables on a CPU server, one GPU worker);
- ``hpcpax_every_rank_a_worker``: one rank, the GPU worker, its tables on the
  host in the same process (``--servers-per-node 0``).
``ratio_gpu_worker_vs_plain_torch`` = the better hpcpax layout / torch, per
model (goal >= 0.9; the layout is named).

``default_job``: ``mpirun -n 4 python -m hpcpax.train --plan ps --steps 300``
with ``--device cpu`` and ``--device auto``, interleaved rounds;
``ratio_default_auto_vs_cpu`` = median auto / median cpu samples/s (goal >=
0.95), with what ``auto`` chose. ``kernel_fraction_of_copy_bw``: from
``benchmarks/kernels.py``'s GPU run in this process (``--skip-kernels`` to
leave out when run beside it).

``--quick`` runs tiny sizes; without a GPU it runs them on the CPU (hpcpax
``--device cpu``, torch on the CPU) so the script itself is exercised.
Without a GPU and without ``--quick`` it prints ``{"skipped": ...}`` and
exits 0.

Run: ``python benchmarks/gpu_models.py [--quick] [--skip-kernels]`` (it starts
its own ``mpirun``; ``MPIRUN`` overrides which).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _common  # noqa: E402

DLRM_ROWS = [4_000_000] * 4 + [1_000_000] * 8 + [100_000] * 14
FULL = {
    "dlrm": {"model": "ctr", "n_dense": 13, "n_fields": 26, "table_rows": DLRM_ROWS,
             "emb_dim": 128, "bottom": [512, 256, 128], "top": [1024, 512],
             "global_batch": 16_384, "steps": 30, "warmup": 8},
    "lm": {"model": "lm", "vocab_size": 793_472, "context": 4, "emb_dim": 128, "hidden": [1024],
           "out_dim": 128, "num_sampled": 8192, "global_batch": 16_384, "steps": 30, "warmup": 8},
}
QUICK = {
    "dlrm": {"model": "ctr", "n_dense": 13, "n_fields": 4, "table_rows": [2000, 1000, 500, 100],
             "emb_dim": 16, "bottom": [32, 16], "top": [32], "global_batch": 256, "steps": 8,
             "warmup": 3},
    "lm": {"model": "lm", "vocab_size": 5000, "context": 4, "emb_dim": 16, "hidden": [32],
           "out_dim": 16, "num_sampled": 64, "global_batch": 256, "steps": 8, "warmup": 3},
}
LR, SPARSE_LR = 0.01, 0.05
DEFAULT_JOB = {"full": {"ranks": 4, "steps": 300, "rounds": 2},
               "quick": {"ranks": 2, "steps": 20, "rounds": 1}}


def device_facts(gpu: bool) -> dict:
    """GPU name and CUDA/CuPy/torch versions (what the results are tied to)."""
    facts = {"host": platform.node(), "gpu": None}
    try:
        import torch

        facts["torch"] = torch.__version__
        facts["torch_cuda"] = torch.version.cuda
    except ImportError:
        facts["torch"] = None
    if gpu:
        from hpcpax.backend import cupy_module

        cp = cupy_module(required=True)
        name = cp.cuda.runtime.getDeviceProperties(0)["name"]
        facts.update(gpu=name.decode() if isinstance(name, bytes) else name,
                     cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                     cuda_driver=cp.cuda.runtime.driverGetVersion(), cupy=cp.__version__)
    return facts


def train_config(sizes: dict, **extra) -> dict:
    """The hpcpax training config of one model (SGD dense and sparse, like the torch side)."""
    config = {k: v for k, v in sizes.items() if k != "warmup"}
    config.update(optimizer="sgd", lr=LR, sparse_optimizer="sgd", sparse_lr=SPARSE_LR,
                  synthetic_samples=sizes["global_batch"] * (sizes["steps"] + 1), quiet=True,
                  **extra)
    return config


def argv_of(config: dict) -> list:
    """``python -m hpcpax.train`` flags of ``config``."""
    argv = []
    for key, value in config.items():
        if value is True:
            argv.append("--" + key.replace("_", "-"))
        elif value is not False and value is not None:
            text = ",".join(str(v) for v in value) if isinstance(value, (list, tuple)) else str(value)
            argv += ["--" + key.replace("_", "-"), text]
    return argv


def mpirun() -> str:
    found = os.environ.get("MPIRUN") or os.path.join(os.path.dirname(sys.executable), "mpirun")
    return found if os.path.exists(found) else "mpirun"


def run_hpcpax(config: dict, ranks: int, timeout: float) -> dict:
    """One ``hpcpax.train`` job; its median step and summary, or its error."""
    run_dir = tempfile.mkdtemp(prefix="hpcpax-gpu-models-")
    config = {**config, "run_dir": os.path.join(run_dir, "run")}
    command = [sys.executable, "-m", "mpi4py", "-m", "hpcpax.train", *argv_of(config)]
    if ranks > 1:
        command = [mpirun(), "-n", str(ranks), *command]
    began = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            return {"error": f"exit {done.returncode}: {done.stderr.strip()[-600:]}"}
        with open(os.path.join(config["run_dir"], "summary.json"), encoding="utf-8") as handle:
            summary = json.load(handle)
        steps = [json.loads(line) for line in open(os.path.join(config["run_dir"], "metrics.jsonl"),
                                                      encoding="utf-8")]
        steps = [s for s in steps if "samples_per_s" in s]
        return {"summary": summary, "steps": steps, "wall_s": time.perf_counter() - began}
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def hpcpax_rate(config: dict, ranks: int, warmup: int, timeout: float) -> dict:
    """samples/s (median step after ``warmup``) and per-phase seconds of one layout."""
    done = run_hpcpax(config, ranks, timeout)
    if "error" in done:
        return done
    steps = done["steps"][warmup:] or done["steps"]
    seconds = statistics.median(s["seconds"] for s in steps)
    phases = {p: statistics.median(s["time"][p] for s in steps) for p in steps[0]["time"]}
    return {"samples_per_s": config["global_batch"] / seconds, "seconds_per_step": seconds,
            "seconds_by_phase": phases, "wall_s": done["wall_s"]}


# -- the same models in plain PyTorch --------------------------------------------


def torch_dlrm(torch, model, device):
    """hpcpax's ``ctr`` (:class:`hpcpax.models.ctr.CTRModel`) in PyTorch."""
    nn = torch.nn

    class DLRM(nn.Module):
        def __init__(self):
            super().__init__()
            dims = [model.n_dense] + list(model.bottom)
            self.bottom = nn.Sequential(*[m for a, b in zip(dims, dims[1:])
                                          for m in (nn.Linear(a, b), nn.ReLU())])
            scale = 1 / np.sqrt(model.emb_dim)
            self.tables = nn.ModuleList()
            for rows in model.table_rows:
                table = nn.Embedding(rows, model.emb_dim, sparse=True)
                nn.init.uniform_(table.weight, -scale, scale)
                self.tables.append(table)
            dims = [model.interaction_dim] + list(model.top)
            self.top = nn.Sequential(*[m for a, b in zip(dims, dims[1:])
                                       for m in (nn.Linear(a, b), nn.ReLU())],
                                     nn.Linear(dims[-1], 1))
            upper = np.triu_indices(model.n_fields + 1, k=1)
            self.upper = [torch.as_tensor(u, device=device) for u in upper]
            self.table_rows = torch.as_tensor(model.table_rows, device=device)

        def forward(self, dense, categorical, label):
            bottom = self.bottom(dense)
            ids = categorical % self.table_rows
            stacked = torch.stack([bottom] + [t(ids[:, i]) for i, t in enumerate(self.tables)], 1)
            gram = stacked @ stacked.transpose(1, 2)
            top_in = torch.cat([bottom, gram[:, self.upper[0], self.upper[1]]], 1)
            logits = self.top(top_in)[:, 0]
            return nn.functional.binary_cross_entropy_with_logits(logits, label)

    return DLRM().to(device)


def torch_lm(torch, model, device):
    """hpcpax's ``lm`` (:class:`hpcpax.models.lm.LanguageModel`) in PyTorch."""
    nn = torch.nn

    class LM(nn.Module):
        def __init__(self):
            super().__init__()
            self.embedding = nn.Embedding(model.vocab_size, model.emb_dim, sparse=True)
            self.softmax_w = nn.Embedding(model.vocab_size, model.out_dim, sparse=True)
            self.softmax_b = nn.Embedding(model.vocab_size, 1, sparse=True)
            for spec in model.sparse_specs():
                nn.init.uniform_(getattr(self, spec.name).weight, -spec.init_scale, spec.init_scale)
            dims = [model.context * model.emb_dim] + list(model.hidden)
            self.mlp = nn.Sequential(*[m for a, b in zip(dims, dims[1:])
                                       for m in (nn.Linear(a, b), nn.ReLU())],
                                     nn.Linear(dims[-1], model.out_dim))

        def forward(self, context, target, samples, log_q_true, log_q_sampled):
            output = self.mlp(self.embedding(context).reshape(context.shape[0], -1))
            true_logits = ((output * self.softmax_w(target)).sum(1)
                           + self.softmax_b(target)[:, 0] - log_q_true)
            sampled = output @ self.softmax_w(samples).T + (self.softmax_b(samples)[:, 0]
                                                            - log_q_sampled)
            sampled = sampled.masked_fill(samples[None, :] == target[:, None], -1e30)
            logits = torch.cat([true_logits[:, None], sampled], 1)
            zeros = torch.zeros(context.shape[0], dtype=torch.int64, device=context.device)
            return nn.functional.cross_entropy(logits, zeros)

    return LM().to(device)


def torch_rate(sizes: dict, device_name: str) -> dict:
    """samples/s of the plain-PyTorch model on ``device_name``, on hpcpax's batches."""
    try:
        import torch
    except ImportError:
        return {"error": "torch is not installed"}
    from hpcpax.app.config import resolve
    from hpcpax.app.datasets import build_model, open_data
    from hpcpax.models.lm import log_uniform_log_expected_count, log_uniform_sample

    config = resolve(train_config(sizes))
    model = build_model(config)
    reader, _ = open_data(model, config)
    device = torch.device(device_name)
    torch.manual_seed(0)
    net = (torch_dlrm if config["model"] == "ctr" else torch_lm)(torch, model, device)
    sparse = [p for n, p in net.named_parameters() if "tables" in n or n.split(".")[0] in
              ("embedding", "softmax_w", "softmax_b")]
    dense = [p for p in net.parameters() if all(p is not s for s in sparse)]
    optimizer = torch.optim.SGD([{"params": dense, "lr": LR}, {"params": sparse, "lr": SPARSE_LR}])
    g = config["global_batch"]

    def inputs(position):
        batch = reader.batch(position, g, 0, 1)
        if config["model"] == "ctr":
            return (torch.as_tensor(batch["dense"], device=device),
                    torch.as_tensor(batch["categorical"], device=device),
                    torch.as_tensor(batch["label"], device=device))
        samples = log_uniform_sample(config["seed"], position, model.num_sampled, model.vocab_size)
        target = batch["target"].astype(np.int64)
        q = [log_uniform_log_expected_count(np, x, model.num_sampled, model.vocab_size, np.float32)
             for x in (target, samples)]
        return tuple(torch.as_tensor(np.ascontiguousarray(x), device=device)
                     for x in (batch["context"].astype(np.int64), target, samples, *q))

    seconds = []
    for position in range(config["steps"]):
        began = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        loss = net(*inputs(position))
        loss.backward()
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    step = statistics.median(seconds[sizes["warmup"]:])
    return {"samples_per_s": g / step, "seconds_per_step": step, "final_loss": loss.item()}


# -- the figures -------------------------------------------------------------------


def model_figures(name: str, sizes: dict, gpu: bool, timeout: float) -> dict:
    device = "gpu" if gpu else "cpu"
    config = train_config(sizes, device=device, plan="ps")
    out = {"sizes": {k: v for k, v in sizes.items()},
           "torch": torch_rate(sizes, "cuda" if gpu else "cpu"),
           "hpcpax_1_server_1_worker": hpcpax_rate({**config, "servers_per_node": 1}, 2,
                                                   sizes["warmup"], timeout),
           "hpcpax_every_rank_a_worker": hpcpax_rate({**config, "servers_per_node": 0}, 1,
                                                     sizes["warmup"], timeout)}
    rates = {k: out[k].get("samples_per_s") for k in out if k.startswith("hpcpax_")}
    best = max((k for k in rates if rates[k]), key=lambda k: rates[k], default=None)
    out["ratio_vs_torch"] = {k: _common.ratio(v, out["torch"].get("samples_per_s"))
                             for k, v in rates.items()}
    out["best_layout"] = best
    return out


def default_job(quick: bool, timeout: float) -> dict:
    """The default job with CPU workers and with ``--device auto``, interleaved."""
    job = DEFAULT_JOB["quick" if quick else "full"]
    rates = {"cpu": [], "auto": []}
    chose = []
    for _ in range(job["rounds"]):
        for device in ("cpu", "auto"):
            done = run_hpcpax({"plan": "ps", "steps": job["steps"], "device": device,
                               "quiet": True}, job["ranks"], timeout)
            if "error" in done:
                return {"error": f"--device {device}: {done['error']}"}
            rates[device].append(done["summary"]["mean_samples_per_s"])
            if device == "auto":
                chose.append(done["summary"].get("device_choice", {"device": "cpu (no GPU seen)"}))
    medians = {k: statistics.median(v) for k, v in rates.items()}
    return {"command": f"mpirun -n {job['ranks']} python -m hpcpax.train --plan ps --steps "
                       f"{job['steps']} --device cpu|auto", "samples_per_s": rates,
            "median": medians, "auto_chose": chose,
            "ratio_default_auto_vs_cpu": _common.ratio(medians["auto"], medians["cpu"])}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (runs on a CPU too)")
    parser.add_argument("--skip-kernels", action="store_true",
                        help="leave out benchmarks/kernels.py's GPU kernels")
    parser.add_argument("--models", default="dlrm,lm", help="which models (dlrm,lm)")
    parser.add_argument("--skip-default-job", action="store_true")
    parser.add_argument("--timeout", type=float, default=240.0, help="seconds per training job")
    args = parser.parse_args()
    from hpcpax.backend import has_gpu

    gpu = has_gpu()
    if not gpu and not args.quick:
        _common.emit({"benchmark": "gpu_models", "skipped": "no CUDA device (CuPy and a GPU "
                      "are needed; --quick runs tiny sizes on the CPU)"})
        return 0
    result = {"benchmark": "gpu_models", "quick": args.quick, "device": device_facts(gpu)}
    if gpu and not args.skip_kernels:
        import kernels

        result["kernels"] = kernels.gpu_benchmark(args.quick, 3 if args.quick else 7)
        result["kernel_fraction_of_copy_bw"] = result["kernels"]["kernel_fraction_of_copy_bw"]
        result["kernels_bit_equal_to_twin"] = result["kernels"]["bit_equal_to_twin"]
    sizes = QUICK if args.quick else FULL
    result["models"] = {name: model_figures(name, sizes[name], gpu, args.timeout)
                        for name in args.models.split(",") if name}
    result["ratio_gpu_worker_vs_plain_torch"] = {
        name: (m["ratio_vs_torch"].get(m["best_layout"]) if m["best_layout"] else None)
        for name, m in result["models"].items()}
    if not args.skip_default_job:
        result["default_job"] = default_job(args.quick, args.timeout)
        result["ratio_default_auto_vs_cpu"] = result["default_job"].get("ratio_default_auto_vs_cpu")
    _common.emit(result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
