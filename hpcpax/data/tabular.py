"""A CSV file to an ``hpcpax-ctr/1`` file, streamed in row blocks.

Categorical values are hashed: ``crc32(value as UTF-8, start=crc32(column
name + NUL)) % hash_buckets``. The column name salts the hash, so the same
string in two columns lands on unrelated ids, and the ids are the same in
every run, on every machine and in every later file hashed with the same
bucket count (an empty cell is hashed like any other string). Missing or
empty dense cells become 0; the label must be a number in [0, 1].

Two passes: the first counts the data rows, so the datasets are written
contiguous and exactly as long as needed (fast random reads, see
:mod:`hpcpax.data.mapping`) and a held-out tail (``eval_fraction``) can go
to a second file.
"""

import csv
import math
import os
import zlib

import numpy as np

from hpcpax.data.layouts import FORMAT_CTR
from hpcpax.data.writing import Appender, atomic_h5
from hpcpax.errors import DataError

__all__ = ["DEFAULT_HASH_BUCKETS", "hash_value", "csv_to_h5"]

DEFAULT_HASH_BUCKETS = 1 << 20
_BLOCK_ROWS = 1 << 15


def _salt(column):
    return zlib.crc32(column.encode("utf-8") + b"\0")


def hash_value(value, column, hash_buckets):
    """The id of categorical ``value`` in ``column``: stable across runs and machines."""
    return zlib.crc32(value.encode("utf-8"), _salt(column)) % hash_buckets


def _number(text, path, line, column, default=None):
    text = text.strip()
    if not text and default is not None:
        return default
    try:
        value = float(text)
    except ValueError:
        raise DataError(f"{path}: line {line}, column {column!r}: {text!r} is not a number") \
            from None
    if not math.isfinite(value):
        raise DataError(f"{path}: line {line}, column {column!r}: {text!r} is not finite")
    return value


def _columns(header, wanted, path, role):
    missing = [name for name in wanted if name not in header]
    if missing:
        raise DataError(f"{path}: {role} column(s) {missing} not in the header; "
                        f"available columns: {header}")
    return [header.index(name) for name in wanted]


def _read_rows(path):
    """``(header, rows)``: the header and an iterator of ``(line, cells)`` of non-blank rows."""
    stream = open(path, encoding="utf-8", newline="")
    rows = csv.reader(stream)
    header = next(rows, None)
    if header is None:
        stream.close()
        raise DataError(f"{path}: empty file, no header row")

    def data():
        with stream:
            for line, row in enumerate(rows, start=2):
                if row:  # csv yields [] for a blank line
                    yield line, row
    return header, data()


class _Columns:
    """Parses one CSV row into (label, dense values, hashed ids), checking it."""

    def __init__(self, path, header, label, categorical, dense, hash_buckets):
        self.path, self.header, self.label, self.hash_buckets = path, header, label, hash_buckets
        self.label_index = _columns(header, [label], path, "label")[0]
        self.categorical_index = _columns(header, categorical, path, "categorical")
        self.dense_index = _columns(header, dense, path, "dense")
        self.salts = [_salt(name) for name in categorical]

    def parse(self, line, row):
        path, header = self.path, self.header
        if len(row) != len(header):
            raise DataError(f"{path}: line {line} has {len(row)} fields, "
                            f"the header has {len(header)}")
        value = _number(row[self.label_index], path, line, self.label)
        if not 0.0 <= value <= 1.0:
            raise DataError(f"{path}: line {line}, column {self.label!r}: label "
                            f"{value} is not in [0, 1]")
        return (value, [_number(row[i], path, line, header[i], 0.0) for i in self.dense_index],
                [zlib.crc32(row[i].encode("utf-8"), salt) % self.hash_buckets
                 for i, salt in zip(self.categorical_index, self.salts)])


