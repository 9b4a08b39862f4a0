"""Tensor-core prefill GEMMs, float32-equivalent: ``Y[M, N] = X[M, K] @ W[N, K]^T`` with float32 activations,
stored BF16 / NVFP4 / FP8 weights (float32 ones: SGEMM) and float32 accumulation, on cuBLAS's BF16 tensor-core GEMM.

Exactness (the engine's default numerics, "stored weights, FP32 accumulation"): every float32 activation is split
exactly into three BF16 parts, ``x == hi + mid + lo`` (truncating split of ``common.cuh:split3``; NumPy twin
:func:`split3_twin`), and each part is multiplied with the BF16 weights by one cuBLAS GEMM
(``CUBLAS_COMPUTE_32F``) accumulating into the same float32 output (``beta`` 0, then 1; smallest part first).
A product of two BF16 values is exact in float32, so the result is a float32 sum of the exact products
``x_k * w_k`` - a float32 GEMM up to the order and the tensor core's internal rounding of the summation (bounded
by the classical ``K * eps32 * sum_k |x_k w_k|``; tests/engine/test_gemm_tc.py). Activations are never
rounded to BF16. Parts below 2^-126 are BF16 subnormals the tensor core may flush (absolute error ~2^-126 *
sum|w|); a non-finite activation gives NaN (as the tensor-core GEMV, ``cuda/dense_linear_mma.cu``).

Weights:

* BF16: used directly.
* NVFP4 (:class:`engine.kernels.quant.QuantWeight`): ``code * scale`` (E2M1 x E4M3: at most 6 significant bits,
  magnitudes 2^-10 .. 2688) is exact in BF16; ``cuda/gemm_tc.cu:nvfp4_to_bf16`` writes those products to a scratch
  buffer and the float32 global scale ``weight_scale_2`` (one per stacked source matrix: gate and up halves keep
  their own) multiplies the GEMM's output rows. Not bit-identical to the reader's per-element
  ``(code * scale) * scale_2`` followed by a float32 sum: the one float32 rounding per weight of the reader moves to
  one rounding per output; float32-accurate (relative difference ~eps32).
* float32 (the router): cuBLAS SGEMM, ``CUBLAS_COMPUTE_32F_PEDANTIC`` (no TF32): a float32 GEMM.
* FP8 (128 x 128 block scales varying along K, so no scale can be moved out of the K sum):
  ``cuda/gemm_tc.cu:fp8_to_bf16x3`` dequantises each weight to float32 exactly as the reader (``code * scale``) and
  splits it into three BF16 parts too; the nine part-by-part GEMMs (smallest first) accumulate every exact
  product ``x_i w_j`` of the parts, i.e. a float32 sum of the exact products ``x_k w_k`` with the reader's weights
  (bound ``(K + 9) eps32 sum |x w|``). Three times the GEMMs of BF16 (ceiling ~1/9 of the BF16 rate), still far
  above the float32-FMA kernels. Dense projections: nine GEMMs. Expert stacks (MoE): per weight part one batched
  GEMM over the tiles (which carry all three activation parts), lo first, accumulating (``beta`` 0, 1, 1), so each
  tile's part products are again sums of all nine exact pair products. A whole stack in three BF16 parts is 6 bytes
  per weight (10 GB for one real-width gate_up), so the tiles run in windows (:func:`moe_fp8_windows`): a window
  of ``w`` tiles uses at most ``min(w, E)`` experts (the tile table is sorted by expert), whose parts must fit
  :data:`MOE_FP8_SCRATCH_BYTES`; ``gemm_tc.cu:tile_ptrs`` numbers the window's experts into scratch slots and
  ``fp8_to_bf16x3`` dequantises only those (an expert whose tiles straddle two windows is dequantised twice).
  ``QWEN4EXP_TC_FP8=0`` (:data:`FP8_ENABLED`) keeps FP8, dense and experts, on ``quant_linear.cu``.

MoE prefill (:func:`moe_experts_tc`): the routed slots are gathered (and split) into a tile-padded buffer, one
tile of :data:`MOE_TILE_ROWS` rows per entry of the device tile table of :func:`engine.kernels.tiles.moe_route_tables`
(tile ``t`` owns padded rows ``[t * R, (t + 1) * R)``; its three parts are stored one after the other), and one
``cublasGemmBatchedEx`` per projection runs every tile's ``3 R`` part rows against its expert's weights through
device pointer arrays (``gemm_tc.cu:tile_ptrs``): each expert's weights are read once per tile, not once per part.
The three part products are summed afterwards, ``(lo + mid) + hi`` (round-to-nearest float32 adds, the dense
path's order), fused into the SwiGLU (which also writes the down projection's input parts) and into the down
output's reduction. The batch is sized by the host-known worst case ``S // R + min(E, S)`` tiles
(``S = T * top_k``); tiles past the device-side count are computed on whatever their padded rows hold and never
read. Nothing is copied to the host. The MoE uses the path only when that worst case pads the slots at most
:data:`MOE_MAX_PAD` times (BF16; few tokens per expert: the grouped GEMV tiles of ``linear.py`` stay), or
:data:`MOE_MAX_PAD_NVFP4` / :data:`MOE_MAX_PAD_FP8` times for NVFP4 / FP8 experts (whose grouped kernels are
float32 FMAs); otherwise (and for decode, below :data:`TC_MIN_ROWS` tokens) the grouped kernels of
``quant_linear.cu`` / ``linear.py`` run.

cuBLAS: called straight into libcublas through ctypes (:class:`_CtypesBlas`: cupy's binding has no
``cublasGemmBatchedEx`` and refuses cuBLAS calls during stream capture; it remains a dense-only fallback, which the
callers skip while the current stream captures), one handle per device owned by this module (cupy's own handle
keeps its state), pointer mode host (the scalars 0 and 1 are captured by value), its stream set to cupy's current
stream before every call, an explicit workspace (so a CUDA-graph capture allocates nothing; one per device: the
engine's streams are ordered with the legacy default stream, so no two GEMMs of a device run at once):
capturable, deterministic (no atomics mode).

Switches (A/B in the bench): ``QWEN4EXP_TC_PREFILL=0`` (read at import; :data:`TC_ENABLED`) turns the path off:
the float32-FMA kernels of ``dense_linear.cu`` / ``quant_linear.cu`` are used again. :data:`TC_MIN_ROWS`
(``QWEN4EXP_TC_MIN_ROWS``) is the number of rows from which :func:`engine.kernels.linear.linear` and the MoE use
it (decode, at most 16 rows, never does). :data:`SPLITS` (tests only: 2 drops ``lo``, a negative control).
"""
from __future__ import annotations

