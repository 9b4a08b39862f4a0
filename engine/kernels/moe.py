"""MoE ops of the engine: router softmax + top-k, device-side dispatch, grouped expert GEMMs,
weighted combine, shared expert with its sigmoid gate.

Formula sources (modeling_qwen4_exp.py): ``Qwen4ExpTextTopKRouter.forward`` (softmax in float32,
top-k, renormalisation when ``norm_topk_prob``), ``Qwen4ExpTextExperts.forward`` (per expert
``down(silu(gate x) * up x)`` weighted by the routing weight and summed), ``Qwen4ExpTextMLP.forward``
(shared expert) and ``Qwen4ExpTextSparseMoeBlock.forward`` (``routed + sigmoid(shared_gate x) * shared``).

Top-k order is the project's canonical one: higher probability first, ties broken by the lower
expert id. Expert weights are stacked as ``gate_up [E, 2*I, H]`` (rows ``[0, I)`` the gate projection,
``[I, 2I)`` the up projection: the official fused layout) and ``down [E, H, I]``.

CUDA path (``engine/kernels/cuda/dense_moe.cu`` + the linear kernels): routing, counting, offsets,
the sorted slot order and the tile tables are all computed on the device; grouped launches are
sized by the worst case (``S // rows_per_tile + min(E, S)`` tiles, ``S = T * top_k``) and tiles past
the device-side count exit at once. Nothing is copied to the host.
"""
from __future__ import annotations

import functools
import os
import re
from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels.linear import GEMM_TILE_ROWS, GEMV_MAX_ROWS, GroupTiles, grouped_linear, launch_plan, linear
from engine.kernels.dense_common import ptr_or_null
from reference.blocks import moe as _ref_moe
from reference.blocks.norms import sigmoid as _ref_sigmoid
from reference.blocks.norms import silu as _ref_silu

__all__ = ["router_topk", "moe_route_tables", "MoERoute", "moe_experts", "moe_block", "MoEOut", "shared_expert",
           "FUSED_DECODE", "SHARED_STREAM", "GEMV_EPILOGUES", "fused_kernel_name", "epilogue_plan",
           "fused_counters"]


def router_topk(logits, top_k: int, norm_topk_prob: bool = True):
    """Softmax over experts, top-k in canonical order, optional renormalisation.

    Args:
        logits: ``[T, E]`` float32 router logits (float64 on NumPy).
        top_k: experts per token (``num_experts_per_tok``), ``1 <= top_k <= min(E, 64)``.
        norm_topk_prob: divide the selected probabilities by their sum.
    Returns:
        ``(ids, weights)``: ``ids`` int32 ``[T, top_k]`` (probability descending, then lower id),
        ``weights`` float32 ``[T, top_k]`` (float64 for float64 NumPy logits).
    Raises:
        KernelInputError: ``logits`` not 2-D or ``top_k`` out of range.
    """
    xp = same_device(logits)
    if logits.ndim != 2:
        raise KernelInputError(f"logits: expected [T, E], found shape {tuple(logits.shape)}")
    T, E = logits.shape
    if not (1 <= top_k <= min(E, 64)):
        raise KernelInputError(f"top_k: expected 1..min(E={E}, 64), found {top_k}")
    if not is_cupy(xp):
        dt = compute_dtype(logits)
        ids, w = _ref_moe.router_topk(logits.astype(dt, copy=False), top_k, norm_topk_prob)
        return ids.astype(np.int32), w
    lg = f32_contig(logits, "logits")
    ids = _empty(xp, (T, top_k), dtype=xp.int32)
    w = _empty(xp, (T, top_k), dtype=xp.float32)
    if T:
        if E * 4 > 48 * 1024:
            raise KernelInputError(f"logits: expected at most 12288 experts (the router kernel's shared memory), "
                                   f"found E={E}")
        kernel("dense_moe.cu", "router_topk")(
            (T,), (256,), (lg, np.int32(T), np.int32(E), np.int32(top_k), np.int32(1 if norm_topk_prob else 0), ids, w),
            shared_mem=E * 4)
    return ids, w


@dataclass
class MoERoute:
    """Device-side dispatch of ``S = T * top_k`` routed slots (slot ``s = t * top_k + j``).

    Attributes:
        offsets: int32 ``[E + 1]`` start of each expert's segment in sorted order.
        sorted_token: int32 ``[S]`` the token of each sorted slot.
        slot_pos: int32 ``[S]`` the sorted position of each original slot.
        tiles: :class:`GroupTiles` for the grouped linear launches (None on NumPy).
        rows_per_tile: 1 or 16 (GEMV tiles) or ``GEMM_TILE_ROWS`` (GEMM tiles).
    """

    offsets: object
    sorted_token: object
    slot_pos: object
    tiles: GroupTiles | None
    rows_per_tile: int


#: slots per tile for batched decode (2..16 tokens): 1 reads an expert once per token routed to it; 4 (default) or 16
#: read it once per tile of tokens (tensor-core GEMV). ``$QWEN4EXP_MOE_DECODE_RPT`` (1, 4 or 16).
DECODE_ROWS_PER_TILE = int(__import__("os").environ.get("QWEN4EXP_MOE_DECODE_RPT", "4"))


