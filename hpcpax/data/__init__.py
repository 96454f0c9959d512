"""hpcpax.data: sharded, stateless readers of sparse-model training data.

Two HDF5 layouts (documented field by field in :mod:`hpcpax.data.layouts`):
``hpcpax-lm/1`` (a token stream and its vocabulary) and ``hpcpax-ctr/1``
(label, dense and categorical features). Each has a file reader and an
in-memory synthetic twin with the same interface::

    reader = open_dataset("train.h5", "lm", context=8, shuffle=True, seed=1)
    part = reader.batch(step, global_batch, shard=rank, num_shards=size)

``batch`` is a pure function of its arguments: resuming at step ``s`` is
calling ``batch(s, ...)``; there is no reader state to checkpoint. A rank
reads only its own slice of the file. Files are made with
``python -m hpcpax.data {text,csv,synth,check}``. Nothing here is collective
and everything lives on the host.
"""

from hpcpax.data.ctr import CTRDataset, SyntheticCTR
from hpcpax.data.dataset import open_dataset
from hpcpax.data.layouts import FORMAT_CTR, FORMAT_LM, UNKNOWN_WORD
from hpcpax.data.lm import LMDataset, SyntheticLM
from hpcpax.data.sampling import sample_indices
from hpcpax.data.synthetic import generate_ctr, generate_lm
from hpcpax.data.tabular import csv_to_h5
from hpcpax.data.text import text_to_h5
from hpcpax.data.writing import write_ctr, write_lm

__all__ = [
    "open_dataset",
    "LMDataset",
    "CTRDataset",
    "SyntheticLM",
    "SyntheticCTR",
    "sample_indices",
    "generate_lm",
    "generate_ctr",
    "write_lm",
    "write_ctr",
    "text_to_h5",
    "csv_to_h5",
    "FORMAT_LM",
    "FORMAT_CTR",
    "UNKNOWN_WORD",
]
