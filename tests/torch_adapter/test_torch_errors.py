"""``hpcpax.torch.distribute`` refuses what it cannot run, naming it, on every rank.

Serial tests build a model with one unsupported thing each and check the
error names the module, parameter or setting. Multi-rank tests: ranks that
built different models, drew different batches, or a batch too small to
share stop together with the culprit named; a dense parameter that receives a
sparse gradient is named.
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
nn = torch.nn

import hpcpax  # noqa: E402
import hpcpax.torch  # noqa: E402
from hpcpax.errors import ConfigError, MismatchError  # noqa: E402


class Small(nn.Module):
    def __init__(self, width=8, **embedding):
        super().__init__()
        self.emb = nn.Embedding(20, 4, **embedding)
        self.lin = nn.Linear(4, width)

    def forward(self, ids):
        return self.lin(self.emb(ids)).sum(1)


def refused(model, optimizer, match, error=ConfigError, **kwargs):
    with pytest.raises(error, match=match):
        hpcpax.torch.distribute(model, optimizer, quiet=True, on_server="return", **kwargs)


def test_batch_norm_is_named():
    model = Small()
    model.norm = nn.BatchNorm1d(8)
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1), "module 'norm'.*BatchNorm1d")


def test_tied_weights_are_named():
    model = Small()
    model.decoder = nn.Linear(4, 20, bias=False)
    model.decoder.weight = model.emb.weight
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1),
            "parameter 'decoder.weight' is the weight of table 'emb'")


def test_max_norm_and_scale_grad_by_freq_are_named():
    model = Small(max_norm=1.0)
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1), "module 'emb': max_norm")
    model = Small(scale_grad_by_freq=True)
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1),
            "module 'emb': scale_grad_by_freq")


def test_unsupported_optimizer_and_settings_are_named():
    model = Small()
    refused(model, torch.optim.RMSprop(model.parameters(), lr=0.1),
            "table 'emb': optimizer RMSprop is not supported")
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1, weight_decay=0.01),
            "table 'emb': weight_decay=0.01")
    refused(model, torch.optim.Adagrad(model.parameters(), lr=0.1, lr_decay=0.1),
            "table 'emb': lr_decay=0.1")
    refused(model, torch.optim.Adam(model.parameters(), lr=0.1, amsgrad=True),
            "table 'emb': amsgrad")


def test_table_outside_every_optimizer_is_named():
    model = Small()
    refused(model, torch.optim.SGD(model.lin.parameters(), lr=0.1),
            "table 'emb': its weight is in no optimizer")


def test_wrapped_model_and_unsupported_dtype_are_named():
    model = Small()
    refused(nn.DataParallel(model), torch.optim.SGD(model.parameters(), lr=0.1),
            "DataParallel: pass the plain model")
    model = Small()
    model.lin.to(torch.bfloat16)
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1),
            "parameter 'lin.weight' is torch.bfloat16")
    model = Small()
    model.emb.to(torch.float16)
    refused(model, torch.optim.SGD(model.parameters(), lr=0.1), "table 'emb' is torch.float16")


def test_bad_arguments_are_refused_before_any_communication():
    model = Small()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module, not str"):
        hpcpax.torch.distribute("model", torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ValueError, match="loss_reduction must be one of"):
        hpcpax.torch.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                loss_reduction="max")


def test_a_second_model_needs_finish_first():
    model = Small()
    hpcpax.torch.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), quiet=True,
                            on_server="return")
    try:
        other = Small()
        refused(other, torch.optim.SGD(other.parameters(), lr=0.1), "already distributed")
    finally:
        hpcpax.torch.finish()


# ------------------------------------------------------------------ several ranks
@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_models_differing_between_ranks_name_the_parameter(comm, all_ok):
    model = Small(width=8 if comm.Get_rank() == 0 else 9)
    try:
        hpcpax.torch.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                quiet=True, on_server="return")
        ok = False
    except MismatchError as exc:
        ok = "lin.weight" in str(exc) and "every rank must build the same model" in str(exc)
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_ranks_drawing_different_batches_stop(comm, all_ok):
    torch.manual_seed(0)
    model = Small()
    data = torch.utils.data.TensorDataset(torch.arange(40).reshape(20, 2) % 20)
    loader = torch.utils.data.DataLoader(data, batch_size=10, shuffle=True,
                                         generator=torch.Generator().manual_seed(comm.Get_rank()))
    topology = hpcpax.init(servers_per_node=0)
    model, optimizer, loader = hpcpax.torch.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), loader, quiet=True,
        topology=topology)
    try:
        next(iter(loader))
        ok = False
    except MismatchError as exc:
        ok = "data order" in str(exc)
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_batch_smaller_than_the_workers_is_refused(comm, all_ok):
    torch.manual_seed(0)
    model = Small()
    batches = [torch.zeros((1, 2), dtype=torch.int64)]
    topology = hpcpax.init(servers_per_node=0)
    model, optimizer, batches = hpcpax.torch.distribute(
        model, torch.optim.SGD(model.parameters(), lr=0.1), batches, quiet=True,
        topology=topology)
    try:
        next(iter(batches))
        ok = False
    except ConfigError as exc:
        ok = "a batch of 1 samples cannot be shared" in str(exc)
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)


@pytest.mark.mpi(min_size=2)
@pytest.mark.timeout(120)
def test_a_sparse_gradient_on_a_dense_parameter_is_named(comm, all_ok):
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Parameter(torch.ones(10, 3))

        def forward(self, ids):
            return nn.functional.embedding(ids, self.table, sparse=True).sum()

    model = Functional()
    topology = hpcpax.init(servers_per_node=0)
    hpcpax.torch.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1), quiet=True,
                            topology=topology)
    try:
        model(torch.tensor([1, 2])).backward()
        ok = False
    except ConfigError as exc:
        ok = "parameter 'table' received a sparse gradient" in str(exc)
    finally:
        hpcpax.torch.finish()
        topology.free()
    assert all_ok(ok)
    assert np.isfinite(1.0)