import dataclasses
import functools
import os

import numpy as np

from engine.backend import cupy_or_none
from engine.kernels.dense_common import empty as _empty
from engine.kernels.tiles import combine, moe_route_tables
from engine.kernels.dense_common import KernelInputError, NULL_PTR, f32_contig, kernel, ptr_or_null, weight_kind
from engine.kernels.quant import QuantWeight

__all__ = ["TC_ENABLED", "TC_MIN_ROWS", "MOE_TILE_ROWS", "MOE_MAX_PAD", "MOE_MAX_PAD_NVFP4", "MOE_MAX_PAD_FP8",
           "MOE_FP8_SCRATCH_BYTES", "MOE_MAX_TOKENS", "K_CHUNK", "FP8_ENABLED", "SPLITS", "BLAS_ERRORS",
           "split3_twin", "tc_weight_ok", "use_tc", "use_tc_moe", "available", "blas_backend", "linear_tc",
           "moe_experts_tc", "moe_tc_max_tiles", "moe_fp8_windows"]

#: Master switch of the tensor-core prefill path (``QWEN4EXP_TC_PREFILL=0`` turns it off).
TC_ENABLED = os.environ.get("QWEN4EXP_TC_PREFILL", "1").strip() != "0"
#: Activation rows (tokens; MoE: tokens of the block) from which the tensor-core GEMM is used.
TC_MIN_ROWS = int(os.environ.get("QWEN4EXP_TC_MIN_ROWS", "64"))
#: Rows per tile of the MoE's batched GEMM (padding per expert < this; the batch is S // R + min(E, S) tiles).
MOE_TILE_ROWS = int(os.environ.get("QWEN4EXP_TC_MOE_TILE_ROWS", "64"))
#: The padding bound for NVFP4 experts: their grouped kernels decode every weight in float32 FMAs (measured on the
#: H200: 27.9 ms at 512 tokens, 1.8 TFLOP/s), so the tensor cores win even with heavily padded tiles.
MOE_MAX_PAD_NVFP4 = float(os.environ.get("QWEN4EXP_TC_MOE_MAX_PAD_NVFP4", "64"))
#: Tokens per MoE pass (longer chunks are split: the padded buffers take ~75 KB per padded row at real widths,
#: ~9 GB at 8192 tokens x top-10).
MOE_MAX_TOKENS = int(os.environ.get("QWEN4EXP_TC_MOE_MAX_TOKENS", "8192"))
#: The MoE uses the tensor-core path while ``moe_tc_max_tiles(S, E) * R <= MOE_MAX_PAD * S`` (padding bound).
MOE_MAX_PAD = float(os.environ.get("QWEN4EXP_TC_MOE_MAX_PAD", "4"))
#: The padding bound for FP8 experts. The tensor-core path runs nine part GEMMs per projection and dequantises every
#: used expert each pass (a fixed ~6 ms per real-width layer), so it needs more tokens per expert than NVFP4: measured
#: on the H200 (4-layer real-width prefill, lab/prof_prefill.py): 4096 tokens (1.8x padding) 564.6 -> 505.1 ms, but
#: 512 tokens (7.4x) 94.9 -> 105.3 ms and 256 (13.8x) 52.0 -> 80.3 ms; the crossing, interpolated, near 1,000 tokens
#: (~4x). 3: the path from ~1,650 tokens at real widths.
MOE_MAX_PAD_FP8 = float(os.environ.get("QWEN4EXP_TC_MOE_MAX_PAD_FP8", "3"))
#: Bytes of dequantised FP8 expert weights (three BF16 parts, 6 bytes per weight) the MoE holds at once: the tiles
#: run in windows of at most this many bytes / (6 N K) tiles, each dequantising only the experts its tiles use (a
#: whole real-width gate_up stack would take 10 GB; 2 GiB: windows of 109 gate_up / 218 down tiles). Measured at
#: 4096 tokens (4-layer prefill): 512 MiB 531.7 ms, 2 GiB 505.1 ms, 8 GiB (one window) 576.0 ms.
MOE_FP8_SCRATCH_BYTES = int(float(os.environ.get("QWEN4EXP_TC_MOE_FP8_SCRATCH_MB", "2048")) * (1 << 20))
#: At most this many columns of K per GEMM call of the hi part (0: all of K; equal chunks). The tensor core's
#: internal accumulation truncates, so a chain of K / 16 steps biases a long dot product by ~K/16 float32 ulps:
#: measured on the H200 (M = 4096, bench_tc) 2.7e-6 relative at K = 2560 and 6.8e-6 at K = 6144 unchunked, 6.0e-7
#: with 640-column chunks, against 9e-7 / 1.4e-6 for the float32-FMA GEMM; but 640-column chunks halved the speed
#: (220 -> 111 TFLOP/s at N = 10240). Chunks accumulate with round-to-nearest adds (beta = 1) between calls. The
#: default 4096 caps the chain at 256 steps, so the bias stays ~<= 4e-6 at every K (K = 2560 runs unchunked, K =
#: 6144 / 10240 in 2 / 3 chunks); 1024 gives about the FMA GEMM's error. Only the hi part (FP8: the hi x hi pair)
#: is chunked: mid and lo are <= 2^-8 of it and add <= 2^-8 of its bias.
K_CHUNK = int(os.environ.get("QWEN4EXP_TC_K_CHUNK", "4096"))
#: FP8 weights on the tensor cores, dense and expert stacks (nine part GEMMs; ``QWEN4EXP_TC_FP8=0``: quant_linear.cu's
#: tiled and grouped GEMMs).
FP8_ENABLED = os.environ.get("QWEN4EXP_TC_FP8", "1").strip() != "0"
#: Activation parts multiplied (3: exact; 2 drops lo, 1 keeps hi only: negative controls / speed bounds).
SPLITS = 3

