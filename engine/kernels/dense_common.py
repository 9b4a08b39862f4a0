"""Helpers shared by the dense kernels (linear, MoE, norms, PLE): BF16 bit handling, argument checks
and launch helpers.

Weight formats understood by every dense op:

* ``uint16`` arrays: BF16 bit patterns (the engine's BF16 storage; cupy has no bfloat16 dtype);
* ``ml_dtypes.bfloat16`` arrays (NumPy only): viewed as their ``uint16`` bits;
* ``float32`` arrays: the exact-parity path;
* ``float64`` arrays (NumPy only): the float64 twin used by tests.
"""
from __future__ import annotations

import functools
import re

import numpy as np

from engine.backend import cupy_or_none, load_module, xp_of
from reference.errors import UserError


class KernelInputError(UserError, ValueError):
    """An engine kernel was called with arrays of the wrong shape, dtype or device."""


try:  # ml_dtypes is a hard dependency of the project; keep the import local to this module
    import ml_dtypes
    _BF16 = np.dtype(ml_dtypes.bfloat16)
except Exception:  # pragma: no cover
    ml_dtypes = None
    _BF16 = None


def to_bf16_bits(a) -> np.ndarray:
    """Round a float array to BF16 (round-to-nearest-even, via ml_dtypes) and return the ``uint16`` bits.

    Args:
        a: numpy or cupy float array of any shape.
    Returns:
        ``uint16`` array of the same shape, on the same device as ``a``.
    """
    xp = xp_of(a)
    host = np.asarray(a if xp is np else a.get(), dtype=np.float32)
    bits = host.astype(ml_dtypes.bfloat16).view(np.uint16)
    return bits if xp is np else xp.asarray(bits)


def bf16_bits_to_float32(bits):
    """Exact upcast of BF16 bit patterns (``uint16``, any shape, numpy or cupy) to ``float32``."""
    xp = xp_of(bits)
    return (bits.astype(xp.uint32) << 16).view(xp.float32)


def weight_kind(w) -> str:
    """'bf16' for uint16/bfloat16 weights, 'f32' for float32, 'f64' for float64, 'fp8' / 'nvfp4' for a
    :class:`engine.kernels.quant.QuantWeight` (stored quantised format).

    Raises:
        KernelInputError: any other dtype.
    """
    fmt = getattr(w, "fmt", None)
    if fmt is not None and hasattr(w, "storage_array"):
        return fmt
    dt = w.dtype
    if dt == np.uint16 or (_BF16 is not None and dt == _BF16):
        return "bf16"
    if dt == np.float32:
        return "f32"
    if dt == np.float64:
        return "f64"
    raise KernelInputError(f"weight: expected uint16 (BF16 bits), bfloat16, float32, float64 or a QuantWeight, "
                           f"found {dt}")


def weight_as_float(w, dtype=np.float32):
    """Weights of any supported kind as a float array of ``dtype`` (exact for BF16 -> float32; quantised
    weights dequantised by the NumPy twin :func:`engine.kernels.quant.dequantize`, host arrays)."""
    kind = weight_kind(w)
    if kind in ("fp8", "nvfp4"):
        return w.dequantize(dtype)  # QuantWeight (engine.kernels.quant), host twin
    if kind == "bf16":
        bits = w.view(np.uint16) if w.dtype != np.uint16 else w
        return bf16_bits_to_float32(bits).astype(dtype, copy=False)
    return w.astype(dtype, copy=False)


def compute_dtype(x):
    """The float dtype the NumPy twin computes in for activation ``x`` (float64 stays float64)."""
    return np.float64 if x.dtype == np.float64 else np.float32


def check_ndim(name: str, a, ndim: int, shape_doc: str) -> None:
    """Raise KernelInputError naming ``name``, ``shape_doc`` and the shape found unless ``a.ndim == ndim``."""
    if a.ndim != ndim:
        raise KernelInputError(f"{name}: expected {shape_doc} ({ndim}-D), found shape {tuple(a.shape)}")


def check_dim(name: str, got: int, want: int, what: str) -> None:
    """Raise KernelInputError naming ``name``, ``what``, ``want`` and ``got`` unless ``got == want``."""
    if got != want:
        raise KernelInputError(f"{name}: expected {what} = {want}, found {got}")


def same_device(*arrays) -> object:
    """The common array module of ``arrays`` (None entries skipped).

    Raises:
        KernelInputError: arrays live on different devices (numpy mixed with cupy).
    """
    mods = {xp_of(a) for a in arrays if a is not None}
    if len(mods) > 1:
        raise KernelInputError("arrays: expected all on one device (all numpy or all cupy), found a mix")
    return mods.pop() if mods else np


