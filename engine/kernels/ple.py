"""PLE (per-layer n-gram embedding) ops of the engine.

* :func:`ngram_hash` - hashed n-gram row ids (int64 wrap-around, EOS reset, carried context).
  Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` and ``_shift_right_ignore_eos``.
* :func:`ple_gate` - key/query grouped norms, signed-square-root gate, gated value and its norm.
  Source: ``Qwen4ExpTextPLELayer.forward``.
* :func:`ple_conv` - ``silu`` of the dilated depthwise causal conv with carried state.
  Source: ``Qwen4ExpTextPLELayer._short_conv``.
* :func:`ple_forward` - the whole layer given the gathered n-gram embeddings.

State layout (engine slabs, one row per sequence slot):

* n-gram context ``ctx_slab [n_slots, ngram_size - 1]`` int64: the previous tokens, oldest first;
  a fresh sequence's row is all ``eos`` (the official initial context).
* conv state ``conv_slab [n_slots, (K - 1) * ngram_size, hc_count * H]`` float32, oldest first; a
  fresh sequence's row is all zeros (the official zero padding).

Batched: ``B`` sequences with ``T`` new tokens each (prefill: ``B = 1``; decode: ``T = 1``).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numba import njit

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels.linear import linear
from engine.kernels.norms import rms_norm
from reference.blocks import ple as _ref_ple
from reference.blocks.norms import sigmoid as _ref_sigmoid
from reference.blocks.norms import silu as _ref_silu

__all__ = ["PLEHashTables", "ngram_hash", "ngram_hash_host", "ple_gate", "ple_conv", "ple_forward", "PLEGateOut"]


@dataclass
class PLEHashTables:
    """One PLE layer's hash constants on a device.

    Attributes:
        multipliers: int64 ``[ngram_size]``; vocab_sizes, offsets: int64 ``[ngram_heads]``.
        ngram_size, heads_per_ngram: ints; eos: the reset token (``config.ple_eos_token_id``).
    """

    multipliers: object
    vocab_sizes: object
    offsets: object
    ngram_size: int
    heads_per_ngram: int
    eos: int

    @classmethod
    def from_layout(cls, layout, config, xp=np) -> "PLEHashTables":
        """Build from a :class:`reference.config.PLELayout` and its :class:`ModelConfig` on ``xp``."""
        mult = np.array([int(m) for m in layout.multipliers], dtype=np.uint64).view(np.int64)
        return cls(multipliers=xp.asarray(mult), vocab_sizes=xp.asarray(np.array(layout.head_vocab_sizes, np.int64)),
                   offsets=xp.asarray(np.array(layout.head_offsets, np.int64)), ngram_size=int(config.ngram_size),
                   heads_per_ngram=int(config.heads_per_ngram), eos=int(config.ple_eos_token_id))


def _slots_i64(slots, xp, B):
    s = xp.asarray(slots).reshape(-1)
    if s.shape[0] != B:
        raise KernelInputError(f"slots: expected [B={B}] slot indices, found shape {tuple(s.shape)}")
    return xp.ascontiguousarray(s.astype(xp.int64))


def ngram_hash(ids, ctx_slab, slots, tables: PLEHashTables, *, update_context: bool = True):
    """Hashed n-gram row ids for ``T`` new tokens of ``B`` sequences.

    For n-gram order ``g = 2..ngram_size`` and each of its ``heads_per_ngram`` heads ``h``:
    ``row = ((tok_0*m_0) ^ (tok_1*m_1) ^ ... ^ (tok_{g-1}*m_{g-1})) mod vocab_h + offset_h`` with int64
    wrap-around and floor modulo, where ``tok_s`` is the token ``s`` positions back, replaced by ``eos``
    when an EOS lies in the ``s`` positions before the current one (the current token itself is never
    replaced). The history before the new tokens comes from ``ctx_slab[slots[b]]``.

    Args:
        ids: int64 ``[B, T]`` new token ids.
        ctx_slab: int64 ``[n_slots, ngram_size - 1]`` carried contexts (updated in place when
            ``update_context``: each row becomes the last ``ngram_size - 1`` tokens of its history).
        slots: int ``[B]`` rows of ``ctx_slab``.
        tables: the layer's :class:`PLEHashTables` (same device).
    Returns:
        int64 ``[B, T, ngram_heads]`` absolute table rows.
    Raises:
        KernelInputError: shapes inconsistent.
    """
    xp = same_device(ids, ctx_slab, tables.multipliers)
    if ids.ndim != 2:
        raise KernelInputError(f"ids: expected [B, T] int64, found shape {tuple(ids.shape)}")
    B, T = ids.shape
    n, hpn = tables.ngram_size, tables.heads_per_ngram
    L = n - 1
    heads = L * hpn
    if ctx_slab.ndim != 2 or ctx_slab.shape[1] != L or ctx_slab.dtype != np.int64:
        raise KernelInputError(f"ctx_slab: expected int64 [n_slots, ngram_size-1={L}], found {ctx_slab.dtype} "
                               f"{tuple(ctx_slab.shape)}")
    if not ctx_slab.flags.c_contiguous:
        raise KernelInputError("ctx_slab: expected a C-contiguous int64 slab, found a strided view")
    sl = _slots_i64(slots, xp, B)
    ids64 = xp.ascontiguousarray(ids.astype(xp.int64))
    if not is_cupy(xp):  # NumPy twin: the shared reference function, one sequence at a time
        hist = np.concatenate([ctx_slab[sl], ids64], axis=1)  # [B, L + T]
        rows = np.empty((B, T, heads), dtype=np.int64)
        for b in range(B):
            rows[b] = _ref_ple.ngram_rows_numpy(hist[b, :L], hist[b, L:], tables.eos, tables.multipliers,
                                                tables.vocab_sizes, tables.offsets, hpn)
        if update_context:
            ctx_slab[sl] = hist[:, T:]
        return rows
    rows = _empty(xp, (B, T, heads), dtype=xp.int64)
    total = B * T * heads
    if total:
        kernel("dense_ple.cu", "ngram_hash")(
            (-(-total // 256),), (256,), (ids64, ctx_slab, sl, np.int32(B), np.int32(T), np.int32(L), np.int32(n),
                                          np.int32(hpn), tables.multipliers, tables.vocab_sizes, tables.offsets,
                                          np.int64(tables.eos), rows))
    if update_context and B and T:
        kernel("dense_ple.cu", "ngram_ctx_update")(
            (-(-B // 128),), (128,), (ids64, ctx_slab, sl, np.int32(B), np.int32(T), np.int32(L)))
    return rows


@njit(cache=True)
def _ngram_hash_host_kernel(ids, ctx_slab, slots, n, hpn, mult, vocab, offs, eos, update, rows):  # pragma: no cover
    B, T = ids.shape
    L = n - 1
    heads = L * hpn
    hist = np.empty(L + T, np.int64)
    for b in range(B):
        row = slots[b]
        for p in range(L):
            hist[p] = ctx_slab[row, p]
        for t in range(T):
            hist[L + t] = ids[b, t]
        for t in range(T):
            q = L + t
            for hd in range(heads):
                g = hd // hpn + 2
                mixed = np.uint64(0)
                eos_seen = False
                for s in range(g):
                    if s == 0:
                        tok = hist[q]
                    else:
                        prev = hist[q - s]
                        if prev == eos:
                            eos_seen = True
                        tok = eos if eos_seen else prev
                    prod = np.uint64(tok) * np.uint64(mult[s])  # wraps mod 2^64 (= int64 wrap-around)
                    mixed = prod if s == 0 else (mixed ^ prod)
                m = np.int64(mixed)
                v = vocab[hd]
                r = m % v
                if r < 0:
                    r += v
                rows[b, t, hd] = r + offs[hd]
        if update:
            for p in range(L):
                ctx_slab[row, p] = hist[T + p]


def ngram_hash_host(ids: np.ndarray, ctx_slab: np.ndarray, slots, tables: PLEHashTables, *,
                    update_context: bool = True) -> np.ndarray:
    """:func:`ngram_hash` on the host for the engine's decode path (Numba, one call for the whole batch):
    the same formula and operation order as the CUDA kernel ``ngram_hash`` in dense_ple.cu (unsigned 64-bit
    products = int64 wrap-around, floor modulo for the positive head vocabulary).

    Args:
        ids: int64 ``[B, T]``; ctx_slab: host int64 ``[n_slots, ngram_size - 1]`` (updated in place when
            ``update_context``); slots: int ``[B]``; tables: NumPy :class:`PLEHashTables`.
    Returns:
        int64 ``[B, T, ngram_heads]`` absolute table rows.
    Raises:
        KernelInputError: shapes or dtypes inconsistent.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` / ``_shift_right_ignore_eos``.
    """
    ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    if ids.ndim != 2:
        raise KernelInputError(f"ids: expected [B, T] int64, found shape {tuple(ids.shape)}")
    n, hpn = tables.ngram_size, tables.heads_per_ngram
    L = n - 1
    if (not isinstance(ctx_slab, np.ndarray) or ctx_slab.ndim != 2 or ctx_slab.shape[1] != L
            or ctx_slab.dtype != np.int64 or not ctx_slab.flags.c_contiguous):
        raise KernelInputError(f"ctx_slab: expected a host C-contiguous int64 [n_slots, ngram_size-1={L}], found "
                               f"{type(ctx_slab).__name__} {getattr(ctx_slab, 'dtype', '?')} "
                               f"{tuple(getattr(ctx_slab, 'shape', ()))}")
    sl = np.ascontiguousarray(np.asarray(slots, dtype=np.int64).reshape(-1))
    B, T = ids.shape
    if sl.shape[0] != B:
        raise KernelInputError(f"slots: expected [B={B}] slot indices, found shape {tuple(sl.shape)}")
    if sl.size and (sl.min() < 0 or sl.max() >= ctx_slab.shape[0]):
        raise KernelInputError(f"slots: expected rows in [0, {ctx_slab.shape[0]}), found [{sl.min()}, {sl.max()}]")
    rows = np.empty((B, T, L * hpn), dtype=np.int64)
    _ngram_hash_host_kernel(ids, ctx_slab, sl, n, hpn, np.asarray(tables.multipliers, np.int64),
                            np.asarray(tables.vocab_sizes, np.int64), np.asarray(tables.offsets, np.int64),
                            np.int64(tables.eos), bool(update_context), rows)
    return rows


@dataclass
class PLEGateOut:
    """Result of :func:`ple_gate`: ``gated [R, hc*H]`` (``sigmoid(gate) * value`` per stream),
    ``gated_normed [R, hc*H]`` (its grouped zero-centred norm: the conv input), ``gate [R, hc]``
    (the signed-square-root gate before the sigmoid: tap ``layers.{i}.ple.gate``)."""

    gated: object
    gated_normed: object
    gate: object


def ple_gate(key, value, hidden, norm_key_w, norm_query_w, norm_conv_w, *, hc_count: int, eps: float) -> PLEGateOut:
    """PLE gating (``Qwen4ExpTextPLELayer.forward`` up to the conv).

    ``kn = norm_key(key)``, ``qn = norm_query(hidden)`` (grouped per stream, zero-centred);
    ``gate_s = <kn_s, qn_s> / sqrt(H)``; ``gate = sign(gate) * sqrt(max(|gate|, 1e-6))``;
    ``gated_s = sigmoid(gate_s) * value``; ``gated_normed = norm_conv(gated)``.

    Args:
        key: ``[R, hc*H]`` float32 (``key_proj`` output); value: ``[R, H]`` (``value_proj`` output);
        hidden: ``[R, hc*H]`` the multi-stream residual; the three norm weights: ``[hc*H]``.
    Returns:
        :class:`PLEGateOut`.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    xp = same_device(key, value, hidden)
    if key.ndim != 2 or hidden.shape != key.shape or value.ndim != 2 or value.shape[0] != key.shape[0] \
            or value.shape[1] * hc_count != key.shape[1]:
        raise KernelInputError(f"key/value/hidden: expected [R, hc*H] / [R, H] / [R, hc*H] with hc={hc_count}, found "
                               f"{tuple(key.shape)} / {tuple(value.shape)} / {tuple(hidden.shape)}")
    R, W = key.shape
    H = W // hc_count
    if not is_cupy(xp):
        dt = compute_dtype(key)
        kn = rms_norm(key, norm_key_w, eps=eps, group_size=H).reshape(R, hc_count, H)
        qn = rms_norm(hidden, norm_query_w, eps=eps, group_size=H).reshape(R, hc_count, H)
        g = _ref_ple.ple_gate(kn, qn, H)
        gated = (_ref_sigmoid(g)[:, :, None] * value.astype(dt, copy=False)[:, None, :]).reshape(R, W)
        gn = rms_norm(gated, norm_conv_w, eps=eps, group_size=H)
        return PLEGateOut(gated=gated, gated_normed=gn, gate=g)
    k, v, h = f32_contig(key, "key"), f32_contig(value, "value"), f32_contig(hidden, "hidden")
    wk, wq, wc = (f32_contig(weight_as_float(w.reshape(-1)), n) for w, n in
                  ((norm_key_w, "norm_key_w"), (norm_query_w, "norm_query_w"), (norm_conv_w, "norm_conv_w")))
    gated = _empty(xp, (R, W), dtype=xp.float32)
    gn = _empty(xp, (R, W), dtype=xp.float32)
    g = _empty(xp, (R, hc_count), dtype=xp.float32)
    if R:
        kernel("dense_ple.cu", "ple_gate")(
            (R * hc_count,), (256,), (k, v, h, wk, wq, wc, gated, gn, g, np.int64(R), np.int32(hc_count), np.int32(H),
                                      np.float32(eps)))
    return PLEGateOut(gated=gated, gated_normed=gn, gate=g)


def ple_conv(x, conv_slab, slots, weight, *, dilation: int, update_state: bool = True):
    """``silu`` of the dilated depthwise causal conv over ``[carried state | x]``, per sequence.

    ``y[b, t, c] = silu(sum_j weight[c, j] * h[b, t - (K-1-j)*dilation, c])`` where ``h`` is ``x`` for
    non-negative times and the carried state row (length ``L = (K-1)*dilation``) before.

    Args:
        x: ``[B, T, C]`` float32.
        conv_slab: ``[n_slots, L, C]`` float32 state (updated in place when ``update_state``: each row
            becomes the last ``L`` inputs of its history).
        slots: int ``[B]`` rows of ``conv_slab``.
        weight: ``[C, K]`` float32 (``conv1d.weight`` reshaped; BF16 bits upcast).
        dilation: ``ngram_size``.
    Returns:
        ``[B, T, C]`` float32.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    xp = same_device(x, conv_slab, weight)
    if x.ndim != 3 or weight.ndim != 2 or conv_slab.ndim != 3:
        raise KernelInputError(f"x/weight/conv_slab: expected [B, T, C] / [C, K] / [n_slots, L, C], found "
                               f"{tuple(x.shape)} / {tuple(weight.shape)} / {tuple(conv_slab.shape)}")
    B, T, C = x.shape
    K = int(weight.shape[1])
    L = (K - 1) * int(dilation)
    if weight.shape[0] != C or conv_slab.shape[1:] != (L, C):
        raise KernelInputError(f"weight/conv_slab: expected [C={C}, K] and [n_slots, L={L}, C={C}], found "
                               f"{tuple(weight.shape)} / {tuple(conv_slab.shape)}")
    sl = _slots_i64(slots, xp, B)
    if not is_cupy(xp):
        dt = compute_dtype(x)  # NumPy twin: the shared reference conv, one sequence at a time
        w = weight_as_float(weight, dt)
        y = np.empty((B, T, C), dtype=dt)
        new_states = []
        for b in range(B):
            yb, st = _ref_ple.dilated_causal_conv(x[b].astype(dt, copy=False), conv_slab[sl[b]].astype(dt), w,
                                                  int(dilation))
            y[b] = _ref_silu(yb)
            new_states.append(st)
        if update_state:
            for b in range(B):
                conv_slab[sl[b]] = new_states[b].astype(conv_slab.dtype)
        return y
    xc = f32_contig(x, "x")
    if conv_slab.dtype != np.float32 or not conv_slab.flags.c_contiguous:
        raise KernelInputError(f"conv_slab: expected a C-contiguous float32 slab on the GPU, found {conv_slab.dtype}")
    wc = f32_contig(weight_as_float(weight), "weight")
    y = _empty(xp, (B, T, C), dtype=xp.float32)
    n = B * T * C
    if n:
        kernel("dense_ple.cu", "ple_conv")(
            (-(-n // 256),), (256,), (xc, conv_slab, sl, wc, y, np.int32(B), np.int32(T), np.int32(C), np.int32(K),
                                      np.int32(dilation)))
    if update_state and B * C and T and L:
        kernel("dense_ple.cu", "ple_conv_state")(
            (-(-(B * C) // 256),), (256,), (xc, conv_slab, sl, np.int32(B), np.int32(T), np.int32(C), np.int32(L)))
    return y


def ple_forward(hidden, emb, key_proj_w, value_proj_w, norm_key_w, norm_query_w, norm_conv_w, conv_w, conv_slab,
                slots, *, hc_count: int, eps: float, dilation: int, update_state: bool = True):
    """The PLE layer's output (added to the residual by the caller): ``gated + silu(conv(norm(gated)))``.

    Args:
        hidden: ``[B, T, hc*H]`` float32 residual entering the layer.
        emb: ``[B, T, ple_embed_dim]`` gathered n-gram embeddings (heads concatenated).
        key_proj_w: ``[hc*H, ple_embed_dim]``; value_proj_w: ``[H, ple_embed_dim]`` (BF16 bits or float32).
        norm_key_w, norm_query_w, norm_conv_w: ``[hc*H]``; conv_w: ``[hc*H, K]``.
        conv_slab, slots: see :func:`ple_conv`.
    Returns:
        ``(out [B, T, hc*H], gate [B, T, hc])``.
    Raises:
        KernelInputError: inconsistent shapes.
    """
    if hidden.ndim != 3 or emb.ndim != 3 or hidden.shape[:2] != emb.shape[:2]:
        raise KernelInputError(f"hidden/emb: expected [B, T, hc*H] / [B, T, ple_embed_dim], found "
                               f"{tuple(hidden.shape)} / {tuple(emb.shape)}")
    B, T, W = hidden.shape
    e2 = emb.reshape(B * T, emb.shape[2])
    key = linear(e2, key_proj_w)
    value = linear(e2, value_proj_w)
    pg = ple_gate(key, value, hidden.reshape(B * T, W), norm_key_w, norm_query_w, norm_conv_w, hc_count=hc_count,
                  eps=eps)
    conv = ple_conv(pg.gated_normed.reshape(B, T, W), conv_slab, slots, conv_w, dilation=dilation,
                    update_state=update_state)
    return pg.gated.reshape(B, T, W) + conv, pg.gate.reshape(B, T, hc_count)
