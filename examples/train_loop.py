"""A plain mpi4py training loop on hpcpax's primitives (no hpcpax.train).

    mpirun -n 4 python -m mpi4py examples/train_loop.py

Rank 0 becomes a parameter server holding the embedding tables; ranks 1-3
are workers. Each step a worker reads its shard of the global batch, pulls
the rows its ids need, runs the model's forward/backward, pushes the sparse
gradients (the servers apply Adagrad to the rows) and averages the dense
gradients with one fused allreduce before its local Adam step.
"""


import hpcpax
from hpcpax.comm.allreduce import DenseAllreduce
from hpcpax.data import SyntheticLM
from hpcpax.models import build_model
from hpcpax.ops.optimizers import make_optimizer
from hpcpax import ParameterServer, SparseVariableSpec
from hpcpax.ps.sparse_grad import SparseGrad

STEPS, GLOBAL_BATCH = 60, 96

topology = hpcpax.init()  # collective; 1 server per node when there are several ranks
model = build_model("lm", vocab_size=2000, context=4, emb_dim=16, hidden=(32,), out_dim=16,
                    num_sampled=32, seed=0)
specs = [SparseVariableSpec(s.name, s.rows, s.dim, initializer="uniform" if s.init_scale else
                            "zeros", init_scale=s.init_scale, optimizer="adagrad",
                            optimizer_params={"lr": 0.1}) for s in model.sparse_specs()]
ps = ParameterServer(topology, local_aggregation=True, seed=0)

if topology.is_server:
    ps.serve()  # follows the workers' register/pull/push until they shut down
else:
    ps.register(specs)
    dense = model.init_dense()
    adam = make_optimizer("adam", lr=0.003)
    state = {name: adam.init_state(p.shape, p.dtype) for name, p in dense.items()}
    allreduce = DenseAllreduce(topology, dense, op="mean")
    data = SyntheticLM(num_tokens=50_000, vocab_size=2000, context=4, seed=0)
    for step in range(STEPS):
        batch = data.batch(step, GLOBAL_BATCH, topology.worker_index, topology.num_workers)
        ids = model.sparse_ids(batch, step)
        rows = {name: ps.pull_unique(name, ids[name]) for name in ids}
        result = model.forward_backward(dense, rows, batch, step)
        for name, (indices, values) in result.sparse_grads.items():
            ps.push(name, SparseGrad(indices, values, model.vocab_size))
        allreduce.allreduce(result.dense_grads)  # in place, mean over workers
        for name, param in dense.items():
            adam.apply_dense(param, state[name], result.dense_grads[name])
        local = len(batch["target"])
        loss = topology.workers.allreduce(result.loss * local) / GLOBAL_BATCH
        if topology.worker_index == 0 and (step % 10 == 0 or step == STEPS - 1):
            print(f"step {step:3d}  loss {loss:.4f}", flush=True)
    ps.shutdown()  # releases the servers from serve()

totals = topology.accounting.reduce(topology.comm)  # collective over all ranks
if topology.rank == 0:
    print("bytes sent per phase:", {p: e["sent_bytes"] for p, e in totals["phases"].items()})
topology.free()
