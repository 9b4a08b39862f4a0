"""Dense linear ops: ``Y[M, N] = X[M, K] @ W[N, K]^T`` with BF16 (or float32) weights, float32
activations and float32 accumulation; plus the grouped form used by the MoE experts.

Dispatch on the array module of ``x`` (:func:`engine.backend.xp_of`):

* cupy: custom CUDA kernels (``engine/kernels/cuda/dense_linear.cu``): a warp-per-row GEMV with
  16-byte weight loads for ``M <= 16`` rows per weight matrix (decode), a 64x64-tiled GEMM otherwise
  (prefill). No host synchronisation: grouped launches are sized by the worst case and read their
  tile table from the device. From ``engine.kernels.gemm_tc.TC_MIN_ROWS`` rows (prefill) :func:`linear`
  runs on the tensor cores instead (:mod:`engine.kernels.gemm_tc`: cuBLAS BF16 GEMMs on an exact 3-way split
  of the activations, float32-equivalent; BF16, float32, NVFP4 and FP8 weights).
* numpy: the NumPy twin: the weights upcast exactly to float32 (float64 for float64 inputs) and one
  BLAS product per weight matrix.

Source of the formula: ``torch.nn.functional.linear`` as used by every projection of
modeling_qwen4_exp.py (e.g. ``Qwen4ExpTextMLP.forward``, ``Qwen4ExpTextExperts.forward``).
"""
from __future__ import annotations


import numpy as np

from engine.kernels import gemm_tc as _tc
from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import NULL_PTR, compute_capability, kernel, ptr_or_null, sm_count
from engine.kernels.tiles import GEMM_TILE_ROWS, GEMV_MAX_ROWS, GroupTiles, gemv_tile_rows
from engine.kernels.dense_common import (KernelInputError, check_dim, check_ndim, compute_dtype, f32_contig, is_cupy,
                                         same_device, weight_as_float, weight_kind)

__all__ = ["linear", "grouped_linear", "GroupTiles", "GEMV_MAX_ROWS", "GEMM_TILE_ROWS", "gemv_tile_rows",
           "MMA_GEMV_ENABLED", "QGEMV2_CONFIG", "dense_kernel_choice", "quant_kernel_choice",
           "launch_plan"]

_GEMV_WARPS = 8  # rows of W per GEMV block (one warp each)
_GEMM_BN = 64
#: The tensor-core GEMV (``cuda/dense_linear_mma.cu``) for BF16 weights and 2..16 rows per weight pass (the
#: float32-FMA GEMV of ``dense_linear.cu`` serves one row, float32 weights and unaligned shapes). A module flag, not
#: an environment switch: the tests and the micro-bench (``lab/bench_dense.py``) set it to run the FMA kernel beside it.
MMA_GEMV_ENABLED = True
#: The streaming quantised GEMV (``qgemv2_*`` of ``cuda/quant_linear.cu``) serves FP8 / NVFP4 weights at 1..16 rows
#: whenever the 16-byte chunk path is possible; the scalar ``qgemv_*_s`` kernels serve the rest (unaligned, odd K).
#: ``qgemv2`` configuration per (format, activation-row tile): ``(G, RL, U)`` = lanes per row slot, weight rows
#: per lane, chunks per lane loaded before any is decoded. Only the combinations quant_linear.cu instantiates
#: (``QGEMV2_FAMILY``) exist; the micro-bench (``lab/bench_quant.py``) swaps entries to compare them. Defaults: the fastest measured on the
#: H200 (``lab/bench_quant.py`` at the routed-expert shapes; docs/kernels_quant.md, docs/performance.md): 1 row (2, 2, 3) for both
#: formats (NVFP4 gate_up 17.1 us vs 26.8 for (4, 1, 5) and 33.6 for the previous kernel), 4 and 16 rows (4, 2, 3).
#: The tensor-core quantised GEMV (``qmma_<fmt>_*`` of ``cuda/quant_linear.cu``, body ``cuda/gemv_qmma.cuh``) serves
#: the activation-row tiles :data:`QMMA_ROWS` names, on sm_80+, where the shape fits (NVFP4: ``K % 128 == 0``; FP8:
#: ``K % 64 == 0`` and scale blocks of ``16 n x 64 m`` rows x columns); ``qgemv2`` serves the rest. FP8 at one
#: activation row over several row tiles (the routed experts at batch 1) stays on ``qgemv2``: there it measured
#: faster (H100, ``lab.bench_quant``, 10 experts: gate_up 19.4 vs 23.3 us, down 11.6 vs 12.8), while one FP8 matrix
#: at one row (the dense projections) runs faster on ``qmma`` (16.9 vs 19.1, 9.5 vs 10.9). Module flags,
#: not environment switches: the tests and the micro-bench (``lab/bench_quant.py``) set them to run ``qgemv2``
#: beside it.
QMMA_ENABLED = True
QMMA_ROWS = {"nvfp4": (1, 4, 16), "fp8": (1, 4, 16)}
QGEMV2_CONFIG = {("nvfp4", 1): (2, 2, 3), ("nvfp4", 4): (4, 2, 3), ("nvfp4", 16): (4, 2, 3),
                 ("fp8", 1): (2, 2, 3), ("fp8", 4): (4, 2, 3), ("fp8", 16): (4, 2, 3)}


