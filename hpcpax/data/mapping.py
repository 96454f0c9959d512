"""Random reads of uncompressed HDF5 datasets through a memory map of the file.

A shuffled batch reads many short, scattered windows. Through h5py each one
costs a call (about 10 us) and, in a chunked dataset, a whole chunk through
the chunk cache (1 MiB chunks against h5py's 8 MiB cache: about one chunk read
per window). An uncompressed dataset's bytes lie at fixed places in the file,
contiguous or one block per chunk, so :func:`map_dataset` maps the file once
and a batch becomes one NumPy fancy-index gather over the OS page cache.

Only plain layouts are mapped: the default file driver, no filters, every
chunk allocated, in bounds and full-sized, chunks cut along the first axis
only. Anything else (compressed data, a truncated file) keeps the h5py path.
The map is checked against h5py reads of sample rows before it is used.
"""

import os

import h5py
import numpy as np

__all__ = ["MappedRows", "map_dataset"]

_CHECK_ROWS = 8  # rows per chunk compared with h5py when a map is made


class MappedRows:
    """Rows ``[n, *row_shape]`` of a dataset, read from a memory map of its file.

    Supports ``len``, ``shape``, ``dtype``, ``ndim``, slicing and indexing by an
    int array along the first axis, like the h5py dataset it stands for.
    Results are native-endian NumPy arrays (copies, never views of the map).
    """

    def __init__(self, view, chunk_base, chunk_rows, shape, dtype):
        self._view = view  # typed memmap of the file, starting at a byte residue
        self._chunk_base = np.asarray(chunk_base, dtype=np.int64)
        self._chunk_rows = int(chunk_rows)
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype).newbyteorder("=")
        self.ndim = len(self.shape)
        self._row_elements = int(np.prod(self.shape[1:], dtype=np.int64))

    def __len__(self):
        return self.shape[0]

    def _elements(self, rows):
        """First element (in the typed view) of each row."""
        rows = np.asarray(rows, dtype=np.int64)
        if len(self._chunk_base) == 1:
            return self._chunk_base[0] + rows * self._row_elements
        chunk = rows // self._chunk_rows
        return self._chunk_base[chunk] + (rows - chunk * self._chunk_rows) * self._row_elements

    def take(self, rows):
        """Rows ``rows`` (int array, any order, repeats allowed), as ``[len(rows), *row_shape]``."""
        rows = np.asarray(rows, dtype=np.int64).reshape(-1)
        if rows.size and (rows.min() < 0 or rows.max() >= self.shape[0]):
            raise IndexError(f"rows must lie in [0, {self.shape[0]}), not "
                             f"[{rows.min()}, {rows.max()}]")
        first = self._elements(rows)
        if self._row_elements != 1:
            first = first[:, None] + np.arange(self._row_elements)
        out = self._view[first].reshape((len(rows),) + self.shape[1:])
        return out.astype(self.dtype, copy=False)

    def _slice(self, start, stop):
        if stop <= start:
            return np.empty((0,) + self.shape[1:], self.dtype)
        parts, row = [], start
        while row < stop:  # one piece per chunk the slice crosses
            end = min(stop, (row // self._chunk_rows + 1) * self._chunk_rows)
            first = int(self._elements(np.array([row]))[0])
            parts.append(self._view[first:first + (end - row) * self._row_elements])
            row = end
        flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
        return flat.reshape((stop - start,) + self.shape[1:]).astype(self.dtype, copy=True)

    def __getitem__(self, key):
        if isinstance(key, slice):
            start, stop, stride = key.indices(self.shape[0])
            if stride != 1:
                return self.take(np.arange(start, stop, stride))
            return self._slice(start, stop)
        if isinstance(key, (int, np.integer)):
            return self.take([int(key)])[0]
        return self.take(key)


def _chunk_table(dataset):
    """``(byte offsets, rows per chunk)`` of a dataset's data blocks, or None."""
    plist = dataset.id.get_create_plist()
    layout = plist.get_layout()
    row_bytes = dataset.dtype.itemsize * int(np.prod(dataset.shape[1:], dtype=np.int64))
    if layout == h5py.h5d.CONTIGUOUS:
        offset = dataset.id.get_offset()
        return (None if offset is None else (np.array([offset], np.int64), dataset.shape[0]),
                row_bytes)
    if layout != h5py.h5d.CHUNKED or tuple(dataset.chunks[1:]) != tuple(dataset.shape[1:]):
        return None, row_bytes
    chunk_rows = dataset.chunks[0]
    found = []
    dataset.id.chunk_iter(lambda info: found.append(
        (info.chunk_offset[0], info.byte_offset, info.size, info.filter_mask)))
    expected = -(-dataset.shape[0] // chunk_rows)
    if len(found) != expected:
        return None, row_bytes  # unallocated chunks read as the fill value: keep h5py
    found.sort()
    starts = np.array([f[0] for f in found], np.int64)
    if not np.array_equal(starts, np.arange(expected, dtype=np.int64) * chunk_rows):
        return None, row_bytes
    if any(size != chunk_rows * row_bytes or mask for _, _, size, mask in found):
        return None, row_bytes
    return (np.array([f[1] for f in found], np.int64), chunk_rows), row_bytes


def _sample_rows(length, chunk_rows):
    """A few rows of every chunk (first, last, middle), for the map check."""
    firsts = np.arange(0, length, chunk_rows, dtype=np.int64)
    picks = [firsts, np.minimum(firsts + chunk_rows - 1, length - 1),
             np.minimum(firsts + chunk_rows // 2, length - 1)]
    rows = np.unique(np.concatenate(picks))
    if len(rows) > _CHECK_ROWS * 64:
        rows = rows[np.linspace(0, len(rows) - 1, _CHECK_ROWS * 64).astype(np.int64)]
    return rows


def map_dataset(dataset):
    """A :class:`MappedRows` for an h5py dataset, or None where only h5py can read it.

    Not collective. The map is used only if sample rows read through it
    equal h5py's reads of the same rows.
    """
    try:
        if dataset.file.driver != "sec2" or dataset.ndim < 1 or dataset.shape[0] == 0:
            return None
        if dataset.id.get_create_plist().get_nfilters() or dataset.dtype.kind not in "iuf":
            return None
        path = dataset.file.filename
        table, row_bytes = _chunk_table(dataset)
        if table is None or row_bytes == 0:
            return None
        offsets, chunk_rows = table
        file_bytes = os.path.getsize(path)
        sizes = np.minimum(chunk_rows, dataset.shape[0]) * row_bytes
        if (offsets < 0).any() or (offsets + sizes > file_bytes).any():
            return None  # a truncated or damaged file: h5py reports it properly
        itemsize = dataset.dtype.itemsize
        residues = np.unique(offsets % itemsize)
        if len(residues) != 1:
            return None
        residue = int(residues[0])
        view = np.memmap(path, dtype=dataset.dtype, mode="r", offset=residue,
                         shape=((file_bytes - residue) // itemsize,))
        mapped = MappedRows(view, (offsets - residue) // itemsize, chunk_rows, dataset.shape,
                            dataset.dtype)
        rows = _sample_rows(dataset.shape[0], chunk_rows)
        expected = np.asarray(dataset[rows]).astype(mapped.dtype, copy=False)
        if mapped.take(rows).tobytes() != expected.tobytes():
            return None
        return mapped
    except (OSError, ValueError, AttributeError, TypeError):
        return None
