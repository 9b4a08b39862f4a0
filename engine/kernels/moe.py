"""MoE ops of the engine: router softmax + top-k, device-side dispatch, grouped expert GEMMs,
weighted combine, shared expert with its sigmoid gate.

Formula sources (modeling_qwen4_exp.py): ``Qwen4ExpTextTopKRouter.forward`` (softmax in float32,
top-k, renormalisation when ``norm_topk_prob``), ``Qwen4ExpTextExperts.forward`` (per expert
``down(silu(gate x) * up x)`` weighted by the routing weight and summed), ``Qwen4ExpTextMLP.forward``
(shared expert) and ``Qwen4ExpTextSparseMoeBlock.forward`` (``routed + sigmoid(shared_gate x) * shared``).

Top-k order is the project's canonical one: higher probability first, ties broken by the lower
expert id. Expert weights are stacked as ``gate_up [E, 2*I, H]`` (rows ``[0, I)`` the gate projection,
``[I, 2I)`` the up projection: the official fused layout) and ``down [E, H, I]``.

CUDA path: for a decode step (1..16 tokens; BF16 / FP8 / NVFP4 experts) the whole block runs in three launches of
``engine/kernels/cuda/moe_decode.cu`` (:data:`FUSED_DECODE`, :func:`_moe_block_decode`). Otherwise the grouped
chain (``engine/kernels/cuda/dense_moe.cu`` + the linear kernels): routing, counting, offsets, the sorted slot order
and the tile tables are all computed on the device; grouped launches are sized by the worst case
(``S // rows_per_tile + min(E, S)`` tiles, ``S = T * top_k``) and tiles past the device-side count exit at once.
Nothing is copied to the host on either path.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels import gemm_tc as _tc
from engine.kernels.dense_common import ptr_or_null
from engine.kernels.dense_common import weight_kind
from engine.kernels.linear import _quant_fargs, grouped_linear, linear
from engine.kernels.tiles import (GEMV_MAX_ROWS, GroupTiles, MoERoute, combine,  # noqa: F401 (re-exported)
                                  moe_route_tables)
from reference.blocks import moe as _ref_moe
from reference.blocks.norms import silu as _ref_silu

__all__ = ["router_topk", "moe_route_tables", "MoERoute", "moe_experts", "moe_block", "MoEOut", "shared_expert",
           "FUSED_DECODE"]


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
            and x.ndim == 2 and 1 <= x.shape[0] <= GEMV_MAX_ROWS
            and (shared_gate_proj is None or shared_gate_up is not None)
            and x.shape[0] <= DECODE_BLOCK_MAX_TOKENS.get(weight_kind(gate_up), 0)):
        got = _moe_block_decode(x, router_weight, gate_up, down, top_k=top_k, norm_topk_prob=norm_topk_prob,
                                shared_gate_up=shared_gate_up, shared_down_proj=shared_down_proj,
                                shared_expert_gate=shared_expert_gate)
        if got is not None:
            return got
    shared = sg = None
    side = None
    if (shared_gate_proj is not None and experts_fn is None and is_cupy(same_device(x))
            and shared_on_side_stream(x.shape[0], (router_weight, shared_gate_up, *shared_ws))):
        side = _side_branch()
    with side if side is not None else contextlib.nullcontext():  # the fork's region: joined on leaving it
        if shared_gate_proj is not None:
            with side.side if side is not None else contextlib.nullcontext():
                shared = shared_expert(x, shared_gate_proj, shared_up_proj, shared_down_proj, gate_up=shared_gate_up)
                sg = linear(x, shared_expert_gate)
        logits = linear(x, router_weight)
        ids, w = router_topk(logits, top_k, norm_topk_prob)
    if experts_fn is not None:
        out = experts_fn(x, ids, w, shared=shared, shared_gate=sg)
    else:
        out = moe_experts(x, ids, w, gate_up, down, shared=shared, shared_gate=sg)
    return MoEOut(out=out, router_logits=logits, topk_ids=ids, topk_weights=w)


#: The shared expert of a decode-sized MoE block (1..16 tokens, cupy, the grouped chain) runs on a side stream,
#: beside the router and top-k of the current stream, which waits for it before the route tables and experts: in a
#: captured decode step the two chains are parallel branches of the graph, so the shared expert's four small launches
#: (latency-bound at these sizes) overlap the router's. The same kernels in the same order on each stream: the
#: results are bitwise those of one stream. Longer inputs stay on one stream (their tensor-core GEMMs share one
#: cuBLAS workspace; as do blocks on the tensor-core path: :func:`shared_on_side_stream`). A module flag (no
#: environment switch) so the tests and lab tools can run both.
SHARED_SIDE_STREAM = True
_SIDE_STREAMS: dict = {}


def shared_on_side_stream(T: int, weights) -> bool:
    """Whether the shared expert of a ``T``-token block forks onto the side stream (pure host logic).

    Args:
        T: the block's tokens. weights: the weights of both branches (router, shared expert and its gate; None
            entries are skipped).
    Returns:
        True for :data:`SHARED_SIDE_STREAM`, at most :data:`GEMV_MAX_ROWS` tokens, and no weight on the tensor-core
        path at ``T`` rows (:func:`engine.kernels.gemm_tc.use_tc`): that path's cuBLAS GEMMs share one handle and one
        workspace per device (``gemm_tc._handle``), so on two streams at once they would write the same workspace.
        ``gemm_tc.TC_MIN_ROWS`` (its environment setting) at 16 or below sends decode-sized blocks there.
    """
    return (SHARED_SIDE_STREAM and T <= GEMV_MAX_ROWS
            and not any(w is not None and _tc.use_tc(T, w) for w in weights))


class _side_branch:
    """A fork of the current stream onto the device's side stream, made on construction; ``with`` it around the
    region where the two streams overlap (launch the side work inside ``with branch.side:``): leaving the region
    joins the fork, on an error too. The side stream is non-blocking (no implicit order with the legacy stream),
    so the fork and the join are explicit events: the side work starts after everything already queued on the
    current stream and the current stream's work after the region waits for it. Each use begins by waiting for the
    current stream, so memory the side stream frees and takes again is never still in use by an earlier join's
    reader."""

    def __init__(self):
        import cupy as cp
        self.cp = cp
        self.main = cp.cuda.get_current_stream()
        dev = cp.cuda.Device().id
        self.side = _SIDE_STREAMS.get(dev)
        if self.side is None:
            self.side = _SIDE_STREAMS[dev] = cp.cuda.Stream(non_blocking=True)
        fork = cp.cuda.Event(disable_timing=True)
        fork.record(self.main)
        self.side.wait_event(fork)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, *exc):
        if exc_type is None:
            self.join()
            return False
        # joined on an error too (one raised by either stream's work, or an interrupt between the fork and the
        # join): a captured step then ends its capture with that error, where an unjoined fork would end it with
        # cudaErrorStreamCaptureUnjoined instead (which the graphs' fallback takes for a capture failure, so an
        # interrupt would be lost), and an eager one does not leave side kernels reading memory the current
        # stream goes on to free and reuse
        try:
            self.join()
        except Exception:  # (a capture the error already invalidated refuses the join): report the first error
            pass
        return False

    def join(self):
        done = self.cp.cuda.Event(disable_timing=True)
        done.record(self.side)
        self.main.wait_event(done)


# ---------------------------------------------------------------------------------------------------------------
# Decode block (cuda/moe_decode.cu): three launches for 1..16 tokens

#: The MoE block of a decode step (1..16 tokens, cupy, no expert parallelism; BF16 / FP8 / NVFP4 experts) in three
#: launches (``cuda/moe_decode.cu``): router + shared gate + top-k + item table; gate_up + SwiGLU of every selected
#: expert and of the shared expert; down + the weighted combine, each block owning 8 output rows of every expert.
#: Runs where :data:`DECODE_BLOCK_MAX_TOKENS` allows and its shapes fit; float32 weights and the rest run the grouped
#: chain of :func:`moe_experts`. A module flag (no environment switch) so the tests can run the grouped chain beside
#: it.
FUSED_DECODE = True

#: Per routed-expert format, the most tokens for which the decode block is the default: where it measured faster than
#: the grouped chain (lab/moe_fused_bench.py at the real widths, one H100, docs/performance.md): at one token BF16
#: 1.39x, FP8 1.16x, NVFP4 1.05x. At 16 tokens the block is 0.38-0.58x (a serial top-k of 16 tokens in one block,
#: float32 FMAs where the grouped chain has tensor cores), so 2..16 tokens run the grouped chain. A module constant,
#: not an environment switch: the tests and the bench raise every entry to 16 to run the block everywhere.
DECODE_BLOCK_MAX_TOKENS = {"bf16": 1, "fp8": 1, "nvfp4": 1}

_DOWN_ROWS = 8  # output rows per block of the down launch (moe_decode.cu MOE_DOWN_ROWS)
#: outputs per block of the gate_up launch by the expert format (moe_decode.cu moe_gu_slots: 32 lanes / G)
_GU_SLOTS = {"bf16": 2, "fp8": 4, "nvfp4": 8}
_COUNTERS: dict = {}


def _counter(xp):
    """The device's ticket counter of the router launch (one uint32, zero between launches: the block taking the last
    ticket resets it). One per device: the decode launches run on one stream."""
    dev = xp.cuda.Device().id
    c = _COUNTERS.get(dev)
    if c is None:
        c = _COUNTERS[dev] = xp.zeros(1, dtype=xp.uint32)
    return c


def _token_bound(T: int) -> int:
    """The accumulator bound MT (1, 4, 16) of the decode kernels for ``T`` tokens."""
    return 1 if T == 1 else (4 if T <= 4 else 16)


def _fmt_args(w, K: int, act):
    """``(format, loader arguments)`` of a BF16 / FP8 / NVFP4 weight (``[N, K]`` or an ``[E, N, K]`` stack) read
    against the activations ``act`` by the decode kernels, or None when the format or the alignment does not fit them
    (16-byte chunks, 16-byte aligned weights and activations: :func:`engine.kernels.linear._quant_fargs`' rule)."""
    kind = weight_kind(w)
    N = int(w.shape[-2])
    if kind in ("fp8", "nvfp4"):
        vec, fargs = _quant_fargs(w, act, N, K)
        return (kind, fargs) if vec else None
    if kind != "bf16" or K % 8 or act.data.ptr % 16:
        return None
    if w.dtype != np.uint16:
        w = w.view(np.uint16)
    if not w.flags.c_contiguous or w.data.ptr % 16:
        return None
    return kind, (w, np.int64(N * K if w.ndim == 3 else 0))


def _moe_block_decode(x, router_weight, gate_up, down, *, top_k, norm_topk_prob, shared_gate_up, shared_down_proj,
                      shared_expert_gate):
    """:func:`moe_block` for 1..16 tokens in three launches (``cuda/moe_decode.cu``; same arguments, the stacked
    shared gate/up required when there is a shared expert). Results: the grouped chain's up to float32 summation
    order (the router logits and every dot product are summed in another order; top-k, SwiGLU and the combine are
    the same expressions), and independent of the other tokens of the step.

    Returns:
        :class:`MoEOut`, or None (nothing launched) when the formats or shapes do not fit the kernels.
    """
    xp = same_device(x, router_weight, gate_up, down)
    T, H, E, I = _expert_shapes(x, gate_up, down)
    k = int(top_k)
    S = T * k
    if not (1 <= k <= min(E, 64)) or S > 1024 or router_weight.ndim != 2 or tuple(router_weight.shape) != (E, H):
        return None
    if E * 4 > 44 * 1024:  # the top-k's probabilities in shared memory
        return None
    rkind = weight_kind(router_weight)
    if rkind not in ("f32", "bf16") or H % 8:
        return None
    rw = router_weight.view(np.uint16) if rkind == "bf16" and router_weight.dtype != np.uint16 else router_weight
    if not rw.flags.c_contiguous or rw.data.ptr % 16:
        return None
    x = f32_contig(x, "x")
    MT = _token_bound(T)
    h = _empty(xp, (S, I), dtype=xp.float32)
    r = _fmt_args(gate_up, H, x)
    rd = _fmt_args(down, I, h)
    if r is None or rd is None or r[0] != rd[0]:
        return None
    has_shared = shared_gate_up is not None
    if has_shared:
        Is = int(shared_gate_up.shape[0]) // 2
        sgk = weight_kind(shared_expert_gate)
        if (shared_gate_up.ndim != 2 or tuple(shared_gate_up.shape) != (2 * Is, H) or shared_down_proj.ndim != 2
                or tuple(shared_down_proj.shape) != (H, Is) or sgk not in ("f32", "bf16")
                or tuple(shared_expert_gate.shape) != (1, H)):
            return None
        hs = _empty(xp, (T, Is), dtype=xp.float32)
        s = _fmt_args(shared_gate_up, H, x)
        sd = _fmt_args(shared_down_proj, Is, hs)
        if s is None or sd is None or s[0] != sd[0]:
            return None
        sgate = xp.ascontiguousarray(shared_expert_gate.reshape(-1))
        if sgk == "bf16" and sgate.dtype != np.uint16:
            sgate = sgate.view(np.uint16)
    else:  # placeholders of the shared slot (never read: has_shared = 0)
        Is, hs, s, sd, sgate, sgk = I, h, r, rd, None, "f32"
    logits = _empty(xp, (T, E), dtype=xp.float32)
    ids = _empty(xp, (T, k), dtype=xp.int32)
    w = _empty(xp, (T, k), dtype=xp.float32)
    sgl = _empty(xp, T, dtype=xp.float32)
    max_items = min(E, S)
    n_items = _empty(xp, 1, dtype=xp.int32)
    # at least 8 items: the down launch's warp w reads entry w beside n_items (moe_decode.cu moe_down_body)
    item_expert, item_count = (_empty(xp, max(max_items, 8), dtype=xp.int32) for _ in range(2))
    item_tok, item_slot = (_empty(xp, max_items * MT, dtype=xp.int32) for _ in range(2))
    out = _empty(xp, (T, H), dtype=xp.float32)
    cnt = _counter(xp)
    i32 = np.int32
    kernel("moe_decode.cu", f"moe_router_{rkind}_t{MT}")(
        (-(-E // 2) + 1,), (256,),
        (rw, x, i32(T), i32(E), i32(H), i32(k), i32(1 if norm_topk_prob else 0), ptr_or_null(sgate),
         i32(1 if sgk == "bf16" else 0), logits, sgl, ids, w, n_items, item_expert, item_count, item_tok, item_slot,
         cnt), shared_mem=E * 4)
    pair = f"{r[0]}_{s[0]}_t{MT}"
    tables = (n_items, item_expert, item_count)
    nbs = -(-Is // _GU_SLOTS[s[0]]) if has_shared else 0  # the shared expert's blocks, then each item slot's
    kernel("moe_decode.cu", f"moe_gate_up_{pair}")(
        (nbs + max_items * -(-I // _GU_SLOTS[r[0]]),), (256,),
        r[1] + s[1] + (i32(1 if has_shared else 0), x, i32(T), i32(H), i32(I), i32(Is)) + tables
        + (item_tok, item_slot, h, hs))
    kernel("moe_decode.cu", f"moe_down_{pair}")(
        (-(-H // _DOWN_ROWS),), (256,),
        rd[1] + sd[1] + (i32(1 if has_shared else 0), i32(T), i32(H), i32(I), i32(Is), i32(k)) + tables
        + (item_slot, h, hs, w, sgl, out), shared_mem=(S + T) * _DOWN_ROWS * 4)
    return MoEOut(out=out, router_logits=logits, topk_ids=ids, topk_weights=w)
