"""`SparseVariableSpec`: a sparse variable (an embedding table) as workers declare it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from ..ops.optimizers import make_optimizer
from .initializers import INITIALIZERS

__all__ = ["SparseVariableSpec", "MAX_PARTITIONS", "MAX_OWNER"]

#: Most partitions of one variable (set-up loops over them; Parallax's search tries far fewer).
MAX_PARTITIONS = 1 << 14
#: Largest owner index a plan may name (the owner ranks of a job are fewer).
MAX_OWNER = (1 << 20) - 1


@dataclass(frozen=True)
class SparseVariableSpec:
    """A sparse variable (an embedding table) as workers register it.

    Attributes:
        name: unique name.
        rows, dim: table shape. ``rows`` may be as large as the id space
            (up to ``2**63 - 1``, e.g. for hashed 64-bit ids): owners create
            a row when it is first pulled or pushed, so start-up and memory
            follow the rows touched, not ``rows``.
        dtype: ``float32`` or ``float64``.
        initializer: ``uniform`` (U(-init_scale, init_scale)), ``zeros`` or
            ``constant`` (every value ``init_scale``).
        init_scale: see ``initializer``.
        optimizer: ``sgd``, ``momentum``, ``adagrad`` or ``adam``.
        optimizer_params: hyper-parameters, e.g. ``{"lr": 0.1}``.
        partitioning: ``mod`` (row r in partition r % P) or ``range``.
        num_partitions: P; None = one per owner rank.
        eviction: ``none`` (default: a table that would outgrow its owner's
            memory budget is an error) or ``lru`` (the least recently used
            rows are dropped to make room; touched again they start over
            from the initializer). See :mod:`hpcpax.ps.rowstore`.
    """

    name: str
    rows: int
    dim: int
    dtype: str = "float32"
    initializer: str = "uniform"
    init_scale: float = 0.05
    optimizer: str = "sgd"
    optimizer_params: dict = field(default_factory=lambda: {"lr": 0.1})
    partitioning: str = "mod"
    num_partitions: int | None = None
    eviction: str = "none"

    def validate(self) -> None:
        """Raise ``ValueError``/``TypeError`` for a bad field (local check)."""
        if not isinstance(self.name, str) or not self.name:
            raise TypeError(f"name must be a non-empty str, not {self.name!r}")
        for key in ("rows", "dim"):
            value = getattr(self, key)
            if not isinstance(value, (int, np.integer)) or not 1 <= value < 1 << 63:
                raise ValueError(f"{self.name}: {key} must be a positive int below 2**63, "
                                 f"not {value!r}")
        if np.dtype(self.dtype) not in (np.dtype("float32"), np.dtype("float64")):
            raise TypeError(f"{self.name}: dtype must be float32 or float64, not {self.dtype}")
        if self.initializer not in INITIALIZERS:
            raise ValueError(f"{self.name}: initializer must be one of {sorted(INITIALIZERS)}, "
                             f"not {self.initializer!r}")
        if self.partitioning not in ("mod", "range"):
            raise ValueError(f"{self.name}: partitioning must be 'mod' or 'range', "
                             f"not {self.partitioning!r}")
        if self.num_partitions is not None and (
                not isinstance(self.num_partitions, (int, np.integer))
                or not 1 <= self.num_partitions <= MAX_PARTITIONS):
            raise ValueError(f"{self.name}: num_partitions must be an int in "
                             f"[1, {MAX_PARTITIONS}], not {self.num_partitions!r}")
        if self.eviction not in ("none", "lru"):
            raise ValueError(f"{self.name}: eviction must be 'none' or 'lru', "
                             f"not {self.eviction!r}")
        make_optimizer(self.optimizer, **self.optimizer_params)

    def to_dict(self) -> dict:
        """JSON-ready dict."""
        d = asdict(self)
        d["dtype"] = str(np.dtype(self.dtype))
        return d

    @property
    def row_bytes(self) -> int:
        """Bytes of one row."""
        return self.dim * np.dtype(self.dtype).itemsize
