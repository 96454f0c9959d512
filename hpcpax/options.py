"""Run-time options: every ``HPCPAX_*`` setting in one place (like mpi4py's ``rc``).

Each option has an attribute on :data:`options` and an environment variable
``HPCPAX_<NAME>``. A value set in code wins; otherwise the environment is
read *when the option is used* (so a job script's ``export`` and a test's
``monkeypatch.setenv`` both take effect), else the default::

    import hpcpax
    hpcpax.options.timeout = 120          # or: export HPCPAX_TIMEOUT=120
    del hpcpax.options.timeout            # back to the environment / default

A bad value raises :class:`~hpcpax.errors.ConfigError` naming the variable.
:func:`hpcpax.init` warns once about ``HPCPAX_*`` variables that name no
option (a typo would otherwise be ignored silently). The table of options is
:data:`OPTIONS`; the README lists the same.
"""

from __future__ import annotations

import os
import re
import warnings
from dataclasses import dataclass
from typing import Callable

from .errors import ConfigError
from .input_checks import shown

__all__ = ["Option", "OPTIONS", "Options", "options", "parse_bytes", "format_bytes",
           "counted"]

_PREFIX = "HPCPAX_"
#: Variables the test suite reads itself (not library options; never warned about).
TEST_VARIABLES = ("HPCPAX_TEST_GPU", "HPCPAX_UPDATE_GOLDEN")


#: Largest integer an option takes (an int64, as the code stores them).
_INT_MAX = (1 << 63) - 1
#: Longest seconds an option takes (about 30 years: finite, and far past any job).
_SECONDS_MAX = 1e9


def _integer(minimum, unset_at=None):
    def parse(text):
        try:
            value = int(text)
        except ValueError:
            raise ValueError(f"an integer >= {minimum}") from None
        if value < minimum:
            raise ValueError(f"an integer >= {minimum}")
        if value > _INT_MAX:
            raise ValueError(f"an integer from {minimum} to {_INT_MAX}")
        return None if unset_at is not None and value == unset_at else value
    return parse


def _seconds(text):
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number of seconds >= 0") from None
    if not value >= 0:  # also refuses nan
        raise ValueError("a number of seconds >= 0")
    if value > _SECONDS_MAX:  # inf: a watchdog that never fires is 0, not inf
        raise ValueError(f"a number of seconds from 0 to {_SECONDS_MAX:.0e} (0: off)")
    return value


def _share(text):
    try:
        value = float(text)
    except ValueError:
        raise ValueError("a number from 0 to 1") from None
    if not 0 <= value <= 1:
        raise ValueError("a number from 0 to 1")
    return value


def _switch(text):
    if text not in ("0", "1"):
        raise ValueError("0 or 1")
    return text == "1"


def _choice(*choices):
    def parse(text):
        if text.lower() not in choices:
            raise ValueError(", ".join(choices[:-1]) + f" or {choices[-1]}")
        return text.lower()
    return parse


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_bytes(value, where="size"):
    """``"8G"`` -> 8589934592; None stays None; ints pass. ConfigError names ``where``."""
    if value is None or value == "":
        return None
    if (isinstance(value, int) and not isinstance(value, bool)) or (
            hasattr(value, "dtype") and value.dtype.kind in "iu"):
        number = int(value)
    else:
        match = _SIZE.match(str(value)) if isinstance(value, (str, float)) else None
        if match is None:
            raise ConfigError(f"{where} must be a size like 512M or 8G, not {value!r}")
        if len(match.group(1)) > 24:  # no size needs more digits; float() would round
            number = 1 << 63
        else:
            number = int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    if number <= 0:
        raise ConfigError(f"{where} must be a positive size, not {value!r}")
    if number >= 1 << 63:  # sizes are int64 wherever they are stored
        raise ConfigError(f"{where} must be a size below 8E (2**63 bytes), not "
                          f"{shown(value)}")
    return number


def counted(n, word) -> str:
    """``"1 node"``, ``"3 nodes"``: a count and its word, plural unless one."""
    return f"{n} {word}" + ("" if n == 1 else "s")


