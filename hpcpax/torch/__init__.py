"""PyTorch adapter: a single-process training script on N ranks, two lines added.

::

    import hpcpax.torch                                   # line 1
    ...build model, optimizer, loader as for one process...
    model, optimizer, loader = hpcpax.torch.distribute(model, optimizer, loader)  # line 2
    ...the unchanged training loop...

    mpirun -n 8 python -m mpi4py train.py      # or srun, from a rendered job script

What :func:`distribute` does (**collective** over every rank):

- Every ``nn.Embedding`` / ``nn.EmbeddingBag`` that trains becomes a table
  held by the parameter servers (or replicated, per the plan): its forward
  pulls only the rows of the batch's distinct ids into a leaf tensor, the
  backward fills their gradient, and ``optimizer.step()`` pushes every
  table's rows in one batched exchange; the servers run the row optimizer
  that the torch optimizer maps to (:mod:`~hpcpax.torch.optim_map`: SGD,
  Adagrad, SparseAdam exactly; Adam lazily, differences named). ``sparse=False``
  tables are fine: the row gradients are sparse anyway.
- Dense parameters keep their torch optimizer; their gradients are averaged
  over the workers by the fused allreduce, bucket by bucket as the backward
  pass produces them (overlap); after ``loss.backward()`` every ``.grad``
  holds the workers' mean, as with DistributedDataParallel. CPU tensors go
  to MPI as NumPy views, CUDA tensors through DLPack as CuPy arrays (no copies).
- ``plan="auto"`` measures each table's sparsity over the first steps, then
  moves each table to the method the cost model picks (``ps``,
  ``allgather``, ``allreduce``), with its optimizer state, exactly.
- The data, when given, becomes this worker's share of every global batch
  (:mod:`~hpcpax.torch.data`), so N workers see what one process saw, and the
  result equals single-process training (to float rounding).
- Every rank starts from the first worker's parameters; ranks that built
  different models stop with an error naming the first differing parameter.

Server ranks run the script up to :func:`distribute`, serve the workers
there, and **end the process** (exit status 0) when the workers finish (at
their interpreter exit, or :func:`finish`): code after the call runs on
workers only. ``on_server="return"`` returns instead (tests). Workers other
than the first print nothing (``stdout="all"`` to change that).

Things to know: every worker must run the same forward passes (a pull is
collective: no rank-dependent branches around the model); ``model.state_dict()``
gathers whole tables on every worker (use :func:`save` / :func:`load` for big
ones: HDF5, rows by global id, resumable on another layout); learning-rate
changes of a table's parameter group after :func:`distribute` do not reach
the servers. A table's original ``weight`` stays in ``model.parameters()``
without its values: its ``.grad``, when the script reads it (a
``clip_grad_norm_`` over ``model.parameters()``), is the workers' mean
gradient, gathered then (collective), and what the script does to it is
what is pushed (:mod:`~hpcpax.torch.table_weight`); computing with its
values stops with an error naming the call. Batches whose samples are not
along the first dimension take ``batch_dim=`` or ``split=``
(:mod:`~hpcpax.torch.data`); :func:`local_batch_size` sizes a state carried
across batches.

Importing this package imports torch; importing ``hpcpax`` does not.
"""

try:
    import torch as _torch  # noqa: F401
except ImportError:  # pragma: no cover - depends on the environment
    from ..errors import DependencyError

    raise DependencyError("hpcpax.torch needs PyTorch: pip install hpcpax[torch]") from None

from .checkpoint import load, save
from .data import cut_bags
from .distribute import distribute, finish, local_batch_size
from .embedding import DistributedEmbedding, DistributedEmbeddingBag

__all__ = ["distribute", "finish", "save", "load", "cut_bags", "local_batch_size",
           "DistributedEmbedding", "DistributedEmbeddingBag"]
