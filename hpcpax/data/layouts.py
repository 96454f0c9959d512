"""The two HDF5 layouts hpcpax reads, and the metadata checks run on open.

Both layouts are plain HDF5 (no pickled objects, no references): one file,
datasets at the root, attributes on the root group. Any HDF5 tool can read
them. Writers in :mod:`hpcpax.data.writing` produce them atomically.

Layout ``hpcpax-lm/1`` (language modelling: a token stream)
-----------------------------------------------------------
Root attributes:

- ``format`` (str): exactly ``"hpcpax-lm/1"``. Checked on open.
- ``vocab_size`` (integer scalar, >= 1): number of ids; equals ``len(vocab)``.
- optional, informational: ``source`` (str, the writer), ``lowercase`` (bool)
  and ``tokenizer`` (str) from the ``text`` converter, ``held_out_of`` (str,
  the training file a held-out split was cut from), ``seed`` and ``zipf``
  (``synth``).

Datasets:

- ``tokens``: int32 or int64, shape ``[T]``, ``T >= 1``. The concatenated token
  stream of all input documents (no separator tokens). Every id lies in
  ``[0, vocab_size)``. Uncompressed and contiguous as written by hpcpax
  (chunked when streamed with an unknown length); readers accept any layout
  h5py can slice, and read uncompressed ones through a memory map.
- ``vocab``: variable-length UTF-8 strings (``h5py.string_dtype("utf-8")``),
  shape ``[vocab_size]``, in id order: ``vocab[i]`` is the word of id ``i``.
  ``vocab[0] == "<unk>"`` (every out-of-vocabulary word maps to 0); entries
  are unique.

A reader with context length ``k`` has ``T - k`` samples; sample ``i`` is
``context = tokens[i : i+k]``, ``target = tokens[i+k]``.

Layout ``hpcpax-ctr/1`` (click-through rate: dense + categorical features)
-------------------------------------------------------------------------
Root attributes:

- ``format`` (str): exactly ``"hpcpax-ctr/1"``. Checked on open.
- ``n_dense`` (integer scalar, >= 0): number of dense features.
- ``n_fields`` (integer scalar, >= 1): number of categorical fields.
- ``cardinality`` (optional, int64 array ``[n_fields]``): the id space of
  each field: every id of field ``f`` is ``< cardinality[f]``, so a table for
  field ``f`` needs ``cardinality[f]`` rows. The ``csv`` converter writes the
  hash bucket count for every field (ids seen later in other files land in
  the same space); ``synth`` writes its configured cardinalities; a file
  written from arrays without it gets ``max id + 1`` per field.
- optional, informational: ``hash_buckets`` (int), ``label_column`` (str),
  ``dense_columns``/``categorical_columns`` (str arrays), ``source``, ``seed``,
  ``held_out_of``.

Datasets (``N >= 1`` rows, row ``i`` is sample ``i``):

- ``label``: float32, shape ``[N]``, values in ``[0, 1]``.
- ``dense``: float32, shape ``[N, n_dense]``, finite.
- ``categorical``: int64, shape ``[N, n_fields]``, already hashed/encoded ids,
  ``>= 0`` (and below ``cardinality`` when present).

Checks
------
Opening a file checks metadata only (format, datasets present, dtypes,
shapes, attributes): cheap on any size. ``validate()`` on a reader also scans
the values (id ranges, finiteness) in bounded chunks, never the whole file
at once. Every problem raises :class:`~hpcpax.errors.DataError` naming the
file and the field.
"""

import os

import h5py
import numpy as np

from hpcpax.errors import DataError

__all__ = ["FORMAT_LM", "FORMAT_CTR", "UNKNOWN_WORD", "open_h5", "read_format", "expect_format",
           "check_lm", "check_ctr"]

FORMAT_LM = "hpcpax-lm/1"
FORMAT_CTR = "hpcpax-ctr/1"
UNKNOWN_WORD = "<unk>"
_FORMATS = {"lm": FORMAT_LM, "ctr": FORMAT_CTR}


def open_h5(path):
    """Open ``path`` read-only as HDF5; every failure becomes a DataError naming the file."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"{path}: no such file")
    if os.path.isdir(path):
        raise DataError(f"{path}: is a directory, not an HDF5 file")
    try:
        h5file = h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path}: not a readable HDF5 file (truncated or corrupted?): {exc}") \
            from exc
    found = find_link(h5file)
    if found is not None:
        h5file.close()
        raise DataError(f"{path}: {found[0]!r} is a {type(found[1]).__name__} to "
                        f"{link_target(found[1])!r}; data files hold plain datasets only")
    return h5file


def find_link(h5file):
    """``(name, link)`` of the first soft or external link in an open HDF5 file, or None.

    Such a link would make a file read data from elsewhere (another file, or a
    name that a hash of the file does not cover). Not collective.
    """
    def check(name, link):  # a non-None return stops the visit
        return None if isinstance(link, h5py.HardLink) else (name, link)

    return h5file.visititems_links(check)


def link_target(link) -> str:
    """Where a soft or external link points."""
    return f"{getattr(link, 'filename', '')}:{link.path}".lstrip(":")


def _attr_text(value):
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) else None


def read_format(h5file, name):
    """Return the kind (``"lm"`` or ``"ctr"``) named by the file's ``format`` attribute."""
    raw = h5file.attrs.get("format")
    text = _attr_text(raw)
    if text is None:
        raise DataError(f"{name}: no 'format' attribute; expected one of "
                        f"{sorted(_FORMATS.values())} (not an hpcpax data file?)")
    for kind, expected in _FORMATS.items():
        if text == expected:
            return kind
        family = expected.split("/")[0] + "/"
        if text.startswith(family):
            raise DataError(f"{name}: format {text!r} is an unsupported version; "
                            f"this hpcpax reads {expected!r}")
    raise DataError(f"{name}: format attribute is {text!r}, expected one of "
                    f"{sorted(_FORMATS.values())}")


