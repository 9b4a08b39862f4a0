"""Tile tables of the grouped launches and the MoE's device-side dispatch of routed slots.

The grouped linear kernels (:mod:`engine.kernels.linear`), the MoE chain (:mod:`engine.kernels.moe`) and the
tensor-core MoE GEMMs (:mod:`engine.kernels.gemm_tc`) all read these tables; they live here so that none of those
modules imports another one's users. Formula source of the combine: ``Qwen4ExpTextExperts.forward`` (weighted sum
of the routed experts) and ``Qwen4ExpTextSparseMoeBlock.forward`` (the gated shared expert).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import KernelInputError, f32_contig, is_cupy, kernel, ptr_or_null, same_device
from reference.blocks.norms import sigmoid as _ref_sigmoid

__all__ = ["GEMV_MAX_ROWS", "GEMM_TILE_ROWS", "gemv_tile_rows", "GroupTiles", "MoERoute", "DECODE_ROWS_PER_TILE",
           "default_rows_per_tile", "moe_route_tables", "combine"]

#: Rows per weight matrix up to which the decode GEMV is used (above: the tiled GEMM).
GEMV_MAX_ROWS = 16
#: Rows of one GEMM tile (the MoE tile tables for prefill use this).
GEMM_TILE_ROWS = 64

def gemv_tile_rows(m: int) -> int:
    """Activation rows sharing one GEMV weight pass for ``m`` rows: 1, 4 or 16."""
    return 1 if m <= 1 else (4 if m <= 4 else 16)


class GroupTiles:
    """A device-side tile table for grouped launches: tile ``i`` covers rows
    ``[start[i], start[i] + count[i])`` (``count <= rows_per_tile``) of weight matrix ``expert[i]``.

    Attributes:
        expert, start, count: int32 device arrays ``[max_tiles]`` (entries past ``n_tiles`` unused).
        n_tiles: int32 device array ``[1]``: how many entries are valid (never read by the host).
        max_tiles: host int, the launch grid's tile dimension (worst case).
        rows_per_tile: host int, ``GEMV_MAX_ROWS``-style bound the table was built for.
    """

    def __init__(self, expert, start, count, n_tiles, max_tiles: int, rows_per_tile: int):
        self.expert, self.start, self.count, self.n_tiles = expert, start, count, n_tiles
        self.max_tiles, self.rows_per_tile = int(max_tiles), int(rows_per_tile)


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
DECODE_ROWS_PER_TILE = int(os.environ.get("QWEN4EXP_MOE_DECODE_RPT", "4"))


def default_rows_per_tile(T: int, k: int, E: int) -> int:
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
        rows_per_tile: slots per tile (1, 4, 16: GEMV; 64: GEMM); default by :func:`default_rows_per_tile`.
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
    rpt = default_rows_per_tile(T, k, E) if rows_per_tile is None else int(rows_per_tile)
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


def combine(y_sorted, route: MoERoute, weights, shared=None, shared_gate=None, *, T: int, k: int, H: int):
    """Weighted combine of the routed slots (``Qwen4ExpTextExperts.forward``'s sum, plus
    ``sigmoid(shared_gate) * shared`` of ``Qwen4ExpTextSparseMoeBlock.forward`` when given):
    ``out[t] = sum_j weights[t, j] * y_sorted[slot_pos[t * k + j]]``, summed in slot order.

    Args:
        y_sorted: ``[S, H]`` expert outputs in sorted slot order (``S = T * k``), float32 (float64 on NumPy).
        route: the :class:`MoERoute` whose ``slot_pos`` maps slots to sorted rows.
        weights: ``[T, k]`` routing weights. shared / shared_gate: optional ``[T, H]`` and ``[T]`` (pre-sigmoid).
    Returns:
        ``[T, H]`` (``dense_moe.cu:moe_combine`` on CUDA).
    """
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
