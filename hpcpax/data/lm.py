"""Language-model readers: an ``hpcpax-lm/1`` file, or a synthetic stream in memory.

Sample ``i`` of a stream with context length ``k`` is ``context =
tokens[i : i+k]``, ``target = tokens[i+k]``, for ``i`` in ``[0, T-k)``.
Batches are ``{"context": int64 [B, k], "target": int64 [B]}`` on the host.
"""

import os

import numpy as np

from hpcpax.data import synthetic
from hpcpax.data.layouts import check_lm, open_h5
from hpcpax.data.mapping import map_dataset
from hpcpax.data.reading import ShardedReader, gather_windows, scan_chunks
from hpcpax.data.sampling import check_int
from hpcpax.errors import DataError

__all__ = ["LMDataset", "SyntheticLM"]


class _LMReader(ShardedReader):
    kind = "lm"
    unit = "tokens"

    def __init__(self, name, tokens, vocab_size, context, shuffle, seed):
        self.context = check_int(context, "context", 1)
        self.vocab_size = vocab_size
        self._tokens = tokens
        self.name = name
        self._set_span(0, len(tokens))
        super().__init__(name, self.num_samples, shuffle, seed)

    def _set_span(self, first, stop):
        """Read tokens ``[first, stop)`` only: samples whose whole window lies inside."""
        self._span = (int(first), int(stop))
        self.num_tokens = stop - first
        if self.num_tokens <= self.context:
            raise DataError(f"{self.name}: holds {self.num_tokens} tokens; context "
                            f"{self.context} needs at least {self.context + 1} for one sample")
        self.num_samples = self.num_tokens - self.context

    def _read(self, indices):
        width = self.context + 1
        windows = gather_windows(self._tokens, indices + self._span[0], width,
                                 self._tokens.dtype.itemsize)
        windows = windows.astype(np.int64, copy=False)
        return {"context": np.ascontiguousarray(windows[:, :self.context]),
                "target": np.ascontiguousarray(windows[:, self.context])}

    def _check_batch(self, batch, indices):
        windows = (batch["context"], batch["target"][:, None])
        low = min(int(w.min()) for w in windows) if len(indices) else 0
        high = max(int(w.max()) for w in windows) if len(indices) else 0
        if low >= 0 and high < self.vocab_size:
            return
        full = np.concatenate(windows, axis=1)
        row, offset = np.argwhere((full < 0) | (full >= self.vocab_size))[0]
        position = int(indices[row]) + self._span[0] + int(offset)
        raise DataError(f"{self.name}: token id {int(full[row, offset])} at position {position} "
                        f"is not in [0, {self.vocab_size}) (the file's vocab_size)")

    def validate(self, vocab_size=None):
        """Scan every token id (in bounded chunks) and check it is in range.

        Args:
            vocab_size: optional rows of the model's embedding table; ids must
                also be below it.

        Returns:
            dict summary: ``kind``, ``num_tokens``, ``num_samples``, ``vocab_size``, ``max_id``.

        Raises:
            DataError: a negative id or an id at or above the vocabulary size,
                naming the file, the position and the bound.
        """
        limit = self.vocab_size
        if vocab_size is not None:
            limit = min(limit, check_int(vocab_size, "vocab_size", 1))
        largest = -1
        with self._reading():
            for first, block in scan_chunks(self._tokens, self._tokens.dtype.itemsize,
                                            *self._span):
                low, high = int(block.min()), int(block.max())
                if low < 0:
                    where = first + int(np.argmax(block < 0))
                    raise DataError(f"{self.name}: negative token id {low} "
                                    f"(first at position {where})")
                if high >= limit:
                    where = first + int(np.argmax(block >= limit))
                    bound = ("the file's vocab_size" if limit == self.vocab_size
                             else "the given vocab_size")
                    raise DataError(f"{self.name}: token id {int(block[where - first])} at "
                                    f"position {where} is not below {bound} {limit}")
                largest = max(largest, high)
        return {"kind": "lm", "num_tokens": self.num_tokens, "num_samples": self.num_samples,
                "vocab_size": self.vocab_size, "max_id": largest}