def _write_part(output, parsed, count, attrs, n_dense, n_fields):
    """Write the next ``count`` parsed rows into ``output`` (atomically)."""
    with atomic_h5(output) as h5file:
        for key, value in attrs.items():
            h5file.attrs[key] = value
        out = {"label": Appender(h5file, "label", "float32", total_rows=count),
               "dense": Appender(h5file, "dense", "float32", (n_dense,), total_rows=count),
               "categorical": Appender(h5file, "categorical", "int64", (n_fields,),
                                       total_rows=count)}
        block = {key: [] for key in out}
        for _ in range(count):
            label, dense, categorical = next(parsed)
            block["label"].append(label)
            block["dense"].append(dense)
            block["categorical"].append(categorical)
            if len(block["label"]) >= _BLOCK_ROWS:
                _flush(out, block, n_dense, n_fields)
        _flush(out, block, n_dense, n_fields)
        for appender in out.values():
            appender.finish()
    return os.path.getsize(output)


def csv_to_h5(path, output, label, categorical, dense=(), hash_buckets=DEFAULT_HASH_BUCKETS,
              eval_output=None, eval_fraction=0.0):
    """Convert a CSV file with a header row to ``hpcpax-ctr/1`` (written atomically).

    Args:
        path: input CSV (UTF-8, first row is the header).
        output: output HDF5 file.
        label: name of the label column.
        categorical: names of the categorical columns (at least one).
        dense: names of the dense columns (may be empty).
        hash_buckets: id space of every categorical field.
        eval_output: optional second file for the held-out tail: the last
            ``eval_fraction`` of the rows go there, not into ``output``.
        eval_fraction: the held-out share, in (0, 1) when ``eval_output`` is set.

    Returns:
        dict summary: ``samples``, ``n_dense``, ``n_fields``, ``bytes`` (and
        ``eval_samples``, ``eval_bytes`` with a split).

    Raises:
        DataError: missing file, unknown column (listing the available ones),
            ragged row, bad number, no data rows, or a split leaving a part empty.
    """
    categorical, dense = list(categorical), list(dense)
    if not categorical:
        raise DataError(f"{path}: at least one categorical column is needed")
    if hash_buckets < 1:
        raise DataError(f"--hash-buckets must be >= 1, not {hash_buckets}")
    if eval_output is not None and not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction must be in (0, 1) with --eval-output, "
                        f"not {eval_fraction}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    attrs = {"format": FORMAT_CTR, "n_dense": np.int64(len(dense)),
             "n_fields": np.int64(len(categorical)),
             "cardinality": np.full(len(categorical), hash_buckets, np.int64),
             "hash_buckets": np.int64(hash_buckets), "label_column": label,
             "categorical_columns": categorical, "dense_columns": dense,
             "source": "hpcpax.data csv"}
    try:
        header, rows = _read_rows(path)
        columns = _Columns(path, header, label, categorical, dense, hash_buckets)
        total = sum(1 for _ in rows)
        if total == 0:
            raise DataError(f"{path}: no data rows after the header")
        held = int(round(total * eval_fraction)) if eval_output is not None else 0
        if eval_output is not None and not 0 < held < total:
            raise DataError(f"--eval-fraction {eval_fraction} of {total} rows leaves "
                            f"{total - held} for training and {held} held out; both must be > 0")
        _, rows = _read_rows(path)
        parsed = (columns.parse(line, row) for line, row in rows)
        summary = {"samples": total - held, "n_dense": len(dense), "n_fields": len(categorical)}
        summary["bytes"] = _write_part(output, parsed, total - held, attrs, len(dense),
                                       len(categorical))
        if held:
            summary["eval_samples"] = held
            summary["eval_bytes"] = _write_part(
                eval_output, parsed, held, {**attrs, "held_out_of": os.path.basename(output)},
                len(dense), len(categorical))
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc})") from None
    except csv.Error as exc:
        raise DataError(f"{path}: malformed CSV ({exc})") from None
    return summary


def _flush(out, block, n_dense, n_fields):
    rows = len(block["label"])
    shapes = {"label": (rows,), "dense": (rows, n_dense), "categorical": (rows, n_fields)}
    for key, appender in out.items():
        if block[key]:
            appender.append(np.asarray(block[key]).reshape(shapes[key]))
        block[key].clear()
