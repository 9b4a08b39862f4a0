"""Array backend selection for the engine: CuPy on a CUDA GPU, NumPy otherwise.

Every custom kernel has a NumPy twin; ops dispatch on the array module of their inputs
(:func:`xp_of`). CUDA sources live in ``engine/kernels/cuda/*.cu``; they are compiled by NVRTC for
the GPU present (through ``cupy.RawModule``) and, in CI, by nvcc for sm_90 and sm_121
(tests/engine/test_engine_nvcc.py). Sources must be self-contained (no host headers) with ``extern "C"``
kernels so both compilers accept them.
"""
from __future__ import annotations

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
    the ``cupy.RawModule``. Compile options always include ``-std=c++17``; the architecture is the
    device's own (cupy picks it). Local headers (``#include "x.cuh"``) are inlined (:func:`cuda_source`)."""
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("load_module needs cupy and a GPU")
    return cp.RawModule(code=cuda_source(filename), options=("-std=c++17",) + tuple(options))


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
