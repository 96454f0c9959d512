"""Row partitioning of a sparse variable across parameter-server partitions.

A :class:`Partitioning` maps a global row id to ``(part, local)``: the
partition that owns the row and the row's index inside that partition. Two
kinds exist:

* ``"mod"``: ``part = id % P``, ``local = id // P`` (round robin; spreads
  the hot low ids of a Zipf distribution over all partitions).
* ``"range"``: contiguous, nearly equal blocks; the first ``num_rows % P``
  partitions hold one row more than the others.

Every method takes and returns NumPy or CuPy arrays and returns its result
on the device of its input. Ids may be any int64 below ``num_rows``, up to
``2**63 - 2``: no intermediate exceeds the row count. Nothing here is
collective.
"""

from __future__ import annotations

import numpy as np

from ..backend import array_module
from ..errors import SparseIndexError

__all__ = ["Partitioning", "PARTITION_KINDS"]

PARTITION_KINDS = ("mod", "range")


def _check_int(name: str, value, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{name} must be an int, not {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, not {value}")
    return int(value)


class Partitioning:
    """How the rows of one variable are split into ``num_parts`` partitions.

    Args:
        kind: ``"mod"`` or ``"range"``.
        num_rows: rows of the whole variable (>= 1).
        num_parts: number of partitions (>= 1); may exceed ``num_rows``, in
            which case some partitions hold no rows.

    Raises:
        ValueError: ``kind`` is unknown or a count is out of range.
        TypeError: a count is not an integer.
    """

    def __init__(self, kind: str, num_rows: int, num_parts: int):
        if kind not in PARTITION_KINDS:
            raise ValueError(f"kind must be one of {PARTITION_KINDS}, not {kind!r}")
        self.kind = kind
        self.num_rows = _check_int("num_rows", num_rows, 1)
        self.num_parts = _check_int("num_parts", num_parts, 1)
        # range kind: the first `remainder` parts hold `base + 1` rows.
        self.base, self.remainder = divmod(self.num_rows, self.num_parts)

    # -- scalar facts ---------------------------------------------------
    def _check_part(self, part) -> int:
        part = _check_int("part", part, 0)
        if part >= self.num_parts:
            raise ValueError(f"part must be < num_parts={self.num_parts}, not {part}")
        return part

    def part_rows(self, part: int) -> int:
        """Number of rows held by partition ``part`` (a host int)."""
        part = self._check_part(part)
        if self.kind == "mod":
            return len(range(part, self.num_rows, self.num_parts))
        return self.base + (1 if part < self.remainder else 0)

    def part_start(self, part: int) -> int:
        """First global row of partition ``part`` (``"range"`` kind only)."""
        part = self._check_part(part)
        if self.kind != "range":
            raise ValueError(f"part_start needs kind 'range', not {self.kind!r}")
        return part * self.base + min(part, self.remainder)

    # -- array maps -----------------------------------------------------
    def check_ids(self, ids) -> None:
        """Raise :class:`SparseIndexError` unless ``0 <= ids < num_rows``.

        Costs one min and one max reduction (a device sync for CuPy input).
        """
        if ids.size == 0:
            return
        low, high = int(ids.min()), int(ids.max())
        if low < 0 or high >= self.num_rows:
            bad = low if low < 0 else high
            raise SparseIndexError(
                f"row id must be in [0, {self.num_rows}), not {bad}"
            )

    def _as_ids(self, ids):
        xp = array_module(ids)
        ids = xp.asarray(ids)
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be an integer array, not {ids.dtype}")
        return xp, ids.astype(xp.int64, copy=False)

    def partition_of(self, ids):
        """Partition owning each global row id, as int64 on the input's device.

        Raises:
            SparseIndexError: an id is negative or >= ``num_rows``.
        """
        xp, ids = self._as_ids(ids)
        self.check_ids(ids)
        if self.num_parts == 1:  # (also keeps base + 1 below 2**63 for rows up to 2**63 - 1)
            return xp.zeros_like(ids)
        if self.kind == "mod":
            return ids % self.num_parts
        boundary = self.remainder * (self.base + 1)
        if self.base == 0:  # every row lies below the boundary
            return ids // (self.base + 1)
        return xp.where(
            ids < boundary,
            ids // (self.base + 1),
            self.remainder + (ids - boundary) // max(self.base, 1),
        )

    def local_index(self, ids):
        """Index of each global row inside its partition (int64, input's device).

        Raises:
            SparseIndexError: an id is negative or >= ``num_rows``.
        """
        xp, ids = self._as_ids(ids)
        if self.kind == "mod":
            self.check_ids(ids)
            return ids // self.num_parts
        parts = self.partition_of(ids)
        starts = parts * self.base + xp.minimum(parts, self.remainder)
        return ids - starts

    def global_index(self, part: int, local_ids):
        """Global row ids of rows ``local_ids`` of partition ``part``.

        Raises:
            SparseIndexError: a local id is negative or >= ``part_rows(part)``.
        """
        rows = self.part_rows(part)
        xp, local_ids = self._as_ids(local_ids)
        if local_ids.size:
            low, high = int(local_ids.min()), int(local_ids.max())
            if low < 0 or high >= rows:
                bad = low if low < 0 else high
                raise SparseIndexError(
                    f"local id of part {part} must be in [0, {rows}), not {bad}"
                )
        if self.kind == "mod":
            return local_ids * self.num_parts + part
        return local_ids + self.part_start(part)

    # -- identity and serialization ------------------------------------
    def to_dict(self) -> dict:
        """A JSON-able dict; :meth:`from_dict` inverts it."""
        return {"kind": self.kind, "num_rows": self.num_rows, "num_parts": self.num_parts}

    @classmethod
    def from_dict(cls, data: dict) -> "Partitioning":
        """Build a partitioning from :meth:`to_dict` output."""
        missing = {"kind", "num_rows", "num_parts"} - set(data)
        if missing:
            raise ValueError(f"partitioning dict must have {sorted(missing)}, not {sorted(data)}")
        return cls(data["kind"], data["num_rows"], data["num_parts"])

    def __eq__(self, other) -> bool:
        if not isinstance(other, Partitioning):
            return NotImplemented
        return self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash((self.kind, self.num_rows, self.num_parts))

    def __repr__(self) -> str:
        return (
            f"Partitioning(kind={self.kind!r}, num_rows={self.num_rows}, "
            f"num_parts={self.num_parts})"
        )
