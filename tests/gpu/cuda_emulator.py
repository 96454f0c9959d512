"""A stand-in for CuPy that runs hpcpax's CUDA kernels on the CPU (test support).

``FakeCupy()`` is a module named ``cupy`` whose arrays are NumPy arrays of a
subclass whose module is ``cupy`` (so ``hpcpax.backend.is_device_array``
takes them for device arrays) and whose ``RawModule`` compiles the kernel
text the loader builds (``_kernel_source.module_code``) with g++ as C++:
``__global__`` functions become host functions, ``threadIdx``/``blockIdx``
thread-local variables, and each launch runs every thread of every block,
one after the other, or, for a kernel that calls ``__syncthreads``, a
block's threads on real threads at a barrier. No fused multiply-add
(``-ffp-contract=off``, as ``--fmad=false``), IEEE ``sqrt`` and division,
as on the GPU, so results must be bit-equal to the NumPy twins there too.

It checks what CuPy does not: each launch's argument count, that arrays go
to pointer parameters and NumPy scalars of the parameter's size to the
others (a Python ``int`` is refused), so a launcher that passes the wrong
scalar type fails here. What it cannot show: speed, races between threads
of different blocks, and the GPU's memory model.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import types

import numpy as np

_PRELUDE = r"""
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <map>
#include <string>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>
using std::sqrt;
struct hp_dim3 { unsigned x = 1, y = 1, z = 1; };
static thread_local hp_dim3 threadIdx, blockIdx;
static hp_dim3 blockDim, gridDim;
static thread_local std::barrier<>* hp_barrier = nullptr;
static inline void __syncthreads() { hp_barrier->arrive_and_wait(); }
#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static thread_local
"""

_LAUNCHER = r"""
template <typename... A, std::size_t... I>
static void hp_call(void (*f)(A...), void** args, std::index_sequence<I...>) {
    f(*static_cast<std::remove_cv_t<A>*>(args[I])...);
}

template <typename... A>
static void hp_run(void (*f)(A...), const unsigned* dims, void** args, bool sync) {
    gridDim = {dims[0], dims[1], 1};
    blockDim = {dims[2], dims[3], 1};
    const auto seq = std::index_sequence_for<A...>{};
    for (unsigned by = 0; by < dims[1]; ++by)
        for (unsigned bx = 0; bx < dims[0]; ++bx) {
            if (!sync) {
                blockIdx = {bx, by, 1};
                for (unsigned ty = 0; ty < dims[3]; ++ty)
                    for (unsigned tx = 0; tx < dims[2]; ++tx) {
                        threadIdx = {tx, ty, 1};
                        hp_call(f, args, seq);
                    }
                continue;
            }
            std::barrier<> barrier((std::ptrdiff_t)(dims[2] * dims[3]));
            std::vector<std::thread> threads;
            for (unsigned ty = 0; ty < dims[3]; ++ty)
                for (unsigned tx = 0; tx < dims[2]; ++tx)
                    threads.emplace_back([&, tx, ty] {
                        blockIdx = {bx, by, 1};
                        threadIdx = {tx, ty, 1};
                        hp_barrier = &barrier;
                        hp_call(f, args, seq);
                        barrier.arrive_and_drop();
                    });
            for (auto& t : threads) t.join();
        }
}

// Each parameter: its size, negated for a pointer.
template <typename... A>
static std::vector<long> hp_signature(void (*)(A...)) {
    return {(std::is_pointer_v<A> ? -(long)sizeof(A) : (long)sizeof(A))...};
}

struct hp_entry {
    std::function<void(const unsigned*, void**)> run;
    std::vector<long> signature;
};

static std::map<std::string, hp_entry>& hp_registry();

extern "C" int hp_signature_of(const char* name, long* out, int capacity) {
    auto it = hp_registry().find(name);
    if (it == hp_registry().end()) return -1;
    const auto& sig = it->second.signature;
    for (int i = 0; i < (int)sig.size() && i < capacity; ++i) out[i] = sig[i];
    return (int)sig.size();
}

