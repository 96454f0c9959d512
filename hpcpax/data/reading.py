"""What every reader shares: slice-only reads, the batch API, chunked value scans.

A rank reads only the rows its shard needs. In-memory arrays and memory-mapped
files (:mod:`hpcpax.data.mapping`: every uncompressed dataset) are gathered
with one NumPy fancy index. Other HDF5 datasets (compressed ones) go through
h5py: the sorted row windows are merged into runs (windows closer than
``COALESCE_BYTES`` share one run, since one larger read costs less than two
small ones); long runs are read as one h5py slice each, many short ones as
one sorted fancy-index read.

A reader may be a *span* of its storage (tokens or rows ``[first, stop)``):
:meth:`ShardedReader.split_tail` cuts a held-out tail that training never reads.
"""

import contextlib
import copy
import operator

import numpy as np

from hpcpax.data.mapping import MappedRows
from hpcpax.data.sampling import check_geometry, sample_index_block, sample_indices, sample_range
from hpcpax.errors import DataError

__all__ = ["COALESCE_BYTES", "SCAN_BYTES", "plan_runs", "read_runs", "gather_windows",
           "scan_chunks", "ShardedReader"]

COALESCE_BYTES = 4 << 10  # a gap this small costs less to read than one more h5py call (~10 us)
_FANCY_ROWS_PER_RUN = 16  # below this many rows per run, one fancy read beats a slice per run
SCAN_BYTES = 16 << 20  # chunk size of validate() scans: bounded memory on any file size
INDEX_BLOCK_SAMPLES = 1 << 16  # shuffled indices are computed for this many samples at a time


def plan_runs(starts, width, gap_rows):
    """Merge windows ``[start, start+width)`` (``starts`` sorted) into contiguous runs.

    Returns:
        ``(run_starts, run_ends, offsets)``: int64 arrays; ``offsets[j]`` is where
        window ``j`` begins in the concatenation of all runs.
    """
    starts = np.asarray(starts, dtype=np.int64)
    ends = starts + width
    reach = np.maximum.accumulate(ends)
    opens = np.empty(len(starts), dtype=bool)
    opens[:1] = True
    opens[1:] = starts[1:] > reach[:-1] + gap_rows
    first = np.flatnonzero(opens)
    run_starts = starts[first]
    run_ends = np.maximum.reduceat(ends, first)
    run_of = np.cumsum(opens) - 1
    run_base = np.concatenate(([0], np.cumsum(run_ends - run_starts)[:-1]))
    offsets = run_base[run_of] + (starts - run_starts[run_of])
    return run_starts, run_ends, offsets