def expect_format(h5file, name, kind):
    """Raise DataError unless ``h5file`` holds data of format ``kind`` (named)."""
    found = read_format(h5file, name)
    if found != kind:
        raise DataError(f"{name}: holds {_FORMATS[found]!r} data, not {_FORMATS[kind]!r}")


def _dataset(h5file, key, name):
    if key not in h5file:
        present = sorted(h5file.keys())
        raise DataError(f"{name}: missing dataset {key!r} (present: {present})")
    node = h5file[key]
    if not isinstance(node, h5py.Dataset):
        raise DataError(f"{name}: {key!r} is a group, not a dataset")
    return node


def _int_attr(h5file, key, name, minimum):
    if key not in h5file.attrs:
        raise DataError(f"{name}: missing attribute {key!r}")
    value = np.asarray(h5file.attrs[key])
    if value.shape != () or value.dtype.kind not in "iu":
        raise DataError(f"{name}: attribute {key!r} must be an integer scalar, not {value!r}")
    if int(value) < minimum:
        raise DataError(f"{name}: attribute {key!r} must be >= {minimum}, not {int(value)}")
    return int(value)


def _expect_dtype(dataset, allowed, name):
    if dataset.dtype not in [np.dtype(t) for t in allowed]:
        wanted = " or ".join(np.dtype(t).name for t in allowed)
        raise DataError(f"{name}: dataset {dataset.name.lstrip('/')!r} must be {wanted}, "
                        f"not {dataset.dtype}")


def check_lm(h5file, name):
    """Check an ``hpcpax-lm/1`` file's metadata; return ``(tokens_dataset, vocab_size)``."""
    expect_format(h5file, name, "lm")
    vocab_size = _int_attr(h5file, "vocab_size", name, 1)
    tokens = _dataset(h5file, "tokens", name)
    _expect_dtype(tokens, (np.int32, np.int64), name)
    if tokens.ndim != 1:
        raise DataError(f"{name}: dataset 'tokens' must be 1-D, not shape {tokens.shape}")
    if tokens.shape[0] == 0:
        raise DataError(f"{name}: dataset 'tokens' is empty")
    vocab = _dataset(h5file, "vocab", name)
    string_info = h5py.check_string_dtype(vocab.dtype)
    if string_info is None or string_info.length is not None:
        raise DataError(f"{name}: dataset 'vocab' must hold variable-length UTF-8 strings, "
                        f"not {vocab.dtype}")
    if vocab.shape != (vocab_size,):
        raise DataError(f"{name}: dataset 'vocab' has shape {vocab.shape}, but attribute "
                        f"vocab_size is {vocab_size}")
    return tokens, vocab_size


def check_ctr(h5file, name):
    """Check an ``hpcpax-ctr/1`` file's metadata.

    Returns:
        ``(label, dense, categorical, cardinality)``: three h5py datasets and an
        int64 array or ``None``.
    """
    expect_format(h5file, name, "ctr")
    n_dense = _int_attr(h5file, "n_dense", name, 0)
    n_fields = _int_attr(h5file, "n_fields", name, 1)
    label = _dataset(h5file, "label", name)
    dense = _dataset(h5file, "dense", name)
    categorical = _dataset(h5file, "categorical", name)
    _expect_dtype(label, (np.float32,), name)
    _expect_dtype(dense, (np.float32,), name)
    _expect_dtype(categorical, (np.int64,), name)
    if label.ndim != 1 or label.shape[0] == 0:
        raise DataError(f"{name}: dataset 'label' must be 1-D and non-empty, "
                        f"not shape {label.shape}")
    rows = label.shape[0]
    if dense.shape != (rows, n_dense):
        raise DataError(f"{name}: dataset 'dense' has shape {dense.shape}, expected "
                        f"({rows}, {n_dense}) from label rows and attribute n_dense")
    if categorical.shape != (rows, n_fields):
        raise DataError(f"{name}: dataset 'categorical' has shape {categorical.shape}, "
                        f"expected ({rows}, {n_fields}) from label rows and attribute n_fields")
    cardinality = None
    if "cardinality" in h5file.attrs:
        cardinality = np.asarray(h5file.attrs["cardinality"])
        if cardinality.dtype.kind not in "iu" or cardinality.shape != (n_fields,):
            raise DataError(f"{name}: attribute 'cardinality' must be int64 [{n_fields}], "
                            f"not {cardinality.dtype} {cardinality.shape}")
        if (cardinality < 1).any():
            raise DataError(f"{name}: attribute 'cardinality' holds values below 1: "
                            f"{cardinality.tolist()}")
        cardinality = cardinality.astype(np.int64)
    return label, dense, categorical, cardinality
