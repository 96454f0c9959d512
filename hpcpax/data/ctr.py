"""CTR readers: an ``hpcpax-ctr/1`` file, or synthetic arrays in memory.

Batches are ``{"dense": float32 [B, n_dense], "categorical": int64 [B, n_fields],
"label": float32 [B]}`` on the host.
"""

import os

import numpy as np

from hpcpax.data import synthetic
from hpcpax.data.layouts import check_ctr, open_h5
from hpcpax.data.mapping import map_dataset
from hpcpax.data.reading import ShardedReader, gather_windows, scan_chunks
from hpcpax.data.sampling import check_int
from hpcpax.errors import DataError

__all__ = ["CTRDataset", "SyntheticCTR"]


class _CTRReader(ShardedReader):
    kind = "ctr"

    def __init__(self, name, label, dense, categorical, cardinality, shuffle, seed):
        self._label, self._dense, self._categorical = label, dense, categorical
        self.n_dense = dense.shape[1]
        self.n_fields = categorical.shape[1]
        self.cardinality = cardinality
        #: Per-field bound of the ids a batch may hold (None: only >= 0).
        self.id_limits = None if cardinality is None else np.asarray(cardinality, np.int64)
        self._limit_sources = ["the file's cardinality"] * self.n_fields
        self._row_bytes = 4 + 4 * self.n_dense + 8 * self.n_fields
        self.name = name
        self._set_span(0, len(label))
        super().__init__(name, self.num_samples, shuffle, seed)

    def _set_span(self, first, stop):
        """Read rows ``[first, stop)`` only."""
        self._span = (int(first), int(stop))
        self.num_samples = stop - first
        if self.num_samples <= 0:
            raise DataError(f"{self.name}: holds no samples")

    def _read(self, indices):
        indices = indices + self._span[0]

        def rows(array, row_bytes):
            return gather_windows(array, indices, 1, max(1, row_bytes))[:, 0]
        # Same runs for all three datasets: each is planned on the whole row's bytes.
        return {"dense": rows(self._dense, self._row_bytes),
                "categorical": rows(self._categorical, self._row_bytes),
                "label": rows(self._label, self._row_bytes)}

    def set_table_rows(self, table_rows, hash_ids=False) -> None:
        """Bound each field's ids by the model's table rows too (unless ``hash_ids``).

        Without hashing an id at or above its table's rows is a data error
        (it would be folded onto another row silently); with it the model folds
        it (``id % rows``) and only the file's own cardinality bounds it.
        """
        if hash_ids:
            return
        rows = np.broadcast_to(np.asarray(table_rows, np.int64), (self.n_fields,))
        current = self.id_limits if self.id_limits is not None else \
            np.full(self.n_fields, np.iinfo(np.int64).max, np.int64)
        tighter = rows < current
        self._limit_sources = ["the table's rows (--table-rows)" if t else s
                               for t, s in zip(tighter, self._limit_sources)]
        self.id_limits = np.minimum(current, rows)

    def _check_batch(self, batch, indices):
        labels, ids, dense = batch["label"], batch["categorical"], batch["dense"]
        bad = ~np.isfinite(labels) | (labels < 0) | (labels > 1)
        if bad.any():
            row = int(np.argmax(bad))
            raise DataError(f"{self.name}: label {labels[row]} at row "
                            f"{int(indices[row]) + self._span[0]} is not in [0, 1]")
        if not np.isfinite(dense).all():  # a NaN here would surface as a NaN gradient
            row, column = np.argwhere(~np.isfinite(dense))[0]
            raise DataError(f"{self.name}: dense value {dense[row, column]} at row "
                            f"{int(indices[row]) + self._span[0]}, column {column} is not finite")
        bad = ids < 0 if self.id_limits is None else (ids < 0) | (ids >= self.id_limits)
        if bad.any():
            row, field = np.argwhere(bad)[0]
            value = int(ids[row, field])
            problem = "is negative" if value < 0 else \
                f"is not below {self._limit_sources[field]} {int(self.id_limits[field])}"
            raise DataError(f"{self.name}: categorical id {value} at row "
                            f"{int(indices[row]) + self._span[0]}, field {field} {problem}")

    def _table_limits(self, table_rows):
        """Per-field id bound and, per field, which of cardinality/table_rows set it."""
        limits = np.full(self.n_fields, np.iinfo(np.int64).max, dtype=np.int64)
        sources = ["int64 range"] * self.n_fields
        if self.cardinality is not None:
            limits = self.cardinality.copy()
            sources = ["cardinality"] * self.n_fields
        if table_rows is not None:
            given = np.asarray(table_rows)
            if given.dtype.kind not in "iu" or given.ndim > 1 or \
                    (given.ndim == 1 and given.shape != (self.n_fields,)):
                raise ValueError(f"table_rows must be an int or {self.n_fields} ints, "
                                 f"not {table_rows!r}")
            given = np.broadcast_to(given.astype(np.int64), limits.shape)
            for field in np.flatnonzero(given < limits):
                sources[field] = "table_rows"
            limits = np.minimum(limits, given)
        return limits, sources

    def validate(self, table_rows=None):
        """Scan every value (in bounded chunks) and check ranges.

        Checks labels finite and in ``[0, 1]``, dense values finite, ids of
        field ``f`` in ``[0, min(cardinality[f], table_rows[f]))``.

        Args:
            table_rows: optional int or ``n_fields`` ints: the rows of the
                model's embedding table per field.

        Returns:
            dict summary: ``kind``, ``num_samples``, ``n_dense``, ``n_fields``,
            ``max_id`` (per field, list), ``positive_rate``.

        Raises:
            DataError: naming the file, the field, the row and the bound.
        """
        limits, sources = self._table_limits(table_rows)
        largest = np.full(self.n_fields, -1, dtype=np.int64)
        positives = 0.0
        with self._reading():
            for first, block in scan_chunks(self._label, self._row_bytes, *self._span):
                bad = ~np.isfinite(block) | (block < 0) | (block > 1)
                if bad.any():
                    row = int(np.argmax(bad))
                    raise DataError(f"{self.name}: label {block[row]} at row {first + row} "
                                    f"is not in [0, 1]")
                positives += float(block.sum(dtype=np.float64))
            for first, block in scan_chunks(self._dense, self._row_bytes, *self._span):
                bad = ~np.isfinite(block)
                if bad.any():
                    row, column = np.argwhere(bad)[0]
                    raise DataError(f"{self.name}: dense value {block[row, column]} at row "
                                    f"{first + row}, column {column} is not finite")
            for first, block in scan_chunks(self._categorical, self._row_bytes, *self._span):
                bad = (block < 0) | (block >= limits)
                if bad.any():
                    row, field = np.argwhere(bad)[0]
                    value = int(block[row, field])
                    problem = ("is negative" if value < 0 else
                               f"is not below {sources[field]} "
                               f"{int(limits[field])}")
                    raise DataError(f"{self.name}: categorical id {value} at row {first + row}, "
                                    f"field {field} {problem}")
                largest = np.maximum(largest, block.max(axis=0))
        return {"kind": "ctr", "num_samples": self.num_samples, "n_dense": self.n_dense,
                "n_fields": self.n_fields, "max_id": largest.tolist(),
                "positive_rate": positives / self.num_samples}


