"""Writing the hpcpax HDF5 layouts atomically, whole or streamed in chunks.

A file appears under its final name only once complete: it is written to a
temporary name in the same folder and moved with ``os.replace``, so a reader
never sees half a file and a crash leaves the old file (if any) in place.
HDF5 creates the file with mode 0666 filtered by the user's umask, like
``open``. Nothing is pickled.
"""

import contextlib
import os
import uuid

import h5py
import numpy as np

from hpcpax.data.layouts import FORMAT_CTR, FORMAT_LM, UNKNOWN_WORD
from hpcpax.errors import DataError

__all__ = ["atomic_h5", "Appender", "write_lm", "write_ctr"]

_CHUNK_BYTES = 1 << 20  # chunks of streams of unknown length: big enough for sequential reads


@contextlib.contextmanager
def atomic_h5(path):
    """Yield an ``h5py.File`` open for writing that is moved to ``path`` on success.

    On an exception the temporary file is removed and ``path`` is untouched.
    """
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise DataError(f"{path}: folder {folder} does not exist")
    temporary = os.path.join(folder, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:12]}")
    try:
        with h5py.File(temporary, "w") as h5file:
            yield h5file
        os.replace(temporary, path)
    finally:
        if os.path.exists(temporary):
            os.remove(temporary)