def _rows_per_tile(T: int, k: int, E: int) -> int:
    """Decode: one token: one slot per tile (GEMV); 2..16 tokens: :data:`DECODE_ROWS_PER_TILE`. Prefill:
    16-row GEMV tiles while experts average <= 32 rows (weights read once per 16 rows, little padding),
    64-row GEMM tiles above."""
    if T <= 1:
        return 1
    if T <= GEMV_MAX_ROWS:
        return DECODE_ROWS_PER_TILE if DECODE_ROWS_PER_TILE in (1, 4, 16) else 1
    return GEMV_MAX_ROWS if T * k <= 32 * E else GEMM_TILE_ROWS


def moe_route_tables(ids, num_experts: int, rows_per_tile: int | None = None) -> MoERoute:
    """Group routed slots by expert (stable within an expert on NumPy; any order on CUDA - results
    do not depend on it) and build the tile table for the grouped GEMMs.

    Args:
        ids: int ``[T, top_k]`` expert ids in ``[0, num_experts)``.
        num_experts: ``E``.
        rows_per_tile: slots per tile (1, 4, 16: GEMV; 64: GEMM); default by :func:`_rows_per_tile`.
    Returns:
        :class:`MoERoute` on the device of ``ids``.
    Raises:
        KernelInputError: ``ids`` not 2-D; (NumPy) ids out of range.
    """
    xp = same_device(ids)
    if ids.ndim != 2:
        raise KernelInputError(f"ids: expected [T, top_k], found shape {tuple(ids.shape)}")
    T, k = ids.shape
    S = T * k
    E = int(num_experts)
    rpt = _rows_per_tile(T, k, E) if rows_per_tile is None else int(rows_per_tile)
    if not is_cupy(xp):
        flat = np.asarray(ids, dtype=np.int64).reshape(-1)
        if flat.size and (flat.min() < 0 or flat.max() >= E):
            raise KernelInputError(f"ids: expected expert ids in [0, {E}), found range [{flat.min()}, {flat.max()}]")
        order = np.argsort(flat, kind="stable")
        counts = np.bincount(flat, minlength=E)
        offsets = np.concatenate([[0], np.cumsum(counts)]).astype(np.int32)
        slot_pos = np.empty(S, dtype=np.int32)
        slot_pos[order] = np.arange(S, dtype=np.int32)
        return MoERoute(offsets=offsets, sorted_token=(order // k).astype(np.int32), slot_pos=slot_pos, tiles=None,
                        rows_per_tile=rpt)
    ids32 = ids.reshape(-1) if ids.dtype == np.int32 else ids.reshape(-1).astype(xp.int32)
    ids32 = xp.ascontiguousarray(ids32)
    max_tiles = S // rpt + min(E, S)
    offsets = _empty(xp, E + 1, dtype=xp.int32)
    sorted_token = _empty(xp, max(S, 1), dtype=xp.int32)[:S]
    slot_pos = _empty(xp, max(S, 1), dtype=xp.int32)[:S]
    te = _empty(xp, max(max_tiles, 1), dtype=xp.int32)
    ts = _empty(xp, max(max_tiles, 1), dtype=xp.int32)
    tc = _empty(xp, max(max_tiles, 1), dtype=xp.int32)
    nt = xp.zeros(1, dtype=xp.int32)
    if E * 4 > 48 * 1024:
        raise KernelInputError(f"num_experts: expected at most 12288 (the dispatch kernel's shared memory), found {E}")
    kernel("dense_moe.cu", "moe_tables")(
        (1,), (1024,), (ids32, np.int32(S), np.int32(k), np.int32(E), np.int32(rpt), offsets, sorted_token, slot_pos,
                        te, ts, tc, nt), shared_mem=E * 4)
    return MoERoute(offsets=offsets, sorted_token=sorted_token, slot_pos=slot_pos,
                    tiles=GroupTiles(te, ts, tc, nt, max_tiles, rpt), rows_per_tile=rpt)


def _swiglu(gu, I: int, out=None):
    xp = same_device(gu)
    if not is_cupy(xp):
        return _ref_silu(gu[:, :I]) * gu[:, I:]
    S = gu.shape[0]
    h = _empty(xp, (S, I), dtype=xp.float32) if out is None else out
    n = S * I
    if n:
        kernel("dense_moe.cu", "moe_swiglu")((-(-n // 256),), (256,), (gu, h, np.int64(S), np.int32(I)))
    return h


def _combine(y_sorted, route: MoERoute, weights, shared=None, shared_gate=None, *, T: int, k: int, H: int):
    xp = same_device(y_sorted, weights)
    if not is_cupy(xp):
        dt = y_sorted.dtype
        pos = np.asarray(route.slot_pos, dtype=np.int64).reshape(T, k)
        out = np.zeros((T, H), dtype=dt)
        for j in range(k):  # per token, the k routed outputs are summed in slot order
            out += y_sorted[pos[:, j]] * weights[:, j:j + 1].astype(dt, copy=False)
        if shared is not None:
            sg = shared_gate.reshape(T, 1).astype(dt, copy=False)
            out = out + _ref_sigmoid(sg) * shared
        return out
    out = _empty(xp, (T, H), dtype=xp.float32)
    n = T * H
    if n:
        wc = f32_contig(weights, "weights")
        kernel("dense_moe.cu", "moe_combine")(
            (-(-n // 256),), (256,), (y_sorted, route.slot_pos, wc, ptr_or_null(shared), ptr_or_null(shared_gate), out,
                                      np.int32(T), np.int32(k), np.int32(H)))
    return out


def _expert_shapes(x, gate_up, down):
    """``(T, H, E, I)`` of consistent ``x [T, H]``, ``gate_up [E, 2I, H]``, ``down [E, H, I]``.

    Raises:
        KernelInputError: wrong ranks or inconsistent shapes.
    """
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise KernelInputError(f"x/gate_up/down: expected [T, H] / [E, 2I, H] / [E, H, I], found {tuple(x.shape)} / "
                               f"{tuple(gate_up.shape)} / {tuple(down.shape)}")
    T, H = x.shape
    E, I2, H2 = gate_up.shape
    I = I2 // 2
    if H2 != H or I2 % 2 or tuple(down.shape) != (E, H, I):
        raise KernelInputError(f"gate_up/down: expected [E, 2I, H={H}] and [E, H, I], found {tuple(gate_up.shape)} "
                               f"and {tuple(down.shape)}")
    return T, H, E, I


def moe_experts(x, ids, weights, gate_up, down, *, route: MoERoute | None = None, shared=None, shared_gate=None):
    """Routed experts: ``out[t] = sum_j weights[t, j] * down_e(silu(gate_e x_t) * up_e x_t)`` with
    ``e = ids[t, j]`` (``+ sigmoid(shared_gate[t]) * shared[t]`` when given, fused into the combine).

    Args:
        x: ``[T, H]`` float32 (float64 on NumPy).
        ids: int ``[T, k]``; weights: ``[T, k]`` float routing weights.
        gate_up: ``[E, 2*I, H]``; down: ``[E, H, I]`` (uint16 BF16 bits / bfloat16 / float32 / float64 NumPy).
        route: a precomputed :func:`moe_route_tables` result for ``ids`` (built here when None).
        shared: optional ``[T, H]`` shared-expert output; shared_gate: its ``[T, 1]`` pre-sigmoid gate.
    Returns:
        ``[T, H]`` float32.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    xp = same_device(x, ids, weights, gate_up, down, shared, shared_gate)
    T, H, E, I = _expert_shapes(x, gate_up, down)
    if tuple(ids.shape) != tuple(weights.shape) or ids.ndim != 2 or ids.shape[0] != T:
        raise KernelInputError(f"ids/weights: expected both [T={T}, k], found {tuple(ids.shape)} / "
                               f"{tuple(weights.shape)}")
    k = int(ids.shape[1])
    if shared is not None and (tuple(shared.shape) != (T, H) or shared_gate is None or shared_gate.size != T):
        raise KernelInputError(f"shared/shared_gate: expected [T={T}, H={H}] and [T, 1], found "
                               f"{tuple(shared.shape)} / {None if shared_gate is None else tuple(shared_gate.shape)}")
    from engine.kernels import gemm_tc as _tc
    # prefill with enough tokens per expert: the tensor-core path (batched cuBLAS GEMMs over the same tile table)
    if is_cupy(xp) and _tc.use_tc_moe(T, k, E, gate_up, down) and _tc.available(grouped=True):
        xs = f32_contig(x, "x")
        if shared is not None:
            shared, shared_gate = f32_contig(shared, "shared"), f32_contig(shared_gate.reshape(-1), "shared_gate")
        if route is None or route.rows_per_tile != _tc.MOE_TILE_ROWS:
            route = moe_route_tables(ids, E, rows_per_tile=_tc.MOE_TILE_ROWS)
        return _tc.moe_experts_tc(xs, ids, f32_contig(weights, "weights"), gate_up, down, route=route,
                                  shared=shared, shared_gate=shared_gate)
    if route is None:
        route = moe_route_tables(ids, E)
    xs = x if is_cupy(xp) else x.astype(compute_dtype(x), copy=False)
    if is_cupy(xp):
        xs = f32_contig(x, "x")
        if shared is not None:
            shared, shared_gate = f32_contig(shared, "shared"), f32_contig(shared_gate.reshape(-1), "shared_gate")
    gu = grouped_linear(xs, gate_up, route.offsets, row_index=route.sorted_token, tiles=route.tiles)
    h = _swiglu(gu, I)
    y = grouped_linear(h, down, route.offsets, tiles=route.tiles)
    return _combine(y, route, weights, shared, shared_gate, T=T, k=k, H=H)


def shared_expert(x, gate_proj, up_proj, down_proj, gate_up=None):
    """``down(silu(gate x) * up x)`` (``Qwen4ExpTextMLP.forward``).

    Args:
        x: ``[T, H]``; gate_proj, up_proj: ``[Is, H]``; down_proj: ``[H, Is]``.
        gate_up: optional (cupy) ``[2 * Is, H]``: gate_proj and up_proj stacked (one GEMV launch).
    Returns:
        ``[T, H]`` float32.
    """
    xp = same_device(x, gate_proj, up_proj, down_proj)
    if not is_cupy(xp):  # NumPy twin: the shared reference function
        dt = compute_dtype(x)
        return _ref_moe.swiglu(x.astype(dt, copy=False), weight_as_float(gate_proj, dt),
                               weight_as_float(up_proj, dt), weight_as_float(down_proj, dt))
    if gate_up is not None:
        gu = linear(x, gate_up)  # [T, 2 Is]: gate columns then up columns, the layout _swiglu reads
    else:
        gu = xp.concatenate([linear(x, gate_proj), linear(x, up_proj)], axis=1)
    h = _swiglu(gu, gate_proj.shape[0])
    return linear(h, down_proj)


@dataclass
class MoEOut:
    """Result of :func:`moe_block`: ``out [T, H]``, ``router_logits [T, E]``, ``topk_ids`` int32 ``[T, k]``,
    ``topk_weights [T, k]`` (the tap values ``layers.{i}.mlp.*``)."""

    out: object
    router_logits: object
    topk_ids: object
    topk_weights: object


def moe_block(x, router_weight, gate_up, down, *, top_k: int, norm_topk_prob: bool = True, shared_gate_proj=None,
              shared_up_proj=None, shared_down_proj=None, shared_expert_gate=None, shared_gate_up=None,
              experts_fn=None) -> MoEOut:
    """The sparse MoE block (``Qwen4ExpTextSparseMoeBlock.forward``): router, routed experts, shared
    expert gated by ``sigmoid(shared_expert_gate x)``.

    Args:
        x: ``[T, H]`` float32.
        router_weight: ``[E, H]`` (``mlp.gate.weight``).
        gate_up: ``[E, 2I, H]``; down: ``[E, H, I]``.
        top_k, norm_topk_prob: the config's ``num_experts_per_tok`` / ``norm_topk_prob``.
        shared_gate_proj, shared_up_proj: ``[Is, H]``; shared_down_proj: ``[H, Is]``;
        shared_expert_gate: ``[1, H]``. All four or none.
        shared_gate_up: optional stacked ``[2 * Is, H]`` (see :func:`shared_expert`).
        experts_fn: optional ``fn(x, ids, weights, shared=, shared_gate=) -> [T, H]`` replacing
            :func:`moe_experts` (expert parallelism: :meth:`engine.parallel.ExpertParallel.routed`);
            ``gate_up``/``down`` are then unused (None).
    Returns:
        :class:`MoEOut`.
    Raises:
        KernelInputError: inconsistent shapes or a partial shared-expert weight set.
    """
    shared_ws = (shared_gate_proj, shared_up_proj, shared_down_proj, shared_expert_gate)
    if any(w is None for w in shared_ws) and not all(w is None for w in shared_ws):
        raise KernelInputError("shared expert: expected all four of gate_proj, up_proj, down_proj, "
                               "shared_expert_gate or none, found a partial set")
    if (FUSED_DECODE and experts_fn is None and gate_up is not None and down is not None and is_cupy(same_device(x))
            and x.ndim == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS):
        return _moe_block_fused(x, router_weight, gate_up, down, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                shared_gate_proj=shared_gate_proj, shared_up_proj=shared_up_proj,
                                shared_down_proj=shared_down_proj, shared_expert_gate=shared_expert_gate,
                                shared_gate_up=shared_gate_up)
    logits = linear(x, router_weight)
    ids, w = router_topk(logits, top_k, norm_topk_prob)
    shared = sg = None
    if shared_gate_proj is not None:
        shared = shared_expert(x, shared_gate_proj, shared_up_proj, shared_down_proj, gate_up=shared_gate_up)
        sg = linear(x, shared_expert_gate)
    if experts_fn is not None:
        out = experts_fn(x, ids, w, shared=shared, shared_gate=sg)
    else:
        out = moe_experts(x, ids, w, gate_up, down, shared=shared, shared_gate=sg)
    return MoEOut(out=out, router_logits=logits, topk_ids=ids, topk_weights=w)


# ---------------------------------------------------------------------------------------------------------------
# Fused decode chain (cuda/moe_fused.cu)

#: The decode chain of the MoE block for 1..16 tokens (cupy, no expert parallelism): top-k + route tables in one
#: single-block launch after the router GEMV (``cuda/moe_route.cu``, in place of router_topk + memset + moe_tables),
#: the shared expert as a parallel branch on a side stream (:data:`SHARED_STREAM`), the combine with all its loads in
#: flight; results bit-identical to the unfused chain. Off unless ``$QWEN4EXP_MOE_FUSED=1`` (read once, at import;
#: tests and the profile tools set this flag) until measured faster on the GPU (docs/kernels_moe_fused.md).
FUSED_DECODE = os.environ.get("QWEN4EXP_MOE_FUSED", "0").strip() == "1"

#: With :data:`FUSED_DECODE`: the shared expert (gate/up + SwiGLU, down, its gate) runs on a second stream forked
#: from and joined back into the caller's, so a CUDA graph holds it as a parallel branch beside the router and
#: the routed gate/up (same kernels and inputs: same bits). ``$QWEN4EXP_MOE_SHARED_STREAM=0`` turns it off.
SHARED_STREAM = os.environ.get("QWEN4EXP_MOE_SHARED_STREAM", "1").strip() != "0"

#: With :data:`FUSED_DECODE`: SwiGLU, combine and top-k in the epilogues of the GEMV launches, through a grid-wide
#: "last block" handshake (``cuda/moe_fused.cu``). Bit-exact, but measured SLOWER on the H200 (2026-12-02,
#: ``ci/tools/moe_fused_bench.py``, one real-width block as a CUDA graph: BF16 73.6 -> 87.3 us at 1 token, NVFP4
#: 709.8 -> 901.9 us at 16): the handshake lengthens every block of the big GEMVs by more than the launches it
#: saves. Off (``$QWEN4EXP_MOE_EPILOGUES=1`` turns it on, for tuning).
GEMV_EPILOGUES = os.environ.get("QWEN4EXP_MOE_EPILOGUES", "0").strip() == "1"

_DENSE_RE = re.compile(r"^gemv_(bf16|f32)_nt(\d+)_r(\d+)_ks(\d+)_([vs])$")
_MMA_RE = re.compile(r"^gemv_bf16_mma_nt(\d+)_ks(\d+)_mt1(_sx)?$")
_QUANT_RE = re.compile(r"^qgemv_(fp8|nvfp4)_nt(\d+)_r(\d+)_ks(\d+)_([vs])$")
_COUNTER_LEN = 65536  # main stream: [0, 65536 - _SIDE_COUNTERS); the shared-expert stream: the last _SIDE_COUNTERS
_SIDE_COUNTERS = 1024  # its launches have ceil(T / rows) <= 16 row tiles


def fused_kernel_name(kname: str, epi: int) -> tuple[str, int] | None:
    """The fused twin of GEMV kernel ``kname`` (a name :func:`engine.kernels.linear.launch_plan` returns).

    Args:
        kname: e.g. ``'gemv_bf16_nt4_r4_ks1_v'``, ``'gemv_bf16_mma_nt8_ks1_mt1_sx'``, ``'qgemv_nvfp4_nt1_r4_ks1_v'``.
        epi: 0 (route: only the dense GEMV family), 1 (SwiGLU epilogue) or 2 (combine epilogue).
    Returns:
        ``(NVRTC name expression of the moe_fused.cu template, output columns per block)`` or None when the kernel
        has no fused twin (the tiled GEMMs, the debug variants): the caller then runs the unfused step.
    """
    m = _DENSE_RE.match(kname)
    if m:
        wt = "unsigned short" if m[1] == "bf16" else "float"
        nt, r, ks, v = int(m[2]), int(m[3]), int(m[4]), "true" if m[5] == "v" else "false"
        if epi == 0:
            return f"moe_route<{wt}, {nt}, {r}, {ks}, {v}>", (8 // ks) * r
        return f"moe_gemv_dense<{epi}, {wt}, {nt}, {r}, {ks}, {v}>", (8 // ks) * r
    if epi == 0:
        return None
    m = _MMA_RE.match(kname)
    if m:
        nt, ks = int(m[1]), int(m[2])
        if ks == 8 and m[3]:
            return None
        return f"moe_gemv_mma<{epi}, {nt}, {ks}, {1 if m[3] else 0}>", (8 // ks) * 16
    m = _QUANT_RE.match(kname)
    if m:
        nt, r, ks, v = int(m[2]), int(m[3]), int(m[4]), "true" if m[5] == "v" else "false"
        return f"moe_qgemv_{m[1]}<{epi}, {nt}, {r}, {ks}, {v}>", (8 // ks) * r
    return None


def _fused_fn(expr: str):
    """The compiled template instantiation ``expr`` of moe_fused.cu on the current device."""
    from engine.backend import cupy_or_none
    return _fused_fn_on(expr, cupy_or_none().cuda.Device().id)


@functools.lru_cache(maxsize=None)
def _fused_fn_on(expr: str, device: int):
    """One NVRTC module per (name expression, device): only the instantiations in use are compiled."""
    from engine.backend import cuda_source, cupy_or_none
    cp = cupy_or_none()
    mod = cp.RawModule(code=cuda_source("moe_fused.cu"), options=("-std=c++17",), name_expressions=(expr,))
    return mod.get_function(expr)


_COUNTERS: dict = {}


def fused_counters(xp):
    """The device's int32 ``[65536]`` handshake counters of the fused kernels (zero between launches: every
    kernel's last blocks reset the entries they used; the shared-expert stream uses the last 1024, so its launches
    may overlap the main stream's). Allocated outside any memory pool (so no graph's private pool owns them) and
    zeroed on first use, which must be eager (the engine and the tests run an eager step before capturing).

    Raises:
        KernelInputError: first use inside a CUDA-graph capture.
    """
    dev = xp.cuda.Device().id
    c = _COUNTERS.get(dev)
    if c is None:
        stream = xp.cuda.get_current_stream()
        if stream.is_capturing():
            raise KernelInputError("fused MoE chain: expected an eager call before any CUDA-graph capture (it creates "
                                   "the handshake counters), found a capture first")
        mem = xp.cuda.Memory(_COUNTER_LEN * 4)
        c = xp.ndarray((_COUNTER_LEN,), dtype=xp.int32, memptr=xp.cuda.MemoryPointer(mem, 0))
        c.fill(0)
        stream.synchronize()
        _COUNTERS[dev] = c
    return c


_SIDE: dict = {}


def _side_stream(xp):
    """(stream, fork event, join event) of the device for the shared-expert branch (created on first use)."""
    dev = xp.cuda.Device().id
    got = _SIDE.get(dev)
    if got is None:
        got = _SIDE[dev] = (xp.cuda.Stream(non_blocking=True), xp.cuda.Event(disable_timing=True),
                            xp.cuda.Event(disable_timing=True))
    return got


def _run_plan(plan) -> None:
    if plan is not None:
        fname, kname, grid, args = plan
        kernel(fname, kname)(grid, (256, 1, 1), args)


#: Largest epilogue tails run fused (elements the last block computes; unmeasured estimates: the tail costs about
#: elements / 256 threads / 4-8 loads in flight L2 round trips, a separate launch ~3 us): SwiGLU of a column pair
#: (rows x columns), SwiGLU of a whole row tile (rows x I), combine of a column block (tokens x columns).
EPI_SWIGLU_PAIR_MAX, EPI_SWIGLU_TILE_MAX, EPI_COMBINE_MAX = 2048, 4096, 1024


def epilogue_plan(kname: str, epi: int, grid, *, M: int, N: int, rows: int, T: int = 0) -> tuple[str, int, int] | None:
    """How a fused launch of GEMV ``kname`` runs epilogue ``epi`` (pure host logic).

    Args:
        kname: the body's kernel name; epi: 1 (SwiGLU of gate/up, ``N = 2 I``) or 2 (combine, ``N = H``).
        grid: the body's launch grid ``(x, y, 1)``; M, N: its output rows and columns.
        rows: the most rows one tile holds (``rows_per_tile`` of a grouped launch, else ``min(M, tile rows)``).
        T: tokens (combine).
    Returns:
        ``(name expression, columns per block, pair_p)`` (``pair_p`` > 0: SwiGLU per gate/up column pair, 0: per
        tile), or None: no fused twin, or a tail above the limits (the caller runs the step unfused).
    """
    got = fused_kernel_name(kname, epi)
    if got is None:
        return None
    expr, cols = got
    if epi == 1:
        I = N // 2
        if I % cols == 0 and grid[0] == 2 * (I // cols):
            pair = I // cols
            ok = rows * cols <= EPI_SWIGLU_PAIR_MAX and grid[1] * pair <= _COUNTER_LEN - _SIDE_COUNTERS
            return (expr, cols, pair) if ok else None
        return (expr, cols, 0) if rows * I <= EPI_SWIGLU_TILE_MAX else None
    return (expr, cols, 0) if T * cols <= EPI_COMBINE_MAX else None


def _launch_epi(xp, plan, epi: int, *, rows: int, h=None, slot_pos=None, rw=None, shared=None, sgate=None, out=None,
                T=0, k=0, side: bool = False) -> bool:
    """Launch ``plan``'s GEMV body followed by epilogue ``epi`` (1 SwiGLU into ``h``, 2 combine into ``out``) on the
    current stream (``side``: the shared-expert stream's counters). Returns False (nothing launched) when
    :func:`epilogue_plan` says no or the grid exceeds the counters."""
    if plan is None:
        return False
    fname, kname, grid, args = plan
    M, N = int(args[-3]), int(args[-2])
    got = epilogue_plan(kname, epi, grid, M=M, N=N, rows=rows, T=T)
    cnt = fused_counters(xp)
    cnt = cnt[cnt.size - _SIDE_COUNTERS:] if side else cnt[:cnt.size - _SIDE_COUNTERS]
    if got is None:
        return False
    expr, cols, pair = got
    need = grid[1] * max(pair, 1) if epi == 1 else grid[0]
    if need > cnt.size:
        return False
    _fused_fn(expr)(grid, (256, 1, 1), args + (cnt, ptr_or_null(h), ptr_or_null(slot_pos), ptr_or_null(rw),
                                                ptr_or_null(shared), ptr_or_null(sgate), ptr_or_null(out),
                                                np.int32(T), np.int32(k), np.int32(cols), np.int32(pair)))
    return True


def _route_fused(xp, x, router_weight, top_k: int, norm_topk_prob: bool):
    """Router GEMV + top-k + route tables in one launch; None when the router launch has no fused twin (e.g. the
    tensor-core GEMV of a BF16 router) or E is too large for the top-k's shared memory."""
    T, H = x.shape
    if router_weight.ndim != 2 or router_weight.shape[1] != H:
        return None
    E = int(router_weight.shape[0])
    k = int(top_k)
    if not (1 <= k <= min(E, 64)) or 8 * E * 4 > 44 * 1024:  # (+ 4 KiB static shared memory)
        return None
    logits = _empty(xp, (T, E), dtype=xp.float32)
    plan = launch_plan(xp, x, None, router_weight, 0, logits, None, T, E, H)
    got = None if plan is None or plan[0] != "dense_linear.cu" else fused_kernel_name(plan[1], 0)
    if got is None:
        return None
    S = T * k
    rpt = _rows_per_tile(T, k, E)
    max_tiles = S // rpt + min(E, S)
    ids = _empty(xp, (T, k), dtype=xp.int32)
    w = _empty(xp, (T, k), dtype=xp.float32)
    offsets = _empty(xp, E + 1, dtype=xp.int32)
    sorted_token = _empty(xp, S, dtype=xp.int32)
    slot_pos = _empty(xp, S, dtype=xp.int32)
    te, ts, tc = (_empty(xp, max_tiles, dtype=xp.int32) for _ in range(3))
    nt = _empty(xp, 1, dtype=xp.int32)  # written by the kernel (no memset)
    wr = plan[3][2]  # the router weight as the launch passes it (BF16 bits view / contiguous)
    _fused_fn(got[0])(plan[2], (256, 1, 1), (
        x, wr, logits, np.int32(T), np.int32(E), np.int32(H), np.int32(k), np.int32(1 if norm_topk_prob else 0),
        np.int32(rpt), ids, w, offsets, sorted_token, slot_pos, te, ts, tc, nt, fused_counters(xp)),
        shared_mem=8 * E * 4)
    route = MoERoute(offsets=offsets, sorted_token=sorted_token, slot_pos=slot_pos,
                     tiles=GroupTiles(te, ts, tc, nt, max_tiles, rpt), rows_per_tile=rpt)
    return logits, ids, w, route


def _route_block(xp, logits, top_k: int, norm_topk_prob: bool):
    """Top-k + route tables of ``logits [T, E]`` in one single-block launch (``moe_route.cu``: bit-identical to
    :func:`router_topk` + :func:`moe_route_tables`); None when ``top_k`` or ``E`` do not fit its shared memory."""
    T, E = logits.shape
    k = int(top_k)
    nw = min(16, T, (44 * 1024) // (4 * E))  # a warp per token, W * E floats (+ 4 KiB static) within 48 KiB
    if not (1 <= k <= min(E, 64)) or nw < 1:
        return None
    S = T * k
    rpt = _rows_per_tile(T, k, E)
    max_tiles = S // rpt + min(E, S)
    ids = _empty(xp, (T, k), dtype=xp.int32)
    w = _empty(xp, (T, k), dtype=xp.float32)
    offsets = _empty(xp, E + 1, dtype=xp.int32)
    sorted_token = _empty(xp, S, dtype=xp.int32)
    slot_pos = _empty(xp, S, dtype=xp.int32)
    te, ts, tc = (_empty(xp, max_tiles, dtype=xp.int32) for _ in range(3))
    nt = _empty(xp, 1, dtype=xp.int32)  # written by the kernel (no memset)
    kernel("moe_route.cu", "moe_route_block")(
        (1,), (32 * nw,), (f32_contig(logits, "logits"), np.int32(T), np.int32(E), np.int32(k),
                           np.int32(1 if norm_topk_prob else 0), np.int32(rpt), ids, w, offsets, sorted_token,
                           slot_pos, te, ts, tc, nt), shared_mem=nw * E * 4)
    return ids, w, MoERoute(offsets=offsets, sorted_token=sorted_token, slot_pos=slot_pos,
                            tiles=GroupTiles(te, ts, tc, nt, max_tiles, rpt), rows_per_tile=rpt)


def _combine_fast(xp, y, route: MoERoute, weights, shared, shared_gate, *, T: int, k: int, H: int, out=None):
    """:func:`_combine` (same expression and order, bit for bit) with every slot's load in flight
    (``moe_route.cu:moe_combine_ilp``)."""
    out = _empty(xp, (T, H), dtype=xp.float32) if out is None else out
    n = T * H
    if n:
        kernel("moe_route.cu", "moe_combine_ilp")(
            (-(-n // 256),), (256,), (y, route.slot_pos, f32_contig(weights, "weights"), ptr_or_null(shared),
                                      ptr_or_null(shared_gate), out, np.int32(T), np.int32(k), np.int32(H)))
    return out


def _gate_up_swiglu(xp, plan, gu, h, I: int, *, rows: int, side: bool = False) -> None:
    """The gate/up launch ``plan`` (into ``gu``) and ``h = silu(gate) * up``: in the launch's epilogue when
    :data:`GEMV_EPILOGUES` allows it, else the launch then the SwiGLU kernel (into ``h``, no allocation)."""
    if not (GEMV_EPILOGUES and _launch_epi(xp, plan, 1, rows=rows, h=h, side=side)):
        _run_plan(plan)
        _swiglu(gu, I, out=h)


def _shared_expert_fused(xp, x, gate_proj, up_proj, down_proj, gate_up):
    """:func:`shared_expert` through :func:`_gate_up_swiglu` (the unfused :func:`shared_expert` when not stacked)."""
    T, H = x.shape
    Is = int(gate_proj.shape[0])
    if gate_up is None or tuple(gate_up.shape) != (2 * Is, H) or gate_proj.ndim != 2 or gate_proj.shape[1] != H:
        return shared_expert(x, gate_proj, up_proj, down_proj, gate_up=gate_up)
    gu = _empty(xp, (T, 2 * Is), dtype=xp.float32)
    h = _empty(xp, (T, Is), dtype=xp.float32)
    _gate_up_swiglu(xp, launch_plan(xp, x, None, gate_up, 0, gu, None, T, 2 * Is, H), gu, h, Is, rows=T)
    return linear(h, down_proj)


def _shared_branch(xp, x, gate_proj, down_proj, expert_gate, gate_up):
    """Launch the shared expert on the side stream, forked from the current stream. Every array it touches is
    allocated before the fork, on the current stream, and returned in ``keep``: the caller holds ``keep`` until it
    has waited on the join event (freed earlier, the memory pool would hand those blocks to the current stream's
    next allocations while the side stream may still use them: a race in eager runs and in graph replays).

    Returns:
        ``(shared [T, H], gate [T], join event, keep)`` or None (nothing launched) when the shapes do not fit.
    """
    T, H = x.shape
    Is = int(gate_proj.shape[0])
    if (gate_up is None or tuple(gate_up.shape) != (2 * Is, H) or down_proj.ndim != 2 or tuple(down_proj.shape) !=
            (H, Is) or expert_gate.ndim != 2 or tuple(expert_gate.shape) != (1, H)):
        return None
    gu = _empty(xp, (T, 2 * Is), dtype=xp.float32)
    h = _empty(xp, (T, Is), dtype=xp.float32)
    shared = _empty(xp, (T, H), dtype=xp.float32)
    sg = _empty(xp, (T, 1), dtype=xp.float32)
    plan = launch_plan(xp, x, None, gate_up, 0, gu, None, T, 2 * Is, H)
    if plan is None:
        return None
    fused_counters(xp)  # (created, and zeroed, on the current stream before anything uses them)
    side, fork, join = _side_stream(xp)
    fork.record(xp.cuda.get_current_stream())
    side.wait_event(fork)
    with side:  # no allocation on this stream
        _gate_up_swiglu(xp, plan, gu, h, Is, rows=T, side=True)
        linear(h, down_proj, out=shared)
        linear(x, expert_gate, out=sg)
    join.record(side)
    return shared, sg.reshape(-1), join, (x, gu, h, shared, sg)


def _moe_block_fused(x, router_weight, gate_up, down, *, top_k, norm_topk_prob, shared_gate_proj, shared_up_proj,
                     shared_down_proj, shared_expert_gate, shared_gate_up) -> MoEOut:
    """:func:`moe_block` on the decode chain (same arguments, same results bit for bit): the router GEMV, then
    top-k + tables in one launch (:func:`_route_block`), the shared expert on the side stream
    (:data:`SHARED_STREAM`), the routed gate/up + SwiGLU and down, and the combine with every load in flight;
    with :data:`GEMV_EPILOGUES` the handshake variants of moe_fused.cu instead. A step that does not fit runs
    unfused."""
    xp = same_device(x, router_weight, gate_up, down)
    T, H, E, I = _expert_shapes(x, gate_up, down)
    x = f32_contig(x, "x")
    join = shared = sg = keep = None
    if SHARED_STREAM and shared_gate_proj is not None:
        got = _shared_branch(xp, x, shared_gate_proj, shared_down_proj, shared_expert_gate, shared_gate_up)
        if got is not None:
            shared, sg, join, keep = got
    r = _route_fused(xp, x, router_weight, top_k, norm_topk_prob) if GEMV_EPILOGUES else None
    if r is None:
        logits = linear(x, router_weight)
        got = _route_block(xp, logits, top_k, norm_topk_prob)
        if got is None:
            ids, w = router_topk(logits, top_k, norm_topk_prob)
            route = moe_route_tables(ids, E)
        else:
            ids, w, route = got
    else:
        logits, ids, w, route = r
    k = int(ids.shape[1])
    if shared_gate_proj is not None and join is None:
        shared = f32_contig(_shared_expert_fused(xp, x, shared_gate_proj, shared_up_proj, shared_down_proj,
                                                 shared_gate_up), "shared")
        sg = f32_contig(linear(x, shared_expert_gate).reshape(-1), "shared_gate")
    if shared is not None and (tuple(shared.shape) != (T, H) or sg.size != T):
        raise KernelInputError(f"shared/shared_gate: expected [T={T}, H={H}] and [T, 1], found "
                               f"{tuple(shared.shape)} / {tuple(sg.shape)}")
    S = T * k
    gu = _empty(xp, (S, 2 * I), dtype=xp.float32)
    h = _empty(xp, (S, I), dtype=xp.float32)
    _gate_up_swiglu(xp, launch_plan(xp, x, route.sorted_token, gate_up, 2 * I * H, gu, route.tiles, S, 2 * I, H), gu,
                    h, I, rows=route.rows_per_tile)
    y = _empty(xp, (S, H), dtype=xp.float32)
    out = _empty(xp, (T, H), dtype=xp.float32)
    if join is not None:
        xp.cuda.get_current_stream().wait_event(join)  # the shared expert's results, before the combine reads them
    plan = launch_plan(xp, h, None, down, H * I, y, route.tiles, S, H, I)
    if not (GEMV_EPILOGUES and _launch_epi(xp, plan, 2, rows=route.rows_per_tile, slot_pos=route.slot_pos, rw=w,
                                           shared=shared, sgate=sg, out=out, T=T, k=k)):
        _run_plan(plan)
        _combine_fast(xp, y, route, w, shared, sg, T=T, k=k, H=H, out=out)
    del keep  # the side stream's arrays, held until the current stream waited on its join
    return MoEOut(out=out, router_logits=logits, topk_ids=ids, topk_weights=w)
