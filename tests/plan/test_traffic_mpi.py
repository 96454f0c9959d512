"""The model's bytes of every step equal the accounting's, on a real multi-rank run."""

import json
import os

import numpy as np
import pytest

from hpcpax.app.trainer import Trainer
from hpcpax.plan.traffic import Layout, owner_bytes, routing_from_ids, step_bytes

TINY = {"vocab_size": 400, "context": 3, "emb_dim": 8, "hidden": [16], "out_dim": 8,
        "num_sampled": 16, "global_batch": 24, "synthetic_samples": 3000, "steps": 4,
        "quiet": True}
FIELDS = {"sent": 0, "recv": 1, "sent_inter": 2}


def _mismatches(trainer, run_dir, layout):
    """(phase, field, step, measured, predicted) for every byte figure that differs."""
    rows = [json.loads(line) for line in open(os.path.join(run_dir, "metrics.jsonl"))]
    rows = [r for r in rows if "loss" in r and r["step"] > 1]  # step 1 also holds set-up
    workers = list(layout.worker_ranks)
    n, dense = len(workers), [int(p.nbytes) for p in trainer.dense.values()]
    out = []
    for row in rows:
        position = row["step"] - 1
        ids = [trainer.model.sparse_ids(trainer.reader.batch(position, TINY["global_batch"], w, n),
                                        position) for w in range(n)]
        routings = {}
        for name, sync in trainer.engine.sync.variables.items():
            spec, method = sync.spec, sync.method
            per_worker = [np.asarray(i[name]) for i in ids]
            if method == "ps":
                var = trainer.engine.ps.variables[name]
                routings[name] = routing_from_ids(
                    layout, "ps", spec.rows, spec.dim * 4, per_worker,
                    partitions=var.layout.num_partitions, owners=list(var.layout.owners),
                    local_aggregation=trainer.engine.ps.local_aggregation)
            else:
                routings[name] = routing_from_ids(layout, method, spec.rows, spec.dim * 4,
                                                  per_worker)
        predicted = step_bytes(layout, routings, dense)
        for phase in set(predicted) | set(row["bytes"]):
            for field, index in FIELDS.items():
                want = 0 if phase not in predicted else int(round(
                    predicted[phase][index][workers].sum()))
                got = int(row["bytes"].get(phase, {}).get(field, 0))
                if want != got:
                    out.append((phase, field, row["step"], got, want))
        owners = {k: int(round(v)) for k, v in owner_bytes(layout, routings).items()}
        got = row.get("owner", dict.fromkeys(owners, 0))
        if got != owners:
            out.append(("owner", "", row["step"], got, owners))
    return out


@pytest.mark.mpi(min_size=3)
@pytest.mark.timeout(180)
@pytest.mark.parametrize("plan", ["ps", "allgather", "allreduce"])
@pytest.mark.parametrize("aggregate", [True, False])
def test_step_bytes_equal_the_accounting(comm, tmp_path, plan, aggregate):
    if plan != "ps" and not aggregate:
        pytest.skip("local aggregation only changes the ps method")
    run_dir = comm.bcast(str(tmp_path / f"{plan}-{aggregate}") if comm.Get_rank() == 0 else None)
    per_node = 3 if comm.Get_size() % 3 == 0 else comm.Get_size()
    trainer = Trainer({**TINY, "plan": plan, "local_aggregation": aggregate, "run_dir": run_dir,
                       "ranks_per_node": per_node, "servers_per_node": 1}, comm=comm,
                      plan={"softmax_w": {"method": "ps", "partitions": 5}}
                      if plan == "ps" else None)
    trainer.run()
    layout = Layout.from_topology(trainer.topology.describe())
    leader = trainer.topology.worker_ranks[0]
    found = _mismatches(trainer, run_dir, layout) if comm.Get_rank() == leader else None
    found = comm.bcast(found, root=leader)
    assert found == []
    if plan == "ps":  # the report shows the owners' links
        from hpcpax.app.report import summarize

        shown = ("owner row bytes per step: egress " in summarize(run_dir)
                 if comm.Get_rank() == leader else None)
        assert comm.bcast(shown, root=leader)
