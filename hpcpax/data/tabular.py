"""A CSV file to an ``hpcpax-ctr/1`` file, streamed in row blocks.

Categorical values are hashed: ``crc32(value as UTF-8, start=crc32(column
name + NUL)) % hash_buckets``. The column name salts the hash, so the same
string in two columns lands on unrelated ids, and the ids are the same in
every run, on every machine and in every later file hashed with the same
bucket count (an empty cell is hashed like any other string). Missing or
empty dense cells become 0; the label must be a number in [0, 1].
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


def csv_to_h5(path, output, label, categorical, dense=(), hash_buckets=DEFAULT_HASH_BUCKETS):
    """Convert a CSV file with a header row to ``hpcpax-ctr/1`` (written atomically).

    Args:
        path: input CSV (UTF-8, first row is the header).
        output: output HDF5 file.
        label: name of the label column.
        categorical: names of the categorical columns (at least one).
        dense: names of the dense columns (may be empty).
        hash_buckets: id space of every categorical field.

    Returns:
        dict summary: ``samples``, ``n_dense``, ``n_fields``, ``bytes``.

    Raises:
        DataError: missing file, unknown column (listing the available ones),
            ragged row, bad number, or no data rows.
    """
    categorical, dense = list(categorical), list(dense)
    if not categorical:
        raise DataError(f"{path}: at least one categorical column is needed")
    if hash_buckets < 1:
        raise DataError(f"--hash-buckets must be >= 1, not {hash_buckets}")
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file")
    try:
        with open(path, encoding="utf-8", newline="") as stream:
            rows = csv.reader(stream)
            header = next(rows, None)
            if header is None:
                raise DataError(f"{path}: empty file, no header row")
            label_index = _columns(header, [label], path, "label")[0]
            categorical_index = _columns(header, categorical, path, "categorical")
            dense_index = _columns(header, dense, path, "dense")
            salts = [_salt(name) for name in categorical]
            with atomic_h5(output) as h5file:
                h5file.attrs["format"] = FORMAT_CTR
                h5file.attrs["n_dense"] = np.int64(len(dense))
                h5file.attrs["n_fields"] = np.int64(len(categorical))
                h5file.attrs["cardinality"] = np.full(len(categorical), hash_buckets, np.int64)
                h5file.attrs["hash_buckets"] = np.int64(hash_buckets)
                h5file.attrs["label_column"] = label
                h5file.attrs["categorical_columns"] = categorical
                h5file.attrs["dense_columns"] = dense
                h5file.attrs["source"] = "hpcpax.data csv"
                out = {"label": Appender(h5file, "label", "float32"),
                       "dense": Appender(h5file, "dense", "float32", (len(dense),)),
                       "categorical": Appender(h5file, "categorical", "int64",
                                               (len(categorical),))}
                block = {key: [] for key in out}
                for line, row in enumerate(rows, start=2):
                    if not row:
                        continue  # csv yields [] for a blank line
                    if len(row) != len(header):
                        raise DataError(f"{path}: line {line} has {len(row)} fields, "
                                        f"the header has {len(header)}")
                    value = _number(row[label_index], path, line, label)
                    if not 0.0 <= value <= 1.0:
                        raise DataError(f"{path}: line {line}, column {label!r}: label "
                                        f"{value} is not in [0, 1]")
                    block["label"].append(value)
                    block["dense"].append([_number(row[i], path, line, header[i], 0.0)
                                           for i in dense_index])
                    block["categorical"].append(
                        [zlib.crc32(row[i].encode("utf-8"), salt) % hash_buckets
                         for i, salt in zip(categorical_index, salts)])
                    if len(block["label"]) >= _BLOCK_ROWS:
                        _flush(out, block, len(dense), len(categorical))
                _flush(out, block, len(dense), len(categorical))
                samples = out["label"].rows
                if samples == 0:
                    raise DataError(f"{path}: no data rows after the header")
                for appender in out.values():
                    appender.finish()
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc})") from None
    except csv.Error as exc:
        raise DataError(f"{path}: malformed CSV ({exc})") from None
    return {"samples": samples, "n_dense": len(dense), "n_fields": len(categorical),
            "bytes": os.path.getsize(output)}


def _flush(out, block, n_dense, n_fields):
    rows = len(block["label"])
    shapes = {"label": (rows,), "dense": (rows, n_dense), "categorical": (rows, n_fields)}
    for key, appender in out.items():
        if block[key]:
            appender.append(np.asarray(block[key]).reshape(shapes[key]))
        block[key].clear()