# cuBLAS enums (cublas_api.h / library_types.h)
_OP_N, _OP_T = 0, 1
_R_32F, _R_16BF = 0, 14
_COMPUTE_32F, _COMPUTE_32F_PEDANTIC = 68, 69
_GEMM_DEFAULT = -1
_DISALLOW_REDUCED_PRECISION_REDUCTION = 16
_WORKSPACE_BYTES = 64 << 20

_ZERO = np.zeros(1, np.float32)  # host scalars (pointer mode host: read when each call is enqueued)
_ONE = np.ones(1, np.float32)


def split3_twin(x):
    """NumPy twin of ``common.cuh:split3``: the truncating split of float32 ``x`` into three BF16 parts.

    Args:
        x: float array (any shape; cast to float32).
    Returns:
        ``(hi, mid, lo)``: ``uint16`` BF16 bit arrays of ``x``'s shape, with ``hi + mid + lo == x`` exactly for
        finite ``x`` whose parts are normal (``|x|`` above ~2^-102), evaluated in float64.
    """
    x = np.ascontiguousarray(x, dtype=np.float32)
    mask = np.uint32(0xFFFF0000)
    hi = x.view(np.uint32) & mask
    r = (x - hi.view(np.float32)).astype(np.float32)
    mid = r.view(np.uint32) & mask
    lo = (r - mid.view(np.float32)).astype(np.float32).view(np.uint32)
    return tuple((p >> np.uint32(16)).astype(np.uint16) for p in (hi, mid, lo))


def tc_weight_ok(w, kinds=("bf16", "f32", "nvfp4", "fp8")) -> bool:
    """Whether weight ``w`` (array or QuantWeight) is of one of the ``kinds`` this module takes (weight_kind)."""
    try:
        kind = weight_kind(w)
    except KernelInputError:
        return False
    return kind in kinds


def use_tc(rows: int, w, *, enabled: bool | None = None, min_rows: int | None = None,
           fp8: bool | None = None) -> bool:
    """The dense dispatch rule (pure host logic, CPU-tested): the tensor-core path for ``rows >= TC_MIN_ROWS``
    activation rows over a BF16 / float32 / NVFP4 weight, or a 2-D FP8 one when :data:`FP8_ENABLED`, when
    :data:`TC_ENABLED`."""
    enabled = TC_ENABLED if enabled is None else bool(enabled)
    min_rows = TC_MIN_ROWS if min_rows is None else int(min_rows)
    fp8 = FP8_ENABLED if fp8 is None else bool(fp8)
    kinds = ("bf16", "f32", "nvfp4", "fp8") if fp8 else ("bf16", "f32", "nvfp4")
    return enabled and rows >= max(min_rows, 1) and tc_weight_ok(w, kinds) and len(w.shape) == 2


def use_tc_moe(T: int, k: int, E: int, gate_up, down, *, enabled: bool | None = None, min_rows: int | None = None,
               tile_rows: int | None = None, max_pad: float | None = None, fp8: bool | None = None) -> bool:
    """The MoE dispatch rule (pure host logic): :func:`use_tc`'s for ``T`` tokens, BF16, NVFP4 or (when
    :data:`FP8_ENABLED`) FP8 expert stacks, and the padded batch ``moe_tc_max_tiles(T * k, E) * R`` at most
    ``max_pad`` times ``T * k`` (default :data:`MOE_MAX_PAD`; :data:`MOE_MAX_PAD_NVFP4` when an expert stack is
    NVFP4, else :data:`MOE_MAX_PAD_FP8` when one is FP8)."""
    enabled = TC_ENABLED if enabled is None else bool(enabled)
    min_rows = TC_MIN_ROWS if min_rows is None else int(min_rows)
    R = MOE_TILE_ROWS if tile_rows is None else int(tile_rows)
    fp8 = FP8_ENABLED if fp8 is None else bool(fp8)
    if max_pad is None:
        nv = any(tc_weight_ok(w, ("nvfp4",)) for w in (gate_up, down))
        f8 = any(tc_weight_ok(w, ("fp8",)) for w in (gate_up, down))
        max_pad = MOE_MAX_PAD_NVFP4 if nv else (MOE_MAX_PAD_FP8 if f8 else MOE_MAX_PAD)
    max_pad = float(max_pad)
    S = T * k
    if not (enabled and T >= max(min_rows, 1) and S > 0):
        return False
    if not all(tc_weight_ok(w, ("bf16", "nvfp4", "fp8") if fp8 else ("bf16", "nvfp4")) for w in (gate_up, down)):
        return False
    # every per-tile pointer of the batched GEMM 16-byte aligned: expert strides and tile heights multiples of 8
    if R % 8 or any((int(w.shape[1]) * int(w.shape[2])) % 8 for w in (gate_up, down)):
        return False
    return moe_tc_max_tiles(S, E, R) * R <= max_pad * S


