"""Array backend selection for the engine: CuPy on a CUDA GPU, NumPy otherwise.

Every custom kernel has a NumPy twin; ops dispatch on the array module of their inputs
(:func:`xp_of`). CUDA sources live in ``engine/kernels/cuda/*.cu``; they are compiled by NVRTC for
the GPU present (through ``cupy.RawModule``) and, in CI, by nvcc for sm_90 and sm_121
(tests/engine/test_engine_nvcc.py). Sources must be self-contained (no host headers) with ``extern "C"``
kernels so both compilers accept them.
"""
from __future__ import annotations

import ctypes
import functools
import re
import os
from pathlib import Path

import numpy as np

CUDA_DIR = Path(__file__).resolve().parent / "kernels" / "cuda"


@functools.lru_cache(maxsize=1)
def cupy_or_none():
    """The cupy module when importable and a CUDA device is present, else None."""
    if os.environ.get("QWEN4EXP_NO_GPU"):
        return None
    try:
        import cupy  # noqa: F401
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None
        return cupy
    except Exception:
        return None


def gpu_available() -> bool:
    """True when cupy imports and sees at least one CUDA device."""
    return cupy_or_none() is not None


def get_xp(device: str):
    """The array module for ``device`` ('cuda' or 'cpu').

    Raises:
        DeviceError (a reference.errors.UserError, defined here): 'cuda' asked for and no usable GPU/cupy present.
    """
    if device == "cpu":
        return np
    if device == "cuda":
        cp = cupy_or_none()
        if cp is None:
            from reference.errors import UserError

            class DeviceError(UserError, RuntimeError):
                pass
            from reference.paths import install_command
            raise DeviceError(f"device 'cuda': expected cupy (the `gpu` extra: {install_command('gpu')}) and a CUDA "
                              f"GPU, found none")
        return cp
    from reference.errors import InputError
    raise InputError(f"device: expected 'cuda' or 'cpu', found {device!r}")


def xp_of(a):
    """numpy or cupy, whichever owns array ``a`` (a quantised weight: its code array's)."""
    a = getattr(a, "storage_array", a)
    cp = cupy_or_none()
    if cp is not None and isinstance(a, cp.ndarray):
        return cp
    return np


def to_numpy(a) -> np.ndarray:
    """Host copy of a numpy or cupy array."""
    if isinstance(a, np.ndarray):
        return a
    return a.get()


@functools.lru_cache(maxsize=None)
def load_module(filename: str, options: tuple[str, ...] = ()):
    """Compile ``engine/kernels/cuda/<filename>`` with NVRTC for the current GPU (cached) and return
    it as a :class:`Module` (``get_function`` gives a :class:`Kernel`). Compile options always include
    ``-std=c++17``; the architecture is the device's own (cupy picks it). Local headers (``#include "x.cuh"``)
    are inlined (:func:`cuda_source`)."""
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("load_module needs cupy and a GPU")
    return Module(cp.RawModule(code=cuda_source(filename), options=("-std=c++17",) + tuple(options)))


class Module:
    """A compiled engine source (``cupy.RawModule``) whose kernels launch through :class:`Kernel`."""

    def __init__(self, raw):
        self.raw = raw
        self._kernels: dict = {}

    def get_function(self, name: str) -> "Kernel":
        k = self._kernels.get(name)
        if k is None:
            k = self._kernels[name] = Kernel(self.raw.get_function(name))
        return k


#: Programmatic dependent launch of captured decode steps (sm_90 and later): ``QWEN4EXP_PDL=0`` turns it off
#: (an A/B switch for benchmarks; docs/performance.md lists the engine's switches).
PDL_ENV = "QWEN4EXP_PDL"
_capture_depth = 0
#: launches made with programmatic dependent launch in this process (a check that captures use it)
pdl_launches = 0


class pdl_capture:
    """Context manager: while it is active, :class:`Kernel` launches use programmatic dependent launch (the
    kernel after another of the same stream is scheduled during that one's last wave; each kernel's
    ``GRID_DEP_ENTRY()`` waits for it, ``kernels/cuda/grid_dep.cuh``). :class:`engine.graphs.DecodeGraphs` holds
    it while it captures a step: the graph keeps the launches' programmatic edges, and its replays save the
    launch gap at each kernel boundary. Eager launches stay plain launches (no marshalling cost per call)."""

    def __enter__(self):
        global _capture_depth
        _capture_depth += 1
        return self

    def __exit__(self, *exc):
        global _capture_depth
        _capture_depth -= 1
        return False


@functools.lru_cache(maxsize=1)
def _pdl_launcher():
    """``cuLaunchKernelEx`` of the CUDA driver with its structures (ctypes), or None where the device is older
    than sm_90, the driver lacks the call, or ``QWEN4EXP_PDL=0``."""
    if os.environ.get(PDL_ENV, "1") == "0":
        return None
    cp = cupy_or_none()
    if cp is None or int(cp.cuda.Device().compute_capability) < 90:
        return None
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = lib.cuLaunchKernelEx
    except (OSError, AttributeError):
        return None

    class Attr(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
        _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int),
                    ("value_rest", ctypes.c_char * 60)]

    class Config(ctypes.Structure):  # CUlaunchConfig
        _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared", ctypes.c_uint),
                    ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(Attr)), ("n_attrs", ctypes.c_uint)]

    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.POINTER(Config), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    attr = Attr()
    attr.id = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
    attr.value = 1
    return fn, Config, attr


