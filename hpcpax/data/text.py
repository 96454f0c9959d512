"""UTF-8 text files to an ``hpcpax-lm/1`` file, in streaming passes.

Files are read in 1 MiB blocks, so neither a large file nor a file with one
enormous line is held in memory (only the word counts are). Pass 1 counts
words, pass 2 encodes them into a contiguous ``tokens`` dataset of the
counted length. With a held-out split (``eval_fraction``), one more pass
takes the last fraction of the tokens out of the counts, so the vocabulary
is built from the training part alone, as it would be for unseen text.

Tokenizers (see :data:`TOKENIZERS`):

- ``whitespace``: ``str.split()``: runs of Unicode whitespace separate words;
  punctuation stays attached (``"end."`` and ``"end"`` are two words).
- ``words``: runs of letters and digits are words (an apostrophe or hyphen
  inside a word keeps it whole: ``don't``, ``well-known``); every other
  non-space character is a token of its own (``"end."`` -> ``end``, ``.``).

``lowercase`` lower-cases the text first (either tokenizer). The vocabulary
is ``<unk>`` (id 0) then the ``vocab_size - 1`` most frequent words, ties
broken by code-point order, so the result is the same on every machine.
"""

import collections
import os
import re
from array import array

from hpcpax.data.layouts import FORMAT_LM, UNKNOWN_WORD
from hpcpax.data.writing import Appender, atomic_h5, write_vocab
from hpcpax.errors import DataError

__all__ = ["TOKENIZERS", "iter_words", "build_vocab", "text_to_h5"]

#: Tokenizer names and what they do (the ``text --help`` wording).
TOKENIZERS = {
    "whitespace": "str.split(): words are separated by whitespace; punctuation stays attached",
    "words": "letters/digits form words (inner ' and - kept: don't, well-known); every other "
             "symbol (. , ; ! ? quotes ...) is a token of its own",
}

_BLOCK_CHARS = 1 << 20
_FLUSH_TOKENS = 1 << 20
_WORD = re.compile(r"[^\W_]+(?:['\u2019\-][^\W_]+)*|[^\w\s]|_", re.UNICODE)
_LAST_SPACE = re.compile(r"\s(?=\S*\Z)")


def _split(text, tokenizer):
    return text.split() if tokenizer == "whitespace" else _WORD.findall(text)


def iter_words(path, lowercase=False, tokenizer="whitespace"):
    """Yield the words of a UTF-8 text file, reading it in blocks."""
    if tokenizer not in TOKENIZERS:
        raise ValueError(f"tokenizer must be one of {sorted(TOKENIZERS)}, not {tokenizer!r}")
    try:
        with open(path, encoding="utf-8") as stream:
            carry = ""
            while True:
                block = stream.read(_BLOCK_CHARS)
                if not block:
                    break
                text = carry + block
                # Text after the last whitespace may continue in the next block.
                cut = _LAST_SPACE.search(text)
                head, carry = (text[:cut.end()], text[cut.end():]) if cut else ("", text)
                yield from _split(head.lower() if lowercase else head, tokenizer)
            if carry:
                yield from _split(carry.lower() if lowercase else carry, tokenizer)
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a text file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc})") from None


def build_vocab(counts, vocab_size):
    """``<unk>`` then the ``vocab_size - 1`` most frequent words (ties: code-point order)."""
    ranked = sorted((word for word in counts if word != UNKNOWN_WORD and counts[word] > 0),
                    key=lambda word: (-counts[word], word))
    return [UNKNOWN_WORD] + ranked[:vocab_size - 1]


def _words(paths, lowercase, tokenizer):
    for path in paths:
        yield from iter_words(path, lowercase, tokenizer)


def _write(output, vocab, ids, words, total, settings):
    """Write ``total`` tokens taken from ``words`` into ``output``; returns the <unk> count."""
    unknown = 0
    with atomic_h5(output) as h5file:
        h5file.attrs["format"] = FORMAT_LM
        h5file.attrs["source"] = "hpcpax.data text"
        for key, value in settings.items():
            h5file.attrs[key] = value
        write_vocab(h5file, vocab)
        tokens = Appender(h5file, "tokens", "int32", total_rows=total)
        pending = array("i")
        for _ in range(total):
            index = ids.get(next(words), 0)
            unknown += index == 0
            pending.append(index)
            if len(pending) >= _FLUSH_TOKENS:
                tokens.append(pending)
                pending = array("i")
        tokens.append(pending)
        tokens.finish()
    return unknown


def text_to_h5(paths, output, vocab_size, lowercase=False, tokenizer="whitespace",
               eval_output=None, eval_fraction=0.0):
    """Tokenize text files into one ``hpcpax-lm/1`` file (written atomically).

    Args:
        paths: UTF-8 text files, read in order as one stream.
        output: the training file.
        vocab_size: ids including ``<unk>``; the stored ``vocab_size`` is
            ``min(vocab_size, distinct words + 1)``.
        lowercase: lower-case the text first.
        tokenizer: a key of :data:`TOKENIZERS`.
        eval_output: optional second file for the held-out tail: the last
            ``eval_fraction`` of the tokens go there, not into ``output``;
            both files share the vocabulary, counted on the training part.
        eval_fraction: the held-out share, in (0, 1) when ``eval_output`` is set.

    Returns:
        dict summary: ``tokens``, ``vocab_size``, ``unknown`` (tokens mapped to
        ``<unk>``), ``bytes``, and with a split ``eval_tokens``,
        ``eval_unknown``, ``eval_bytes``.

    Raises:
        DataError: a missing or non-UTF-8 input, no words at all, or a split
            that leaves a part empty.
    """
    if vocab_size < 2:
        raise DataError(f"--vocab-size must be >= 2 (room for '<unk>' and one word), "
                        f"not {vocab_size}")
    if tokenizer not in TOKENIZERS:
        raise DataError(f"--tokenizer must be one of {sorted(TOKENIZERS)}, not {tokenizer!r}")
    if eval_output is not None and not 0 < eval_fraction < 1:
        raise DataError(f"--eval-fraction must be in (0, 1) with --eval-output, "
                        f"not {eval_fraction}")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
    counts = collections.Counter(_words(paths, lowercase, tokenizer))
    total = sum(counts.values())
    if not total:
        raise DataError(f"{', '.join(map(str, paths))}: no words found")
    held = int(round(total * eval_fraction)) if eval_output is not None else 0
    if eval_output is not None and not 0 < held < total:
        raise DataError(f"--eval-fraction {eval_fraction} of {total} tokens leaves "
                        f"{total - held} for training and {held} held out; both must be > 0")
    if held:
        words = _words(paths, lowercase, tokenizer)
        for _ in range(total - held):
            next(words)
        counts.subtract(words)  # the vocabulary comes from the training part only
    vocab = build_vocab(counts, vocab_size)
    ids = {word: index for index, word in enumerate(vocab)}
    settings = {"lowercase": bool(lowercase), "tokenizer": tokenizer}
    words = _words(paths, lowercase, tokenizer)
    unknown = _write(output, vocab, ids, words, total - held, settings)
    summary = {"tokens": total - held, "vocab_size": len(vocab), "unknown": unknown,
               "bytes": os.path.getsize(output)}
    if held:
        summary["eval_unknown"] = _write(eval_output, vocab, ids, words, held,
                                         {**settings, "held_out_of": os.path.basename(output)})
        summary.update(eval_tokens=held, eval_bytes=os.path.getsize(eval_output))
    return summary
