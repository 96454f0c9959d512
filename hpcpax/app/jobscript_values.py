"""How :mod:`hpcpax.app.jobscript` writes a value into a job script: as data, never as code.

A rendered script has two readers, and a value is written for the one that reads its line:

- bash runs every line that is not a comment. A value there becomes one
  shell word, quoted by :func:`shlex.quote` (a plain word such as ``pmi2``
  or ``runs/a-1`` stays bare); a placeholder declared ``(words)`` is split
  into words as a shell would split it (:func:`shlex.split`, no expansion)
  and each word is quoted.
- Slurm reads ``#SBATCH`` lines with its own parser: whitespace separates
  arguments, quotes group, a backslash escapes the next character and an
  unquoted ``#`` starts a comment. A value there is escaped with backslashes
  (every Slurm reads ``\\x`` as ``x``; before 2.1 it ignored single quotes).

Control characters (newline, NUL, carriage return...) are refused everywhere:
a newline would start a new line of the script.
"""

from __future__ import annotations

import re
import shlex
from typing import List

from ..errors import ConfigError

__all__ = ["check_text", "shell_word", "sbatch_word", "split_words", "check_template_lines"]

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
#: What Slurm's directive parser would take for syntax: whitespace, comment, quotes, escape.
_SBATCH_SPECIAL = re.compile(r"([\s#'\"\\])")
#: Outside single quotes a shell would run or expand these; a word list must quote them.
_SHELL_SYNTAX = set(";&|<>()`$")
_PLACEHOLDER = re.compile(r"\{\{\s*([A-Za-z_][A-Za-z0-9_]*)\s*\}\}")


def check_text(flag: str, value: str) -> None:
    """Refuse a value with a control character (a newline would start a new script line).

    Raises:
        ConfigError: ``"--flag must be one line without control characters, not '...'"``.
    """
    if _CONTROL.search(value):
        raise ConfigError(f"{flag} must be one line without control characters, not {value!r}")


def shell_word(value: str) -> str:
    """``value`` as one bash word that bash reads back unchanged (``''`` for empty)."""
    return shlex.quote(value)


def sbatch_word(value: str) -> str:
    """``value`` for an ``#SBATCH`` line: Slurm reads it back unchanged as one argument.

    Plain words stay bare; any other value goes in double quotes, with ``"``
    and ``\\`` after a backslash. Slurm 22.05's parser (Debian 12) splits at a
    backslash-escaped space but honours double quotes and the two escapes in
    them, as later releases do (checked with sbatch and squeue in
    ``tests/slurm/test_sbatch_job.py``).
    """
    if not _SBATCH_SPECIAL.search(value):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _shell_syntax_outside_quotes(value: str) -> str:
    """The first character of ``value`` a shell would treat as syntax, or ``""``.

    Single quotes and a backslash make any character literal. Inside double
    quotes a shell still expands ``$`` and backticks; they are refused there
    even after a backslash, which :func:`shlex.split` keeps and a shell drops.
    """
    quote, escaped = "", False
    for index, char in enumerate(value):
        if escaped:
            escaped = False
        elif quote == "'":
            quote = "" if char == "'" else quote
        elif quote == '"':
            following = value[index + 1:index + 2]
            if char in "$`":
                return char
            if char == "\\" and following and following in "$`":
                return following
            escaped = char == "\\"
            quote = "" if char == '"' else quote
        elif char == "\\":
            escaped = True
        elif char in "'\"":
            quote = char
        elif char in _SHELL_SYNTAX:
            return char
    return ""


def split_words(flag: str, value: str) -> List[str]:
    """Split a word-list value (``--train-args``...) into words, as a shell would, expanding nothing.

    Quotes group words and make characters literal: ``--name 'a b;c'`` is
    two words, ``--name`` and ``a b;c``. A shell operator or expansion
    outside single quotes (``; & | < > ( ) ` $``) is refused rather than
    passed on as a word: it was meant as shell code, which a value is not.

    Raises:
        ConfigError: naming ``flag``, for unbalanced quotes or unquoted shell syntax.
    """
    char = _shell_syntax_outside_quotes(value)
    if char:
        raise ConfigError(
            f"{flag} must be words without shell syntax (single-quote a word to pass "
            f"{char!r} as data), not {value!r}")
    try:
        return shlex.split(value)
    except ValueError as error:  # unbalanced quotes
        raise ConfigError(f"{flag} must be words a shell can split ({error}), "
                          f"not {value!r}") from None


def _line_contexts(line: str) -> List[str]:
    """Per character of a shell line: ``""`` bare, ``"'"``/``'"'`` quoted, ``"\\\\"`` escaped, ``"#"`` comment."""
    contexts: List[str] = []
    quote, escaped = "", False
    for index, char in enumerate(line):
        if quote == "#":
            contexts.append("#")
            continue
        contexts.append("\\" if escaped else quote)
        if escaped:
            escaped = False
        elif quote == "'":
            quote = "" if char == "'" else quote
        elif char == "\\":
            escaped = True
        elif quote == '"':
            quote = "" if char == '"' else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (index == 0 or line[index - 1].isspace()):
            quote = contexts[-1] = "#"
    return contexts


def check_template_lines(template: str, text: str, words: frozenset) -> None:
    """Refuse a template whose placeholders bash would not read as whole quoted words.

    Outside ``#SBATCH`` lines a placeholder must stand outside quotes and
    not after a backslash (a quoted value inside ``"..."`` would be read
    with its quotes, and ``$`` in it expanded); a ``(words)`` placeholder
    must also have whitespace or the line's end on both sides. The check
    reads one line at a time.

    Raises:
        ConfigError: naming the template, the line number and the placeholder.
    """
    for number, line in enumerate(text.splitlines(), start=1):
        if line.startswith("#SBATCH"):
            continue
        contexts = _line_contexts(line)
        for match in _PLACEHOLDER.finditer(line):
            name, where = match.group(1), f"template {template!r} line {number}"
            context = contexts[match.start()]
            if context in ("'", '"', "\\"):
                raise ConfigError(f"{where}: {{{{{name}}}}} must stand outside quotes "
                                  f"(its value is written quoted), not in {line.strip()!r}")
            bare = (match.start() == 0 or line[match.start() - 1].isspace()) and \
                (match.end() == len(line) or line[match.end()].isspace())
            if context == "" and name in words and not bare:
                raise ConfigError(f"{where}: word list {{{{{name}}}}} must have spaces "
                                  f"around it, not {line.strip()!r}")
