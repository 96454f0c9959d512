"""``hpcpax.torch`` in one MPI job: results, bytes, checkpoints.

- Training a small model (an ``nn.Embedding``, an ``nn.EmbeddingBag`` with a
  padding index and a ``sparse=False`` table, dense layers) through the
  adapter equals training it in this one process on the same global batches
  (computed on every rank), for each plan and with or without servers.
- The bytes one step moves (pull and push of a table) equal the parameter
  server's formula for the layout, replayed from every worker's ids.
- A checkpoint written on one layout and plan and restored on another
  continues exactly as the uninterrupted run; ``load_state_dict`` puts
  tables back on their holders.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import hpcpax  # noqa: E402
import hpcpax.torch  # noqa: E402
from hpcpax.torch.data import share  # noqa: E402

ROWS = 60


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 4, sparse=True)
        self.bag = nn.EmbeddingBag(ROWS, 4, mode="sum", padding_idx=0)  # sparse=False
        self.lin = nn.Linear(8, 3)
        self.out = nn.Linear(3, 1)

    def forward(self, ids, bag):
        return self.out(torch.relu(self.lin(torch.cat([self.emb(ids).mean(1), self.bag(bag)],
                                                      1)))).squeeze(1)


def batches(count=8, size=12, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, ROWS, (size, 3), generator=g),
             torch.randint(0, ROWS, (size, 2), generator=g), torch.randn(size, generator=g))
            for _ in range(count)]


def build(optimizer="adagrad", lr=0.1):
    torch.manual_seed(0)
    model = Tiny()
    if optimizer == "adagrad":
        opt = torch.optim.Adagrad(model.parameters(), lr=lr, initial_accumulator_value=0.1)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=lr)
    return model, opt


def train(model, opt, data, reduction="mean"):
    for ids, bag, y in data:
        opt.zero_grad()
        squared = (model(ids, bag) - y) ** 2
        (squared.mean() if reduction == "mean" else squared.sum()).backward()
        opt.step()


def state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def close(a, b, tolerance=1e-5):
    return sorted(a) == sorted(b) and all(
        np.abs(a[k] - b[k]).max() <= tolerance * max(1.0, np.abs(a[k]).max()) for k in a)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("plan,servers", [("ps", 0), ("ps", 1), ("allgather", 1),
                                          ("allreduce", 0), ("auto", 1)])
@pytest.mark.parametrize("optimizer", ["adagrad", "sgd"])
def test_training_equals_one_process(comm, all_ok, plan, servers, optimizer):
    if servers and comm.Get_size() == 1:
        pytest.skip("a server needs a second rank")
    reference, ref_opt = build(optimizer)
    train(reference, ref_opt, batches())
    expected = state(reference)
    model, opt = build(optimizer)
    topology = hpcpax.init(servers_per_node=servers)
    model, opt, data = hpcpax.torch.distribute(model, opt, batches(), plan=plan, plan_steps=3,
                                               topology=topology, quiet=True,
                                               on_server="return", fabric_seconds=0.2)
    ok = True
    try:
        if topology.is_worker:
            train(model, opt, data)
            ok = close(expected, state(model))
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_uneven_shares_and_summed_losses_equal_one_process(comm, all_ok, reduction):
    data = batches(size=13)  # 13 samples: uneven shares for 2, 3 or 4 workers
    lr = 0.1 if reduction == "mean" else 0.1 / 13
    reference, ref_opt = build("sgd", lr)
    train(reference, ref_opt, data, reduction)
    expected = state(reference)
    model, opt = build("sgd", lr)
    topology = hpcpax.init(servers_per_node=0)
    model, opt, shards = hpcpax.torch.distribute(model, opt, data, plan="ps",
                                                 loss_reduction=reduction, topology=topology,
                                                 quiet=True)
    try:
        train(model, opt, shards, reduction)
        ok = close(expected, state(model))
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


def _expected_bytes(topo, var, uniq, la):
    """``{phase: [sent, recv, sent_inter, recv_inter]}`` of one pull + one push (the PS formula)."""
    me = topo.rank
    out = {p: np.zeros(4, np.int64) for p in ("pull", "push", "intra_node")}
    part_of, owner_of = var.layout.partitioning.partition_of, var.layout.dest_of
    row, id_bytes = var.spec.dim * 4, 8

    def add(phase, src, dst, nbytes):
        if src == dst or nbytes == 0:
            return
        inter = topo.node_of[src] != topo.node_of[dst]
        if src == me:
            out[phase][0] += nbytes
            out[phase][2] += nbytes * inter
        if dst == me:
            out[phase][1] += nbytes
            out[phase][3] += nbytes * inter

    def counts(phase, ranks):  # the Alltoall of counts: 8 bytes to each peer
        for a in ranks:
            for b in ranks:
                add(phase, a, b, 8)

    senders = {}
    for node in range(topo.num_nodes):
        members = topo.workers_on_node(node)
        if la and len(members) > 1:
            counts("intra_node", members)
            counts("intra_node", members)
            for w in members:
                for d_index, d in enumerate(members):
                    mine = uniq[w][part_of(uniq[w]) % len(members) == d_index]
                    add("intra_node", w, d, len(mine) * id_bytes)
                    add("intra_node", d, w, len(mine) * row)
                    add("intra_node", w, d, len(mine) * (id_bytes + row))
            union = np.unique(np.concatenate([uniq[w] for w in members]))
            for d_index, d in enumerate(members):
                senders[d] = union[part_of(union) % len(members) == d_index]
        else:
            for w in members:
                senders[w] = uniq[w]
    counts("pull", range(topo.size))
    counts("push", range(topo.size))
    for src, ids in senders.items():
        owners = owner_of(ids)
        for dst in np.unique(owners):
            n = int((owners == dst).sum())
            add("pull", src, int(dst), n * id_bytes)
            add("pull", int(dst), src, n * row)
            add("push", src, int(dst), n * (id_bytes + row))
    return out


class OneTable(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(ROWS, 5, sparse=True)

    def forward(self, ids):
        return self.emb(ids).sum()


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("la", [True, False])
@pytest.mark.parametrize("servers,rpn", [(1, 2), (0, 2), (1, None)])
def test_step_bytes_equal_the_ps_formula(comm, all_ok, la, servers, rpn):
    if servers >= (rpn or comm.Get_size()):
        pytest.skip("layout leaves a node with no worker")
    torch.manual_seed(0)
    model = OneTable()
    g = torch.Generator().manual_seed(3)
    batch = torch.minimum(torch.randint(0, 8, (23, 3), generator=g) ** 2,
                          torch.tensor(ROWS - 1))  # skewed ids, repeats within and across
    topology = hpcpax.init(ranks_per_node=rpn, servers_per_node=servers)
    model, opt, data = hpcpax.torch.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), [batch], plan="ps",
        local_aggregation=la, topology=topology, quiet=True, on_server="return")
    session = model._hpcpax_session  # servers served the step inside distribute()
    try:
        if topology.is_worker:
            for ids in data:
                opt.zero_grad()
                model(ids).backward()
                opt.step()
        uniq = {}
        for index, rank in enumerate(topology.worker_ranks):
            start, stop = share(len(batch), index, topology.num_workers)
            uniq[rank] = np.unique(batch[start:stop].numpy())
        want = _expected_bytes(topology, session.sync.ps.variables["emb"], uniq, la)
        ok = True
        for phase, (sent, recv, s_inter, r_inter) in want.items():
            got = topology.accounting.phase(phase)
            ok &= (got["sent_bytes"], got["recv_bytes"], got["sent_inter_bytes"],
                   got["recv_inter_bytes"]) == (sent, recv, s_inter, r_inter)
    finally:
        if topology.is_worker:
            hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(240)
def test_checkpoint_resumes_on_another_layout_and_plan(comm, all_ok, tmp_path_factory):
    run_dir = comm.bcast(str(tmp_path_factory.mktemp("ckpt")) if comm.Get_rank() == 0 else None)
    data = batches(8)
    reference, ref_opt = build()
    train(reference, ref_opt, data)
    expected = state(reference)

    def session(servers, plan):
        model, opt = build()
        topology = hpcpax.init(servers_per_node=servers)
        model, opt, shards = hpcpax.torch.distribute(model, opt, data, plan=plan,
                                                     topology=topology, quiet=True,
                                                     on_server="return")
        return model, opt, list(shards) if topology.is_worker else [], topology

    model, opt, shards, topology = session(1, "ps")  # 1 server per node, tables on the PS
    path = None
    try:
        if topology.is_worker:
            train(model, opt, shards[:4])
            path = hpcpax.torch.save(model, run_dir, 4)
    finally:
        hpcpax.torch.finish()
        topology.free()
    model, opt, shards, topology = session(0, "allgather")  # no server, tables replicated
    ok = True
    try:
        step = hpcpax.torch.load(model, run_dir)
        train(model, opt, shards[4:])
        ok = step == 4 and (path is None or path.endswith("step_000004"))
        ok = ok and close(expected, state(model))
        # load_state_dict puts the tables back on their holders
        saved = {k: torch.from_numpy(v) for k, v in state(reference).items()}
        model.load_state_dict({**saved, "emb.weight": torch.zeros(ROWS, 4)})
        ok = ok and np.all(state(model)["emb.weight"] == 0)
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
@pytest.mark.parametrize("plan,idle", [("allgather", True), ("ps", False)])
def test_a_server_without_tables_gives_its_cores_to_the_workers(comm, all_ok, plan, idle):
    """One server beside the workers: under a fixed plan that leaves it no table
    it only sleeps, so each worker's BLAS, Numba and torch threads are the host's
    cores over the workers on it; under ``ps`` the server counts too."""
    from mpi4py import MPI

    from hpcpax.comm.threads import thread_cap, usable_cores

    model, opt = build("sgd")
    topology = hpcpax.init(servers_per_node=1)
    host = comm.Split_type(MPI.COMM_TYPE_SHARED)
    workers_here = host.allreduce(int(topology.is_worker))
    ranks_here = host.Get_size()
    host.Free()
    model, opt, data = hpcpax.torch.distribute(model, opt, batches(), plan=plan,
                                               topology=topology, quiet=True,
                                               on_server="return")
    ok = True
    try:
        if topology.is_worker:
            want = max(1, usable_cores() // (workers_here if idle else ranks_here))
            ok = thread_cap() == want and torch.get_num_threads() == want
            train(model, opt, data)
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)