@functools.lru_cache(maxsize=1)
def _cupy_cublas():
    """cupy's cuBLAS binding module (importing it also loads libcublas into the process)."""
    try:
        from cupy_backends.cuda.libs import cublas
    except ImportError:  # pragma: no cover - older cupy layouts
        from cupy.cuda import cublas
    return cublas


def _libcublas_candidates() -> list[str]:
    """Where libcublas is: the copy already mapped into this process (cupy's), a CUDA toolkit's or the nvidia
    wheel's copy, then the usual sonames (the dynamic loader's search)."""
    import glob
    names = []
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if line.strip() else ""
                if path.rsplit("/", 1)[-1].startswith("libcublas.so") and path not in names:
                    names.append(path)
    except OSError:  # pragma: no cover - no procfs
        pass
    roots = [os.environ.get("CUDA_PATH", ""), "/usr/local/cuda"]
    try:
        import nvidia.cublas  # the pip wheel cupy may use
        roots += list(getattr(nvidia.cublas, "__path__", []))
    except Exception:  # noqa: BLE001 - not installed
        pass
    for r in roots:
        if r:
            names += sorted(glob.glob(os.path.join(r, "lib*", "libcublas.so*")), reverse=True)
    return names + ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


class _CtypesBlas:
    """The cuBLAS calls of this module straight into libcublas (ctypes): cupy's binding lacks
    ``cublasGemmBatchedEx`` and refuses every cuBLAS call while a stream is being captured, which cuBLAS itself
    supports. Signatures: cublas_api.h (all enums are C ints)."""

    capture_ok = True

    def __init__(self):
        import ctypes
        try:  # cupy's binding and its own handle: libcublas is then certainly mapped (first in /proc/self/maps)
            _cupy_cublas()
            cupy_or_none().cuda.device.get_cublas_handle()
        except Exception:  # noqa: BLE001 - the other candidates remain
            pass
        self.ct = ctypes
        lib, errs = None, []
        for name in _libcublas_candidates():
            try:
                lib = ctypes.CDLL(name)
                break
            except OSError as e:
                errs.append(f"{name}: {e}")
        if lib is None:
            raise OSError("libcublas: not loadable (" + "; ".join(errs) + ")")
        P, I = ctypes.c_void_p, ctypes.c_int

        def fn(names, argtypes):
            for n in names:
                f = getattr(lib, n, None)
                if f is not None:
                    f.argtypes, f.restype = argtypes, ctypes.c_int
                    return f
            raise OSError(f"libcublas: none of {names} exported")
        self._create = fn(("cublasCreate_v2", "cublasCreate"), [ctypes.POINTER(P)])
        self._set_stream = fn(("cublasSetStream_v2", "cublasSetStream"), [P, P])
        self._set_workspace = fn(("cublasSetWorkspace_v2", "cublasSetWorkspace"), [P, P, ctypes.c_size_t])
        self._set_math = fn(("cublasSetMathMode",), [P, I])
        # handle, transa, transb, m, n, k, alpha, A, Atype, lda, B, Btype, ldb, beta, C, Ctype, ldc,
        # [batchCount,] computeType, algo
        gemm = [P, I, I, I, I, I, P, P, I, I, P, I, I, P, P, I, I]
        self._gemm_ex = fn(("cublasGemmEx",), gemm + [I, I])
        self._gemm_batched_ex = fn(("cublasGemmBatchedEx",), gemm + [I, I, I])

    @staticmethod
    def _check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"cuBLAS {what}: status {status} (cublasStatus_t), expected 0 (CUBLAS_STATUS_SUCCESS)")

    def create(self) -> int:
        h = self.ct.c_void_p()
        self._check(self._create(self.ct.byref(h)), "cublasCreate")
        self._check(self._set_math(h, _DISALLOW_REDUCED_PRECISION_REDUCTION), "cublasSetMathMode")
        return int(h.value)

    def bind(self, h: int, stream: int, ws) -> None:
        self._check(self._set_stream(h, stream), "cublasSetStream")
        # (cublasSetStream resets the workspace to cuBLAS's default pool: set ours again)
        self._check(self._set_workspace(h, ws.data.ptr, _WORKSPACE_BYTES), "cublasSetWorkspace")

    def gemm(self, h, *args) -> None:
        self._check(self._gemm_ex(h, *args), "cublasGemmEx")

    def gemm_batched(self, h, *args) -> None:
        self._check(self._gemm_batched_ex(h, *args), "cublasGemmBatchedEx")


class _CupyBlas:
    """Fallback: cupy's binding (``gemmEx`` only; no calls while a stream is being captured)."""

    capture_ok = False

    def __init__(self):
        self.cb = _cupy_cublas()
        if not hasattr(self.cb, "gemmEx"):
            raise OSError("cupy's cuBLAS binding has no gemmEx")

    def create(self) -> int:
        h = self.cb.create()
        try:
            self.cb.setMathMode(h, _DISALLOW_REDUCED_PRECISION_REDUCTION)
        except Exception:  # pragma: no cover - the default math mode is the same for F32 outputs
            pass
        return h

    def bind(self, h: int, stream: int, ws) -> None:
        self.cb.setStream(h, stream)
        if hasattr(self.cb, "setWorkspace"):
            self.cb.setWorkspace(h, ws.data.ptr, _WORKSPACE_BYTES)

    def gemm(self, h, *args) -> None:
        self.cb.gemmEx(h, *args)

    def gemm_batched(self, h, *args) -> None:
        if not hasattr(self.cb, "gemmBatchedEx"):
            raise RuntimeError("cupy's cuBLAS binding has no gemmBatchedEx")
        self.cb.gemmBatchedEx(h, *args)


