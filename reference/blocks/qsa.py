"""QSA: the block-sparse indexed attention layers (indexer + gated GQA over the selected tokens).

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextQSAIndexer.forward`` (indexer), ``Qwen4ExpTextAttention.forward``
and ``eager_attention_forward`` (gated attention), ``apply_rotary_pos_emb``.

Canonical top-k order (used by every component of this project): higher score first, then the LOWER
block index. The official code leaves ties to ``torch.topk`` whose CPU order for ties is not fixed.
"""
from __future__ import annotations

import math

import numpy as np

from reference.blocks.linear import linear
from reference.blocks.norms import rms_norm
from reference.blocks.rope import apply_rope
from reference.numba_kernels import block_topk_select, selected_attention

__all__ = ["canonical_topk", "indexer_project", "pool_block_keys", "indexer_select", "selection_mask",
           "attention_project", "sparse_attention", "qsa_attention", "DENSE_MAX_KEYS"]

#: Key counts above which :func:`qsa_attention` runs over the attended tokens only (the Numba
#: ``selected_attention``): the masked dense form costs ``T * L`` and a ``[T, L]`` mask, which histories past 32768
#: positions cannot afford. At and below it the dense form keeps its numbers (every fixture, every prompt of
#: the other levels and the floor's prompts): the two agree to float32 summation order (tests).
DENSE_MAX_KEYS = 8192


def canonical_topk(scores: np.ndarray, k: int) -> np.ndarray:
    """Indices of the ``k`` largest entries of each row, score descending then lower index first.

    Args:
        scores: ``[N, M]`` float (``-inf`` entries are never preferred over finite ones).
        k: ``0 <= k <= M``.
    Returns:
        ``[N, k]`` int64. A stable sort of ``-scores`` gives exactly the canonical tie order.
    """
    order = np.argsort(-scores, axis=-1, kind="stable")
    return order[..., :k].astype(np.int64)


def indexer_project(x: np.ndarray, w: dict, cos: np.ndarray, sin: np.ndarray, cfg, taps: dict | None = None):
    """Indexer queries (normed, rotated at their positions) and raw keys.

    Args:
        x: ``[T, H]``; w: ``index_qk_proj [(n_heads + 1) * D, H]``, ``q_layernorm [D]``;
        cos/sin: ``[T, rotary_dim]`` at the tokens' positions.
        taps: when a dict, receives ``q_layernorm`` (the normed queries before RoPE).
    Returns:
        ``(q [T, indexer_n_heads, D], raw_keys [T, D])``.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (first part).
    """
    T = x.shape[0]
    D, nh = cfg.indexer_head_dim, cfg.indexer_n_heads
    qk = linear(x, w["index_qk_proj"])
    q = rms_norm(qk[:, :nh * D].reshape(T, nh, D), w["q_layernorm"], cfg.rms_norm_eps)
    if taps is not None:
        taps["q_layernorm"] = q
    q = apply_rope(q, cos, sin)
    return q, qk[:, nh * D:].reshape(T, D)


def pool_block_keys(raw_keys: np.ndarray, first_block: int, n_blocks: int, k_norm_w: np.ndarray, cos_fn, cfg):
    """Compressed keys of complete blocks ``first_block .. n_blocks-1``.

    Block ``b`` = mean of raw keys ``b*r .. b*r+r-1`` -> ``k_layernorm`` -> RoPE at position ``b*r``.

    Args:
        raw_keys: ``[L, D]`` the raw indexer-key history (``L >= n_blocks * r``).
        cos_fn: ``positions [n] -> (cos, sin)`` tables.
    Returns:
        ``[n_blocks - first_block, D]``.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (``pooled_keys``, ``block_key_states``).
    """
    r, D = cfg.indexer_compress_ratio, cfg.indexer_head_dim
    if n_blocks <= first_block:
        return np.zeros((0, D), dtype=raw_keys.dtype)
    groups = raw_keys[first_block * r: n_blocks * r].reshape(n_blocks - first_block, r, D)
    pooled = rms_norm(groups.mean(axis=1), k_norm_w, cfg.rms_norm_eps)
    cos, sin = cos_fn(np.arange(first_block, n_blocks, dtype=np.int64) * r)
    return apply_rope(pooled, cos, sin)


