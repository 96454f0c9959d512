"""Whether the Numba CPU fast path is on, and lazy access to its kernels.

Importing this module imports no Numba; :func:`kernels` imports
``_numba_kernels`` (and so Numba) on first use. Set ``HPCPAX_NUMBA=0`` to
force the plain NumPy path, for example to compare the two.
"""

from __future__ import annotations

import os

_KERNELS = None
_TRIED = False


def enabled() -> bool:
    """True when Numba is importable and ``HPCPAX_NUMBA`` is not ``"0"``."""
    if os.environ.get("HPCPAX_NUMBA", "1") == "0":
        return False
    return kernels() is not None


def kernels():
    """The ``_numba_kernels`` module, or None when Numba cannot be imported."""
    global _KERNELS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            from . import _numba_kernels  # noqa: PLC0415  (lazy: numba is slow to import)

            _KERNELS = _numba_kernels
        except ImportError:
            _KERNELS = None
    return _KERNELS


def num_chunks(work_items: int, per_thread: int = 4) -> int:
    """Chunks for a parallel loop: a few per Numba thread, never more than items."""
    import numba  # noqa: PLC0415

    return max(1, min(work_items, numba.get_num_threads() * per_thread))
