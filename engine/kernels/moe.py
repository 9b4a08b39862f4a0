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

import os
from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels import gemm_tc as _tc
from engine.kernels.dense_common import ptr_or_null
from engine.kernels.linear import grouped_linear, launch_plan, linear
from engine.kernels.tiles import (GEMV_MAX_ROWS, GroupTiles, MoERoute, combine, moe_route_tables,  # noqa: F401 (re-exported)
                                  default_rows_per_tile)
from reference.blocks import moe as _ref_moe
from reference.blocks.norms import silu as _ref_silu

__all__ = ["router_topk", "moe_route_tables", "MoERoute", "moe_experts", "moe_block", "MoEOut", "shared_expert",
           "FUSED_DECODE", "SHARED_STREAM"]


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
    return combine(y, route, weights, shared, shared_gate, T=T, k=k, H=H)


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
# Decode chain (cuda/moe_route.cu, the shared-expert stream)

#: The decode chain of the MoE block for 1..16 tokens (cupy, no expert parallelism): top-k + route tables in one
#: single-block launch after the router GEMV (``cuda/moe_route.cu``, in place of router_topk + memset + moe_tables),
#: the shared expert as a parallel branch on a side stream (:data:`SHARED_STREAM`), the combine with all its loads in
#: flight; results bit-identical to the grouped chain of :func:`moe_experts` (measured 1.03-1.05x faster on the H200,
#: docs/kernels_moe_fused.md). The only decode path; a module flag (no environment switch) so the tests can run
#: the grouped chain beside it and compare bit for bit.
FUSED_DECODE = True

#: With :data:`FUSED_DECODE`: the shared expert (gate/up + SwiGLU, down, its gate) runs on a second stream forked
#: from and joined back into the caller's, so a CUDA graph holds it as a parallel branch beside the router and
#: the routed gate/up (same kernels and inputs: same bits). ``$QWEN4EXP_MOE_SHARED_STREAM=0`` turns it off.
SHARED_STREAM = os.environ.get("QWEN4EXP_MOE_SHARED_STREAM", "1").strip() != "0"

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


def _route_block(xp, logits, top_k: int, norm_topk_prob: bool):
    """Top-k + route tables of ``logits [T, E]`` in one single-block launch (``moe_route.cu``: bit-identical to
    :func:`router_topk` + :func:`moe_route_tables`); None when ``top_k`` or ``E`` do not fit its shared memory."""
    T, E = logits.shape
    k = int(top_k)
    nw = min(16, T, (44 * 1024) // (4 * E))  # a warp per token, W * E floats (+ 4 KiB static) within 48 KiB
    if not (1 <= k <= min(E, 64)) or nw < 1:
        return None
    S = T * k
    rpt = default_rows_per_tile(T, k, E)
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
    """combine (:func:`engine.kernels.tiles.combine`, same expression and order, bit for bit) with every slot's load in flight
    (``moe_route.cu:moe_combine_ilp``)."""
    out = _empty(xp, (T, H), dtype=xp.float32) if out is None else out
    n = T * H
    if n:
        kernel("moe_route.cu", "moe_combine_ilp")(
            (-(-n // 256),), (256,), (y, route.slot_pos, f32_contig(weights, "weights"), ptr_or_null(shared),
                                      ptr_or_null(shared_gate), out, np.int32(T), np.int32(k), np.int32(H)))
    return out


def _gate_up_swiglu(xp, plan, gu, h, I: int) -> None:
    """The gate/up launch ``plan`` (into ``gu``), then the SwiGLU kernel ``h = silu(gate) * up`` (into ``h``, no
    allocation)."""
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
    _gate_up_swiglu(xp, launch_plan(xp, x, None, gate_up, 0, gu, None, T, 2 * Is, H), gu, h, Is)
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
    side, fork, join = _side_stream(xp)
    fork.record(xp.cuda.get_current_stream())
    side.wait_event(fork)
    with side:  # no allocation on this stream
        _gate_up_swiglu(xp, plan, gu, h, Is)
        linear(h, down_proj, out=shared)
        linear(x, expert_gate, out=sg)
    join.record(side)
    return shared, sg.reshape(-1), join, (x, gu, h, shared, sg)


def _moe_block_fused(x, router_weight, gate_up, down, *, top_k, norm_topk_prob, shared_gate_proj, shared_up_proj,
                     shared_down_proj, shared_expert_gate, shared_gate_up) -> MoEOut:
    """:func:`moe_block` on the decode chain (same arguments, same results bit for bit): the router GEMV, then
    top-k + tables in one launch (:func:`_route_block`), the shared expert on the side stream
    (:data:`SHARED_STREAM`), the routed gate/up + SwiGLU and down, and the combine with every load in flight. A
    step that does not fit runs the grouped pieces."""
    xp = same_device(x, router_weight, gate_up, down)
    T, H, E, I = _expert_shapes(x, gate_up, down)
    x = f32_contig(x, "x")
    join = shared = sg = keep = None
    if SHARED_STREAM and shared_gate_proj is not None:
        got = _shared_branch(xp, x, shared_gate_proj, shared_down_proj, shared_expert_gate, shared_gate_up)
        if got is not None:
            shared, sg, join, keep = got
    logits = linear(x, router_weight)
    got = _route_block(xp, logits, top_k, norm_topk_prob)
    if got is None:
        ids, w = router_topk(logits, top_k, norm_topk_prob)
        route = moe_route_tables(ids, E)
    else:
        ids, w, route = got
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
                    h, I)
    y = _empty(xp, (S, H), dtype=xp.float32)
    out = _empty(xp, (T, H), dtype=xp.float32)
    if join is not None:
        xp.cuda.get_current_stream().wait_event(join)  # the shared expert's results, before the combine reads them
    plan = launch_plan(xp, h, None, down, H * I, y, route.tiles, S, H, I)
    _run_plan(plan)
    _combine_fast(xp, y, route, w, shared, sg, T=T, k=k, H=H, out=out)
    del keep  # the side stream's arrays, held until the current stream waited on its join
    return MoEOut(out=out, router_logits=logits, topk_ids=ids, topk_weights=w)