def _check_x_w(x, w, name_x="x", name_w="w"):
    check_ndim(name_x, x, 2, "[M, K]")
    kind = weight_kind(w)
    if x.dtype.kind != "f":
        raise KernelInputError(f"{name_x}: expected a float32 array [M, K], found dtype {x.dtype}")
    return kind


def linear(x, w, *, out=None):
    """``x @ w.T`` with float32 accumulation.

    Args:
        x: activations ``[M, K]`` float32 (NumPy also float64: then the twin computes in float64).
        w: weights ``[N, K]``: uint16 BF16 bits, ml_dtypes bfloat16 (NumPy), float32, or float64 (NumPy).
        out: optional ``[M, N]`` float32 array (same device) written in full and returned.
    Returns:
        ``[M, N]`` float32 (float64 for a float64 NumPy ``x``), on the device of ``x``.
    Raises:
        KernelInputError: wrong ranks, mismatched K, unsupported dtypes, mixed devices, bad ``out``.
    """
    xp = same_device(x, w, out)
    kind = _check_x_w(x, w)
    check_ndim("w", w, 2, "[N, K]")
    M, K = x.shape
    N = w.shape[0]
    check_dim("w", w.shape[1], K, "K (columns of w matching x's)")
    if out is not None and tuple(out.shape) != (M, N):
        raise KernelInputError(f"out: expected shape {(M, N)}, found {tuple(out.shape)}")
    if not is_cupy(xp):
        dt = compute_dtype(x)
        y = x.astype(dt, copy=False) @ weight_as_float(w, dt).T
        if out is not None:
            out[...] = y
            return out
        return y
    if kind == "f64" or x.dtype == np.float64:
        raise KernelInputError("x/w: the CUDA path computes in float32; found float64")
    if _tc.use_tc(M, w) and _tc.available():
        return _tc.linear_tc(x, w, out=out)
    y = out if out is not None else _empty(xp, (M, N), dtype=xp.float32)
    if M == 0 or N == 0:
        return y
    _launch(xp, f32_contig(x, "x"), None, w, 0, y, None, M, N, K)
    return y


