"""``hpcpax.torch`` with inputs as real scripts pass them, clipping, named batch dimensions.

Each model trains through the adapter (on 1 to 4 ranks, with and without a
server) and in this one process on the same global batches, in float64; the
parameters must agree within 1e-10 (relative):

- a DLRM-style model whose forward takes offsets stacked ``(tables, batch)``,
  a list of ragged index tensors (``EmbeddingBag`` sums with per-sample
  weights, ``include_last_offset``, int32 indices) and fixed-size bags
  stacked ``(tables, batch, ids)``, its batches
  cut by sample with ``split=`` and :func:`hpcpax.torch.cut_bags`; all its
  tables are pulled in one exchange per step (prefetched from the list);
- a DeepCTR-style model whose ids are columns of one float input cast in the
  forward (``X[:, a:b].long()``), also prefetched in one exchange;
- a word-level recurrent model on ``(time, batch)`` batches with flattened
  targets and a hidden state carried across steps, clipping every
  gradient (its ``sparse=False`` embedding included) with
  ``clip_grad_norm_`` or ``clip_grad_value_``.

And the refusals: computing with a distributed table's original weight
(a regularizer) and a dense gradient too large to gather name the table
and the call.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import hpcpax  # noqa: E402
import hpcpax.torch  # noqa: E402
from hpcpax.errors import ConfigError  # noqa: E402
from hpcpax.options import options  # noqa: E402

ROWS = (40, 25, 30)
DIM = 4
BATCH = 11  # uneven shares for 2, 3 and 4 workers


def close(a, b, tolerance=1e-10):
    return sorted(a) == sorted(b) and all(
        np.abs(a[k] - b[k]).max() <= tolerance * max(1.0, np.abs(a[k]).max()) for k in a)


def state(model):
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def layouts(comm):
    """(servers per node) the world can hold with a worker left."""
    return [0] + ([1] if comm.Get_size() > 1 else [])


def train_both(comm, build, data, step, servers, plan="ps", **options):
    """Parameters after ``step`` over ``data`` in one process, and through the
    adapter (None on servers); the pull calls of the steps after the first."""
    reference, ref_opt = build()
    for batch in data:
        step(reference, ref_opt, batch)
    expected = state(reference)
    model, opt = build()
    topology = hpcpax.init(servers_per_node=servers)
    model, opt, local = hpcpax.torch.distribute(model, opt, data, plan=plan, plan_steps=2,
                                                topology=topology, quiet=True,
                                                on_server="return", fabric_seconds=0.1,
                                                **options)
    got, calls = None, None
    try:
        if topology.is_worker:
            for i, batch in enumerate(local):
                step(model, opt, batch)
                if i == 0:  # the first forward pass learns where each table's ids are
                    calls = -topology.accounting.phase("pull")["calls"]
            calls += topology.accounting.phase("pull")["calls"]
            got = state(model)  # gathers the tables (more pulls)
    finally:
        hpcpax.torch.finish()
        topology.free()
    return expected, got, calls


# ------------------------------------------------------------------ DLRM style
class Bags(nn.Module):
    """DLRM's inputs: offsets stacked (tables, batch), a list of ragged ids."""

    def __init__(self):
        super().__init__()
        self.emb_l = nn.ModuleList([
            nn.EmbeddingBag(ROWS[0], DIM, mode="sum", sparse=True),
            nn.EmbeddingBag(ROWS[1], DIM, mode="sum", sparse=True),
            nn.EmbeddingBag(ROWS[2], DIM, mode="mean", sparse=True)])
        self.last = nn.EmbeddingBag(ROWS[0], DIM, mode="sum", include_last_offset=True)
        self.grid = nn.ModuleList([nn.EmbeddingBag(ROWS[1], DIM, mode="max"),
                                   nn.EmbeddingBag(ROWS[2], DIM, mode="sum")])
        self.top = nn.Linear(6 * DIM + 2, 1)

    def forward(self, dense_x, lS_o, lS_i, weights, bag, grid):
        ly = [self.emb_l[0](lS_i[0], lS_o[0], per_sample_weights=weights),
              self.emb_l[1](lS_i[1], lS_o[1]),
              self.emb_l[2](lS_i[2], lS_o[2].to(torch.int32)),  # int32 ids and offsets
              self.last(*bag),
              self.grid[0](grid[0]), self.grid[1](grid[1])]  # stacked 2-D bags
        return self.top(torch.cat([dense_x] + ly, 1)).squeeze(1)