def indexer_select(q: np.ndarray, block_keys: np.ndarray, positions: np.ndarray, cfg):
    """Block scores and the canonical block top-k per query.

    ``score[t, b] = sum_h relu(q[t, h] . K_b) / sqrt(D)`` for the ``n_t = (p_t + 1) // r`` complete blocks
    visible to query ``t`` at absolute position ``p_t`` (``-inf`` for the others); ``min(block_topk, n_t)``
    blocks are selected.

    Args:
        q: ``[T, n_heads, D]``; block_keys: ``[NB, D]`` with ``NB >= n_t`` for every query.
        positions: ``[T]`` int64 absolute positions.
    Returns:
        ``(scores [T, NB], selected [T, block_topk] int64, -1 padded, n_complete [T])``.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (``scores``, ``topk``).
    """
    r, D = cfg.indexer_compress_ratio, cfg.indexer_head_dim
    T, nh = q.shape[0], q.shape[1]
    NB = block_keys.shape[0]
    n_complete = (positions + 1) // r
    scores = np.empty((T, NB), dtype=q.dtype)
    # in query blocks: the per-head product [Tb, NB, n_heads] stays ~16M entries (at T = NB * r = 32768 the
    # whole product would be 4 GiB)
    step = max(1, (1 << 24) // max(1, nh * NB))
    for s0 in range(0, T, step):
        sl = slice(s0, min(T, s0 + step))
        raw = np.einsum("thd,bd->tbh", q[sl], block_keys, optimize=True)
        sc = np.maximum(raw, 0).sum(axis=-1) / q.dtype.type(math.sqrt(D))
        visible = np.arange(NB)[None, :] < n_complete[sl, None]
        scores[sl] = np.where(visible, sc, -np.inf)
    sel = block_topk_select(scores, n_complete, cfg.block_topk)  # Numba twin of canonical_topk per row
    return scores, sel, n_complete


def selection_mask(selected: np.ndarray, positions: np.ndarray, n_complete: np.ndarray, length: int, r: int):
    """Token-level visibility ``[T, length]`` bool: the selected blocks' tokens plus the incomplete tail
    ``n_complete*r .. p`` (always visible).

    Source: ``Qwen4ExpTextQSAIndexer.forward`` (``selected_tokens``, ``tail``) and the mask combine in
    ``Qwen4ExpTextAttention.forward``.
    """
    T = selected.shape[0]
    NB = length // r
    blocks = np.zeros((T, NB + 1), dtype=bool)
    rows = np.repeat(np.arange(T), selected.shape[1])
    cols = np.where(selected >= 0, selected, NB).reshape(-1)
    blocks[rows, cols] = True
    mask = np.zeros((T, length), dtype=bool)
    mask[:, :NB * r] = np.repeat(blocks[:, :NB], r, axis=1)
    j = np.arange(length)[None, :]
    mask |= (j >= (n_complete * r)[:, None]) & (j <= positions[:, None])
    return mask


def selected_tokens(selected: np.ndarray, positions: np.ndarray, r: int, width: int) -> np.ndarray:
    """Token-level selection ``[T, width]`` int64: the positions each query attends -- the selected
    blocks' tokens plus the incomplete tail ``n_complete*r .. p`` -- ascending, ``-1`` padded (the
    registry's ``indexer.selected_tokens``; compared as sets, so an engine that selects tokens rather than
    blocks is comparable). ``width``: ``indexer_budget + compress_ratio - 1``, the most a query can attend.

    Source: ``Qwen4ExpTextQSAIndexer.forward`` (``selected_token_indices``: selected blocks, then the tail).
    """
    selected = np.asarray(selected).reshape(len(positions), -1)
    out = np.full((len(positions), width), -1, dtype=np.int64)
    ar = np.arange(r)
    for t, p in enumerate(np.asarray(positions, dtype=np.int64)):
        nc = (int(p) + 1) // r
        blocks = selected[t][selected[t] >= 0].astype(np.int64)
        toks = np.concatenate([(blocks[:, None] * r + ar[None, :]).reshape(-1), np.arange(nc * r, int(p) + 1)])
        toks = np.sort(toks)[:width]
        out[t, :len(toks)] = toks
    return out


def attention_project(x: np.ndarray, w: dict, cos: np.ndarray, sin: np.ndarray, cfg, taps: dict | None = None):
    """Queries, output gate, keys and values of the gated attention.

    ``q_proj`` rows per head: ``head_dim`` query values then ``head_dim`` gate values.
    ``taps``: when a dict, receives ``q_norm`` / ``k_norm`` (the RMSNorm outputs before RoPE).
    Returns:
        ``(q [T, nH, hd], gate [T, nH*hd], k [T, nKV, hd], v [T, nKV, hd])``; q and k normed and rotated.
    Source: ``Qwen4ExpTextAttention.forward``.
    """
    T = x.shape[0]
    nH, nKV, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim

    def lin(name):
        y = linear(x, w[name + ".weight"])
        b = w.get(name + ".bias")
        return y if b is None else y + b

    qg = lin("q_proj").reshape(T, nH, 2 * hd)
    q, gate = qg[..., :hd], qg[..., hd:].reshape(T, nH * hd)
    qn = rms_norm(q, w["q_norm"], cfg.rms_norm_eps)
    kn = rms_norm(lin("k_proj").reshape(T, nKV, hd), w["k_norm"], cfg.rms_norm_eps)
    if taps is not None:
        taps.update(q_norm=qn, k_norm=kn)
    q = apply_rope(qn, cos, sin)
    k = apply_rope(kn, cos, sin)
    v = lin("v_proj").reshape(T, nKV, hd)
    return q, gate, k, v


def sparse_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, mask: np.ndarray, scaling: float,
                     query_block: int | None = None) -> np.ndarray:
    """Softmax attention of each query over the keys its mask allows (GQA: head ``h`` reads KV head
    ``h // (nH // nKV)``).

    Args:
        q: ``[T, nH, hd]``; K, V: ``[L, nKV, hd]``; mask: ``[T, L]`` bool (every row has >= 1 True).
        scaling: ``head_dim ** -0.5``.
    Returns:
        ``[T, nH * hd]``.
    Source: ``eager_attention_forward``.
    """
    T, nH, hd = q.shape
    nKV = K.shape[1]
    rep = nH // nKV
    if query_block is None:  # keep one block's score matrix [nH, block, L] around 16M entries
        query_block = max(1, min(128, (1 << 24) // max(1, nH * K.shape[0])))
    out = np.empty((T, nH, hd), dtype=q.dtype)
    Kh = K.transpose(1, 0, 2)  # [nKV, L, hd]
    Vh = V.transpose(1, 0, 2)
    for s0 in range(0, T, query_block):
        sl = slice(s0, min(T, s0 + query_block))
        qb = q[sl].transpose(1, 0, 2).reshape(nKV, rep * (sl.stop - sl.start), hd)
        s = (qb @ Kh.transpose(0, 2, 1)).reshape(nKV, rep, -1, Kh.shape[1]) * q.dtype.type(scaling)
        m = mask[sl][None, None]
        s = np.where(m, s, -np.inf)
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        p = s / s.sum(axis=-1, keepdims=True)
        o = p.reshape(nKV, -1, Kh.shape[1]) @ Vh  # [nKV, rep*Tb, hd]
        out[sl] = o.reshape(nH, -1, hd).transpose(1, 0, 2)
    return out.reshape(T, nH * hd)


def qsa_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, selected: np.ndarray, positions: np.ndarray,
                  n_complete: np.ndarray, r: int, scaling: float) -> np.ndarray:
    """The QSA attention of each query over its selected blocks' tokens plus its incomplete tail
    ``n_complete*r .. p``: :func:`sparse_attention` under :func:`selection_mask` for at most
    :data:`DENSE_MAX_KEYS` keys, else the same quantity over the attended tokens only
    (:func:`reference.numba_kernels.selected_attention`).

    Args:
        q: ``[T, nH, hd]``; K, V: ``[L, nKV, hd]`` (index = absolute position); selected: ``[T, block_topk]`` int
        (-1 padded); positions, n_complete: ``[T]`` int; r: compress ratio; scaling: ``head_dim ** -0.5``.
    Returns:
        ``[T, nH * hd]``.
    Source: ``Qwen4ExpTextAttention.forward`` (the indexer's mask) / ``eager_attention_forward``.
    """
    L = K.shape[0]
    if L <= DENSE_MAX_KEYS:
        return sparse_attention(q, K, V, selection_mask(np.asarray(selected, np.int64), np.asarray(positions),
                                                        np.asarray(n_complete), L, r), scaling)
    return selected_attention(q, K, V, selected, positions, n_complete, r, scaling)
