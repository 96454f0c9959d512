"""The one validator of what a user hands a run: config and plan files, flag values.

Every value of ``python -m hpcpax.train``'s flags, its TOML config file and a
plan (``--plan FILE``, ``plan.json``, a plan table) goes through these
functions before anything is allocated or communicated. A bad value is a
one-line :class:`~hpcpax.errors.ConfigError` naming the key and the value
(shortened to :data:`SHOWN_CHARS` characters); nothing reaches a traceback:

- files: at most :data:`MAX_FILE_BYTES` bytes, strict UTF-8, nesting at
  most :data:`MAX_NESTING` deep (checked on the text before a recursive
  parser sees it), only finite numbers and integers within int64;
- numbers: finite floats within their bounds, integers within their bounds
  (int64 at most) and given as integers (``1e8`` is not an int);
- text: a str, without NUL, without undecodable bytes, at most
  :data:`MAX_TEXT_CHARS` characters.

Nothing here is collective; every rank checks the same input the same way.
"""

from __future__ import annotations

import json
import math
import os
import tomllib

from .errors import ConfigError

__all__ = ["MAX_FILE_BYTES", "MAX_NESTING", "MAX_TEXT_CHARS", "INT64_MAX", "SHOWN_CHARS",
           "shown", "shown_path", "check_int", "check_float", "check_text", "check_name",
           "check_tree", "read_text_file", "parse_json_text", "load_json_file", "load_toml_file"]

#: Largest config or plan file read (a saved plan with its measurements is far smaller).
MAX_FILE_BYTES = 16 << 20
#: Deepest nesting of lists and tables a config or plan may hold.
MAX_NESTING = 32
#: Longest text value (a path, a spec) a flag or key may hold.
MAX_TEXT_CHARS = 1 << 16
#: Largest integer any setting may hold.
INT64_MAX = (1 << 63) - 1
#: Characters of a refused value an error message shows.
SHOWN_CHARS = 60