def bag_batches(count=5, seed=2):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        lengths = torch.randint(1, 4, (4, BATCH), generator=g)
        ends = torch.cumsum(lengths, 1)
        lS_o = ends - lengths  # (tables, batch): each bag's first id
        ids = [torch.randint(0, ROWS[t % 3], (int(ends[t, -1]),), generator=g)
               for t in range(4)]
        ids[2] = ids[2].to(torch.int32)
        bag = (ids[3], torch.cat([lS_o[3], ends[3, -1:]]))  # include_last_offset
        grid = torch.stack([torch.randint(0, ROWS[1], (BATCH, 3), generator=g),
                            torch.randint(0, ROWS[2], (BATCH, 3), generator=g)])
        out.append((torch.randn(BATCH, 2, generator=g, dtype=torch.float64), lS_o[:3],
                    ids[:3], torch.rand(len(ids[0]), generator=g, dtype=torch.float64), bag,
                    grid, torch.randn(BATCH, generator=g, dtype=torch.float64)))
    return out


def cut_bag_batch(batch, start, stop):
    """Samples [start, stop) of a global batch (the ``split=`` function)."""
    dense_x, lS_o, lS_i, weights, (ids, offsets), grid, y = batch
    i0, o0, w0 = hpcpax.torch.cut_bags(lS_i[0], lS_o[0], start, stop,
                                       per_sample_weights=weights)
    i1, o1 = hpcpax.torch.cut_bags(lS_i[1], lS_o[1], start, stop)
    i2, o2 = hpcpax.torch.cut_bags(lS_i[2], lS_o[2], start, stop)
    bag = hpcpax.torch.cut_bags(ids, offsets, start, stop, include_last_offset=True)
    return (dense_x[start:stop], torch.stack([o0, o1, o2]), [i0, i1, i2], w0, bag,
            grid[:, start:stop], y[start:stop])


def bag_step(model, opt, batch):
    dense_x, lS_o, lS_i, weights, bag, grid, y = batch
    opt.zero_grad()
    ((model(dense_x, lS_o, lS_i, weights, bag, grid) - y) ** 2).mean().backward()
    opt.step()


def build_bags():
    torch.manual_seed(0)
    model = Bags().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.2)


