"""PLE: hashed n-gram embeddings injected into every residual stream.

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextNGramEmbedding`` (``_shift_right_ignore_eos``, ``forward``:
the n-gram hash), ``Qwen4ExpTextPLELayer`` (``forward``: key/value projections, the signed-square-root
sigmoid gate, ``_short_conv``: the dilated depthwise conv with its carried state, silu).

Hash facts (checked bit for bit against the official code by tests/test_reference_ple.py):
* the history is the carried ``ngram_size - 1`` previous tokens (EOS-filled at the start) + the new ids;
* shift ``s`` of position ``p`` is ``history[p - s]`` unless an EOS lies in ``history[p-s .. p-1]``
  (or ``p - s < 0``), in which case it is the EOS id: the n-gram never crosses a document boundary;
* ``mixed = (sh0 * m0) ^ (sh1 * m1) ^ ...`` in int64 with wrap-around multiplication (NumPy int64
  arrays wrap silently, as torch's int64 does);
* row = ``mixed mod vocab_h`` (non-negative remainder, ``torch.remainder`` / ``np.mod`` semantics) ``+ offset_h``.
"""
from __future__ import annotations

import math

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import rms_norm, sigmoid, silu

__all__ = ["shift_ignore_eos", "ngram_rows_numpy", "ple_gate", "dilated_causal_conv", "ple_block"]


def shift_ignore_eos(history: np.ndarray, shift: int, eos: int) -> np.ndarray:
    """Token ``shift`` places back within the same EOS-delimited segment, else EOS.

    Args:
        history: ``[L]`` int64 token history.
    Returns:
        ``[L]`` int64: ``history[p - shift]`` when no EOS lies in ``history[p-shift .. p-1]`` and
        ``p - shift >= 0``; the EOS id otherwise. ``shift == 0`` returns the history.
    Source: ``Qwen4ExpTextNGramEmbedding._shift_right_ignore_eos``.
    """
    history = np.asarray(history, dtype=np.int64)
    if shift == 0:
        return history.copy()
    L = history.shape[0]
    pos = np.arange(L)
    is_eos = np.where(history == eos, pos, -1)
    last_eos_incl = np.maximum.accumulate(is_eos) if L else is_eos
    prev_eos = np.concatenate([[-1], last_eos_incl[:-1]]) if L else is_eos  # last EOS strictly before p
    src = pos - shift
    valid = (pos - (prev_eos + 1) >= shift) & (src >= 0)
    return np.where(valid, history[np.maximum(src, 0)], np.int64(eos))


def ngram_rows_numpy(context: np.ndarray, ids: np.ndarray, eos: int, multipliers, head_vocab_sizes,
                     head_offsets, heads_per_ngram: int) -> np.ndarray:
    """PLE n-gram table rows (readable NumPy form; the Numba twin is ``numba_kernels.ngram_hash_rows``).

    Args:
        context: ``[ngram_size - 1]`` int64, the tokens before ``ids`` (EOS-filled at sequence start).
        ids: ``[T]`` int64 new token ids.
        eos: the reset id (``eos_token_id[0]``).
        multipliers: ``[ngram_size]`` int64; head_vocab_sizes, head_offsets: ``[ngram_heads]`` int64.
    Returns:
        ``[T, ngram_heads]`` int64 rows (head offsets added), heads ordered bigram heads first.
    Source: ``Qwen4ExpTextNGramEmbedding.forward``.
    """
    context = np.asarray(context, dtype=np.int64)
    history = np.concatenate([context, np.asarray(ids, dtype=np.int64)])
    mult = np.asarray(multipliers, dtype=np.int64)
    sizes = np.asarray(head_vocab_sizes, dtype=np.int64)
    offs = np.asarray(head_offsets, dtype=np.int64)
    n = mult.shape[0]
    shifted = [shift_ignore_eos(history, s, eos) for s in range(n)]
    blocks = []
    with np.errstate(over="ignore"):
        for ng in range(2, n + 1):
            mixed = shifted[0] * mult[0]
            for s in range(1, ng):
                mixed = np.bitwise_xor(mixed, shifted[s] * mult[s])
            sl = slice((ng - 2) * heads_per_ngram, (ng - 1) * heads_per_ngram)
            blocks.append(np.mod(mixed[:, None], sizes[None, sl]) + offs[None, sl])
    rows = np.concatenate(blocks, axis=-1)
    return rows[context.shape[0]:]