class Appender:
    """A dataset of rows ``[n, *row_shape]`` filled by successive appends.

    With ``total_rows`` known (the converters count first) the dataset is
    contiguous and exactly that long: random reads of windows or rows then
    touch only the bytes they need (see :mod:`hpcpax.data.mapping`).
    Otherwise it grows, in chunks no larger than the first append (a small
    file written in one append stays small). Call :meth:`finish` once after
    the last append.
    """

    def __init__(self, h5file, key, dtype, row_shape=(), total_rows=None):
        self.h5file, self.key, self.dtype, self.row_shape = h5file, key, np.dtype(dtype), row_shape
        self.rows = 0
        self.dataset = None
        self.total_rows = total_rows
        self._row_elements = int(np.prod(row_shape, dtype=np.int64))
        if total_rows is not None:
            self.dataset = h5file.create_dataset(key, shape=(total_rows, *row_shape),
                                                 dtype=self.dtype)

    def append(self, values):
        """Append ``values`` (rows of the dataset's dtype) to the dataset, growing it."""
        values = np.asarray(values, dtype=self.dtype)
        if len(values) == 0:
            return
        if self.total_rows is not None:
            if self.rows + len(values) > self.total_rows:
                raise DataError(f"dataset {self.key!r}: more than the {self.total_rows} rows "
                                f"counted before writing (did an input change?)")
            self.dataset[self.rows:self.rows + len(values)] = values
            self.rows += len(values)
            return
        if self._row_elements == 0:  # HDF5 cannot chunk a zero-width row: made in finish()
            self.rows += len(values)
            return
        if self.dataset is None:
            chunk_rows = max(1, _CHUNK_BYTES // (self._row_elements * self.dtype.itemsize))
            self.dataset = self.h5file.create_dataset(
                self.key, shape=(0, *self.row_shape), maxshape=(None, *self.row_shape),
                dtype=self.dtype, chunks=(min(chunk_rows, len(values)), *self.row_shape))
        self.dataset.resize(self.rows + len(values), axis=0)
        self.dataset[self.rows:self.rows + len(values)] = values
        self.rows += len(values)

    def finish(self):
        """The dataset (created empty if nothing was appended); DataError if a counted total
        was not met."""
        if self.total_rows is not None and self.rows != self.total_rows:
            raise DataError(f"dataset {self.key!r}: {self.rows} rows written, "
                            f"{self.total_rows} counted before writing (did an input change?)")
        if self.dataset is None:
            self.dataset = self.h5file.create_dataset(
                self.key, shape=(self.rows, *self.row_shape), dtype=self.dtype)
        return self.dataset


def write_vocab(h5file, vocab):
    """Store ``vocab`` (``<unk>`` at id 0) as the file's ``vocab`` dataset."""
    words = list(vocab)
    if not words or words[0] != UNKNOWN_WORD:
        raise DataError(f"vocabulary must start with {UNKNOWN_WORD!r} at id 0")
    if len(set(words)) != len(words):
        raise DataError("vocabulary holds duplicate words")
    h5file.create_dataset("vocab", data=np.array(words, dtype=object),
                          dtype=h5py.string_dtype("utf-8"))
    h5file.attrs["vocab_size"] = np.int64(len(words))


def write_lm(path, tokens, vocab, attrs=None):
    """Write an ``hpcpax-lm/1`` file from in-memory arrays, atomically.

    Args:
        path: output file.
        tokens: 1-D integer array of ids in ``[0, len(vocab))``; stored as int32
            when ``len(vocab) < 2**31``, else int64.
        vocab: sequence of str in id order, ``vocab[0] == "<unk>"``.
        attrs: optional extra root attributes (informational).

    Returns:
        The size of the written file in bytes.
    """
    tokens = np.asarray(tokens)
    vocab = list(vocab)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu" or tokens.size == 0:
        raise DataError(f"{path}: tokens must be a non-empty 1-D integer array, "
                        f"not {tokens.dtype} {tokens.shape}")
    if tokens.min() < 0 or tokens.max() >= len(vocab):
        raise DataError(f"{path}: token ids must lie in [0, {len(vocab)}), found "
                        f"[{tokens.min()}, {tokens.max()}]")
    dtype = np.int32 if len(vocab) < 2**31 else np.int64
    with atomic_h5(path) as h5file:
        h5file.attrs["format"] = FORMAT_LM
        for key, value in (attrs or {}).items():
            h5file.attrs[key] = value
        write_vocab(h5file, vocab)
        h5file.create_dataset("tokens", data=tokens.astype(dtype, copy=False))
    return os.path.getsize(path)


def write_ctr(path, label, dense, categorical, cardinality=None, attrs=None):
    """Write an ``hpcpax-ctr/1`` file from in-memory arrays, atomically.

    Args:
        path: output file.
        label: ``[N]`` values in ``[0, 1]`` (stored float32).
        dense: ``[N, n_dense]`` (stored float32).
        categorical: ``[N, n_fields]`` non-negative ids (stored int64).
        cardinality: optional ``[n_fields]`` id space per field; defaults to
            ``max id + 1`` per field.
        attrs: optional extra root attributes (informational).

    Returns:
        The size of the written file in bytes.
    """
    label = np.asarray(label, dtype=np.float32)
    dense = np.asarray(dense, dtype=np.float32)
    categorical = np.asarray(categorical)
    if categorical.ndim != 2 or categorical.dtype.kind not in "iu":
        raise DataError(f"{path}: categorical must be a 2-D integer array, "
                        f"not {categorical.dtype} {categorical.shape}")
    rows, n_fields = categorical.shape
    if label.shape != (rows,) or dense.ndim != 2 or dense.shape[0] != rows or rows == 0:
        raise DataError(f"{path}: label {label.shape}, dense {dense.shape} and categorical "
                        f"{categorical.shape} must share a non-zero first dimension")
    if n_fields == 0:
        raise DataError(f"{path}: categorical must have at least one field")
    if categorical.min() < 0:
        raise DataError(f"{path}: categorical ids must be >= 0, found {categorical.min()}")
    observed = categorical.max(axis=0).astype(np.int64) + 1
    if cardinality is None:
        cardinality = observed
    cardinality = np.asarray(cardinality, dtype=np.int64)
    if cardinality.shape != (n_fields,) or (observed > cardinality).any():
        raise DataError(f"{path}: cardinality {cardinality.tolist()} must have {n_fields} "
                        f"entries, each above the field's largest id {(observed - 1).tolist()}")
    with atomic_h5(path) as h5file:
        h5file.attrs["format"] = FORMAT_CTR
        h5file.attrs["n_dense"] = np.int64(dense.shape[1])
        h5file.attrs["n_fields"] = np.int64(n_fields)
        h5file.attrs["cardinality"] = cardinality
        for key, value in (attrs or {}).items():
            h5file.attrs[key] = value
        h5file.create_dataset("label", data=label)
        h5file.create_dataset("dense", data=dense)
        h5file.create_dataset("categorical", data=categorical.astype(np.int64, copy=False))
    return os.path.getsize(path)
