"""PLE (per-layer n-gram embedding) ops of the engine.

* :func:`ngram_hash` - hashed n-gram row ids (int64 wrap-around, EOS reset, carried context), on the
  host through the reference's Numba twin. Source: modeling_qwen4_exp.py
  ``Qwen4ExpTextNGramEmbedding.forward`` and ``_shift_right_ignore_eos``.
* :func:`ple_gate` - key/query grouped norms, signed-square-root gate, gated value and its norm.
  Source: ``Qwen4ExpTextPLELayer.forward``.
* :func:`ple_conv` - ``silu`` of the dilated depthwise causal conv with carried state.
  Source: ``Qwen4ExpTextPLELayer._short_conv``.

The layer itself (projections, gate, conv, taps in between) is composed by ``engine.model.Engine._ple``.

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

from engine.kernels.dense_common import empty as _empty
from engine.kernels.dense_common import (KernelInputError, compute_dtype, f32_contig, is_cupy, kernel, same_device,
                                         weight_as_float)
from engine.kernels.norms import rms_norm
from reference import numba_kernels as _numba
from reference.blocks import ple as _ref_ple
from reference.blocks.norms import sigmoid as _ref_sigmoid
from reference.blocks.norms import silu as _ref_silu

__all__ = ["PLEHashTables", "ngram_hash", "ple_gate", "ple_conv", "PLEGateOut"]


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


def ngram_hash(ids: np.ndarray, ctx_slab: np.ndarray, slots, tables: PLEHashTables, *,
               update_context: bool = True) -> np.ndarray:
    """Hashed n-gram row ids for ``T`` new tokens of ``B`` sequences, on the host (every engine path:
    the ids are host data and the rows index a host- or device-resident table).

    For n-gram order ``g = 2..ngram_size`` and each of its ``heads_per_ngram`` heads ``h``:
    ``row = ((tok_0*m_0) ^ (tok_1*m_1) ^ ... ^ (tok_{g-1}*m_{g-1})) mod vocab_h + offset_h`` with int64
    wrap-around and floor modulo, where ``tok_s`` is the token ``s`` positions back, replaced by ``eos``
    when an EOS lies in the ``s`` positions before the current one. The hash itself is the reference's
    Numba twin :func:`reference.numba_kernels.ngram_hash_rows_batch` (one call for the whole batch); this
    function owns the engine's slab layout: it reads each sequence's carried context from
    ``ctx_slab[slots[b]]`` and advances it.

    Args:
        ids: int64 ``[B, T]`` new token ids.
        ctx_slab: host C-contiguous int64 ``[n_slots, ngram_size - 1]`` carried contexts (updated in place
            when ``update_context``: each row becomes the last ``ngram_size - 1`` tokens of its history).
        slots: int ``[B]`` rows of ``ctx_slab``.
        tables: the layer's NumPy :class:`PLEHashTables`.
    Returns:
        int64 ``[B, T, ngram_heads]`` absolute table rows.
    Raises:
        KernelInputError: shapes, dtypes or slot indices inconsistent.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` / ``_shift_right_ignore_eos``.
    """
    ids = np.ascontiguousarray(np.asarray(ids, dtype=np.int64))
    if ids.ndim != 2:
        raise KernelInputError(f"ids: expected [B, T] int64, found shape {tuple(ids.shape)}")
    L = tables.ngram_size - 1
    if (not isinstance(ctx_slab, np.ndarray) or ctx_slab.ndim != 2 or ctx_slab.shape[1] != L
            or ctx_slab.dtype != np.int64 or not ctx_slab.flags.c_contiguous):
        raise KernelInputError(f"ctx_slab: expected a host C-contiguous int64 [n_slots, ngram_size-1={L}], found "
                               f"{type(ctx_slab).__name__} {getattr(ctx_slab, 'dtype', '?')} "
                               f"{tuple(getattr(ctx_slab, 'shape', ()))}")
    B, T = ids.shape
    sl = _slots_i64(slots, np, B)
    if sl.size and (sl.min() < 0 or sl.max() >= ctx_slab.shape[0]):
        raise KernelInputError(f"slots: expected rows in [0, {ctx_slab.shape[0]}), found [{sl.min()}, {sl.max()}]")
    hist = np.concatenate([ctx_slab[sl], ids], axis=1)  # [B, L + T]
    rows = _numba.ngram_hash_rows_batch(hist[:, :L], hist[:, L:], tables.eos, tables.multipliers,
                                        tables.vocab_sizes, tables.offsets, tables.heads_per_ngram)
    if update_context:
        ctx_slab[sl] = hist[:, T:]
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
