"""Eval metrics do not depend on the number of workers (issue 11, item 1).

Same parameters, same eval set, evaluated by 1, 2 and 3 workers: loss,
perplexity and AUC agree to float rounding, and equal a one-process NumPy
reference over the whole set (perplexity = exp(mean loss), AUC of all
scores). The old per-shard averages differ from these by far more than the
tolerance, so the tests fail on them. Then the same through the Trainer
(float64 training is the same on any layout, so its evals must agree too).
"""

import math
import os

import numpy as np
import pytest
from mpi4py import MPI

from hpcpax.app.evaluation import EvalSet, evaluate
from hpcpax.app.trainer import Trainer
from hpcpax.data import SyntheticCTR, SyntheticLM
from hpcpax.models import CTRModel, LanguageModel, roc_auc

GLOBAL_BATCH = 60  # divisible by 1, 2, 3 and 4 workers


class Workers:
    """The part of a topology evaluate() needs, for the first k ranks of a communicator."""

    def __init__(self, comm):
        self.workers, self.worker_index, self.num_workers = comm, comm.Get_rank(), comm.Get_size()


def make(kind):
    """Model, dense parameters, full sparse tables and a pull function (no servers)."""
    if kind == "lm":
        model = LanguageModel(vocab_size=50, context=3, emb_dim=4, hidden=(8,), out_dim=4,
                              num_sampled=8, seed=3, dtype="float64")
        reader = SyntheticLM(num_tokens=3000, vocab_size=50, context=3, seed=5)
    else:
        model = CTRModel(n_dense=3, n_fields=3, table_rows=40, emb_dim=4, bottom=(6, 4),
                         top=(5,), seed=3, dtype="float64")
        reader = SyntheticCTR(num_samples=3000, n_dense=3, n_fields=3, cardinality=40, seed=5)
    rng = np.random.default_rng(11)
    tables = {s.name: rng.uniform(-0.5, 0.5, (s.rows, s.dim)) for s in model.sparse_specs()}

    def pull(ids):
        out = {}
        for name, wanted in ids.items():
            unique = np.unique(wanted)
            out[name] = (unique, tables[name][unique])
        return out

    _, held = reader.split_tail(0.3)
    held.shuffle = True
    return model, model.init_dense(), pull, EvalSet(held, 0, 4, held_out=True)


def reference(model, dense, pull, eval_set):
    """One process, the whole set as one batch: the numbers every layout must give."""
    positions = [eval_set.reader.batch(k, GLOBAL_BATCH) for k in range(eval_set.batches)]
    batch = {key: np.concatenate([b[key] for b in positions]) for key in positions[0]}
    out = model.eval_outputs(dense, pull(model.sparse_ids(batch, 0, full=True)), batch, 0,
                             full=True)
    loss = float(np.mean(out.losses))
    result = {"loss": loss}
    if out.scores is not None:
        result["auc"] = roc_auc(out.labels, out.scores)
    else:
        result["perplexity"] = math.exp(loss)
    return result


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["lm", "ctr"])
def test_eval_metrics_are_the_same_on_1_2_and_3_workers(comm, kind):
    model, dense, pull, eval_set = make(kind)
    expected = reference(model, dense, pull, eval_set)
    results, per_shard = {}, []
    for k in (1, 2, 3):
        sub = comm.Split(0 if comm.Get_rank() < k else MPI.UNDEFINED, comm.Get_rank())
        if sub != MPI.COMM_NULL:
            results[k] = evaluate(model, dense, pull, eval_set, Workers(sub),
                                  {"global_batch": GLOBAL_BATCH})
            if k == 3:  # what the old code reported: a mean of per-shard metrics
                shard = eval_set.reader.batch(0, GLOBAL_BATCH, sub.Get_rank(), 3)
                rows = pull(model.sparse_ids(shard, 0, full=True))
                per_shard = sub.allgather(model.evaluate(dense, rows, shard, 0, full=True))
            sub.Free()
    results = comm.bcast(results, root=0)
    per_shard = comm.bcast(per_shard, root=0)
    ok = True
    for k, got in results.items():
        ok &= got["samples"] == 4 * GLOBAL_BATCH and set(got) == set(expected) | {"samples"}
        ok &= all(math.isclose(got[key], expected[key], rel_tol=1e-12) for key in expected)
    key = "auc" if kind == "ctr" else "perplexity"
    # the tolerance above is tight enough to tell the old averaging apart
    assert not math.isclose(np.mean([m[key] for m in per_shard]), reference(
        model, dense, pull, EvalSet(eval_set.reader, 0, 1, True))[key], rel_tol=1e-6)
    assert comm.allreduce(bool(ok), op=MPI.LAND), (results, expected)


TINY_LM = {"model": "lm", "vocab_size": 60, "context": 3, "emb_dim": 6, "hidden": [8],
           "out_dim": 6, "num_sampled": 10, "synthetic_samples": 4000}
TINY_CTR = {"model": "ctr", "n_dense": 3, "n_fields": 3, "table_rows": 30, "emb_dim": 4,
            "synthetic_samples": 4000}


@pytest.mark.mpi(min_size=4)
@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["lm", "ctr"])
def test_trainer_evals_agree_on_1_2_and_3_workers(comm, tmp_path, kind):
    """Train 4 float64 steps at 1 (COMM_SELF), 2 and 3 workers (plus one server) and
    evaluate on the held-out tail: the eval lines agree to 1e-9."""
    config = {**(TINY_LM if kind == "lm" else TINY_CTR), "steps": 4, "global_batch": 24,
              "dtype": "float64", "eval_every": 4, "eval_batches": 3, "eval_fraction": 0.2,
              "plan": "ps", "quiet": True}
    root = comm.bcast(str(tmp_path) if comm.Get_rank() == 0 else None, root=0)
    evals = {}
    for ranks in (4, 3):  # 1 server + 3 workers, 1 server + 2 workers
        sub = comm.Split(0 if comm.Get_rank() < ranks else MPI.UNDEFINED, comm.Get_rank())
        if sub != MPI.COMM_NULL:
            trainer = Trainer({**config, "run_dir": os.path.join(root, f"{kind}{ranks}")},
                              comm=sub)
            trainer.run()
            sub.Barrier()  # the first worker has written metrics.jsonl
            evals[ranks - 1] = _last_eval(trainer.run_dir)
            sub.Free()
        comm.Barrier()
    single = Trainer({**config, "servers_per_node": 0,
                      "run_dir": str(tmp_path / f"{kind}self{comm.Get_rank()}")},
                     comm=MPI.COMM_SELF)
    single.run()
    local_single = _last_eval(single.run_dir)
    evals = comm.bcast(evals, root=0)  # rank 0 ran with 2 and 3 workers
    evals[1] = local_single
    keys = ("loss", "perplexity") if kind == "lm" else ("loss", "auc")
    ok = all(math.isclose(evals[k][key], local_single[key], rel_tol=1e-9)
             for k in (1, 2, 3) for key in keys)
    ok &= all(evals[k]["samples"] == 72 for k in (1, 2, 3))
    if kind == "lm":
        ok &= math.isclose(local_single["perplexity"], math.exp(local_single["loss"]),
                           rel_tol=1e-12)
    assert comm.allreduce(bool(ok), op=MPI.LAND), (evals, local_single)


def _last_eval(run_dir):
    import json

    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as handle:
        records = [json.loads(line) for line in handle]
    return [r["eval"] for r in records if "eval" in r][-1]
