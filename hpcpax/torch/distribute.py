"""`distribute`: a single-process PyTorch script on N ranks, one call.

See :mod:`hpcpax.torch` for the user's view. This module builds a
:class:`Session` on every rank: it scans the model
(:mod:`~hpcpax.torch.model_scan`), compares it between ranks, creates the
:class:`~hpcpax.app.model_sync.ModelSync` (tables start from the first
worker's weights), copies the first worker's dense parameters and buffers to
every worker, puts the distributed embedding modules in place, takes the
tables out of the optimizers, and hooks the optimizers' steps. Server ranks
then serve until the workers finish, and exit.
"""

from __future__ import annotations

import atexit
import os
import sys
import warnings

import numpy as np
import torch

from ..comm.agreement import agree_input, check_same
from ..errors import ConfigError
from ..ops.optimizers import make_optimizer
from .embedding import DistributedEmbedding, DistributedEmbeddingBag
from .model_scan import scan
from .prefetch import Prefetch
from .runtime import Runtime
from .tensors import as_array, numpy_dtype

__all__ = ["distribute", "finish", "local_batch_size", "Session", "session_of"]

#: The live session of this process (one distributed model at a time).
_ACTIVE = None


class Session:
    """One distributed model on this rank: its sync, runtime and bookkeeping.

    Attributes:
        topology, sync, runtime (None on servers), model, optimizers, layout.
    """

    def __init__(self, topology, sync, model, optimizers, layout):
        self.topology, self.sync, self.model = topology, sync, model
        self.optimizers, self.layout = optimizers, layout
        self.runtime = None
        self.finished = False
        self._hooks = []
        self._stdout = None

    @property
    def is_server(self) -> bool:
        """True on parameter-server ranks."""
        return self.topology.is_server

    def finish(self) -> None:
        """Release the servers and free the communicators; **collective** (every rank)."""
        if self.finished:
            return
        self.finished = True
        if self.runtime is not None:
            self.runtime.close()
        for handle in self._hooks:
            handle.remove()
        if self._stdout is not None:
            sys.stdout.close()
            sys.stdout, self._stdout = self._stdout, None
        self.sync.finish()


def session_of(model) -> Session:
    """The :class:`Session` of a distributed ``model``."""
    session = getattr(model, "_hpcpax_session", None)
    if session is None:
        raise ConfigError("the model was not distributed: call hpcpax.torch.distribute first")
    return session


def _check_arguments(model, optimizer, loss_reduction, stdout, on_server):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    for opt in optimizers:
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError(f"optimizer must be a torch.optim.Optimizer (or a list of them), "
                            f"not {type(opt).__name__}")
    for name, value, allowed in (("loss_reduction", loss_reduction, ("mean", "sum")),
                                 ("stdout", stdout, ("first", "all")),
                                 ("on_server", on_server, ("exit", "return"))):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, not {value!r}")
    if _ACTIVE is not None and not _ACTIVE.finished:
        raise ConfigError("a model is already distributed in this process; call "
                          "hpcpax.torch.finish() before distributing another")
    return optimizers


def _agree_model(comm, layout) -> None:
    """Every rank built the same model: the first differing parameter is named."""
    from ..comm.reductions import largest

    signature = layout.signature()
    count = largest(comm, len(signature))
    check_same(comm, "the model (every rank must build the same model)",
               {f"parameter {i}": signature[i] if i < len(signature) else None
                for i in range(count)})


def _broadcast(topology, tensors) -> None:
    """Copy the first worker's ``tensors`` (dense, frozen, buffers) to every worker."""
    comm = topology.workers
    if comm.Get_size() == 1:
        return
    for tensor in tensors:
        with torch.no_grad():
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                comm.Bcast(as_array(tensor), root=0)
            else:
                host = np.ascontiguousarray(tensor.detach().cpu().numpy())
                comm.Bcast(host, root=0)
                tensor.copy_(torch.from_numpy(host))


def _install(model, layout, runtime) -> None:
    """Put the distributed modules where the embeddings were (every path)."""
    replacement = {}
    for table, info in layout.tables.items():
        for path in info["modules"]:
            parent_path, _, child = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            original = getattr(parent, child)
            if id(original) not in replacement:
                cls = (DistributedEmbeddingBag if isinstance(original, torch.nn.EmbeddingBag)
                       else DistributedEmbedding)
                replacement[id(original)] = cls(original, table, runtime)
            setattr(parent, child, replacement[id(original)])


def _strip_tables(optimizers, layout) -> None:
    """Take the tables out of the torch optimizers (the servers update them)."""
    weights = {id(info["weight"]) for info in layout.tables.values()}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) not in weights]
        for param in [p for p in optimizer.state if id(p) in weights]:
            del optimizer.state[param]


