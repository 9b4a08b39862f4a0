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

from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels.linear import GEMM_TILE_ROWS, GEMV_MAX_ROWS, GroupTiles, grouped_linear, linear
from engine.kernels.dense_common import ptr_or_null
from reference.blocks import moe as _ref_moe
from reference.blocks.norms import sigmoid as _ref_sigmoid
from reference.blocks.norms import silu as _ref_silu

__all__ = ["router_topk", "moe_route_tables", "MoERoute", "moe_experts", "moe_block", "MoEOut", "shared_expert"]


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


def _swiglu(gu, I: int):
    xp = same_device(gu)
    if not is_cupy(xp):
        return _ref_silu(gu[:, :I]) * gu[:, I:]
    S = gu.shape[0]
    h = _empty(xp, (S, I), dtype=xp.float32)
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
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise KernelInputError(f"x/gate_up/down: expected [T, H] / [E, 2I, H] / [E, H, I], found {tuple(x.shape)} / "
                               f"{tuple(gate_up.shape)} / {tuple(down.shape)}")
    T, H = x.shape
    E, I2, H2 = gate_up.shape
    I = I2 // 2
    if H2 != H or I2 % 2 or tuple(down.shape) != (E, H, I):
        raise KernelInputError(f"gate_up/down: expected [E, 2I, H={H}] and [E, H, I], found {tuple(gate_up.shape)} "
                               f"and {tuple(down.shape)}")
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