def grouped_linear(x, w, offsets, *, row_index=None, tiles: GroupTiles | None = None, out=None):
    """Per-group products for MoE experts: rows ``s`` in ``[offsets[e], offsets[e+1])`` use ``w[e]``:
    ``out[s] = x[row_index[s]] @ w[e].T`` (``x[s]`` when ``row_index`` is None).

    Args:
        x: activations ``[R, K]`` float32 (float64 on NumPy).
        w: stacked weights ``[E, N, K]`` (uint16 BF16 bits / bfloat16 / float32 / float64 NumPy).
        offsets: int ``[E + 1]`` segment bounds over the ``S`` output rows (used by the NumPy twin;
            the CUDA path reads ``tiles`` instead and never syncs on ``offsets``).
        row_index: optional int32 ``[S]`` rows of ``x`` to gather (``S`` rows computed); else ``S = R``.
        tiles: (cupy only, required there) the device tile table built from the same routing, e.g. by
            :func:`engine.kernels.tiles.moe_route_tables`.
        out: optional ``[S, N]`` float32 output, written in full.
    Returns:
        ``[S, N]`` float32 in segment (sorted) order.
    Raises:
        KernelInputError: shapes/dtypes inconsistent; cupy without ``tiles``.
    """
    xp = same_device(x, w, out, row_index)
    kind = _check_x_w(x, w)
    check_ndim("w", w, 3, "[E, N, K]")
    E, N, K = w.shape
    check_dim("x", x.shape[1], K, "K (columns, matching w's last axis)")
    S = int(row_index.shape[0]) if row_index is not None else int(x.shape[0])
    if out is not None and tuple(out.shape) != (S, N):
        raise KernelInputError(f"out: expected shape {(S, N)}, found {tuple(out.shape)}")
    if not is_cupy(xp):
        dt = compute_dtype(x)
        off = np.asarray(offsets, dtype=np.int64)
        if off.shape != (E + 1,) or off[0] != 0 or off[-1] != S or np.any(np.diff(off) < 0):
            raise KernelInputError(f"offsets: expected non-decreasing [E+1={E + 1}] from 0 to S={S}, found {off}")
        xs = x if row_index is None else x[np.asarray(row_index, dtype=np.int64)]
        xs = xs.astype(dt, copy=False)
        y = out if out is not None else np.empty((S, N), dtype=dt)
        for e in np.nonzero(np.diff(off))[0]:
            a, b = off[e], off[e + 1]
            y[a:b] = xs[a:b] @ weight_as_float(w[e], dt).T
        return y
    if tiles is None:
        raise KernelInputError("tiles: the CUDA grouped_linear needs the device tile table (GroupTiles), found None")
    if kind == "f64" or x.dtype == np.float64:
        raise KernelInputError("x/w: the CUDA path computes in float32; found float64")
    y = out if out is not None else _empty(xp, (S, N), dtype=xp.float32)
    if S == 0:
        return y
    ri = None
    if row_index is not None:
        ri = row_index if row_index.dtype == np.int32 else row_index.astype(np.int32)
    _launch(xp, f32_contig(x, "x"), ri, w, N * K, y, tiles, S, N, K)
    return y


def _launch(xp, x, row_index, w, w_expert_stride, y, tiles: GroupTiles | None, M, N, K):
    """Pick GEMV vs GEMM and launch (no host synchronisation)."""
    plan = launch_plan(xp, x, row_index, w, w_expert_stride, y, tiles, M, N, K)
    if plan is not None:
        fname, kname, grid, args = plan
        kernel(fname, kname)(grid, (256, 1, 1), args)