def ple_gate(key_normed: np.ndarray, query_normed: np.ndarray, hidden_size: int) -> np.ndarray:
    """Signed-square-root gate: ``g = <k, q> / sqrt(H)``; ``sign(g) * sqrt(max(|g|, 1e-6))``.

    Args:
        key_normed, query_normed: ``[T, hc, H]``.
    Returns:
        ``[T, hc]`` (before the sigmoid). Note ``sign(0) = 0``.
    Source: ``Qwen4ExpTextPLELayer.forward``.
    """
    dt = key_normed.dtype.type
    g = (key_normed * query_normed).sum(axis=-1) / dt(math.sqrt(hidden_size))
    return np.sqrt(np.maximum(np.abs(g), dt(1e-6))) * np.sign(g)


def dilated_causal_conv(x: np.ndarray, state: np.ndarray, weight: np.ndarray, dilation: int):
    """Depthwise causal conv with dilation over ``[state; x]``.

    ``y[t, c] = sum_j weight[c, j] * z[t + j * dilation, c]`` with ``z = concat(state, x)`` and
    ``len(state) = (K - 1) * dilation``.

    Args:
        x: ``[T, C]``; state: ``[(K-1)*dilation, C]`` (zeros at sequence start);
        weight: ``[C, K]`` (the stored ``[C, 1, K]`` squeezed).
    Returns:
        ``(y [T, C], new_state [(K-1)*dilation, C])`` (new state = last rows of ``z``).
    Source: ``Qwen4ExpTextPLELayer._short_conv`` (dilation = ngram_size) and ``causal_conv1d_fn`` /
    ``causal_conv1d_update`` (dilation 1) of the Gated DeltaNet.
    """
    T = x.shape[0]
    S = state.shape[0]
    K = weight.shape[1]
    z = np.concatenate([state.astype(x.dtype, copy=False), x], axis=0)
    y = np.zeros_like(x)
    for j in range(K):
        y += z[j * dilation: j * dilation + T] * weight[:, j]
    new_state = z[z.shape[0] - S:].copy() if S else z[:0].copy()
    return y, new_state


def ple_block(hidden: np.ndarray, embeddings: np.ndarray, w: dict, conv_state: np.ndarray, hc_count: int,
              hidden_size: int, ngram_size: int, eps: float, taps: dict | None = None):
    """One PLE layer (its output is added to the residual by the caller).

    Args:
        hidden: ``[T, hc*H]`` residual entering the layer.
        embeddings: ``[T, ple_embed_dim]`` gathered n-gram rows, heads concatenated.
        w: weights ``key_proj [hc*H, E]``, ``value_proj [H, E]``, ``norm_key``/``norm_query``/``norm_conv``
           ``[hc*H]``, ``conv1d [hc*H, K]``.
        conv_state: ``[(K-1)*ngram_size, hc*H]``.
        taps: when a dict, receives ``norm_key``, ``norm_query``, ``norm_conv`` (the three RMSNorm outputs,
            ``[T, hc*H]``) and ``conv_out`` (``silu`` of the dilated conv, ``[T, hc*H]``).
    Returns:
        ``(out [T, hc*H], gate [T, hc], new_conv_state)``.
    Source: ``Qwen4ExpTextPLELayer.forward``.
    """
    T = hidden.shape[0]
    key = rms_norm(linear(embeddings, w["key_proj"]), w["norm_key"], eps, group_size=hidden_size)
    value = linear(embeddings, w["value_proj"])
    query = rms_norm(hidden, w["norm_query"], eps, group_size=hidden_size)
    gate = ple_gate(key.reshape(T, hc_count, hidden_size), query.reshape(T, hc_count, hidden_size), hidden_size)
    gated = (sigmoid(gate)[:, :, None] * value[:, None, :]).reshape(T, hc_count * hidden_size)
    gated_normed = rms_norm(gated, w["norm_conv"], eps, group_size=hidden_size)
    conv, new_state = dilated_causal_conv(gated_normed, conv_state, w["conv1d"], ngram_size)
    conv = silu(conv)
    if taps is not None:
        taps.update(norm_key=key, norm_query=query, norm_conv=gated_normed, conv_out=conv)
    return gated + conv, gate, new_state