class CTRDataset(_CTRReader):
    """Reader of an ``hpcpax-ctr/1`` HDF5 file (layout in :mod:`hpcpax.data.layouts`).

    Opening checks metadata only; call :meth:`validate` to scan the values.
    Each :meth:`batch` reads only the rows of the calling shard.

    Args:
        path: the file.
        shuffle: visit samples in a per-epoch permutation keyed by
            ``(seed, epoch)`` (default False: file order).
        seed: non-negative int keying the shuffle.

    Raises:
        DataError: missing, unreadable or malformed file.
    """

    def __init__(self, path, shuffle=False, seed=0):
        name = os.fspath(path)
        self._file = open_h5(name)
        try:
            label, dense, categorical, cardinality = check_ctr(self._file, name)
            label, dense, categorical = (map_dataset(d) or d for d in (label, dense, categorical))
            super().__init__(name, label, dense, categorical, cardinality, shuffle, seed)
        except BaseException:
            self._file.close()
            raise

    def close(self):
        """Close the HDF5 file if this dataset opened it."""
        if self._owner:
            self._file.close()


class SyntheticCTR(_CTRReader):
    """In-memory synthetic CTR data with the same interface as :class:`CTRDataset`.

    Generated by :func:`hpcpax.data.synthetic.generate_ctr` (Zipf ids, normal
    dense features, labels from a hidden logistic model: learnable).
    ``python -m hpcpax.data synth ctr`` writes the same arrays to a file.

    Args:
        num_samples: rows (default 100_000).
        n_dense: dense features (default 13).
        n_fields: categorical fields (default 26).
        cardinality: int or ``n_fields`` ints, id space per field (default 1000).
        seed: non-negative int; keys both the data and the shuffle.
        zipf: Zipf exponent (default 1.1).
        shuffle: per-epoch permutation of the sample order (default False).
    """

    def __init__(self, num_samples=100_000, n_dense=13, n_fields=26, cardinality=1000, seed=0,
                 zipf=1.1, shuffle=False):
        num_samples = check_int(num_samples, "num_samples", 1)
        n_dense = check_int(n_dense, "n_dense", 0)
        n_fields = check_int(n_fields, "n_fields", 1)
        seed = check_int(seed, "seed", 0)
        sizes = np.asarray(cardinality)
        if sizes.dtype.kind not in "iu" or sizes.ndim > 1 or (sizes < 1).any() or \
                (sizes.ndim == 1 and sizes.shape != (n_fields,)):
            raise ValueError(f"cardinality must be an int >= 1 or {n_fields} such ints, "
                             f"not {cardinality!r}")
        label, dense, categorical, cardinality = synthetic.generate_ctr(
            num_samples, n_dense, n_fields, sizes, seed=seed, zipf=zipf)
        self.zipf = zipf
        super().__init__(f"synthetic-ctr(seed={seed})", label, dense, categorical, cardinality,
                         shuffle, seed)

    def arrays(self):
        """``(label, dense, categorical)``: the whole in-memory arrays."""
        return self._label, self._dense, self._categorical