def launch_plan(xp, x, row_index, w, w_expert_stride, y, tiles: GroupTiles | None, M, N, K):
    """The launch :func:`linear` / :func:`grouped_linear` make, without making it (the fused MoE kernels of
    ``engine/kernels/moe.py`` run the same body with the same grid and arguments, plus an epilogue).

    Args: as the private launcher: ``x`` float32 contiguous ``[*, K]``, ``row_index`` int32 or None, ``w`` the
        weight (2-D, or 3-D with ``tiles``), ``w_expert_stride`` elements between experts (dense weights),
        ``y`` the ``[M, N]`` float32 output, ``tiles`` the grouped tile table or None.
    Returns:
        ``(cuda file, kernel name, grid (x, y, 1), argument tuple)``, or None when there is nothing to launch.
        Every launch uses 256 threads per block.
    Raises:
        KernelInputError: unsupported tile size; more tiles than the grid allows.
    """
    kind = weight_kind(w)
    if kind in ("fp8", "nvfp4"):
        return _plan_quant(x, row_index, w, y, tiles, M, N, K)
    if kind == "bf16" and w.dtype != np.uint16:
        w = w.view(np.uint16)
    if not w.flags.c_contiguous:
        w = xp.ascontiguousarray(w)
    wname = "bf16" if kind == "bf16" else "f32"
    null = NULL_PTR
    if tiles is not None:
        rpt = tiles.rows_per_tile
        grid_y = tiles.max_tiles
        tbl = (tiles.expert, tiles.start, tiles.count, tiles.n_tiles)
    else:
        rpt = gemv_tile_rows(M) if M <= GEMV_MAX_ROWS else GEMM_TILE_ROWS
        grid_y = -(-M // rpt)
        tbl = (null, null, null, null)
    if grid_y == 0:
        return None
    if rpt <= GEMV_MAX_ROWS:
        if rpt not in (1, 4, 16):
            raise KernelInputError(f"tiles.rows_per_tile: expected 1, 4, 16 or {GEMM_TILE_ROWS}, found {rpt}")
        aligned = (w.data.ptr % 16 == 0) and (x.data.ptr % 16 == 0)
        fname, kname, grid_x = dense_kernel_choice(kind, rpt, N, K, grid_y, aligned=aligned)
        grid = (grid_x, grid_y, 1)
    else:
        if rpt != GEMM_TILE_ROWS:
            raise KernelInputError(f"tiles.rows_per_tile: expected 1, 4, 16 or {GEMM_TILE_ROWS}, found {rpt}")
        fname, kname = "dense_linear.cu", f"gemm_{wname}"
        grid = (-(-N // _GEMM_BN), grid_y, 1)
    if grid[1] > 65535:
        raise KernelInputError(f"rows: {M} rows need {grid[1]} tiles, above the grid limit 65535; use smaller chunks")
    return fname, kname, grid, (x, ptr_or_null(row_index), w, np.int64(w_expert_stride), y, tbl[0], tbl[1], tbl[2],
                                tbl[3], np.int32(M), np.int32(N), np.int32(K))


def dense_kernel_choice(kind: str, rpt: int, N: int, K: int, grid_y: int, *, aligned: bool = True,
                        sms: int | None = None, mma: bool | None = None) -> tuple[str, str, int]:
    """Which GEMV kernel a launch uses (pure host logic; the bench and the tests query it).

    Args:
        kind: weight kind, ``'bf16'`` or ``'f32'`` (:func:`engine.kernels.dense_common.weight_kind`).
        rpt: activation rows per weight pass (``gemv_tile_rows(M)`` or ``GroupTiles.rows_per_tile``): 1, 4, 16.
        N, K: weight shape ``[N, K]``.
        grid_y: number of row tiles launched (``ceil(M / rpt)``, or ``GroupTiles.max_tiles``).
        aligned: the weight and activation device pointers are 16-byte aligned.
        sms: streaming multiprocessors (default: the current GPU's, 1 without one).
        mma: use the tensor-core GEMV when eligible (default :data:`MMA_GEMV_ENABLED`).
    Returns:
        ``(cuda file, kernel name, grid x)``. The tensor-core kernel (``dense_linear_mma.cu``) is chosen
        for BF16 weights, ``rpt`` 4 or 16 (2..16 rows), ``K % 32 == 0`` and aligned pointers; otherwise
        the float32-FMA GEMV of ``dense_linear.cu``. Short, wide matrices (few row blocks for the SMs)
        get the split-K (``ks8``) variants; the tensor-core kernel's own rule is in the code below.
    Raises:
        KernelInputError: ``rpt`` not 1, 4 or 16.
    """
    if rpt not in (1, 4, 16):
        raise KernelInputError(f"tiles.rows_per_tile: expected 1, 4, 16 or {GEMM_TILE_ROWS}, found {rpt}")
    sms = sm_count() if sms is None else int(sms)
    use_mma = MMA_GEMV_ENABLED if mma is None else bool(mma)
    if use_mma and kind == "bf16" and rpt in (4, 16) and K % 32 == 0 and aligned:
        # one warp = 16 weight rows; a block of 8 warps covers 128 rows and shares the activation split
        # (_sx); with fewer such blocks than half the SMs (measured faster there) 8 warps split K (ks8)
        nt = 8 if rpt == 4 else 16
        if -(-N // (_GEMV_WARPS * 16)) * grid_y < sms / 2:
            return ("dense_linear_mma.cu", f"gemv_bf16_mma_nt{nt}_ks8_mt1", -(-N // 16))
        return ("dense_linear_mma.cu", f"gemv_bf16_mma_nt{nt}_ks1_mt1_sx", -(-N // (_GEMV_WARPS * 16)))
    wname = "bf16" if kind == "bf16" else "f32"
    vec = (K % 8 == 0) and aligned
    r = 1 if rpt == 1 else 4
    # short/wide matrices (few row blocks for the SMs): 8 warps split K of one row instead
    ks = 8 if -(-N // (_GEMV_WARPS * r)) * grid_y < 2 * sms else 1
    if ks == 8:
        r = 1
    return ("dense_linear.cu", f"gemv_{wname}_nt{rpt}_r{r}_ks{ks}_{'v' if vec else 's'}",
            -(-N // ((_GEMV_WARPS // ks) * r)))


def quant_kernel_choice(fmt: str, rpt: int, N: int, K: int, grid_y: int, *, vec: bool, sms: int | None = None,
                        config: tuple[int, int, int] | None = None, qmma: bool | None = None,
                        cc: int | None = None, blocks: tuple[int, int] = (128, 128)) -> tuple[str, int]:
    """Which ``quant_linear.cu`` kernel a launch over a quantised weight uses (pure host logic).

    Args:
        fmt: 'fp8' or 'nvfp4'. rpt: activation rows per weight pass (1, 4, 16; 64 = the tiled GEMM).
        N, K: logical weight shape. grid_y: row tiles launched. vec: 16-byte chunks possible (K a multiple of
            the chunk, aligned pointers, fp8 scale blocks a multiple of 16 columns).
        sms: streaming multiprocessors (default: the current GPU's). config: ``(G, RL, U)`` for ``qgemv2``
            (default :data:`QGEMV2_CONFIG` ``[fmt, rpt]``). qmma: use the tensor-core NVFP4 GEMV where eligible
            (default :data:`QMMA_ENABLED`, for the row tiles of :data:`QMMA_ROWS`; FP8 at one row only for one row tile). cc: compute capability
            (default: the current GPU's). blocks: the FP8 scale block ``(rb, cb)``.
    Returns:
        ``(kernel name, grid x)``. ``qmma_<fmt>`` (vec, sm_80+; NVFP4 ``K % 128 == 0``; FP8 ``K % 64 == 0``,
        ``rb % 16 == 0``, ``cb % 64 == 0``): 8 warps per block, ``KS`` of them split the k groups (128 NVFP4 / 64
        FP8 weights), ``8 / KS`` row groups of 16; ``KS`` the smallest power of two up to 8 (and up to the groups)
        with at least twice as many blocks as SMs. ``qgemv2`` (vec only): 8 warps per block, ``KS`` of them split K, each warp
        ``32 / G`` slots of ``RL`` rows; ``KS`` is the smallest power of two up to 8 with which every lane's
        chunks are loaded in one round (``G * KS * U >= K / chunk``), doubled while the launch has fewer
        blocks than twice the SMs. Otherwise (not vec) the scalar ``qgemv_*_s`` kernels: 8 warps per block, each over
        4 weight rows (``r4``, 1 and 4 activation rows) or 1 (16 rows); short, wide matrices split K of one row
        over the 8 warps of a block (``r1_ks8``).
    Raises:
        KernelInputError: ``rpt`` not 1, 4, 16 or 64.
    """
    if rpt == GEMM_TILE_ROWS:
        return f"qgemm_{fmt}", -(-N // _GEMM_BN)
    if rpt not in (1, 4, 16):
        raise KernelInputError(f"tiles.rows_per_tile: expected 1, 4, 16 or {GEMM_TILE_ROWS}, found {rpt}")
    sms = sm_count() if sms is None else int(sms)
    if qmma is None:
        qmma = QMMA_ENABLED and rpt in QMMA_ROWS.get(fmt, ()) and not (fmt == "fp8" and rpt == 1 and grid_y > 1)
    use_qmma = bool(qmma)
    kg = 128 if fmt == "nvfp4" else 64
    fits = K % kg == 0 and (fmt == "nvfp4" or (blocks[0] % 16 == 0 and blocks[1] % 64 == 0))
    if use_qmma and vec and fits and (compute_capability() if cc is None else cc) >= 80:
        ng = K // kg
        ks = 1
        while ks < 8 and 2 * ks <= ng and -(-N // ((_GEMV_WARPS // ks) * 16)) * grid_y < 2 * sms:
            ks *= 2
        return f"qmma_{fmt}_nt{rpt}_ks{ks}", -(-N // ((_GEMV_WARPS // ks) * 16))
    if vec:
        G, RL, U = QGEMV2_CONFIG[fmt, rpt] if config is None else config
        kc = K // (32 if fmt == "nvfp4" else 16)
        ks = 1
        while ks < 8 and G * ks * U < kc:
            ks *= 2
        while ks < 8 and -(-N // ((_GEMV_WARPS // ks) * (32 // G) * RL)) * grid_y < 2 * sms:
            ks *= 2
        rows_per_block = (_GEMV_WARPS // ks) * (32 // G) * RL
        return f"qgemv2_{fmt}_nt{rpt}_g{G}_r{RL}_ks{ks}_u{U}", -(-N // rows_per_block)
    # 4 weight rows per warp share each activation piece (1 and 4 activation rows; 16 rows: registers allow 1)
    r = 4 if rpt in (1, 4) else 1
    ks = 1
    if -(-N // (_GEMV_WARPS * r)) * grid_y < 2 * sms:  # few blocks for the SMs: 8 warps split K of one row
        ks, r = 8, 1
    return f"qgemv_{fmt}_nt{rpt}_r{r}_ks{ks}_s", -(-N // ((_GEMV_WARPS // ks) * r))


def _quant_fargs(w, x, N, K):
    """``(vec, weight arguments)`` of a ``quant_linear.cu`` GEMV/GEMM launch over QuantWeight ``w`` (2-D or a
    3-D expert stack) with activations ``x``: vec = the 16-byte chunk paths are possible."""
    es = w.ndim == 3
    if w.fmt == "fp8":
        vec = K % 16 == 0 and w.cb % 16 == 0 and w.q.data.ptr % 16 == 0 and x.data.ptr % 16 == 0
        fargs = (w.q, w.scale, np.int64(N * K if es else 0), np.int64(w.scale[0].size if es else 0),
                 np.int32(w.rb), np.int32(w.cb), np.int32(w.scale.shape[-1]))
    else:
        vec = K % 32 == 0 and w.q.data.ptr % 16 == 0 and x.data.ptr % 16 == 0
        fargs = (w.q, w.scale, w.scale2, np.int64(N * K // 2 if es else 0), np.int64(N * K // 16 if es else 0),
                 np.int32(w.s2_rows), np.int32(N // w.s2_rows))
    return vec, fargs


def _plan_quant(x, row_index, w, y, tiles: GroupTiles | None, M, N, K):
    """:func:`launch_plan` for a ``quant_linear.cu`` kernel over QuantWeight ``w`` (2-D, or 3-D with ``tiles``)."""
    null = NULL_PTR
    if tiles is not None:
        rpt, grid_y = tiles.rows_per_tile, tiles.max_tiles
        tbl = (tiles.expert, tiles.start, tiles.count, tiles.n_tiles)
    else:
        rpt = gemv_tile_rows(M) if M <= GEMV_MAX_ROWS else GEMM_TILE_ROWS
        grid_y = -(-M // rpt)
        tbl = (null, null, null, null)
    if grid_y == 0:
        return None
    if grid_y > 65535:
        raise KernelInputError(f"rows: {M} rows need {grid_y} tiles, above the grid limit 65535; use smaller chunks")
    vec, fargs = _quant_fargs(w, x, N, K)
    name, grid_x = quant_kernel_choice(w.fmt, rpt, N, K, grid_y, vec=vec, blocks=(w.rb, w.cb))
    return "quant_linear.cu", name, (grid_x, grid_y, 1), fargs + (
        x, ptr_or_null(row_index), y, tbl[0], tbl[1], tbl[2], tbl[3], np.int32(M), np.int32(N), np.int32(K))