def read_runs(array, run_starts, run_ends):
    """Read rows ``[a, b)`` of every run, concatenated along axis 0.

    Many short runs (shuffled CTR rows) go as one sorted fancy-index read;
    long runs (LM windows, sequential batches) as one slice each: h5py spends
    about 10 us per slice call but about 0.5 us per fancy-indexed row.
    """
    lengths = run_ends - run_starts
    total = int(lengths.sum())
    if len(lengths) > 1 and total <= _FANCY_ROWS_PER_RUN * len(lengths):
        rows = np.repeat(run_starts - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
        return array[rows]
    parts = [array[int(a):int(b)] for a, b in zip(run_starts, run_ends)]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def gather_windows(array, starts, width, row_bytes):
    """Rows ``array[s : s+width]`` for each ``s`` in ``starts`` (any order), reading only those.

    Returns:
        An array ``[len(starts), width, *row_shape]`` in the order of ``starts``.
    """
    starts = np.asarray(starts, dtype=np.int64)
    if isinstance(array, (np.ndarray, MappedRows)):  # no per-call cost: one gather
        rows = (starts[:, None] + np.arange(width)).reshape(-1)
        taken = array.take(rows, axis=0) if isinstance(array, np.ndarray) else array.take(rows)
        return taken.reshape((len(starts), width) + tuple(array.shape[1:]))
    order = np.argsort(starts, kind="stable")
    run_starts, run_ends, offsets = plan_runs(starts[order], width, COALESCE_BYTES // row_bytes)
    buffer = read_runs(array, run_starts, run_ends)
    windows = buffer[offsets[:, None] + np.arange(width)]
    result = np.empty_like(windows)
    result[order] = windows
    return result


def scan_chunks(array, row_bytes, start=0, stop=None):
    """Yield ``(first_row, block)`` over rows ``[start, stop)`` of ``array`` in blocks of
    about ``SCAN_BYTES``."""
    stop = len(array) if stop is None else stop
    rows = max(1, SCAN_BYTES // max(1, row_bytes))
    for first in range(start, stop, rows):
        yield first, np.asarray(array[first:min(first + rows, stop)])


class ShardedReader:
    """Base of every reader: a stateless map from ``(step, shard)`` to a batch.

    There is no cursor. ``batch(step, ...)`` depends only on its arguments and
    the reader's ``shuffle``/``seed``, so resuming from a checkpoint at step
    ``s`` means calling ``batch(s, ...)`` again: no data state to save.
    Subclasses set ``name``, ``num_samples`` and ``_span`` (the storage units,
    tokens or rows, they read) and define ``_read(indices)`` and
    ``_set_span(first, stop)``.
    """

    kind = None
    unit = "rows"  # what a span counts

    def __init__(self, name, num_samples, shuffle, seed):
        self.name = name
        self.source = name  # the file (or synthetic source), also in a view's name
        self._owner = True  # views made by split_tail share the file and never close it
        self.num_samples = int(num_samples)
        self.shuffle = bool(shuffle)
        self.seed = operator.index(seed) if isinstance(seed, (int, np.integer)) else seed
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an int >= 0, not {seed!r}")
        if self.num_samples <= 0:
            raise DataError(f"{name}: holds no samples")

    def sample_indices(self, step, global_batch, shard=0, num_shards=1):
        """Sample indices this shard reads at ``step``, in batch order (int64 array).

        Not collective. Raises DataError for an uneven split or an empty shard.
        Shuffled indices are computed for a block of steps at once and kept
        (one block, a few KiB): still a pure function of the arguments.
        """
        if not self.shuffle:
            return sample_indices(step, global_batch, shard, num_shards, self.num_samples,
                                  False, self.seed, self.name)
        local = check_geometry(step, global_batch, shard, num_shards, self.num_samples,
                               self.name)
        # A block spans at most about two epochs: one permutation each.
        steps = max(1, min(4096, INDEX_BLOCK_SAMPLES // local,
                           self.num_samples // global_batch))
        first = step - step % steps
        key = (first, steps, global_batch, shard, num_shards, self.num_samples, self.seed)
        cached = getattr(self, "_index_block", None)
        if cached is None or cached[0] != key:
            try:
                block = sample_index_block(first, steps, global_batch, shard, num_shards,
                                           self.num_samples, True, self.seed, self.name)
            except DataError:  # a block reaching past the int64 positions: this step alone
                return sample_indices(step, global_batch, shard, num_shards, self.num_samples,
                                      True, self.seed, self.name)
            cached = self._index_block = (key, block)
        return cached[1][step - first].copy()

    def batch(self, step, global_batch, shard=0, num_shards=1):
        """The slice of step ``step``'s global batch that ``shard`` of ``num_shards`` owns.

        Not collective; host NumPy arrays. The global batch of step ``s`` is
        samples ``[s*G, (s+1)*G)`` modulo ``num_samples`` (epochs wrap), mapped
        through the per-epoch permutation when ``shuffle`` is on; shard ``r``
        gets the ``r``-th of ``num_shards`` equal contiguous parts.

        Returns:
            dict of NumPy arrays with leading dimension ``global_batch // num_shards``.

        Raises:
            DataError: ``global_batch`` not divisible by ``num_shards``, an empty
                shard, fewer samples than one global batch, an unreadable file,
                or a value out of range in the batch (named with its position).
        """
        indices = self.sample_indices(step, global_batch, shard, num_shards)
        with self._reading():
            batch = self._read(indices)
        self._check_batch(batch, indices)
        return batch

    def batch_range(self, step, global_batch, start, stop):
        """Samples ``[start, stop)`` of step ``step``'s global batch (an uneven share).

        Not collective; host NumPy arrays with leading dimension
        ``stop - start``. The ranges of every worker, in order, hold the
        same samples as :meth:`batch`'s even shards: balanced BSP changes
        which worker reads a sample, never the global batch.

        Raises:
            DataError: a range outside ``[0, global_batch)`` or empty, fewer
                samples than one global batch, an unreadable file, or a bad
                value in the batch.
        """
        indices = sample_range(step, global_batch, start, stop, self.num_samples, self.shuffle,
                               self.seed, self.name)
        with self._reading():
            batch = self._read(indices)
        self._check_batch(batch, indices)
        return batch

    def _check_batch(self, batch, indices) -> None:
        """Raise :class:`~hpcpax.errors.DataError` for a value no model may train on
        (cheap: a pass over the batch), naming the file and the position."""

    @contextlib.contextmanager
    def _reading(self):
        try:
            yield
        except OSError as exc:  # h5py reports damaged chunks and truncated files as OSError
            raise DataError(f"{self.name}: read failed (corrupted or truncated file?): {exc}") \
                from exc

    def _read(self, indices):
        raise NotImplementedError

    def _set_span(self, first, stop):
        raise NotImplementedError

    @property
    def span(self):
        """``(first, stop)``: the storage units (tokens for lm, rows for ctr) this reader reads."""
        return self._span

    def split_tail(self, fraction):
        """``(head, tail)``: readers of the first ``1 - fraction`` and the last ``fraction``
        of this reader's span, sharing its storage. Not collective.

        No sample of ``head`` reads a token or row of ``tail`` (an lm sample's
        window lies inside its reader's span), so ``tail`` is a held-out set.
        Both keep this reader's ``shuffle`` and ``seed``; closing a view is a
        no-op (the reader it came from owns the file).

        Raises:
            ValueError: ``fraction`` not in (0, 1).
            DataError: a part too small to hold one sample.
        """
        if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
                or not 0 < fraction < 1:
            raise ValueError(f"fraction must be a float in (0, 1), not {fraction!r}")
        first, stop = self._span
        boundary = stop - int(round((stop - first) * fraction))
        return self._view(first, boundary), self._view(boundary, stop)

    def _view(self, first, stop):
        view = copy.copy(self)
        view._owner = False
        view.name = f"{self.source} ({self.unit} {first}:{stop})"
        view._set_span(first, stop)
        return view

    def close(self):
        """Release the file handle (no-op for in-memory data and for views)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}({self.name!r}, num_samples={self.num_samples}, "
                f"shuffle={self.shuffle}, seed={self.seed})")