def test_cut_bags_cuts_by_sample():
    ids, offsets = torch.arange(10), torch.tensor([0, 2, 3, 7])
    i, o = hpcpax.torch.cut_bags(ids, offsets, 1, 3)
    assert i.tolist() == [2, 3, 4, 5, 6] and o.tolist() == [0, 1]
    i, o = hpcpax.torch.cut_bags(ids, offsets, 2, 4)
    assert i.tolist() == [3, 4, 5, 6, 7, 8, 9] and o.tolist() == [0, 4]
    i, o, w = hpcpax.torch.cut_bags(ids, torch.tensor([0, 2, 3, 7, 10]), 3, 4,
                                    include_last_offset=True, per_sample_weights=ids * 2)
    assert i.tolist() == [7, 8, 9] and o.tolist() == [0, 3] and w.tolist() == [14, 16, 18]
    with pytest.raises(ValueError, match="0 <= start <= stop <= 4"):
        hpcpax.torch.cut_bags(ids, offsets, 2, 5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_ragged_bags_with_weights_and_int32_ids_equal_one_process(comm, all_ok):
    for servers in layouts(comm):
        expected, got, calls = train_both(comm, build_bags, bag_batches(), bag_step, servers,
                                          batch_dim=(0, 1, None, None, None, 1, 0),
                                          split=cut_bag_batch)
        # 6 tables, one batched pull per step (a request and a reply exchange)
        ok = got is None or (close(expected, got) and calls == 4 * 2)
        assert all_ok(ok), (servers, calls)


# --------------------------------------------------------------- DeepCTR style
class Columns(nn.Module):
    """Ids are float columns of one input, cast in the forward (DeepCTR's layout)."""

    def __init__(self):
        super().__init__()
        self.tables = nn.ModuleDict({f"f{i}": nn.Embedding(r, DIM) for i, r in enumerate(ROWS)})
        self.linear = nn.ModuleDict({f"f{i}": nn.Embedding(r, 1) for i, r in enumerate(ROWS)})
        self.out = nn.Linear(DIM, 1)

    def forward(self, X):
        cols = [X[:, i + 1:i + 2].long() for i in range(len(ROWS))]
        deep = sum(self.tables[f"f{i}"](c).squeeze(1) for i, c in enumerate(cols))
        wide = sum(self.linear[f"f{i}"](c).squeeze(1) for i, c in enumerate(cols))
        return (self.out(deep) + wide).squeeze(1) + X[:, 0]


def column_batches(count=5, seed=3):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(count):
        ids = torch.stack([torch.randint(0, r, (BATCH,), generator=g) for r in ROWS], 1)
        X = torch.cat([torch.randn(BATCH, 1, generator=g, dtype=torch.float64),
                       ids.double()], 1)
        out.append((X, torch.randn(BATCH, generator=g, dtype=torch.float64)))
    return out


def column_step(model, opt, batch):
    X, y = batch
    opt.zero_grad()
    nn.functional.mse_loss(model(X), y, reduction="sum").backward()
    opt.step()


def build_columns():
    torch.manual_seed(0)
    model = Columns().double()
    return model, torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_ids_cast_from_a_float_input_are_prefetched_and_equal_one_process(comm, all_ok):
    for servers in layouts(comm):
        expected, got, calls = train_both(comm, build_columns, column_batches(), column_step,
                                          servers, loss_reduction="sum")
        ok = got is None or (close(expected, got) and calls == 4 * 2)
        assert all_ok(ok), (servers, calls)


# ------------------------------------------------------------ recurrent model
class WordModel(nn.Module):
    """An LSTM language model: (time, batch) ids, hidden state carried."""

    def __init__(self, vocab=50, hidden=6):
        super().__init__()
        self.encoder = nn.Embedding(vocab, hidden)  # sparse=False: a dense gradient
        self.rnn = nn.LSTM(hidden, hidden)
        self.decoder = nn.Linear(hidden, vocab)
        self.hidden = hidden

    def forward(self, data, state):
        output, state = self.rnn(self.encoder(data), state)
        return self.decoder(output).view(-1, self.decoder.out_features), state

    def init_hidden(self, batch):
        zeros = torch.zeros(1, batch, self.hidden, dtype=torch.float64)
        return zeros, zeros.clone()


TIME = 5


def word_batches(count=6, seed=4):
    g = torch.Generator().manual_seed(seed)
    stream = torch.randint(0, 50, (count * TIME + 1, BATCH), generator=g)
    return [(stream[i:i + TIME], stream[i + 1:i + 1 + TIME].reshape(-1))
            for i in range(0, count * TIME, TIME)]


def cut_targets(targets, start, stop, total):
    return targets.view(-1, total)[:, start:stop].reshape(-1)


def build_words():
    torch.manual_seed(0)
    model = WordModel().double()
    return model, torch.optim.SGD(model.parameters(), lr=0.5)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
@pytest.mark.parametrize("clip", ["norm", "value"])
def test_a_recurrent_model_with_carried_state_and_clipping_equals_one_process(
        comm, all_ok, clip):
    def train(model, opt, batches, local):
        state = model.init_hidden(local)
        criterion = nn.CrossEntropyLoss()
        for data, targets in batches:
            state = tuple(s.detach() for s in state)
            model.zero_grad()
            output, state = model(data, state)
            criterion(output, targets).backward()
            if clip == "norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            else:
                torch.nn.utils.clip_grad_value_(model.parameters(), 0.01)
            opt.step()

    data = word_batches()
    reference, ref_opt = build_words()
    train(reference, ref_opt, data, BATCH)
    expected = state(reference)
    for servers in layouts(comm):
        model, opt = build_words()
        topology = hpcpax.init(servers_per_node=servers)
        model, opt, local = hpcpax.torch.distribute(
            model, opt, data, plan="ps", topology=topology, quiet=True, on_server="return",
            batch_dim=(1, cut_targets))
        ok = True
        try:
            if topology.is_worker:
                train(model, opt, local, hpcpax.torch.local_batch_size(BATCH))
                ok = close(expected, state(model))
        finally:
            hpcpax.torch.finish()
            topology.free()
        assert all_ok(ok), servers


def on_each_layout(comm, all_ok, build, data, check):
    """For each layout of :func:`layouts`: distribute a fresh ``build()`` (plan
    ``ps``) over ``data``; every worker's ``check(model, opt, local, topology)``
    must return True (on every rank)."""
    for servers in layouts(comm):
        model, opt = build()
        topology = hpcpax.init(servers_per_node=servers)
        model, opt, local = hpcpax.torch.distribute(
            model, opt, data, plan="ps", topology=topology, quiet=True, on_server="return")
        ok = True
        try:
            if topology.is_worker:
                ok = check(model, opt, local, topology)
        finally:
            hpcpax.torch.finish()
            topology.free()
        assert all_ok(ok), servers


class ThreeTables(nn.Module):
    """Three ``sparse=False`` tables of two widths and a head, summed per sample."""

    def __init__(self):
        super().__init__()
        self.words = nn.Embedding(40, DIM)
        self.places = nn.Embedding(25, DIM)
        self.kinds = nn.Embedding(30, 2 * DIM)
        self.head = nn.Linear(4 * DIM, 1)

    def forward(self, ids):
        features = torch.cat([self.words(ids[:, 0]), self.places(ids[:, 1]),
                              self.kinds(ids[:, 2])], dim=1)
        return self.head(features).squeeze(1)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_a_clip_over_several_tables_equals_one_process_in_one_exchange(comm, all_ok,
                                                                        monkeypatch):
    """``clip_grad_norm_`` reads every table's ``.grad`` in turn: the workers' rows of all
    of them travel in one exchange per step (the first read), and the clipped result is
    one process's."""
    from hpcpax.torch import runtime

    calls = []
    gather = runtime.allgather_sparse_many
    monkeypatch.setattr(runtime, "allgather_sparse_many",
                        lambda topology, names, *rest: calls.append(list(names))
                        or gather(topology, names, *rest))

    def build():
        torch.manual_seed(0)
        model = ThreeTables().double()
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    def train(model, opt, batches):
        for ids, target in batches:
            opt.zero_grad()
            ((model(ids) - target) ** 2).mean().backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()

    g = torch.Generator().manual_seed(5)
    data = [(torch.stack([torch.randint(0, rows, (BATCH,), generator=g) for rows in ROWS],
                         dim=1), torch.randn(BATCH, generator=g, dtype=torch.float64))
            for _ in range(4)]
    reference, ref_opt = build()
    train(reference, ref_opt, data)
    expected = state(reference)
    def check(model, opt, local, topology):
        calls.clear()
        train(model, opt, local)
        # one gather of the three tables per step with several workers, none alone
        return close(expected, state(model)) and calls == (
            [["words", "places", "kinds"]] * len(data) if topology.num_workers > 1 else [])

    on_each_layout(comm, all_ok, build, data, check)


@pytest.mark.mpi(min_size=1)
@pytest.mark.timeout(240)
def test_a_dense_tables_grad_is_one_tensor_refilled_each_step(comm, all_ok):
    """A ``sparse=False`` table's ``.grad`` read is the same tensor every step, zeroed
    and refilled: each step's read equals one process's ``.grad``, with nothing left
    of the rows only an earlier step touched."""
    def build():
        torch.manual_seed(0)
        model = ThreeTables().double()
        return model, torch.optim.SGD(model.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(9)
    # step 2 touches rows 30-39 of "words" only, step 1 rows 0-9 only
    data = [(torch.stack([torch.randint(lo, lo + 10, (BATCH,), generator=g),
                          torch.randint(0, 25, (BATCH,), generator=g),
                          torch.randint(0, 30, (BATCH,), generator=g)], dim=1),
             torch.randn(BATCH, generator=g, dtype=torch.float64)) for lo in (0, 30)]

    def train(model, opt, batches):
        grads = []
        for ids, target in batches:
            opt.zero_grad()
            ((model(ids) - target) ** 2).mean().backward()
            grad = model.words.weight.grad
            grads.append((grad, grad.detach().clone()))
            opt.step()
        return grads

    reference, ref_opt = build()
    expected = [copy for _, copy in train(reference, ref_opt, data)]
    def check(model, opt, local, topology):
        got = train(model, opt, local)
        return got[0][0] is got[1][0] and not bool(got[1][1][:10].any()) and all(
            torch.allclose(copy, want, rtol=1e-12, atol=1e-15)
            for (_, copy), want in zip(got, expected))

    on_each_layout(comm, all_ok, build, data, check)


# ------------------------------------------------------------------- refusals
def test_computing_with_a_distributed_table_weight_names_the_table_and_call():
    model, opt = build_words()
    weight = model.encoder.weight  # a regularizer's reference, taken before distribute
    model, opt = hpcpax.torch.distribute(model, opt, plan="ps", quiet=True)
    try:
        assert model.encoder.weight is weight and weight.numel() == 0  # values freed
        with pytest.raises(ConfigError, match=r"table 'encoder' lives with its holders.*"
                                              r"square on it at test_torch_inputs.py:\d+"):
            torch.square(weight).sum()
    finally:
        hpcpax.torch.finish()


def test_reading_a_dense_gradient_too_large_for_a_worker_names_the_call():
    model, opt = build_words()
    model, opt = hpcpax.torch.distribute(model, opt, plan="ps", quiet=True)
    options.replica_memory = 1024
    try:
        output, _ = model(word_batches(1)[0][0], model.init_hidden(BATCH))
        output.sum().backward()
        with pytest.raises(ConfigError, match=r"table 'encoder': its gradient, read at "
                                              r"test_torch_inputs.py:\d+ .*over "
                                              r"HPCPAX_REPLICA_MEMORY"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    finally:
        del options.replica_memory
        hpcpax.torch.finish()
