"""``open_dataset``: one entry point for every reader, files and synthetic data."""

import os

from hpcpax.data.ctr import CTRDataset, SyntheticCTR
from hpcpax.data.layouts import open_h5, read_format
from hpcpax.data.lm import LMDataset, SyntheticLM
from hpcpax.errors import DataError

__all__ = ["open_dataset"]

_FILE_READERS = {"lm": LMDataset, "ctr": CTRDataset}
_SYNTHETIC_READERS = {"lm": SyntheticLM, "ctr": SyntheticCTR}


def open_dataset(path, kind=None, **options):
    """Open a data set for sharded batch reading. Not collective.

    Args:
        path: an ``hpcpax-lm/1`` or ``hpcpax-ctr/1`` HDF5 file, or the string
            ``"synthetic"`` for in-memory generated data (``kind`` required).
        kind: ``"lm"`` or ``"ctr"``; ``None`` takes it from the file's
            ``format`` attribute. A file of another kind raises.
        **options: passed to the reader: :class:`LMDataset` (``context``,
            ``shuffle``, ``seed``), :class:`CTRDataset` (``shuffle``, ``seed``),
            :class:`SyntheticLM` or :class:`SyntheticCTR`.

    Returns:
        A reader with ``num_samples``, ``batch(step, global_batch, shard,
        num_shards)``, ``validate(...)`` and ``close()``.

    Raises:
        DataError: missing or malformed file, or a kind that does not match it.
        ValueError: an unknown ``kind``.
    """
    if kind is not None and kind not in _FILE_READERS:
        raise ValueError(f"kind must be 'lm' or 'ctr', not {kind!r}")
    if isinstance(path, str) and path == "synthetic":
        if kind is None:
            raise ValueError("kind must be 'lm' or 'ctr' for synthetic data, not None")
        return _SYNTHETIC_READERS[kind](**options)
    name = os.fspath(path)
    with open_h5(name) as h5file:
        found = read_format(h5file, name)
    if kind is not None and found != kind:
        raise DataError(f"{name}: holds {found!r} data, but kind {kind!r} was asked for")
    return _FILE_READERS[found](name, **options)