extern "C" int hp_launch(const char* name, const unsigned* dims, void** args) {
    auto it = hp_registry().find(name);
    if (it == hp_registry().end()) return -1;
    it->second.run(dims, args);
    return 0;
}
"""


def compiler() -> str | None:
    """The C++ compiler the emulator uses (``CXX`` or g++), or None."""
    return shutil.which(os.environ.get("CXX", "g++"))


def _syncs(code: str, name: str) -> bool:
    """Whether kernel ``name``'s definition calls ``__syncthreads``."""
    match = re.search(rf"__global__\s+void\s+{re.escape(name)}\s*\(", code)
    if match is None:
        raise KeyError(f"no definition of kernel {name}")
    rest = code[match.end():]
    following = re.search(r"__global__\s+void\s+\w+\s*\(", rest)
    return "__syncthreads" in rest[:following.start() if following else len(rest)]


class _Kernel:
    def __init__(self, library, name: str):
        self._library, self._name = library, name
        signature = (ctypes.c_long * 64)()
        count = library.hp_signature_of(name.encode(), signature, 64)
        if count < 0:
            raise KeyError(f"kernel {name} is not among the module's name expressions")
        self.signature = list(signature[:count])
        self.launches = 0

    def __call__(self, grid, block, args):
        grid, block = tuple(grid) + (1,) * (2 - len(grid)), tuple(block) + (1,) * (2 - len(block))
        if len(args) != len(self.signature):
            raise TypeError(f"{self._name} takes {len(self.signature)} arguments, not {len(args)}")
        keep, pointers = [], (ctypes.c_void_p * len(args))()
        for i, (arg, size) in enumerate(zip(args, self.signature)):
            if isinstance(arg, np.ndarray):
                if size >= 0:
                    raise TypeError(f"{self._name} argument {i} must be a scalar, not an array")
                cell = ctypes.c_void_p(arg.ctypes.data)
            elif isinstance(arg, np.generic):
                if size < 0 or arg.dtype.itemsize != size:
                    raise TypeError(f"{self._name} argument {i} must be a {size}-byte "
                                    f"{'pointer' if size < 0 else 'scalar'}, not {arg.dtype}")
                cell = ctypes.create_string_buffer(arg.tobytes(), size)
            else:
                raise TypeError(f"{self._name} argument {i} must be an array or a NumPy "
                                f"scalar, not {type(arg).__name__}")
            keep.append(cell)
            pointers[i] = ctypes.cast(ctypes.pointer(cell), ctypes.c_void_p)
        dims = (ctypes.c_uint * 4)(int(grid[0]), int(grid[1]), int(block[0]), int(block[1]))
        self.launches += 1
        if self._library.hp_launch(self._name.encode(), dims, pointers) != 0:
            raise KeyError(self._name)


class _RawModule:
    """``cupy.RawModule(code=..., options=..., name_expressions=[...])`` on the CPU."""

    def __init__(self, code: str, options=(), name_expressions=()):
        if "--fmad=false" not in options:
            raise ValueError("the kernels must be compiled with --fmad=false")
        self.kernels: dict = {}
        registry = []
        for name in name_expressions:
            base = name.split("<")[0]
            sync = "true" if _syncs(code, base) else "false"
            registry.append(f'    {{"{name}", {{[](const unsigned* d, void** a) '
                            f'{{ hp_run(&{name}, d, a, {sync}); }}, hp_signature(&{name})}}}},')
        source = (_PRELUDE + code + _LAUNCHER + "static std::map<std::string, hp_entry>& hp_registry() {\n"
                  "    static std::map<std::string, hp_entry> r = {\n" + "\n".join(registry)
                  + "\n    };\n    return r;\n}\n")
        digest = hashlib.sha256(source.encode()).hexdigest()[:20]
        folder = os.path.join(tempfile.gettempdir(), f"hpcpax-cuda-emulator-{os.getuid()}")
        os.makedirs(folder, exist_ok=True)
        library = os.path.join(folder, f"{digest}.so")
        if not os.path.exists(library):
            path = os.path.join(folder, f"{digest}.{os.getpid()}.cpp")
            with open(path, "w") as f:
                f.write(source)
            partial = f"{library}.{os.getpid()}"
            subprocess.run([compiler(), "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-w",
                            "-ffp-contract=off", "-fno-strict-aliasing", "-o", partial, path],
                           check=True, capture_output=True, text=True)
            os.replace(partial, library)
        self._library = ctypes.CDLL(library)
        self._library.hp_launch.restype = ctypes.c_int
        self._library.hp_signature_of.restype = ctypes.c_int

    def get_function(self, name: str) -> _Kernel:
        if name not in self.kernels:
            self.kernels[name] = _Kernel(self._library, name)
        return self.kernels[name]


class _Pointer:
    def __init__(self, ptr):
        self.ptr = ptr