def _arg_holder(a):
    """A ctypes object holding kernel argument ``a`` by value, as cupy passes it: a device array or a memory
    pointer as its address, None as a null pointer, a NumPy scalar (or one-element array) as its bytes, a
    Python int / float / bool as int64 / float64 / bool."""
    if a is None:
        return ctypes.c_uint64(0)
    if not isinstance(a, (np.ndarray, np.generic, int, float)):
        ptr = getattr(getattr(a, "data", None), "ptr", None)  # a cupy array
        ptr = getattr(a, "ptr", None) if ptr is None else ptr  # a cupy MemoryPointer
        if ptr is not None:
            return ctypes.c_uint64(ptr)
    if isinstance(a, bool):
        return ctypes.c_bool(a)
    if isinstance(a, int):
        return ctypes.c_int64(a)
    if isinstance(a, float):
        return ctypes.c_double(a)
    if isinstance(a, (np.generic, np.ndarray)) and np.asarray(a).size == 1:
        raw = np.asarray(a).tobytes()
        return (ctypes.c_char * len(raw)).from_buffer_copy(raw)
    raise TypeError(f"kernel argument: expected a device array, None or a scalar, found {type(a).__name__}")


def _dim3(d) -> list:
    """A launch dimension (an int or a tuple of up to three) as three ints, each at least 1: cupy launches an
    extent of 0 as 1 (a kernel's bounds checks then do nothing), which the driver would refuse."""
    d = tuple(d) if isinstance(d, (tuple, list)) else (d,)
    return [max(1, int(v)) for v in d] + [1] * (3 - len(d))


class Kernel:
    """A kernel of a :class:`Module`: called as a ``cupy.RawKernel`` is, ``k(grid, block, args, shared_mem=0,
    stream=None)``; attributes (``max_dynamic_shared_size_bytes``...) are the cupy function's. Inside
    :class:`pdl_capture` on sm_90+ it is launched by ``cuLaunchKernelEx`` with programmatic stream
    serialization allowed; otherwise by cupy.

    Raises:
        RuntimeError: the driver refused the launch (its CUresult is named).
        TypeError: an argument of a kind cupy would not pass either.
    """

    def __init__(self, fn):
        object.__setattr__(self, "fn", fn)

    def __getattr__(self, name):
        return getattr(self.fn, name)

    def __setattr__(self, name, value):
        setattr(self.fn, name, value)

    def __call__(self, grid, block, args, shared_mem=0, stream=None):
        launcher = _pdl_launcher() if _capture_depth else None
        if launcher is None:
            return self.fn(grid, block, args, shared_mem=shared_mem, stream=stream)
        fn, Config, attr = launcher
        cp = cupy_or_none()
        cfg = Config()
        cfg.grid[:] = _dim3(grid)
        cfg.block[:] = _dim3(block)
        cfg.shared = int(shared_mem)
        cfg.stream = (stream if stream is not None else cp.cuda.get_current_stream()).ptr
        cfg.attrs = ctypes.pointer(attr)
        cfg.n_attrs = 1
        held = [_arg_holder(a) for a in args]
        params = (ctypes.c_void_p * max(1, len(held)))(*[ctypes.cast(ctypes.pointer(h), ctypes.c_void_p)
                                                          for h in held])
        rc = fn(ctypes.byref(cfg), self.fn.kernel.ptr, params, None)  # the RawKernel's CUfunction
        if rc != 0:
            raise RuntimeError(f"cuLaunchKernelEx: CUresult {rc} launching {getattr(self.fn, 'name', '?')}")
        global pdl_launches
        pdl_launches += 1


_LOCAL_INCLUDE = re.compile(r'^[ \t]*#[ \t]*include[ \t]*"([^"]+)"[ \t]*$', re.M)


def cuda_source(filename: str) -> str:
    """The text of ``engine/kernels/cuda/<filename>`` with each ``#include "x.cuh"`` of a header beside it
    replaced by that header's text (once per header; nested includes too). NVRTC gets this text, so cupy's
    compile cache (keyed on the source text) sees a header change; nvcc reads the same files directly.

    Raises:
        FileNotFoundError: the source or an included header is not in ``engine/kernels/cuda``.
    """
    seen: set[str] = set()

    def expand(name: str) -> str:
        text = (CUDA_DIR / name).read_text()

        def sub(m):
            inc = m.group(1)
            if inc in seen:
                return f"// {inc}: already included"
            seen.add(inc)
            return f"// ---- {inc} (inlined)\n" + expand(inc) + f"\n// ---- end of {inc}"
        return _LOCAL_INCLUDE.sub(sub, text)
    return expand(filename)
