"""Shuffled against in-order batch reads, and the data phase's share of a training step.

The workload of issue 11: an LM token file of 8.4M tokens (20k-word Zipf
vocabulary), one worker's shard (1 of 3) of a 192-sample global batch,
context 4. Reads are timed per batch, over ``--batches`` consecutive steps
starting at a fresh position each round (so the OS page cache, not a warm
array, serves them), A B A B ... interleaved over ``--rounds`` rounds; the
per-batch time is the mean of a round (it includes the shuffled index
blocks, computed once per 4096 steps). Three file/read paths:

- ``mapped_contiguous``: the file as ``python -m hpcpax.data`` writes it now
  (contiguous), read through the memory map: the default path;
- ``mapped_chunked``: a file of the old converter (1 MiB chunks), same path;
- ``h5py_chunked``: that old file read through h5py with per-step indices
  (the code before issue 11), for reference (``--batches / 20`` per round).

Then ``python -m hpcpax.train`` itself (``Trainer``, plan ``ps``) on the
contiguous file, shuffled and ``--no-shuffle`` runs interleaved: the data
phase's share of a step is ``sum(time.data) / sum(seconds)`` over the steady
steps (warm-up excluded) of the first worker's ``metrics.jsonl``.

    mpirun -n 4 python benchmarks/data_read.py      # 1 server + 3 workers, as in the issue
    python benchmarks/data_read.py --quick          # smoke run, any rank count

Keys: ``ratio_shuffled_vs_sequential`` (goal <= 1.5) and
``data_fraction_of_step`` (goal <= 0.05), each with ``_median`` and
``_spread`` ([min, max] over rounds/runs).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common

from hpcpax.app.trainer import Trainer
from hpcpax.data import open_dataset, write_lm
from hpcpax.data.sampling import sample_indices
from hpcpax.data.writing import Appender, atomic_h5, write_vocab

GLOBAL_BATCH, SHARDS, CONTEXT = 192, 3, 4


def make_files(folder, tokens, vocab_size):
    """The same tokens as a contiguous file (today's converters) and a 1 MiB-chunked one."""
    vocab = ["<unk>"] + [f"w{i}" for i in range(1, vocab_size)]
    contiguous = os.path.join(folder, "contiguous.h5")
    write_lm(contiguous, tokens, vocab)
    chunked = os.path.join(folder, "chunked.h5")
    with atomic_h5(chunked) as h5file:  # what the streaming converter wrote before
        h5file.attrs["format"] = "hpcpax-lm/1"
        write_vocab(h5file, vocab)
        appender = Appender(h5file, "tokens", "int32")
        for first in range(0, len(tokens), 1 << 20):
            appender.append(tokens[first:first + (1 << 20)])
        appender.finish()
    return contiguous, chunked


def reader_for(path, shuffle, old_path):
    reader = open_dataset(path, "lm", context=CONTEXT, shuffle=shuffle, seed=0)
    if old_path:
        reader._tokens = reader._file["tokens"]  # the h5py dataset, not the map
        reader.sample_indices = lambda step, g, shard, n: sample_indices(
            step, g, shard, n, reader.num_samples, shuffle, 0, reader.name)
    return reader


def time_batches(reader, first_step, batches):
    start = time.perf_counter()
    for step in range(first_step, first_step + batches):
        reader.batch(step, GLOBAL_BATCH, 0, SHARDS)
    return (time.perf_counter() - start) / batches


def read_benchmark(paths, rounds, batches, samples):
    """``{path_name: {"sequential": [s, ...], "shuffled": [s, ...]}}`` per-batch seconds."""
    steps_per_epoch = samples // GLOBAL_BATCH
    out = {}
    readers = {(name, shuffle): reader_for(path, shuffle, name == "h5py_chunked")
               for name, path in paths.items() for shuffle in (False, True)}
    for name in paths:
        out[name] = {"sequential": [], "shuffled": []}
    for k in range(rounds):
        first = (1 + k * 7919 * batches) % max(1, steps_per_epoch - batches)
        for name in paths:
            # the old h5py path takes milliseconds a shuffled batch: time fewer
            count = max(20, batches // 20) if name == "h5py_chunked" else batches
            for shuffle, label in ((False, "sequential"), (True, "shuffled")):
                out[name][label].append(time_batches(readers[name, shuffle], first, count))
    return out


def train_fraction(comm, path, shuffle, steps, run_dir):
    config = {"data": path, "steps": steps, "global_batch": GLOBAL_BATCH, "context": CONTEXT,
              "plan": "ps", "quiet": True, "shuffle": shuffle, "run_dir": run_dir}
    Trainer(config, comm=comm).run()
    comm.Barrier()
    if comm.Get_rank() != 0:
        return None
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle if '"loss"' in line][1:]  # no warm-up
    return (sum(r["time"]["data"] for r in records) / sum(r["seconds"] for r in records),
            GLOBAL_BATCH * len(records) / sum(r["seconds"] for r in records))


def summary(values):
    return _common.median(values), [float(min(values)), float(max(values))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=8_400_000)
    parser.add_argument("--vocab-size", type=int, default=20_000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=2000, help="batches timed per round")
    parser.add_argument("--train-steps", type=int, default=300)
    parser.add_argument("--train-runs", type=int, default=3, help="runs of each order")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.tokens, args.vocab_size, args.rounds, args.batches = 200_000, 2000, 3, 100
        args.train_steps, args.train_runs = 12, 1
    comm = MPI.COMM_WORLD
    rank = comm.Get_rank()
    folder = comm.bcast(tempfile.mkdtemp(prefix="hpcpax-data-read-") if rank == 0 else None)
    result = {"benchmark": "data_read", "ranks": comm.Get_size(), "tokens": args.tokens,
              "vocab_size": args.vocab_size, "global_batch": GLOBAL_BATCH, "shards": SHARDS,
              "context": CONTEXT, "method": "hpcpax.train --plan ps (every sparse variable "
              "on the parameter server)", "machine": "shared; timings are noisy"}
    try:
        paths = None
        if rank == 0:
            rng = np.random.default_rng(0)
            tokens = (rng.zipf(1.2, args.tokens) % args.vocab_size).astype(np.int32)
            contiguous, chunked = make_files(folder, tokens, args.vocab_size)
            paths = {"mapped_contiguous": contiguous, "mapped_chunked": chunked,
                     "h5py_chunked": chunked}
            times = read_benchmark(paths, args.rounds, args.batches, args.tokens - CONTEXT)
            for name, entry in times.items():
                ratios = [s / q for s, q in zip(entry["shuffled"], entry["sequential"])]
                result[name] = {"sequential_us_per_batch": summary(
                                    [1e6 * t for t in entry["sequential"]])[0],
                                "shuffled_us_per_batch": summary(
                                    [1e6 * t for t in entry["shuffled"]])[0],
                                "ratio_shuffled_vs_sequential_median": summary(ratios)[0],
                                "ratio_shuffled_vs_sequential_spread": summary(ratios)[1]}
            default = result["mapped_contiguous"]
            result["ratio_shuffled_vs_sequential"] = default["ratio_shuffled_vs_sequential_median"]
            result["ratio_shuffled_vs_sequential_spread"] = \
                default["ratio_shuffled_vs_sequential_spread"]
        paths = comm.bcast(paths, root=0)
        fractions = {True: [], False: []}
        rates = {True: [], False: []}
        for k in range(args.train_runs):
            for shuffle in (True, False):
                run_dir = os.path.join(folder, f"run-{k}-{int(shuffle)}")
                got = train_fraction(comm, paths["mapped_contiguous"], shuffle,
                                     args.train_steps, run_dir)
                if got is not None:
                    fractions[shuffle].append(got[0])
                    rates[shuffle].append(got[1])
        if rank == 0:
            for shuffle, label in ((True, "shuffled"), (False, "sequential")):
                median, spread = summary(fractions[shuffle])
                result[f"data_fraction_of_step_{label}_median"] = median
                result[f"data_fraction_of_step_{label}_spread"] = spread
                result[f"train_samples_per_s_{label}_median"] = summary(rates[shuffle])[0]
            result["data_fraction_of_step"] = result["data_fraction_of_step_shuffled_median"]
            result["train_steps_per_run"] = args.train_steps
            result["train_runs"] = args.train_runs
    finally:
        comm.Barrier()
        if rank == 0:
            shutil.rmtree(folder, ignore_errors=True)
    _common.emit(result, rank)


if __name__ == "__main__":
    main()