class _Device:
    def __init__(self, device=None):
        self.id = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


#: Host round trips the code under test made (what waits for the device in
#: CuPy: ``get``, a Python number from an array, a boolean mask, functions
#: whose output size depends on the data), and host-to-device uploads.
COUNTS = {"syncs": 0, "uploads": 0}
_SYNCING = ("flatnonzero", "nonzero", "argwhere", "unique", "compress", "extract", "bincount",
            "asnumpy")


def _sync():
    COUNTS["syncs"] += 1


class ndarray(np.ndarray):  # noqa: N801  (CuPy's name)
    """A NumPy array that hpcpax takes for a CuPy one."""

    def get(self, stream=None, out=None):
        _sync()
        return np.array(self, copy=True).view(np.ndarray)

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.dtype == bool:
            _sync()  # the result's size depends on the data
        return super().__getitem__(key)

    def item(self, *args):
        _sync()
        return super().item(*args)

    def tolist(self):
        _sync()
        return super().tolist()

    def __int__(self):
        _sync()
        return int(np.asarray(self).view(np.ndarray))

    def __float__(self):
        _sync()
        return float(np.asarray(self).view(np.ndarray))

    def __bool__(self):
        _sync()
        return bool(np.asarray(self).view(np.ndarray))

    def __index__(self):
        _sync()
        return int(np.asarray(self).view(np.ndarray))

    # CuPy's reductions give 0-d device arrays (no sync until read)
    def min(self, *args, **kwargs):
        return np.asarray(super().min(*args, **kwargs)).view(ndarray)

    def max(self, *args, **kwargs):
        return np.asarray(super().max(*args, **kwargs)).view(ndarray)

    def sum(self, *args, **kwargs):
        return np.asarray(super().sum(*args, **kwargs)).view(ndarray)

    @property
    def device(self):
        return _Device()

    @property
    def data(self):  # CuPy's MemoryPointer, for alignment checks
        return _Pointer(self.ctypes.data)


ndarray.__module__ = "cupy"


def _wrap(value):
    if isinstance(value, np.ndarray):
        return value.view(ndarray)
    if isinstance(value, tuple):
        return tuple(_wrap(v) for v in value)
    if isinstance(value, list):
        return [_wrap(v) for v in value]
    return value


def _unwrap(value):
    if isinstance(value, ndarray):
        return value.view(np.ndarray)
    if isinstance(value, (list, tuple)):
        return type(value)(_unwrap(v) for v in value)
    return value


def FakeCupy(sm_count: int = 1) -> types.ModuleType:  # noqa: N802  (stands for a module)
    """A fresh ``cupy`` stand-in; every NumPy function is reachable on it."""
    module = types.ModuleType("cupy")
    module.ndarray = ndarray
    module.RawModule = _RawModule
    module.__version__ = "emulated"
    properties = {"multiProcessorCount": sm_count, "name": b"CPU emulator"}
    module.cuda = types.SimpleNamespace(
        Device=_Device,
        runtime=types.SimpleNamespace(getDeviceCount=lambda: 1,
                                      getDeviceProperties=lambda device: properties,
                                      runtimeGetVersion=lambda: 0),
        get_current_stream=lambda: types.SimpleNamespace(synchronize=lambda: None),
        Event=None,
    )
    module.asnumpy = lambda a: np.asarray(_unwrap(a))

    def asarray(a, dtype=None):
        if isinstance(a, ndarray):
            return a if dtype is None or a.dtype == np.dtype(dtype) else a.astype(dtype)
        COUNTS["uploads"] += 1
        return np.array(a, dtype=dtype, copy=True).view(ndarray)  # a copy, as to a device

    module.asarray = module.array = asarray
    # CuPy sorts stably (a radix sort); NumPy's default quicksort does not
    module.argsort = lambda a, axis=-1: _wrap(np.argsort(_unwrap(a), axis=axis, kind="stable"))
    module.sort = lambda a, axis=-1: _wrap(np.sort(_unwrap(a), axis=axis, kind="stable"))

    def __getattr__(name):
        value = getattr(np, name)
        if not callable(value) or isinstance(value, type):
            return value

        def call(*args, **kwargs):
            if name in _SYNCING:
                _sync()
            return _wrap(value(*_unwrap(args), **{k: _unwrap(v) for k, v in kwargs.items()}))

        return call

    module.__getattr__ = __getattr__
    return module