def is_cupy(xp) -> bool:
    """True when the array module ``xp`` is cupy (False when cupy is not importable)."""
    cp = cupy_or_none()
    return cp is not None and xp is cp


def module(filename: str):
    """The compiled :class:`engine.backend.Module` of ``engine/kernels/cuda/<filename>`` (NVRTC, cached)."""
    return load_module(filename)


_QGEMV2_NT = re.compile(r"^(?:qgemv2|qmma)_\w+?_nt(\d+)_")
_MOE_PAIR = re.compile(r"^moe_(?:gate_up|down)_(bf16|fp8|nvfp4)_(bf16|fp8|nvfp4)_t\d+$")
_MOE_FORMATS = ("bf16", "fp8", "nvfp4")  # moe_decode.cu's format indices


def kernel_module_options(filename: str, name: str) -> tuple[str, ...]:
    """NVRTC options of the module that holds kernel ``name`` of ``filename``: ``quant_linear.cu``'s streaming
    GEMVs (``qgemv2_<fmt>_nt<N>_...``) and tensor-core NVFP4 GEMVs (``qmma_nvfp4_nt<N>_...``) are compiled per
    activation-row tile (``-DQGEMV2_NT=<N>``), apart from the
    file's other kernels, each on first use (their instances would multiply the file's NVRTC time by ~4);
    ``moe_decode.cu``'s expert kernels (``moe_{gate_up,down}_<routed>_<shared>_t<MT>``) per format pair
    (``-DMOE_FR=<i> -DMOE_FS=<j>``), its router kernels in the module without defines."""
    if filename == "quant_linear.cu":
        m = _QGEMV2_NT.match(name)
        if m:
            return (f"-DQGEMV2_NT={int(m[1])}",)
    if filename == "moe_decode.cu":
        m = _MOE_PAIR.match(name)
        if m:
            return (f"-DMOE_FR={_MOE_FORMATS.index(m[1])}", f"-DMOE_FS={_MOE_FORMATS.index(m[2])}")
    return ()


@functools.lru_cache(maxsize=None)
def kernel(filename: str, name: str):
    """The cached :class:`engine.backend.Kernel` ``name`` of ``engine/kernels/cuda/<filename>`` (in the module
    :func:`kernel_module_options` names)."""
    return load_module(filename, kernel_module_options(filename, name)).get_function(name)


def sm_count() -> int:
    """Streaming multiprocessors of the current GPU (launch heuristics; 1 without cupy)."""
    cp = cupy_or_none()
    return _sm_count_of(int(cp.cuda.Device().id)) if cp is not None else 1


@functools.lru_cache(maxsize=None)
def _sm_count_of(device_id: int) -> int:
    return int(cupy_or_none().cuda.Device(device_id).attributes["MultiProcessorCount"])


@functools.lru_cache(maxsize=None)
def compute_capability() -> int:
    """The current GPU's compute capability as major * 10 + minor (90 on Hopper, 121 on GB10; 0 without one)."""
    cp = cupy_or_none()
    return int(cp.cuda.Device().compute_capability) if cp is not None else 0


def f32_contig(a, name: str):
    """``a`` as a C-contiguous float32 device array whose data pointer is 16-byte aligned.

    Raises:
        KernelInputError: ``a`` is not a floating array.
    """
    xp = xp_of(a)
    if a.dtype.kind != "f":
        raise KernelInputError(f"{name}: expected a float32 array, found {a.dtype}")
    if a.dtype != np.float32 or not a.flags.c_contiguous or a.data.ptr % 16:
        a = xp.ascontiguousarray(a, dtype=xp.float32)
        if a.data.ptr % 16:
            a = a.copy()
    return a


#: A null device pointer as a kernel argument (8-byte zero).
NULL_PTR = np.uint64(0)


def ptr_or_null(a):
    """``a`` itself, or a null pointer argument when ``a`` is None."""
    return NULL_PTR if a is None else a


def poison_like(shape, xp, dtype=np.float32):
    """A fresh array filled with NaN (floats) or -7 (ints): tests check every element was written."""
    if np.dtype(dtype).kind == "f":
        return xp.full(shape, np.nan, dtype=dtype)
    return xp.full(shape, -7, dtype=dtype)


#: When True (tests), every output the dense ops allocate is pre-filled with NaN (floats) or -7
#: (ints) so a kernel that leaves an element unwritten is caught. Off by default (no cost).
POISON = False


def empty(xp, shape, dtype=np.float32):
    """``xp.empty`` for op outputs; poisoned (NaN / -7) when :data:`POISON` is set."""
    if POISON:
        return poison_like(shape, xp, dtype)
    return xp.empty(shape, dtype=dtype)