#: Why a cuBLAS caller could not be set up (``"Class: error"`` strings; see :func:`blas_backend`).
BLAS_ERRORS: list = []


@functools.lru_cache(maxsize=1)
def _blas():
    """The cuBLAS caller (ctypes into libcublas; cupy's binding if that fails; None without either)."""
    if cupy_or_none() is None:
        return None
    for cls in (_CtypesBlas, _CupyBlas):
        try:
            return cls()
        except Exception as e:  # noqa: BLE001 - try the next way in; the reason is kept
            BLAS_ERRORS.append(f"{cls.__name__}: {type(e).__name__}: {e}")
    return None


def blas_backend(verbose: bool = False) -> str:
    """'ctypes' (libcublas directly), 'cupy' (cupy's binding: dense only, never inside a capture) or 'none';
    ``verbose`` appends why a preferred caller failed (:data:`BLAS_ERRORS`)."""
    b = _blas()
    name = "none" if b is None else ("ctypes" if isinstance(b, _CtypesBlas) else "cupy")
    return name + (f" ({'; '.join(BLAS_ERRORS)})" if verbose and BLAS_ERRORS else "")


def _capturing() -> bool:
    cp = cupy_or_none()
    try:
        return bool(cp.cuda.get_current_stream().is_capturing())
    except Exception:  # noqa: BLE001 - cannot tell (e.g. the legacy stream while another one captures): assume so
        return True


def available(grouped: bool = False) -> bool:
    """Whether the tensor-core GEMMs can run now: a cuBLAS caller exists (:func:`blas_backend`), it has the
    batched GEMM when ``grouped``, and, with cupy's binding (which refuses cuBLAS during stream capture), the
    current stream is not capturing (the callers then take the float32-FMA kernels)."""
    b = _blas()
    if b is None:
        return False
    if isinstance(b, _CupyBlas):
        if grouped and not hasattr(b.cb, "gemmBatchedEx"):
            return False
        return not _capturing()
    return True


@functools.lru_cache(maxsize=None)
def _handle_for(device_id: int):
    cp = cupy_or_none()
    with cp.cuda.Device(device_id):
        h = _blas().create()
        ws = cp.empty(_WORKSPACE_BYTES, dtype=cp.uint8)
    return h, ws  # ws kept alive with the handle


def _handle():
    """This device's handle, bound to cupy's current stream and this module's workspace."""
    cp = cupy_or_none()
    h, ws = _handle_for(cp.cuda.Device().id)
    _blas().bind(h, cp.cuda.get_current_stream().ptr, ws)
    return h