def _summary(session, plan) -> str:
    layout, topo = session.layout, session.topology
    tables = ", ".join(f"{n} {i['rows']}x{i['dim']} {i['optimizer']}"
                       + ("" if i["sparse"] else " (sparse=False: row gradients made sparse)")
                       for n, i in layout.tables.items()) or "none"
    values = sum(p.numel() for p in layout.dense.values())
    return (f"hpcpax.torch: {topo.counts()}; plan {plan}; tables: "
            f"{tables}; {len(layout.dense)} dense parameters ({values:,} values) through "
            "the fused allreduce")


def distribute(model, optimizer, data=None, *, plan="auto", loss_reduction="mean",
               local_aggregation=True, bucket_bytes=None, plan_steps=10, run_dir=None,
               stdout="first", on_server="exit", quiet=False, timeout=None,
               fabric_seconds=1.0, prefetch=True, topology=None, batch_dim=0, split=None):
    """Make ``model`` and ``optimizer`` train data-parallel on every rank of the job.

    **Collective** over every rank (``MPI.COMM_WORLD``, or ``topology``'s).
    Returns the same ``model`` and ``optimizer`` objects, changed in place
    (and ``data`` as this worker's share of each batch, when given). See
    :mod:`hpcpax.torch` for what changes and the choices made.

    Args:
        model: a ``torch.nn.Module`` (the same on every rank).
        optimizer: a ``torch.optim.Optimizer``, or a list of them.
        data: optional ``DataLoader`` or iterable of global batches.
        plan: ``auto``, ``hybrid``, ``ps``, ``allgather``, ``allreduce``, a
            plan file or ``{table: {"method", ...}}`` (tables are module paths).
        loss_reduction: ``mean`` (the loss averages over the batch) or ``sum``.
        local_aggregation: aggregate pulls and pushes per node first.
        bucket_bytes: dense gradient bucket size (default: measured).
        plan_steps: steps measured before ``auto`` decides.
        run_dir: where ``plan.json`` goes (None: not written).
        stdout: ``first``: only the first worker prints (others to /dev/null);
            ``all``: every worker prints.
        on_server: ``exit``: a server rank serves and then ends the process
            (status 0) when the workers finish; ``return``: it serves, then
            returns (for tests; the returned model must not be used).
        quiet: print neither the summary nor the plan table.
        timeout: watchdog seconds (None: ``HPCPAX_TIMEOUT``).
        fabric_seconds: budget of the start-up fabric measurement.
        prefetch: pull the tables a forward pass reads straight from the
            model's inputs in one exchange before it (:mod:`~hpcpax.torch.prefetch`).
        topology: from :func:`hpcpax.init` (default: made here).
        batch_dim: where ``data``'s samples are: one dimension for every
            tensor, or a structure shaped like a batch giving each tensor's
            dimension, ``None`` (every worker takes it whole) or a function
            ``f(tensor, start, stop, total)`` (:mod:`~hpcpax.torch.data`).
        split: ``split(batch, start, stop)``: samples ``[start, stop)`` of a
            global batch, for layouts ``batch_dim`` cannot describe (ragged
            bags: :func:`~hpcpax.torch.data.cut_bags`; flattened targets);
            ``batch_dim`` still counts the samples.

    Raises:
        TypeError, ValueError, ConfigError: bad arguments, an unsupported
            module, parameter or optimizer setting (named), on every rank.
        MismatchError: ranks built different models (the parameter is named).
    """
    global _ACTIVE
    from ..app.model_sync import ModelSync
    from ..comm.topology import init
    from ..ps.spec import SparseVariableSpec

    optimizers = _check_arguments(model, optimizer, loss_reduction, stdout, on_server)
    from .data import check_split

    check_split(batch_dim, split)
    own = topology is None
    topology = init() if own else topology
    try:
        error = layout = None
        try:
            layout = scan(model, optimizers)
        except (ConfigError, TypeError, ValueError) as exc:
            error = exc
        agree_input(topology.comm, error, "hpcpax.torch.distribute", labels=None)
        _agree_model(topology.comm, layout)
        specs = [SparseVariableSpec(name, info["rows"], info["dim"], dtype=info["dtype"].name,
                                    initializer="zeros", optimizer=info["optimizer"],
                                    optimizer_params=info["optimizer_params"])
                 for name, info in layout.tables.items()]
        initial = {name: as_array(info["weight"].detach().cpu())
                   for name, info in layout.tables.items()}
        dense = {name: (tuple(p.shape), numpy_dtype(p.dtype))
                 for name, p in reversed(list(layout.dense.items()))}
        sync = ModelSync(specs, dense, plan=plan, initial=initial, topology=topology,
                         local_aggregation=local_aggregation, bucket_bytes=bucket_bytes,
                         plan_steps=plan_steps, fabric_seconds=fabric_seconds, run_dir=run_dir,
                         quiet=quiet, timeout=timeout)
        sync._own_topology = own
    except BaseException:
        if own:
            topology.free()
        raise
    session = Session(topology, sync, model, optimizers, layout)
    _ACTIVE = session
    model._hpcpax_session = session
    if topology.is_worker:
        _broadcast(topology, list(layout.dense.values()) + list(layout.frozen.values()))
    runtime = Runtime(sync, {n: {"rows": i["rows"], "dim": i["dim"], "dtype": i["dtype"],
                                 "padding_idx": i["padding_idx"], "device": i["device"],
                                 "sparse": i["sparse"],
                                 "counts_steps": bool(make_optimizer(
                                     i["optimizer"], **i["optimizer_params"]).scalar_slots)}
                             for n, i in layout.tables.items()},
                      layout.dense if topology.is_worker else {}, loss_reduction)
    _install(model, layout, runtime)
    _strip_tables(optimizers, layout)
    for info in layout.tables.values():
        info["weight"] = None  # the table lives with its holders now
    _share_idle_server_cores(topology, sync)
    if topology.is_server:
        sync.serve()
        session.finished = True
        if on_server == "exit":
            sys.exit(0)
        return (model, optimizer) if data is None else (model, optimizer, None)
    session.runtime = runtime
    _cap_torch_threads()
    if prefetch and layout.tables:
        runtime.prefetch = Prefetch(runtime, model)
    for opt in optimizers:
        session._hooks.append(opt.register_step_pre_hook(
            lambda *_: runtime.before_step()))
    first = topology.worker_index == 0
    if first and not quiet:
        print(_summary(session, plan if isinstance(plan, str) else "table"), flush=True)
        for name, info in layout.tables.items():
            if info["note"]:
                warnings.warn(f"hpcpax.torch: table {name!r}: {info['note']}", stacklevel=2)
    if stdout == "first" and not first:
        session._stdout, sys.stdout = sys.stdout, open(os.devnull, "w")
    _watch_exit()
    if data is None:
        return model, optimizer
    from .data import shard

    return model, optimizer, shard(data, runtime, batch_dim, split)