def format_bytes(n) -> str:
    """``3.0 GiB``-style text."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _bytes(text):
    try:
        return parse_bytes(text, "size")
    except ConfigError:
        raise ValueError("a positive size such as 512M or 8G") from None


@dataclass(frozen=True)
class Option:
    """One setting: attribute ``name``, variable ``HPCPAX_<NAME>``, parser and default;
    ``agree``: every rank must hold the same value."""

    name: str
    parse: Callable[[str], object]
    default: object
    help: str
    agree: bool = False

    @property
    def variable(self) -> str:
        """The environment variable."""
        return _PREFIX + self.name.upper()


OPTIONS = (
    Option("device", _choice("cpu", "gpu", "auto"), "auto",
           "worker device: cpu, gpu or auto (a GPU when CuPy sees one; python -m hpcpax.train "
           "only if a trial step measured faster there)"),
    Option("timeout", _seconds, 600.0,
           "seconds a guarded operation (set-up phase, step, served request) may take before "
           "the watchdog names the stuck ranks and aborts the job; 0 turns it off", agree=True),
    Option("ranks_per_node", _integer(0, unset_at=0), None,
           "cut each host into virtual nodes of this many consecutive ranks (0: hosts)",
           agree=True),
    Option("servers_per_node", _integer(0), None,
           "parameter-server ranks per node (default 1 with several ranks, else 0)", agree=True),
    Option("threads", _integer(0), None,
           "BLAS and Numba threads per rank (0: leave the libraries' own; default: the "
           "host's cores / ranks on the host)"),
    Option("server_memory", _bytes, None,
           "bytes of sparse rows and optimizer state one owner rank may hold (default: "
           "80 % of available memory / ranks on the host)"),
    Option("replica_memory", _bytes, 4 << 30,
           "bytes a whole sparse table with its optimizer slots may take on one rank: larger "
           "tables are never replicated (allgather/allreduce) nor gathered whole "
           "(gather_table, read_table); also the limit of a worker's dense layers (parameters, "
           "gradients, optimizer slots, allreduce buffer)", agree=True),
    Option("bucket_bytes", _integer(1), None,
           "dense allreduce fusion size, skipping the autotune", agree=True),
    Option("cuda_aware_mpi", _switch, None,
           "1/0: the MPI library does/does not take GPU buffers (default: ask the library)"),
    Option("run_log", str, None,
           "SQLite file of the run log (python -m hpcpax.runs), or off (default: "
           "$XDG_CACHE_HOME/hpcpax/runs.sqlite)"),
    Option("calibration_cache", str, None,
           "directory where --plan auto keeps its start-up calibration for later jobs of the "
           "same layout on the same hosts, which then skip the measurement (off: every job "
           "measures; the default)"),
    Option("numba", _switch, True, "0: NumPy reference kernels instead of the Numba ones"),
    Option("numba_lock_seconds", _seconds, 60.0,
           "seconds a rank waits for another process's hold on Numba's cache lock before it "
           "compiles its kernels without the cache (with a warning naming the holder)"),
    Option("numba_threads", _integer(1), None,
           "Numba threads of the parallel kernels (default: as for threads)"),
    Option("numba_serial_below", _integer(0), 1 << 20,
           "elements below which a Numba kernel runs on one thread"),
    Option("wait", _choice("sleep", "spin"), "sleep",
           "how every rank waits for MPI: sleep (poll, then sleep between polls, each sleep "
           "at most a tenth of the wait so far and poll_seconds: no core held) or spin "
           "(inside MPI, which busy-polls a core: for nodes with a spare core per rank)"),
    Option("poll_seconds", _seconds, 0.001,
           "longest sleep of a waiting rank between two polls (the backoff cap: latency "
           "against idle CPU; x D in a run with --time-dilation D)"),
    Option("server_poll_seconds", _seconds, None,
           "BSP parameter server: longest sleep of a server rank waiting for the workers' "
           "next operation (0: wait inside MPI, which busy-polls a core; default: as "
           "HPCPAX_WAIT says, with poll_seconds)"),
    Option("hot_rows", _integer(0), 0,
           "parameter server: rows that at least this many nodes pull or push in a step "
           "travel once, down a broadcast tree / up a reduction chain (0: off)", agree=True),
    Option("hot_rows_min_bytes", _integer(0), 16384,
           "hot rows, fixed rule (HPCPAX_HOT_ROWS): a group of rows takes a tree only when "
           "the owner bytes it saves reach this (the plan's cost model sets its own)", agree=True),
    Option("hot_rows_chunk_bytes", _integer(0), 262144,
           "hot rows: a group larger than this goes in pieces of about this size, each "
           "forwarded down its chain as soon as it arrives (pipelining; 0: whole groups, "
           "binomial trees above 3 nodes)", agree=True),
    Option("hot_rows_relay_share", _share, 0.2,
           "hot rows by relays: the busiest owners relay an operation's shared rows only when "
           "that takes at least this share off the busiest node link (0 to 1; 0: every owner "
           "with shared rows relays)", agree=True),
)
_BY_NAME = {option.name: option for option in OPTIONS}


class Options:
    """The attribute view of :data:`OPTIONS`; use the module's :data:`options`."""

    def __init__(self):
        object.__setattr__(self, "_values", {})
        object.__setattr__(self, "_warned", False)

    @staticmethod
    def _option(name) -> Option:
        try:
            return _BY_NAME[name]
        except KeyError:
            raise AttributeError(f"hpcpax has no option {name!r}; options: "
                                 f"{sorted(_BY_NAME)}") from None

    def __getattr__(self, name):
        option = self._option(name)
        if name in self._values:
            return self._values[name]
        text = os.environ.get(option.variable, "").strip()
        if not text:
            return option.default
        try:
            return option.parse(text)
        except ValueError as exc:
            raise ConfigError(f"{option.variable} must be {exc}, not {text!r}") from None

    def __setattr__(self, name, value):
        option = self._option(name)
        if value is None:
            self._values.pop(name, None)
            return
        try:
            parsed = option.parse(str(int(value) if isinstance(value, bool) else value))
        except ValueError as exc:
            raise ConfigError(f"hpcpax.options.{name} must be {exc}, not {value!r}") from None
        self._values[name] = parsed

    def __delattr__(self, name):
        self._option(name)
        self._values.pop(name, None)

    def source(self, name) -> str:
        """Where ``name``'s value comes from: ``code``, ``environment`` or ``default``."""
        option = self._option(name)
        if name in self._values:
            return "code"
        return "environment" if os.environ.get(option.variable, "").strip() else "default"

    def as_dict(self) -> dict:
        """Every option's current value."""
        return {option.name: getattr(self, option.name) for option in OPTIONS}

    def agreed_values(self) -> dict:
        """``{variable: value}`` of every option marked ``agree``, for comparison across ranks.

        A value that does not parse is ``"invalid: <text>"`` here instead of an
        error, so that ranks compare before any of them raises.
        """
        values = {}
        for option in OPTIONS:
            if option.agree:
                try:
                    values[option.variable] = getattr(self, option.name)
                except ConfigError:
                    values[option.variable] = \
                        f"invalid: {os.environ.get(option.variable, '').strip()!r}"
        return values

    def unknown_variables(self, environ=None) -> list:
        """``HPCPAX_*`` names in the environment that are no option (typos)."""
        environ = os.environ if environ is None else environ
        known = {option.variable for option in OPTIONS} | set(TEST_VARIABLES)
        return sorted(k for k in environ if k.startswith(_PREFIX) and k not in known)

    def warn_unknown(self) -> None:
        """Warn once per process about :meth:`unknown_variables`."""
        unknown = self.unknown_variables()
        if unknown and not self._warned:
            object.__setattr__(self, "_warned", True)
            warnings.warn(f"unknown hpcpax environment variable(s) {', '.join(unknown)} "
                          f"ignored; known: {', '.join(o.variable for o in OPTIONS)}",
                          stacklevel=2)


#: The options of this process.
options = Options()
