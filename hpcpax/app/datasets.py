"""The trainer's data set-up: the model sized by its data, the training reader
and the evaluation set. Nothing here is collective; every rank runs the same
checks on the same files, so a bad combination stops every rank together,
before the first step, with both numbers named.
"""

from __future__ import annotations

import numpy as np

from ..errors import ConfigError
from ..options import counted, format_bytes
from .config import model_kwargs
from .evaluation import EVAL_POSITION, EvalSet

__all__ = ["build_model", "check_full_eval_memory", "check_synthetic_memory", "open_data"]


def _reader_options(kind, config, context):
    options = {"shuffle": config["shuffle"], "seed": config["seed"]}
    return {"context": context, **options} if kind == "lm" else options


def _check_lm_vocabulary(path, flag, file_vocab, model_vocab):
    if file_vocab > model_vocab:
        raise ConfigError(
            f"{flag}: {path} has a vocabulary of {file_vocab} words (ids 0..{file_vocab - 1}), "
            f"more than --vocab-size {model_vocab}; leave --vocab-size out to take the file's, "
            f"or give at least {file_vocab}")


def _check_ctr_features(path, flag, reader, n_dense, n_fields):
    for key, value, found in (("n_dense", n_dense, reader.n_dense),
                              ("n_fields", n_fields, reader.n_fields)):
        if value is not None and value != found:
            raise ConfigError(f"{flag}: {path} has {key} {found}, but --{key.replace('_', '-')} "
                              f"is {value}")


def _check_ctr_tables(path, flag, reader, kwargs, hash_ids):
    """Tables as large as the file's id spaces (its ``cardinality``), unless ids are hashed."""
    if reader.cardinality is None:
        return
    cardinality = [int(c) for c in reader.cardinality]
    if "table_rows" not in kwargs:
        kwargs["table_rows"] = cardinality
        return
    rows = list(kwargs["table_rows"]) * (len(cardinality) if len(kwargs["table_rows"]) == 1 else 1)
    small = [f for f, (r, c) in enumerate(zip(rows, cardinality)) if r < c]
    if small and not hash_ids:
        f = small[0]
        raise ConfigError(f"{flag}: {path} has ids up to {cardinality[f] - 1} in field {f} "
                          f"(cardinality {cardinality[f]}), but --table-rows gives it "
                          f"{rows[f]} rows: give --table-rows >= the cardinality, or "
                          "--hash-ids to fold the ids onto the smaller tables on purpose")


def build_model(config):
    """The model of ``config``, with the sizes its data file fixes unless given.

    Raises:
        ConfigError: ``--vocab-size`` smaller than the data file's (or the
            ``--eval-data`` file's) vocabulary, or ``--n-dense``/``--n-fields``
            other than the file's, naming both numbers.
        DataError: an unreadable data file.
    """
    from ..data import open_dataset
    from ..models import build_model as build

    kind = config["model"]
    kwargs = model_kwargs(config)
    for flag in ("data", "eval_data"):
        path = config[flag]
        if path is None:
            continue
        name = "--" + flag.replace("_", "-")
        options = {"context": kwargs.get("context", 4)} if kind == "lm" else {}
        with open_dataset(path, kind, **options) as reader:
            if kind == "lm":
                if "vocab_size" in kwargs:
                    _check_lm_vocabulary(path, name, int(reader.vocab_size), kwargs["vocab_size"])
                else:
                    kwargs["vocab_size"] = int(reader.vocab_size)
            else:
                _check_ctr_features(path, name, reader, kwargs.get("n_dense"),
                                    kwargs.get("n_fields"))
                kwargs.setdefault("n_dense", int(reader.n_dense))
                kwargs.setdefault("n_fields", int(reader.n_fields))
                _check_ctr_tables(path, name, reader, kwargs, config["hash_ids"])
    if kind == "lm" and config["data"] is not None and config["eval_data"] is not None:
        _check_same_vocabulary(config["data"], config["eval_data"], kwargs.get("context", 4))
    return build(kind, **kwargs)


def _check_same_vocabulary(train_path, eval_path, context):
    from ..data import open_dataset

    with open_dataset(train_path, "lm", context=context) as train, \
            open_dataset(eval_path, "lm", context=context) as held:
        train_words, held_words = train.vocab, held.vocab
    if train_words != held_words:
        differ = next((i for i, (a, b) in enumerate(zip(train_words, held_words)) if a != b),
                      min(len(train_words), len(held_words)))
        raise ConfigError(
            f"--eval-data: {eval_path} was encoded with another vocabulary than {train_path} "
            f"(id {differ} differs); make both with one `python -m hpcpax.data text ... "
            f"--eval-output` run")