def _share_idle_server_cores(topology, sync) -> None:
    """Servers left with no table by a plan that stays fixed (one worker, or a
    plan of replicated methods) give their cores to the workers on their host
    (:func:`~hpcpax.comm.threads.share_idle_cores`). **Collective** (every rank)."""
    from ..comm.threads import share_idle_cores
    from ..sync.methods import method_of

    idle = None
    if topology.is_worker and topology.worker_index == 0:
        fixed = sync.engine.planning.mode is None
        idle = fixed and not any(method_of(m).on_servers for m in sync.methods().values())
    idle = topology.comm.bcast(idle, root=topology.worker_ranks[0])
    share_idle_cores(topology.comm, busy=not (idle and topology.is_server))


def _cap_torch_threads() -> None:
    """Give torch's intra-op pool this rank's share of the host's cores (as BLAS and
    Numba get from :func:`hpcpax.init`): a worker's threads must not take the core
    of a server or another worker on its host, nor leave one idle that is its
    share (``mpirun`` here starts torch on one thread; a sleeping server's core
    goes to the workers, :func:`_share_idle_server_cores`). ``HPCPAX_THREADS=0``
    leaves the pool as the script set it."""
    from ..comm.threads import thread_cap

    cap = thread_cap()
    if cap is not None and torch.get_num_threads() != cap:
        torch.set_num_threads(cap)


def local_batch_size(total) -> int:
    """This worker's share of a global batch of ``total`` samples (as the sharded
    data cuts it), e.g. to size a recurrent state carried across batches. Local."""
    from .data import share

    if _ACTIVE is None or _ACTIVE.finished or _ACTIVE.runtime is None:
        raise ConfigError("local_batch_size needs a distributed model on a worker: call "
                          "hpcpax.torch.distribute first")
    topo = _ACTIVE.topology
    start, stop = share(total, topo.worker_index, topo.num_workers)
    return stop - start


def finish() -> None:
    """End the distributed model of this process: servers are released and exit.

    **Collective** over the workers. Called at interpreter exit when not
    called before; call it earlier to end the servers sooner.
    """
    if _ACTIVE is not None:
        _ACTIVE.finish()


_EXIT_WATCHED = []


def _watch_exit() -> None:
    """At exit: release the servers, or abort the job after an uncaught exception."""
    if _EXIT_WATCHED:
        return
    _EXIT_WATCHED.append(True)
    crashed = []
    previous = sys.excepthook

    def hook(kind, value, traceback):
        crashed.append(kind)
        previous(kind, value, traceback)

    sys.excepthook = hook

    def at_exit():
        if _ACTIVE is None or _ACTIVE.finished:
            return
        if crashed:
            # the other ranks may sit in a collective: stop the job, don't hang it
            from ..comm.deathwatch import abort_job

            abort_job(1)
        _ACTIVE.finish()

    atexit.register(at_exit)