def shown(value) -> str:
    """``repr(value)``, cut to :data:`SHOWN_CHARS` characters (one line, whatever it holds)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 190:
        # repr of a huge int is slow, or refused past 4300 digits
        return f"an int of about {int(value.bit_length() * math.log10(2)) + 1} digits"
    text = repr(value)
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS - 3] + "..."


def shown_path(path) -> str:
    """A file name for a message: as is where printable and short, else :func:`shown`."""
    path = os.fspath(path)
    return path if isinstance(path, str) and path.isprintable() and len(path) <= 256 \
        else shown(path)


def check_int(value, where: str, minimum=None, maximum=INT64_MAX) -> int:
    """``value`` (an int, or a str holding one) as an int within ``[minimum, maximum]``.

    Raises:
        ConfigError: ``"WHERE must be int, not ..."`` or ``"WHERE must be <= MAX, not ..."``.
    """
    if isinstance(value, str):
        text = value.strip()
        digits = text[1:] if text[:1] in "+-" else text
        if not digits.replace("_", "").isdigit():
            raise ConfigError(f"{where} must be int, not {shown(value)}")
        if len(digits) > 24:  # int() of thousands of digits is slow or refused; no bound has 20
            bound = f">= {minimum}" if text.startswith("-") else f"<= {maximum}"
            raise ConfigError(f"{where} must be {bound}, not {shown(value)}")
        value = int(text)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{where} must be int, not {type(value).__name__} ({shown(value)})")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{where} must be >= {minimum}, not {shown(value)}")
    if maximum is not None and value > maximum:
        raise ConfigError(f"{where} must be <= {maximum}, not {shown(value)}")
    return value


def check_float(value, where: str, minimum=None, maximum=None, above=None, below=None) -> float:
    """``value`` (a number, or a str holding one) as a finite float within its bounds.

    ``minimum``/``maximum`` are inclusive, ``above``/``below`` exclusive.

    Raises:
        ConfigError: not a number, not finite (inf, nan) or out of bounds, naming ``where``.
    """
    if isinstance(value, str):
        if len(value) > 64:
            raise ConfigError(f"{where} must be float, not {shown(value)}")
        try:
            value = float(value)
        except ValueError:
            raise ConfigError(f"{where} must be float, not {shown(value)}") from None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{where} must be float, not {type(value).__name__} ({shown(value)})")
    try:
        number = float(value)
    except OverflowError:  # an int beyond float's range
        raise ConfigError(f"{where} must be a finite number, not {shown(value)}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{where} must be a finite number, not {number}")
    if minimum is not None and number < minimum:
        raise ConfigError(f"{where} must be >= {minimum:g}, not {number!r}")
    if maximum is not None and number > maximum:
        raise ConfigError(f"{where} must be <= {maximum:g}, not {number!r}")
    if above is not None and not number > above:
        raise ConfigError(f"{where} must be > {above:g}, not {number!r}")
    if below is not None and not number < below:
        raise ConfigError(f"{where} must be < {below:g}, not {number!r}")
    return number


def check_text(value, where: str, max_chars: int = MAX_TEXT_CHARS, one_line: bool = True) -> str:
    """``value`` if it is a str a file name or a spec can be: no NUL, valid text, bounded.

    Args:
        value: the value.
        where: the key or flag, for the message.
        max_chars: the most characters it may hold.
        one_line: refuse control characters (newline, NUL...) too; tabs pass.

    Raises:
        ConfigError: a non-str, a NUL or control character, an undecodable byte
            (a surrogate from a non-UTF-8 argument) or more than ``max_chars`` characters.
    """
    if not isinstance(value, str):
        raise ConfigError(f"{where} must be str, not {type(value).__name__} ({shown(value)})")
    if len(value) > max_chars:
        raise ConfigError(f"{where} must be at most {max_chars} characters, not "
                          f"{len(value)} ({shown(value)})")
    if one_line and any(c < " " or c == "\x7f" for c in value if c != "\t"):
        raise ConfigError(f"{where} must be one line without control characters, "
                          f"not {shown(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ConfigError(f"{where} must be valid UTF-8 text, not {shown(value)}") from None
    return value


def check_name(value, where: str) -> str:
    """``value`` if it is a non-empty str fit to name a variable (:func:`check_text`, 256 chars).

    Raises:
        ConfigError: a list, a number, an empty or overlong name, naming ``where``.
    """
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{where} must be a non-empty str, not "
                          f"{type(value).__name__} ({shown(value)})")
    return check_text(value, where, 256)


def check_tree(value, where: str):
    """``value`` (parsed JSON or TOML) if every part is plain data a run can hold.

    Iterative, so no depth reaches Python's recursion limit: nesting at most
    :data:`MAX_NESTING`, str keys, ints within int64, finite floats, valid text.

    Raises:
        ConfigError: naming the path to the first bad part (``where.key[2]``).
    """
    stack = [(value, where, 0)]
    while stack:
        item, path, depth = stack.pop()
        if isinstance(item, (dict, list, tuple)):
            if depth >= MAX_NESTING:
                raise ConfigError(f"{path} is nested deeper than {MAX_NESTING} levels")
            if isinstance(item, dict):
                for key, child in item.items():
                    if not isinstance(key, str):
                        raise ConfigError(f"{path} keys must be str, not {shown(key)}")
                    check_text(key, f"{path} key", 256)
                    stack.append((child, f"{path}: {key}" if depth == 0 else f"{path}.{key}",
                                  depth + 1))
            else:
                stack.extend((child, f"{path}[{i}]", depth + 1) for i, child in enumerate(item))
        elif isinstance(item, bool) or item is None:
            continue
        elif isinstance(item, int):
            check_int(item, path, -INT64_MAX - 1, INT64_MAX)
        elif isinstance(item, float):
            check_float(item, path)
        elif isinstance(item, str):
            check_text(item, path, MAX_FILE_BYTES, one_line=False)
        else:  # TOML dates and times: no setting takes one
            raise ConfigError(f"{path} must be a number, str, bool, list or table, "
                              f"not {type(item).__name__}")
    return value


def _nesting(text: str, quotes: str, comments: bool = False) -> int:
    """Deepest ``[``/``{`` nesting of ``text`` outside quoted strings (and ``#`` comments)."""
    depth = deepest = 0
    quote, escaped = "", False
    for char in text:
        if quote == "#":
            quote = "" if char == "\n" else quote
        elif quote:
            if escaped:
                escaped = False
            elif char == "\\" and quote == '"':
                escaped = True
            elif char == quote:
                quote = ""
        elif char in quotes or (comments and char == "#"):
            quote = char
        elif char in "[{":
            depth += 1
            if depth > deepest:
                deepest = depth
                if deepest > MAX_NESTING + 1:  # TOML's [[table]] headers take one extra
                    return deepest
        elif char in "]}":
            depth -= 1
    return deepest


def read_text_file(path, what: str) -> str:
    """The text of a config or plan file: at most :data:`MAX_FILE_BYTES`, strict UTF-8.

    Raises:
        ConfigError: unreadable, too large (a device or FIFO is read only that far),
            or not UTF-8 (the byte offset named).
    """
    path = os.fspath(path)
    if isinstance(path, str):
        check_text(path, f"{what} name")
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_FILE_BYTES + 1)
    except (OSError, ValueError) as exc:  # ValueError: a NUL in the name
        raise ConfigError(f"cannot read {what} {shown_path(path)}: "
                          f"{getattr(exc, 'strerror', None) or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise ConfigError(f"{what} {shown_path(path)} is larger than {MAX_FILE_BYTES} bytes")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{what} {shown_path(path)} is not UTF-8 text (byte {exc.start}: "
                          f"{data[exc.start:exc.start + 1]!r})") from None


def _one_line(text: str, limit: int = 160) -> str:
    """``text`` as one line of at most ``limit`` characters (a parser's message)."""
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _refuse_constant(name):
    raise ValueError(f"{name} is not a finite number")


def parse_json_text(text: str, where: str):
    """JSON ``text`` -> checked data (:func:`check_tree`); NaN and Infinity refused.

    Raises:
        ConfigError: bad JSON, too deep, a non-finite number or an int beyond int64.
    """
    if _nesting(text, '"') > MAX_NESTING:
        raise ConfigError(f"{where} is nested deeper than {MAX_NESTING} levels")
    try:
        data = json.loads(text, parse_constant=_refuse_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError is a ValueError
        raise ConfigError(f"{where} is not valid JSON: {_one_line(exc)}") from None
    return check_tree(data, where)


def load_json_file(path, what: str):
    """A JSON file read by :func:`read_text_file` and parsed by :func:`parse_json_text`."""
    return parse_json_text(read_text_file(path, what), f"{what} {shown_path(path)}")


def load_toml_file(path, what: str = "config file") -> dict:
    """A TOML file read by :func:`read_text_file`, parsed and checked (:func:`check_tree`).

    Raises:
        ConfigError: bad TOML, too deep, a non-finite number or an int beyond int64.
    """
    text = read_text_file(path, what)
    where = f"{what} {shown_path(path)}"
    if _nesting(text, "\"'", comments=True) > MAX_NESTING + 1:
        raise ConfigError(f"{where} is nested deeper than {MAX_NESTING} levels")
    try:
        data = tomllib.loads(text)
    except (ValueError, RecursionError) as exc:  # TOMLDecodeError is a ValueError
        raise ConfigError(f"{where} is not valid TOML: {_one_line(exc)}") from None
    return check_tree(data, where)
