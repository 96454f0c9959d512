"""The model interface: sparse tables live on servers, dense weights on workers.

A model never holds an embedding table. Per step the training loop asks
:meth:`Model.sparse_ids` which rows a batch needs, pulls them from the
parameter servers, and hands them to :meth:`Model.forward_backward` as
``rows[name] = (ids, table_rows)`` with ``ids`` sorted and unique. The model
returns the dense gradients and the raw per-occurrence sparse gradients; the
library deduplicates and pushes them.

Everything runs in ``xp`` (NumPy or CuPy), taken from the arrays passed in.
Nothing here is collective.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..backend import array_module
from ..errors import ConfigError, SparseIndexError
from ..input_checks import INT64_MAX, check_int, shown

__all__ = [
    "SparseSpec",
    "StepResult",
    "EvalOutputs",
    "Model",
    "counter_generator",
    "gather_rows",
    "parse_sizes",
    "MAX_WIDTH",
    "MAX_LAYERS",
    "MAX_FIELDS",
    "MAX_ROWS",
    "MAX_CONTEXT",
    "MAX_SAMPLED",
]

# Upper bounds of the model sizes, checked before anything is allocated: a size past them
# is a typo or an attack (--n-fields 100000000 asked numpy for 8.88 PiB of indices).
#: Widest layer, embedding row or dense feature vector.
MAX_WIDTH = 1 << 16
#: Most layers in ``hidden``, ``bottom`` or ``top``.
MAX_LAYERS = 64
#: Most ctr fields (one table each; the pairwise interaction grows with the square).
MAX_FIELDS = 1024
#: Most rows of a table (ids are int64; rows are created when first touched).
MAX_ROWS = INT64_MAX
#: Most previous tokens per lm example.
MAX_CONTEXT = 1 << 16
#: Most sampled-softmax negatives per step.
MAX_SAMPLED = 1 << 20

# Stream tags in the high counter word keep the generators of one key apart.
STREAM_DENSE_INIT = 1
STREAM_SAMPLER = 2
STREAM_EXAMPLE = 3

_DTYPES = {"float32": np.float32, "float64": np.float64}


@dataclass(frozen=True)
class SparseSpec:
    """One embedding table; it lives on the parameter servers, never in a model.

    Attributes:
        name: the key of the table in ``rows`` and ``sparse_grads``.
        rows: number of rows (ids run over ``[0, rows)``).
        dim: width of a row.
        init_scale: rows start as ``U(-init_scale, init_scale)``, drawn by the
            library's counter-based generator keyed by (seed, name, row).
    """

    name: str
    rows: int
    dim: int
    init_scale: float


@dataclass
class StepResult:
    """What one forward/backward pass on a (shard of a) batch gives.

    Attributes:
        loss: mean loss over the examples given, as a Python float.
        metrics: named scalars, ``loss`` among them.
        dense_grads: same keys and shapes as the dense parameters, in ``xp``.
        sparse_grads: ``name -> (indices int64 [n], values [n, dim])``, one row
            per lookup occurrence (duplicates allowed, not summed).
    """

    loss: float
    metrics: dict = field(default_factory=dict)
    dense_grads: dict = field(default_factory=dict)
    sparse_grads: dict = field(default_factory=dict)


@dataclass
class EvalOutputs:
    """Per-example results of a forward pass on one batch (shard), on the host.

    The decomposable part is ``losses``; metrics that are not means of
    per-example values (perplexity, AUC) are computed by
    :meth:`Model.eval_metrics` from sums over *all* examples and from the
    gathered ``scores``/``labels``, so they do not depend on how the examples
    were split over workers.

    Attributes:
        losses: float64 ``[B]`` per-example loss.
        scores: float64 ``[B]`` ranking scores (logits) for rank metrics, or None.
        labels: float64 ``[B]`` labels matching ``scores``, or None.
    """

    losses: np.ndarray
    scores: np.ndarray | None = None
    labels: np.ndarray | None = None


def counter_generator(seed: int, word: int, stream: int) -> np.random.Generator:
    """A host Philox generator keyed by ``(seed, word)`` in stream ``stream``.

    Counter-based, so the draws depend on these three numbers only: never on
    the rank, the shard or how many draws came before elsewhere.
    """
    key = np.array([seed, word], dtype=np.uint64)
    counter = np.array([0, 0, 0, stream], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key, counter=counter))


def gather_rows(rows: dict, name: str, wanted, dtype):
    """Rows of table ``name`` for the ids ``wanted`` (any shape), via searchsorted.

    Args:
        rows: ``name -> (ids sorted unique int64, table_rows [len(ids), dim])``.
        wanted: int64 ids, in the same ``xp`` as the rows.
        dtype: the compute dtype the rows are cast to.

    Returns:
        ``table_rows`` gathered to shape ``wanted.shape + (dim,)``, on the
        rows' device.

    Raises:
        SparseIndexError: an id in ``wanted`` was not pulled.
    """
    if name not in rows:
        raise SparseIndexError(f"rows must hold table {name!r}, not only {sorted(rows)}")
    ids, table_rows = rows[name]
    xp = array_module(table_rows)
    flat = wanted.reshape(-1)
    if ids.shape[0] == 0:
        if flat.shape[0]:
            raise SparseIndexError(f"table {name!r}: no rows were pulled for {flat.shape[0]} ids")
        return xp.zeros(wanted.shape + (table_rows.shape[1],), dtype=dtype)
    position = xp.searchsorted(ids, flat)
    clipped = xp.minimum(position, ids.shape[0] - 1)
    # One device sync per table: cheap next to a silent wrong-row gather.
    if not bool(xp.all(ids[clipped] == flat)):
        missing = flat[ids[clipped] != flat]
        raise SparseIndexError(
            f"table {name!r}: ids {missing[:5].tolist()} were needed but not pulled"
        )
    gathered = table_rows[clipped].astype(dtype, copy=False)
    return gathered.reshape(wanted.shape + (table_rows.shape[1],))


def parse_sizes(value, flag: str, *, allow_empty: bool = False, maximum: int = MAX_WIDTH,
                max_count: int = MAX_LAYERS) -> tuple[int, ...]:
    """``64`` / ``(64, 32)`` / ``"64,32"`` -> ``(64, 32)``; each size an int in ``[1, maximum]``,
    at most ``max_count`` of them (checked before anything is allocated)."""
    if isinstance(value, str):
        if value.count(",") >= max_count:
            raise ConfigError(f"{flag} must hold at most {max_count} sizes, not {shown(value)}")
        parts = [part for part in value.replace(" ", "").split(",") if part]
        try:
            sizes = tuple(check_int(part, flag, None, None) if len(part) < 25 else maximum + 1
                          for part in parts)
        except ConfigError:
            raise ConfigError(f"{flag} must be comma-separated ints, not {shown(value)}") from None
    elif isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        sizes = (int(value),)
    else:
        try:
            sizes = tuple(value)
        except TypeError:
            raise ConfigError(
                f"{flag} must be an int or a sequence of ints, not {type(value).__name__}"
            ) from None
        if len(sizes) > max_count:
            raise ConfigError(f"{flag} must hold at most {max_count} sizes, not {len(sizes)}")
        for size in sizes:
            if not isinstance(size, (int, np.integer)) or isinstance(size, bool):
                raise ConfigError(f"{flag} must hold ints, not {type(size).__name__}")
        sizes = tuple(int(size) for size in sizes)
    if not sizes and not allow_empty:
        raise ConfigError(f"{flag} must name at least one size, not {value!r}")
    if any(size <= 0 for size in sizes):
        raise ConfigError(f"{flag} must be positive sizes, not {shown(sizes)}")
    if any(size > maximum for size in sizes):
        raise ConfigError(f"{flag} must be sizes of at most {maximum}, not "
                          f"{shown(value if isinstance(value, str) else sizes)}")
    return sizes


def check_positive_int(value, flag: str, maximum: int = MAX_ROWS) -> int:
    """``value`` if it is an int in ``[1, maximum]``, else ConfigError naming ``flag``."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise ConfigError(f"{flag} must be int, not {type(value).__name__}")
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, not {value}")
    return check_int(int(value), flag, 1, maximum)


