"""The CUDA sources of the sparse ops, as text; needs no CuPy.

Sources are ``kernels/*.cu`` (and ``*.cuh`` headers), read with
:mod:`importlib.resources` from the installed package ``hpcpax.kernels``
(setup.py maps the folder there) or, in a source tree, from ``kernels/``
beside the ``hpcpax/`` package. Local ``#include "x.cuh"`` lines are pasted
in, since NVRTC compiles one string. A hash of the whole folder goes into
the compile options, so CuPy's compile cache misses when any header changes.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import re
from pathlib import Path

__all__ = ["NAME_EXPRESSIONS", "ROW_VARIANTS", "kernels_dir", "kernel_sources", "kernels_hash",
           "module_code", "compile_options", "header_constant"]

#: (C type, elements per access) of every row kernel instance: HP_FOR_EACH_VEC.
ROW_VARIANTS = (("float", 1), ("float", 2), ("float", 4), ("double", 1), ("double", 2))


def _rows(*kernels):
    return [f"{k}<{t}, {v}>" for k in kernels for t, v in ROW_VARIANTS]


#: Every kernel (an NVRTC name expression) that each source file provides.
NAME_EXPRESSIONS = {
    "dedup_sum.cu": ["mark_segment_heads", "long_chunk_map"]
    + _rows("segment_sum_short", "segment_chunk_sums", "segment_tree"),
    "gather_rows.cu": _rows("gather_rows"),
    "partition_pack.cu": ["partition_of"] + _rows("pack_rows"),
    "sparse_optimizers.cu": _rows("sgd_rows", "momentum_rows", "adagrad_rows", "adam_rows"),
}

_SOURCES: dict = {}
_HASH: list = []
_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.MULTILINE)
_DEFINE = r'^[ \t]*#[ \t]*define[ \t]+{}[ \t]+(\d+)[ \t]*$'


def kernels_dir():
    """The folder (a Traversable or Path) holding the ``.cu`` sources."""
    try:
        folder = importlib.resources.files("hpcpax.kernels")
        if folder.joinpath("hpcpax_common.cuh").is_file():
            return folder
    except (ModuleNotFoundError, TypeError):
        pass
    return Path(__file__).resolve().parent.parent.parent / "kernels"


def kernel_sources() -> dict:
    """``{file name: text}`` of every ``.cu``/``.cuh`` file, read once."""
    if not _SOURCES:
        for entry in sorted(kernels_dir().iterdir(), key=lambda e: e.name):
            if entry.name.endswith((".cu", ".cuh")):
                _SOURCES[entry.name] = entry.read_text(encoding="utf-8")
    return _SOURCES


def kernels_hash(sources: dict | None = None) -> str:
    """First 16 hex digits of a SHA-256 over every kernel file's name and text."""
    if sources is None and _HASH:
        return _HASH[0]
    digest = hashlib.sha256()
    for name, text in sorted((sources or kernel_sources()).items()):
        digest.update(name.encode() + b"\0" + text.encode() + b"\0")
    value = digest.hexdigest()[:16]
    if sources is None:
        _HASH.append(value)
    return value


def module_code(filename: str, sources: dict | None = None) -> str:
    """Text of ``filename`` with its local includes pasted in, once each."""
    sources = kernel_sources() if sources is None else sources
    seen: set = set()

    def paste(text: str) -> str:
        def replace(match):
            name = match.group(1)
            if name not in sources:
                return match.group(0)
            if name in seen:
                return ""
            seen.add(name)
            return paste(sources[name])

        return _INCLUDE.sub(replace, text)

    return paste(sources[filename])


def compile_options() -> tuple:
    """NVRTC options: C++17, no fused multiply-add, and the folder's hash."""
    return ("-std=c++17", "--fmad=false", f"-DHPCPAX_KERNELS_HASH=0x{kernels_hash()}")


def header_constant(name: str) -> int:
    """The integer ``#define name N`` of ``hpcpax_common.cuh``.

    The launchers read the kernels' launch constants (block size, long-segment
    threshold) from the header itself, so the two sides cannot drift apart.

    Raises:
        KeyError: the header defines no integer constant ``name``.
    """
    match = re.search(_DEFINE.format(re.escape(name)), kernel_sources()["hpcpax_common.cuh"], re.MULTILINE)
    if match is None:
        raise KeyError(f"hpcpax_common.cuh must #define {name} as an integer")
    return int(match.group(1))