def _synthetic_sizes(kind, model, config):
    if kind == "lm":
        return {"num_tokens": config["synthetic_samples"], "vocab_size": model.vocab_size}
    return {"num_samples": config["synthetic_samples"], "n_dense": model.n_dense,
            "n_fields": model.n_fields, "cardinality": list(model.table_rows)}


def check_synthetic_memory(model, config, workers_on_node, meminfo="/proc/meminfo"):
    """Refuse synthetic data the node's workers cannot hold, before any of it is made.

    Every worker generates the whole synthetic data set (no array grows with
    the vocabulary or the table rows: :mod:`hpcpax.data.zipf`), so
    ``workers_on_node`` copies of its peak bytes must fit ``MemAvailable``.
    Not collective; a no-op with ``--data`` or where ``/proc/meminfo`` is unreadable.

    Raises:
        ConfigError: naming ``--synthetic-samples``, the bytes needed and available.
    """
    from ..data.synthetic import ctr_bytes, lm_bytes
    from ..ps.memory import available_memory

    if config["data"] is not None:
        return
    kind = config["model"]
    sizes = _synthetic_sizes(kind, model, config)
    need = lm_bytes(**sizes) if kind == "lm" else ctr_bytes(**sizes)
    available = available_memory(meminfo)
    if available is not None and need * workers_on_node > available:
        raise ConfigError(
            f"--synthetic-samples {config['synthetic_samples']}: synthetic {kind} data needs "
            f"about {format_bytes(need)} per worker, {format_bytes(need * workers_on_node)} for "
            f"the {counted(workers_on_node, 'worker')} of this node, more than the "
            f"{format_bytes(available)} available; give a smaller --synthetic-samples or a "
            f"--data file")


def check_full_eval_memory(model, config):
    """Refuse an lm evaluation whose full softmax cannot be pulled to a worker.

    lm evaluation scores every word: each worker pulls all rows of
    ``softmax_w`` and ``softmax_b`` with their ids, a whole-table read held to
    ``HPCPAX_REPLICA_MEMORY`` like ``read_table``. Not collective; a pure
    function of the model, the config and the option (the same on every rank).

    Raises:
        ConfigError: naming ``--eval-every``, the rows and the bytes.
    """
    from ..options import options

    if model.name != "lm" or not config["eval_every"]:
        return
    width = model.out_dim + 1  # a softmax_w row and its softmax_b entry
    need = model.vocab_size * (16 + width * np.dtype(model.dtype).itemsize)  # two id arrays
    if need > options.replica_memory:
        raise ConfigError(
            f"--eval-every {config['eval_every']}: lm evaluation scores the full softmax, "
            f"pulling every row of softmax_w and softmax_b ({model.vocab_size} x {width}) to "
            f"each worker: about {format_bytes(need)}, above HPCPAX_REPLICA_MEMORY "
            f"({format_bytes(options.replica_memory)}); leave --eval-every at 0, give a "
            f"smaller --vocab-size, or raise HPCPAX_REPLICA_MEMORY")


def open_data(model, config):
    """``(training reader, EvalSet)`` for ``model`` and ``config``.

    The training reader reads ``--data`` (or synthetic data) with
    ``--shuffle``/``--seed``; with ``--eval-fraction F`` it stops before the
    file's last fraction F, which becomes the held-out set; with
    ``--eval-data`` that file is. A held-out set is read in a fixed shuffled
    order, so ``--eval-batches`` global batches are a random sample of it.

    Raises:
        ConfigError: a held-out set smaller than one global batch while
            ``--eval-every`` is on.
        DataError: unreadable files, or a split leaving a part without samples.
    """
    from ..data import open_dataset

    kind = config["model"]
    context = getattr(model, "context", None)
    options = _reader_options(kind, config, context)
    if config["data"] is None:
        train = open_dataset("synthetic", kind, **_synthetic_sizes(kind, model, config),
                             **options)
    else:
        train = open_dataset(config["data"], kind, **options)
    if kind == "ctr":
        train.set_table_rows(model.table_rows, config["hash_ids"])
    held = None
    if config["eval_fraction"]:
        train, held = train.split_tail(config["eval_fraction"])
    elif config["eval_data"] is not None:
        held = open_dataset(config["eval_data"], kind, **options)
        if kind == "ctr":
            held.set_table_rows(model.table_rows, config["hash_ids"])
    if held is None:
        return train, EvalSet(train, EVAL_POSITION, config["eval_batches"], held_out=False)
    held.shuffle = True  # a fixed random sample of the held-out set, whatever --shuffle says
    batches = min(config["eval_batches"], held.num_samples // config["global_batch"])
    if batches < 1 and config["eval_every"]:
        raise ConfigError(
            f"the held-out set {held.name} has {held.num_samples} samples, fewer than one "
            f"global batch of {config['global_batch']}; give a larger --eval-fraction or "
            f"--eval-data file, or a smaller --global-batch")
    return train, EvalSet(held, 0, batches, held_out=True)
