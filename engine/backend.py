"""Array backend selection for the engine: CuPy on a CUDA GPU, NumPy otherwise.

Every custom kernel has a NumPy twin; ops dispatch on the array module of their inputs
(:func:`xp_of`). CUDA sources live in ``engine/kernels/cuda/*.cu``; they are compiled by NVRTC for
the GPU present (through ``cupy.RawModule``) and, in CI, by nvcc for sm_90 and sm_121
(tests/engine/test_engine_nvcc.py). Sources must be self-contained (no host headers) with ``extern "C"``
kernels so both compilers accept them.
"""
from __future__ import annotations

import functools
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
            raise DeviceError("device 'cuda': expected cupy (pip install '.[gpu]') and a CUDA GPU, found none")
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
    device's own (cupy picks it)."""
    cp = cupy_or_none()
    if cp is None:
        raise RuntimeError("load_module needs cupy and a GPU")
    src = (CUDA_DIR / filename).read_text()
    return cp.RawModule(code=src, options=("-std=c++17",) + tuple(options))