class Model:
    """Base class of the built-in models (see the module docstring).

    Subclasses set :attr:`name` and implement the five methods below. Dense
    parameters are NumPy arrays from :meth:`init_dense`; the caller moves them
    to the device, and every other method works in whichever ``xp`` the
    arrays it is given live in.

    Args:
        seed: non-negative int; dense init and in-step randomness derive from it.
        dtype: ``"float32"`` or ``"float64"``, used for every float array.
    """

    name = "model"

    def __init__(self, *, seed: int = 0, dtype="float32"):
        if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
            raise ConfigError(f"seed must be int, not {type(seed).__name__}")
        if not 0 <= seed < 2**64:
            raise ConfigError(f"seed must be in [0, 2**64), not {seed}")
        dtype_name = np.dtype(dtype).name if not isinstance(dtype, str) else dtype
        if dtype_name not in _DTYPES:
            raise ConfigError(f"dtype must be float32 or float64, not {dtype!r}")
        self.seed = int(seed)
        self.dtype = np.dtype(_DTYPES[dtype_name])

    # --- the interface -------------------------------------------------
    def sparse_specs(self) -> list[SparseSpec]:
        """The embedding tables this model reads, for the servers to create."""
        raise NotImplementedError

    def dense_shapes(self) -> dict[str, tuple[int, ...]]:
        """Name -> shape of every dense parameter, in a fixed order."""
        raise NotImplementedError

    def init_dense(self) -> dict[str, np.ndarray]:
        """Dense parameters as NumPy arrays, deterministic from the seed.

        Weights are Glorot-uniform, biases zero, drawn in :meth:`dense_shapes`
        order from one counter-based stream.
        """
        rng = counter_generator(self.seed, 0, STREAM_DENSE_INIT)
        params = {}
        for param_name, shape in self.dense_shapes().items():
            if len(shape) == 2:
                limit = np.sqrt(6.0 / (shape[0] + shape[1]))
                params[param_name] = rng.uniform(-limit, limit, size=shape).astype(self.dtype)
            else:
                params[param_name] = np.zeros(shape, dtype=self.dtype)
        return params

    def sparse_ids(self, batch: dict, step: int, *, full: bool = False) -> dict:
        """int64 ids per table that this batch needs (duplicates allowed)."""
        raise NotImplementedError

    def forward_backward(self, dense: dict, rows: dict, batch: dict, step: int) -> StepResult:
        """Mean loss over ``batch`` and its gradients (see :class:`StepResult`)."""
        raise NotImplementedError

    def eval_outputs(self, dense: dict, rows: dict, batch: dict, step: int, *,
                     full: bool = False) -> EvalOutputs:
        """Forward only: per-example losses (and scores), see :class:`EvalOutputs`."""
        raise NotImplementedError

    def eval_metrics(self, loss_sum: float, count: int, scores=None, labels=None) -> dict:
        """Metrics of a whole evaluation set from its loss sum over ``count``
        examples (and all its scores and labels); Python floats."""
        return {"loss": float(loss_sum) / count}

    def evaluate(self, dense: dict, rows: dict, batch: dict, step: int, *, full: bool = False) -> dict:
        """Forward only; the metrics of this one batch as Python floats.

        For a set split over workers use :meth:`eval_outputs` on each part and
        :meth:`eval_metrics` on the totals (:mod:`hpcpax.app.evaluation` does).
        """
        out = self.eval_outputs(dense, rows, batch, step, full=full)
        return self.eval_metrics(float(out.losses.sum()), len(out.losses), out.scores, out.labels)

    def config(self) -> dict:
        """The flags that rebuild this model with :func:`hpcpax.models.build_model`."""
        return {"seed": self.seed, "dtype": self.dtype.name}

    def example_batch(self, batch_size: int, *, seed: int = 0) -> dict:
        """A random batch in this model's format, as NumPy arrays (tests, benchmarks)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        flags = ", ".join(f"{key}={value!r}" for key, value in self.config().items())
        return f"{type(self).__name__}({flags})"