def _grid1(n: int, block: int = 256) -> tuple[int]:
    return (max(1, -(-int(n) // block)),)


def _nparts() -> int:
    if SPLITS not in (1, 2, 3):
        raise KernelInputError(f"gemm_tc.SPLITS: expected 1, 2 or 3, found {SPLITS}")
    return int(SPLITS)


def _split_rows(xp, x, rows_out: int, row_index=None, tiles=None, tm: int = 0):
    """The three BF16 parts of ``x``'s rows as uint16 ``[3 * rows_out, K]``: dense (``tiles`` None: part ``p`` of
    row ``r`` at row ``p * rows_out + r``) or gathered into the part-interleaved tile layout (``gemm_tc.cu``)."""
    K = int(x.shape[1])
    parts = xp.empty((3 * rows_out, K), dtype=xp.uint16)  # (scratch: POISON's -7 fill is for int outputs)
    if rows_out == 0 or K == 0:
        return parts
    vec4 = 1 if (K % 4 == 0 and x.data.ptr % 16 == 0) else 0
    tb = (tiles.start, tiles.count, tiles.n_tiles) if tiles is not None else (NULL_PTR, NULL_PTR, NULL_PTR)
    kernel("gemm_tc.cu", "split3_rows")((rows_out,), (256,), (
        x, ptr_or_null(row_index), parts, tb[0], tb[1], tb[2], np.int32(max(tm, 1)), np.int64(rows_out), np.int32(K),
        np.int32(0 if tiles is None else 1), np.int32(_nparts()), np.int32(vec4)))
    return parts


def _bf16_weight(xp, w):
    """``(bf16 uint16 array [.., N, K] contiguous, scale2 info or None)`` for a BF16 or NVFP4 weight."""
    kind = weight_kind(w)
    if kind == "bf16":
        b = w if w.dtype == np.uint16 else w.view(np.uint16)
        return (b if b.flags.c_contiguous else xp.ascontiguousarray(b)), None
    if kind != "nvfp4":
        raise KernelInputError(f"weight: the tensor-core GEMM takes BF16 or NVFP4 weights here, found {kind}")
    q = w.q if w.q.flags.c_contiguous else xp.ascontiguousarray(w.q)
    s = w.scale if w.scale.flags.c_contiguous else xp.ascontiguousarray(w.scale)
    if q.data.ptr % 8:
        q = q.copy()
    n = int(np.prod(w.shape))
    out = xp.empty(tuple(w.shape), dtype=xp.uint16)
    if n:
        kernel("gemm_tc.cu", "nvfp4_to_bf16")(_grid1(n // 16), (256,), (q, s, out, np.int64(n // 16)))
    N = int(w.shape[-2])
    return out, (xp.ascontiguousarray(w.scale2), N // w.s2_rows, int(w.s2_rows))


def _fp8_dequant3(xp, w, out, slots: int, pslots: int, slot_expert=None) -> None:
    """``fp8_to_bf16x3``: the three BF16 parts of the float32-dequantised FP8 weight ``w`` ([N, K], or a stack
    [E, N, K] with ``slot_expert``, int32 ``[slots]``: the expert of each slot, -1 skipped) into uint16 ``out``
    ``[3, pslots, N, K]`` (part-major; slots ``[0, slots)`` written)."""
    N, K = (int(s) for s in w.shape[-2:])
    q = w.q if w.q.flags.c_contiguous else xp.ascontiguousarray(w.q)
    sc = w.scale if w.scale.flags.c_contiguous else xp.ascontiguousarray(w.scale)
    vec4 = 1 if (K % 4 == 0 and q.data.ptr % 4 == 0) else 0
    per = -(-N * K // (256 * (4 if vec4 else 1)))
    gx = max(1, min(per, max(8, 4096 // max(slots, 1))))  # ~4096 blocks in all: enough to stream at full bandwidth
    kernel("gemm_tc.cu", "fp8_to_bf16x3")((gx, max(slots, 1)), (256,), (
        q, sc, ptr_or_null(slot_expert), np.int32(pslots), out, np.int32(N), np.int32(K), np.int32(w.rb),
        np.int32(w.cb), np.int32(sc.shape[-1]), np.int32(vec4)))


def _fp8_parts(xp, w):
    """The three BF16 parts of the float32-dequantised FP8 weight ``w`` [N, K]: uint16 ``[3 * N, K]`` (hi, mid, lo)."""
    N, K = (int(s) for s in w.shape)
    out = xp.empty((3 * N, K), dtype=xp.uint16)
    if N * K:
        _fp8_dequant3(xp, w, out, 1, 1)
    return out


def _pair_order():
    """(activation part, weight part) of the FP8 path's nine GEMMs (``SPLITS`` activation parts), smallest product
    first (part p ~ 2^(-8 p) of its value)."""
    pairs = [(i, j) for i in range(_nparts()) for j in range(3)]
    return sorted(pairs, key=lambda ij: (-(ij[0] + ij[1]), -ij[0]))


def _k_chunks(K: int, chunked: bool) -> list[tuple[int, int]]:
    """``(k0, kn)`` column ranges of one part's GEMM calls: all of K, or (``chunked`` and :data:`K_CHUNK` > 0)
    ``ceil(K / K_CHUNK)`` near-equal chunks, multiples of 8 columns (16-byte aligned pointers) but the last."""
    if not chunked or K_CHUNK <= 0 or K <= K_CHUNK:
        return [(0, K)]
    n = -(-K // int(K_CHUNK))
    kc = -(-(-(-K // n)) // 8) * 8
    return [(k0, min(kc, K - k0)) for k0 in range(0, K, kc)]


def _part_order():
    """(part index, beta) of the dense GEMMs: lo (beta 0), mid, hi (beta 1): the smallest part first."""
    return [(p, _ZERO if i == 0 else _ONE) for i, p in enumerate((2, 1, 0)[3 - _nparts():])]


def linear_tc(x, w, *, out=None):
    """``x @ w.T`` on the tensor cores (module docstring: exactness, formats). CUDA only.

    Args:
        x: ``[M, K]`` float32 cupy array.
        w: ``[N, K]`` BF16 bits (uint16), float32, or an NVFP4 / FP8 :class:`~engine.kernels.quant.QuantWeight`.
        out: optional ``[M, N]`` float32 cupy array written in full.
    Returns:
        ``[M, N]`` float32.
    Raises:
        KernelInputError: shapes or weight kind not supported.
    """
    cp = cupy_or_none()
    if x.ndim != 2 or len(w.shape) != 2 or int(w.shape[1]) != int(x.shape[1]):
        raise KernelInputError(f"x/w: expected [M, K] and [N, K], found {tuple(x.shape)} / {tuple(w.shape)}")
    M, K = (int(s) for s in x.shape)
    N = int(w.shape[0])
    direct = out is not None and out.dtype == np.float32 and out.flags.c_contiguous
    y = out if direct else _empty(cp, (M, N), dtype=cp.float32)
    if M and N:
        x = f32_contig(x, "x")
        blas, h = _blas(), _handle()
        if weight_kind(w) == "f32":
            wf = w if w.flags.c_contiguous else cp.ascontiguousarray(w)
            blas.gemm(h, _OP_T, _OP_N, N, M, K, _ONE.ctypes.data, wf.data.ptr, _R_32F, K, x.data.ptr, _R_32F, K,
                      _ZERO.ctypes.data, y.data.ptr, _R_32F, N, _COMPUTE_32F_PEDANTIC, _GEMM_DEFAULT)
        elif K == 0:
            y.fill(0)
        elif weight_kind(w) == "fp8":
            wparts = _fp8_parts(cp, w)
            parts = _split_rows(cp, x, M)
            pb, wb_ = M * K * 2, N * K * 2
            first = True
            for i, j in _pair_order():
                for k0, kn in _k_chunks(K, i == 0 and j == 0):
                    beta = _ZERO if first else _ONE
                    first = False
                    blas.gemm(h, _OP_T, _OP_N, N, M, kn, _ONE.ctypes.data, wparts.data.ptr + j * wb_ + 2 * k0,
                              _R_16BF, K, parts.data.ptr + i * pb + 2 * k0, _R_16BF, K, beta.ctypes.data,
                              y.data.ptr, _R_32F, N, _COMPUTE_32F, _GEMM_DEFAULT)
        else:
            wb, s2 = _bf16_weight(cp, w)
            parts = _split_rows(cp, x, M)
            pb = M * K * 2
            first = True
            for p, _ in _part_order():
                for k0, kn in _k_chunks(K, p == 0):  # (the hi part's chain shortened: K_CHUNK)
                    beta = _ZERO if first else _ONE  # the first call writes, the rest add
                    first = False
                    blas.gemm(h, _OP_T, _OP_N, N, M, kn, _ONE.ctypes.data, wb.data.ptr + 2 * k0, _R_16BF, K,
                              parts.data.ptr + p * pb + 2 * k0, _R_16BF, K, beta.ctypes.data, y.data.ptr, _R_32F,
                              N, _COMPUTE_32F, _GEMM_DEFAULT)
            if s2 is not None:
                n = M * N
                kernel("gemm_tc.cu", "scale_rows_s2")(_grid1(n), (256,), (
                    y, s2[0], np.int32(s2[1]), np.int32(s2[2]), NULL_PTR, NULL_PTR, np.int32(1), np.int64(M),
                    np.int32(N)))
    if out is not None and not direct:
        out[...] = y
        return out
    return y


def moe_tc_max_tiles(S: int, E: int, R: int | None = None) -> int:
    """Tiles of the MoE's batched GEMM for ``S`` routed slots over ``E`` experts (the host-known worst case)."""
    R = MOE_TILE_ROWS if R is None else int(R)
    return S // R + min(E, S)


def moe_fp8_windows(max_tiles: int, E: int, N: int, K: int, budget: int | None = None) -> list[tuple[int, int, int]]:
    """The windows of the tile table an FP8 expert projection runs in (pure host logic): ``(t0, count, nslots)``
    for tiles ``[t0, t0 + count)``, covering ``[0, max_tiles)`` in order; a window's tiles use at most
    ``nslots = min(count, E)`` distinct experts (tiles are sorted by expert), whose three BF16 parts (``6 N K``
    bytes each) fit ``budget`` (default :data:`MOE_FP8_SCRATCH_BYTES`; at least one tile per window)."""
    budget = MOE_FP8_SCRATCH_BYTES if budget is None else int(budget)
    wt = max(1, min(int(max_tiles), budget // max(6 * int(N) * int(K), 1)))
    return [(t0, min(wt, max_tiles - t0), min(wt, max_tiles - t0, int(E))) for t0 in range(0, int(max_tiles), wt)]


def _grouped_gemm(cp, w, parts, C3, tiles, R: int, N: int, K: int):
    """``C3`` (part-interleaved ``[3 * P, N]`` float32) = the three parts of every tile's rows times the weights of
    the tile's expert, ``3 R`` columns per tile (weights read once per tile). ``w``: BF16 bits ``[E, N, K]`` (one
    gemmBatchedEx over all tiles) or an FP8 stack (:func:`moe_fp8_windows`: per window of tiles, its experts
    dequantised into three BF16 parts, then one gemmBatchedEx per weight part, lo first, accumulating)."""
    MT = tiles.max_tiles
    blas, h = _blas(), _handle()
    b_tile, c_tile = np.int64(3 * R * K * 2), np.int64(3 * R * N * 4)
    if weight_kind(w) != "fp8":
        ptrs = cp.empty((3, MT), dtype=cp.uint64)
        kernel("gemm_tc.cu", "tile_ptrs")((1,), (1024,), (
            tiles.expert, tiles.n_tiles, np.int32(0), np.int32(MT), np.int32(0), NULL_PTR, np.int32(0),
            np.uint64(w.data.ptr), np.int64(N * K * 2), np.int64(0), np.int32(1), np.uint64(parts.data.ptr), b_tile,
            np.uint64(C3.data.ptr), c_tile, ptrs))
        row = MT * 8
        blas.gemm_batched(h, _OP_T, _OP_N, N, 3 * R, K, _ONE.ctypes.data, ptrs.data.ptr, _R_16BF, K,
                          ptrs.data.ptr + row, _R_16BF, K, _ZERO.ctypes.data, ptrs.data.ptr + 2 * row, _R_32F, N, MT,
                          _COMPUTE_32F, _GEMM_DEFAULT)
        return
    if not (w.q.flags.c_contiguous and w.scale.flags.c_contiguous):  # (once, not per window)
        w = QuantWeight("fp8", w.shape, cp.ascontiguousarray(w.q), cp.ascontiguousarray(w.scale), rb=w.rb, cb=w.cb)
    wins = moe_fp8_windows(MT, int(w.shape[0]), N, K)
    cap = max((ns for _, _, ns in wins), default=1)
    scratch = cp.empty((3, cap, N, K), dtype=cp.uint16)  # part-major: part j of slot s at (j * cap + s) * N * K
    for t0, cnt, ns in wins:
        slot_expert = cp.empty(ns, dtype=cp.int32)
        ptrs = cp.empty((5, cnt), dtype=cp.uint64)
        kernel("gemm_tc.cu", "tile_ptrs")((1,), (1024,), (
            tiles.expert, tiles.n_tiles, np.int32(t0), np.int32(cnt), np.int32(1), slot_expert, np.int32(ns),
            np.uint64(scratch.data.ptr), np.int64(N * K * 2), np.int64(cap * N * K * 2), np.int32(3),
            np.uint64(parts.data.ptr), b_tile, np.uint64(C3.data.ptr), c_tile, ptrs))
        _fp8_dequant3(cp, w, scratch, ns, cap, slot_expert)
        row = cnt * 8
        for j, beta in ((2, _ZERO), (1, _ONE), (0, _ONE)):  # weight parts lo, mid, hi: the smallest products first
            blas.gemm_batched(h, _OP_T, _OP_N, N, 3 * R, K, _ONE.ctypes.data, ptrs.data.ptr + j * row, _R_16BF, K,
                              ptrs.data.ptr + 3 * row, _R_16BF, K, beta.ctypes.data, ptrs.data.ptr + 4 * row, _R_32F,
                              N, cnt, _COMPUTE_32F, _GEMM_DEFAULT)


def _expert_operand(cp, w):
    """What :func:`_grouped_gemm` takes for an expert stack: ``(BF16 bits, NVFP4 scale_2 info or None)``, or the FP8
    QuantWeight itself (dequantised there, window by window)."""
    return (w, None) if weight_kind(w) == "fp8" else _bf16_weight(cp, w)


def moe_experts_tc(x, ids, weights, gate_up, down, *, route, shared=None, shared_gate=None):
    """The routed experts of :func:`engine.kernels.moe.moe_experts` on the tensor cores (CUDA, prefill).

    Args:
        x: ``[T, H]`` float32 cupy array (contiguous).
        ids, weights: ``[T, k]`` expert ids (int32) and routing weights (float32).
        gate_up: ``[E, 2I, H]``; down: ``[E, H, I]`` (BF16 bits, NVFP4 or FP8 QuantWeight stacks).
        route: the :class:`engine.kernels.tiles.MoERoute` of ``ids`` (its tile table is rebuilt for
            :data:`MOE_TILE_ROWS` rows per tile when it was built for another height).
        shared, shared_gate: optional shared-expert output ``[T, H]`` and its ``[T]`` pre-sigmoid gate.
    Returns:
        ``[T, H]`` float32: ``sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` (+ the gated shared
        expert), combined by ``dense_moe.cu:moe_combine`` exactly as the grouped path.
    """
    cp = cupy_or_none()
    T, H = (int(s) for s in x.shape)
    if T > MOE_MAX_TOKENS > 0:  # bound the padded buffers: token chunks, each routed on its own
        out = _empty(cp, (T, H), dtype=cp.float32)
        for a in range(0, T, MOE_MAX_TOKENS):
            b = min(T, a + MOE_MAX_TOKENS)
            ia = cp.ascontiguousarray(ids[a:b])
            ra = moe_route_tables(ia, int(gate_up.shape[0]), rows_per_tile=MOE_TILE_ROWS)
            out[a:b] = moe_experts_tc(x[a:b], ia, cp.ascontiguousarray(weights[a:b]), gate_up, down, route=ra,
                                      shared=None if shared is None else shared[a:b],
                                      shared_gate=None if shared_gate is None else shared_gate[a:b])
        return out
    E, I2, _ = (int(s) for s in gate_up.shape)
    I = I2 // 2
    k = int(ids.shape[1])
    S = T * k
    R = int(MOE_TILE_ROWS)
    if route.rows_per_tile != R or route.tiles is None:
        route = moe_route_tables(ids, E, rows_per_tile=R)
    tiles = route.tiles
    MT = tiles.max_tiles
    P = MT * R
    # gate/up: tokens gathered into the padded tile layout and split
    xparts = _split_rows(cp, x, P, row_index=route.sorted_token, tiles=tiles, tm=R)
    wgu, s2gu = _expert_operand(cp, gate_up)
    gu3 = _empty(cp, (3 * P, I2), dtype=cp.float32)
    _grouped_gemm(cp, wgu, xparts, gu3, tiles, R, I2, H)
    del wgu, xparts
    # SwiGLU (+ NVFP4 scale of each half) written as the three parts of the down projection's input
    hparts = cp.empty((3 * P, I), dtype=cp.uint16)
    s2 = s2gu if s2gu is not None else (NULL_PTR, 1, 1)
    kernel("gemm_tc.cu", "swiglu_split3")(_grid1(P * I), (256,), (
        gu3, hparts, s2[0], np.int32(s2[1]), np.int32(s2[2]), tiles.expert, tiles.count, tiles.n_tiles, np.int32(R),
        np.int64(P), np.int32(I), np.int32(_nparts())))
    del gu3
    wd, s2d = _expert_operand(cp, down)
    y3 = _empty(cp, (3 * P, H), dtype=cp.float32)
    _grouped_gemm(cp, wd, hparts, y3, tiles, R, H, I)
    del wd, hparts
    y = _empty(cp, (P, H), dtype=cp.float32)
    s2 = s2d if s2d is not None else (NULL_PTR, 1, 1)
    kernel("gemm_tc.cu", "reduce3_rows")(_grid1(P * H), (256,), (
        y3, y, s2[0], np.int32(s2[1]), np.int32(s2[2]), tiles.expert, tiles.n_tiles, np.int32(R), np.int64(P),
        np.int32(H)))
    del y3
    # the padded row of every slot, then the grouped path's combine
    pad = _empty(cp, (max(S, 1),), dtype=cp.int32)
    kernel("gemm_tc.cu", "pad_of_sorted")(_grid1(P), (256,), (
        tiles.start, tiles.count, tiles.n_tiles, np.int32(R), np.int64(P), pad))
    sp = _empty(cp, (max(S, 1),), dtype=cp.int32)[:S]
    slot_pos = route.slot_pos if route.slot_pos.dtype == np.int32 else route.slot_pos.astype(cp.int32)
    kernel("gemm_tc.cu", "slot_pad")(_grid1(S), (256,), (slot_pos, pad, np.int32(S), sp))
    return combine(y, dataclasses.replace(route, slot_pos=sp), weights, shared, shared_gate, T=T, k=k, H=H)
