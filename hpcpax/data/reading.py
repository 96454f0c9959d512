"""What every reader shares: slice-only reads, the batch API, chunked value scans.

A rank reads only the rows its shard needs: the sorted row windows are merged
into runs (windows closer than ``COALESCE_BYTES`` share one run, since one
larger read costs less than two small ones); long runs are read as one h5py
slice each, many short ones as one sorted fancy-index read. The same code
serves HDF5 datasets and in-memory NumPy arrays.
"""

import contextlib
import operator

import numpy as np

from hpcpax.data.sampling import sample_indices
from hpcpax.errors import DataError

__all__ = ["COALESCE_BYTES", "SCAN_BYTES", "plan_runs", "read_runs", "gather_windows",
           "scan_chunks", "ShardedReader"]

COALESCE_BYTES = 4 << 10  # a gap this small costs less to read than one more h5py call (~10 us)
_FANCY_ROWS_PER_RUN = 16  # below this many rows per run, one fancy read beats a slice per run
SCAN_BYTES = 16 << 20  # chunk size of validate() scans: bounded memory on any file size


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
    order = np.argsort(starts, kind="stable")
    run_starts, run_ends, offsets = plan_runs(starts[order], width, COALESCE_BYTES // row_bytes)
    buffer = read_runs(array, run_starts, run_ends)
    windows = buffer[offsets[:, None] + np.arange(width)]
    result = np.empty_like(windows)
    result[order] = windows
    return result


def scan_chunks(array, row_bytes):
    """Yield ``(first_row, block)`` over ``array`` in blocks of about ``SCAN_BYTES``."""
    rows = max(1, SCAN_BYTES // max(1, row_bytes))
    for first in range(0, len(array), rows):
        yield first, np.asarray(array[first:first + rows])


class ShardedReader:
    """Base of every reader: a stateless map from ``(step, shard)`` to a batch.

    There is no cursor. ``batch(step, ...)`` depends only on its arguments and
    the reader's ``shuffle``/``seed``, so resuming from a checkpoint at step
    ``s`` means calling ``batch(s, ...)`` again: no data state to save.
    Subclasses set ``name`` and ``num_samples`` and define ``_read(indices)``.
    """

    kind = None

    def __init__(self, name, num_samples, shuffle, seed):
        self.name = name
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
        """
        return sample_indices(step, global_batch, shard, num_shards, self.num_samples,
                              self.shuffle, self.seed, self.name)

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
                shard, fewer samples than one global batch, or an unreadable file.
        """
        indices = self.sample_indices(step, global_batch, shard, num_shards)
        with self._reading():
            return self._read(indices)

    @contextlib.contextmanager
    def _reading(self):
        try:
            yield
        except OSError as exc:  # h5py reports damaged chunks and truncated files as OSError
            raise DataError(f"{self.name}: read failed (corrupted or truncated file?): {exc}") \
                from exc

    def _read(self, indices):
        raise NotImplementedError

    def close(self):
        """Release the file handle (no-op for in-memory data)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()

    def __repr__(self):
        return (f"{type(self).__name__}({self.name!r}, num_samples={self.num_samples}, "
                f"shuffle={self.shuffle}, seed={self.seed})")
