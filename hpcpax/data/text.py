"""UTF-8 text files to an ``hpcpax-lm/1`` file, in two streaming passes.

Pass 1 counts words, pass 2 encodes them; files are read in 1 MiB blocks, so
neither a large file nor a file with one enormous line is held in memory
(only the word counts are). Tokenization is ``str.split()``: runs of Unicode
whitespace separate words; punctuation stays attached. The vocabulary is
``<unk>`` (id 0) then the ``vocab_size - 1`` most frequent words, ties broken
by code-point order, so the result is the same on every machine.
"""

import collections
import os
from array import array

from hpcpax.data.layouts import FORMAT_LM, UNKNOWN_WORD
from hpcpax.data.writing import Appender, atomic_h5, write_vocab
from hpcpax.errors import DataError

__all__ = ["iter_words", "build_vocab", "text_to_h5"]

_BLOCK_CHARS = 1 << 20
_FLUSH_TOKENS = 1 << 20


def iter_words(path, lowercase=False):
    """Yield the words of a UTF-8 text file, reading it in blocks."""
    try:
        with open(path, encoding="utf-8") as stream:
            carry = ""
            while True:
                block = stream.read(_BLOCK_CHARS)
                if not block:
                    break
                text = carry + block
                words = text.split()
                # A word cut by the block boundary continues in the next block.
                carry = words.pop() if words and not text[-1].isspace() else ""
                for word in words:
                    yield word.lower() if lowercase else word
            if carry:
                yield carry.lower() if lowercase else carry
    except FileNotFoundError:
        raise DataError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise DataError(f"{path}: is a directory, not a text file") from None
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not valid UTF-8 ({exc})") from None


def build_vocab(counts, vocab_size):
    """``<unk>`` then the ``vocab_size - 1`` most frequent words (ties: code-point order)."""
    ranked = sorted((word for word in counts if word != UNKNOWN_WORD),
                    key=lambda word: (-counts[word], word))
    return [UNKNOWN_WORD] + ranked[:vocab_size - 1]


def text_to_h5(paths, output, vocab_size, lowercase=False):
    """Tokenize text files into one ``hpcpax-lm/1`` file (written atomically).

    The stored ``vocab_size`` is ``min(vocab_size, distinct words + 1)``.

    Returns:
        dict summary: ``tokens``, ``vocab_size``, ``unknown`` (tokens mapped to
        ``<unk>``), ``bytes``.

    Raises:
        DataError: a missing or non-UTF-8 input, or no words at all.
    """
    if vocab_size < 2:
        raise DataError(f"--vocab-size must be >= 2 (room for '<unk>' and one word), "
                        f"not {vocab_size}")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"{path}: no such file")
    counts = collections.Counter()
    for path in paths:
        counts.update(iter_words(path, lowercase))
    if not counts:
        raise DataError(f"{', '.join(map(str, paths))}: no words found")
    vocab = build_vocab(counts, vocab_size)
    ids = {word: index for index, word in enumerate(vocab)}
    unknown = sum(counts.values()) - sum(counts[word] for word in vocab[1:])
    with atomic_h5(output) as h5file:
        h5file.attrs["format"] = FORMAT_LM
        h5file.attrs["source"] = "hpcpax.data text"
        h5file.attrs["lowercase"] = bool(lowercase)
        write_vocab(h5file, vocab)
        tokens = Appender(h5file, "tokens", "int32")
        pending = array("i")
        for path in paths:
            for word in iter_words(path, lowercase):
                pending.append(ids.get(word, 0))
                if len(pending) >= _FLUSH_TOKENS:
                    tokens.append(pending)
                    pending = array("i")
        tokens.append(pending)
        tokens.finish()
        total = tokens.rows
    return {"tokens": total, "vocab_size": len(vocab), "unknown": unknown,
            "bytes": os.path.getsize(output)}