class LMDataset(_LMReader):
    """Reader of an ``hpcpax-lm/1`` HDF5 file (layout in :mod:`hpcpax.data.layouts`).

    Opening checks metadata only; call :meth:`validate` to scan the ids. Each
    :meth:`batch` reads only the token windows of the calling shard: an
    uncompressed ``tokens`` dataset through a memory map of the file
    (:mod:`hpcpax.data.mapping`), any other through h5py.

    Args:
        path: the file.
        context: tokens of context per sample, >= 1 (default 8).
        shuffle: visit samples in a per-epoch permutation keyed by
            ``(seed, epoch)`` (default False: file order).
        seed: non-negative int keying the shuffle.

    Raises:
        DataError: missing, unreadable or malformed file, or too few tokens.
    """

    def __init__(self, path, context=8, shuffle=False, seed=0):
        name = os.fspath(path)
        self._file = open_h5(name)
        try:
            tokens, vocab_size = check_lm(self._file, name)
            tokens = map_dataset(tokens) or tokens
            super().__init__(name, tokens, vocab_size, context, shuffle, seed)
        except BaseException:
            self._file.close()
            raise

    @property
    def vocab(self):
        """The vocabulary as a list of str in id order (read on each access)."""
        with self._reading():
            return list(self._file["vocab"].asstr()[...])

    def _check_batch(self, batch, indices):
        windows = (batch["context"], batch["target"][:, None])
        low = min(int(w.min()) for w in windows) if len(indices) else 0
        high = max(int(w.max()) for w in windows) if len(indices) else 0
        if low >= 0 and high < self.vocab_size:
            return
        full = np.concatenate(windows, axis=1)
        row, offset = np.argwhere((full < 0) | (full >= self.vocab_size))[0]
        position = int(indices[row]) + self._span[0] + int(offset)
        raise DataError(f"{self.name}: token id {int(full[row, offset])} at position {position} "
                        f"is not in [0, {self.vocab_size}) (the file's vocab_size)")

    def validate(self, vocab_size=None):
        """Check that the vocabulary starts with ``<unk>``, then scan every token id.

        Returns and raises as :meth:`_LMReader.validate` (DataError naming the
        file, the position and the bound).
        """
        with self._reading():
            vocab = self._file["vocab"].asstr()
            if vocab[0] != "<unk>":
                raise DataError(f"{self.name}: vocab[0] is {vocab[0]!r}, expected '<unk>'")
        return super().validate(vocab_size)

    def close(self):
        """Close the HDF5 file if this dataset opened it."""
        if self._owner:
            self._file.close()


class SyntheticLM(_LMReader):
    """In-memory synthetic token stream with the same interface as :class:`LMDataset`.

    Generated by :func:`hpcpax.data.synthetic.generate_lm` (Zipf marginal with a
    sparse Markov structure: learnable). ``python -m hpcpax.data synth lm``
    writes the same stream to a file, so a file reader with the same
    ``context``/``shuffle``/``seed`` returns identical batches.

    Args:
        num_tokens: length of the stream (default 200_000).
        vocab_size: ids including ``<unk>`` = 0, >= 2 (default 1000).
        context: tokens of context per sample (default 8).
        seed: non-negative int; keys both the data and the shuffle.
        zipf: Zipf exponent (default 1.1).
        shuffle: per-epoch permutation of the sample order (default False).
    """

    def __init__(self, num_tokens=200_000, vocab_size=1000, context=8, seed=0, zipf=1.1,
                 shuffle=False):
        num_tokens = check_int(num_tokens, "num_tokens", 1)
        vocab_size = check_int(vocab_size, "vocab_size", 2)
        seed = check_int(seed, "seed", 0)
        tokens = synthetic.generate_lm(num_tokens, vocab_size, seed=seed, zipf=zipf)
        self.zipf = zipf
        super().__init__(f"synthetic-lm(seed={seed})", tokens, vocab_size, context, shuffle,
                         seed)

    @property
    def tokens(self):
        """The whole token stream (int32, int64 past ``2**31`` ids; it lives in memory anyway)."""
        return self._tokens

    @property
    def vocab(self):
        """The synthetic vocabulary (``<unk>`` then generated words)."""
        return synthetic.lm_vocab(self.vocab_size)
