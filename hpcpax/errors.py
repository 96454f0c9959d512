"""The exception hierarchy of hpcpax.

Every error hpcpax raises on purpose derives from :class:`HpcpaxError`, so a
user can catch them all; the argument errors also derive from the built-in
``ValueError``/``TypeError`` so ordinary ``except ValueError`` code works.
"""

__all__ = [
    "HpcpaxError",
    "ConfigError",
    "MismatchError",
    "TopologyError",
    "SparseIndexError",
    "NonFiniteError",
    "DependencyError",
    "CommTimeoutError",
    "CheckpointError",
    "DataError",
]


class HpcpaxError(Exception):
    """Base class of every error raised by hpcpax.

    Attributes:
        on_every_rank: True on an error that every rank raises with the same
            message (a collective check's); ``python -m hpcpax.train`` then
            prints it once, from rank 0, instead of once per rank.
    """

    on_every_rank = False


class ConfigError(HpcpaxError, ValueError):
    """A configuration value, flag or environment variable is invalid."""


class MismatchError(HpcpaxError, ValueError):
    """Ranks disagree about something that must be identical everywhere.

    The message names the first field that differs and the ranks holding
    each value; it is raised on every rank together.
    """


class TopologyError(HpcpaxError, RuntimeError):
    """The process layout cannot work (for example Slurm and MPI disagree)."""


class SparseIndexError(HpcpaxError, ValueError):
    """A sparse index is negative or not below the variable's row count."""


class NonFiniteError(HpcpaxError, FloatingPointError):
    """A gradient holds NaN or Inf and the policy is ``raise``."""


class DependencyError(HpcpaxError, ImportError):
    """An optional dependency is missing; the message names the pip extra."""


class CommTimeoutError(HpcpaxError, TimeoutError):
    """A collective did not complete within ``HPCPAX_TIMEOUT`` seconds."""


class CheckpointError(HpcpaxError, RuntimeError):
    """A checkpoint is missing, incomplete or corrupted, or a run's file cannot be written."""


class DataError(HpcpaxError, ValueError):
    """A data file is missing, malformed or holds out-of-range values."""
