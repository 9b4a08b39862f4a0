"""QSA (indexed sparse attention) kernels over the engine's paged token pools.

Pool layout (owned by ``engine/state.py``; every array indexed by *token slot*): token ``p`` of the sequence in
block-table row ``r`` lives in slot ``block_tables[r, p // page_size] * page_size + p % page_size``:
  * ``kv_k, kv_v``: ``[num_slots, Hkv, D]`` float32 -- normed + roped keys, values;
  * ``idx_k``: ``[num_slots, Di]`` float32 -- raw indexer keys (as projected; the official cache stores these);
  * ``blk_k``: ``[num_slots, Di]`` float32 -- the pooled, k_layernormed, roped key of the compressed block that ENDS
    at this token (block ``b`` = tokens ``[b*ratio, (b+1)*ratio)``, stored at the slot of token ``b*ratio+ratio-1``).
Any page size works (1, 3, 16, 64, ...): blocks may straddle pages since every token is addressed through the
block table.

Per query token with ``n_visible`` visible tokens (``position + 1`` for a causal text query), the official
selection is: ``n_complete = n_visible // ratio`` complete blocks are scored, the best
``min(block_topk, n_complete)`` are kept (canonical order: higher score first, then lower block index), and the
``n_visible - n_complete*ratio`` tail tokens are always visible. Prefill and decode use the same ops, so the
semantics are identical by construction.

Ops (numpy -> NumPy twin; cupy -> ``engine/kernels/cuda/qsa.cu``; each one launch for all query tokens of all
sequences, except the attention: a split-KV partial launch + an in-order combine launch; no host synchronisation):
  :func:`token_slots`, :func:`qsa_write_tokens`, :func:`qsa_block_keys`, :func:`qsa_index_scores`, :func:`qsa_topk`,
  :func:`qsa_sparse_attention`, and :func:`qsa_select` (scores + top-k).

Sources (modeling_qwen4_exp.py): ``Qwen4ExpTextQSAIndexer.forward`` (pooled mean of raw keys in float32, k_layernorm,
RoPE at each block's first position, ``relu(q.k)`` summed over index heads ``/ sqrt(Di)``, block top-k, tail
always visible), ``Qwen4ExpTextAttention.forward`` + ``eager_attention_forward`` (GQA softmax attention over the
selected tokens with ``scaling = head_dim ** -0.5``; the sigmoid output gate is applied by the caller).
"""
from __future__ import annotations

import math

import numpy as np

from engine.backend import load_module, xp_of
from engine.kernels.dense_common import sm_count
from types import SimpleNamespace

from reference.blocks import qsa as _ref_qsa
from reference.blocks import rope as _ref_rope
from reference.errors import InputError
from reference.numba_kernels import block_topk_select

#: the largest block_topk the CUDA top-k sorts in shared memory (the model uses 512; vLLM allows 512 / 2048)
QSA_MAX_BLOCK_TOPK = 4096
#: the split attention (qsa_attn_partial_split: a CTA per query, KV head and token split, serving the KV head's whole
#: query-head group) serves every float32 launch whose rows are 16-byte aligned, prefill included: at a 4096-token
#: prefill it measured faster than the per-query-head kernel, which reads each K / V row once per query head (H100,
#: 4 real-width layers: 349 vs 371 ms per prefill). ``None`` = no limit; a number caps the query tokens per split
#: launch (the tests set 0 to run the per-query-head kernel, which serves unaligned rows and ``D % 4 != 0``).
QSA_SPLIT_MAX_T: int | None = None
_SPLIT_TILE = 16  # QSA_TILE in qsa.cu
_TOPK_THREADS = 1024
_ATTN_WARPS = 4  # QSA_WARPS in qsa.cu


def _int_arr(xp, a, name, n):
    if a.shape != (n,):
        raise InputError(f"qsa: {name}: expected shape [{n}], found {list(a.shape)}")
    if a.dtype.kind not in "iu":
        raise InputError(f"qsa: {name}: expected an integer array, found dtype {a.dtype}")
    return a


def _f32_gpu(name, a, pool=True):
    if a.dtype != np.float32:
        raise InputError(f"qsa: {name}: the CUDA path takes float32, found {a.dtype}")
    if pool and not a.flags.c_contiguous:
        raise InputError(f"qsa: {name}: the CUDA path takes a C-contiguous array, found strides {a.strides}")


def token_slots(block_tables, rows, positions, page_size: int):
    """Pool slot of each token: ``block_tables[row, pos // page_size] * page_size + pos % page_size``.

    Args:
        block_tables: ``[max_seqs, max_pages]`` int32 (-1 = no page). rows: ``[T]`` int table rows.
        positions: ``[T]`` int absolute positions. page_size: int.
    Returns:
        ``[T]`` int64 slots (same array module). A position whose page is missing gives a negative slot.
    """
    xp = xp_of(block_tables)
    pg = xp.asarray(positions).astype(np.int64)
    rw = xp.asarray(rows).astype(np.int64)
    page = block_tables[rw, pg // page_size].astype(np.int64)
    return xp.where(page >= 0, page * page_size + pg % page_size, -1)


def _ref_cfg(ratio, head_dim, eps=1e-6, k=1):
    """The config fields the shared reference QSA functions read."""
    return SimpleNamespace(indexer_compress_ratio=int(ratio), indexer_head_dim=int(head_dim), rms_norm_eps=eps,
                           block_topk=int(k))


def _slots_np(block_tables, row, positions, page_size):
    pos = np.asarray(positions, dtype=np.int64)
    page = np.asarray(block_tables[int(row)], dtype=np.int64)[pos // page_size]
    if np.any(page < 0):
        raise InputError(f"qsa: block table row {row}: positions {pos[page < 0][:4].tolist()} have no page")
    return page * page_size + pos % page_size


# ------------------------------------------------------------------------------------------------ token write
def _rows_view(cp, a, name, T, width):
    """(array, row stride in elements) of ``a`` viewed as ``[T, width]`` float32 rows with contiguous rows; a
    strided row view (a column slice of a fused projection) is used in place, anything else is copied."""
    if a.dtype != np.float32:
        raise InputError(f"qsa write: {name}: the CUDA path takes float32, found {a.dtype}")
    if a.shape[0] != T or int(np.prod(a.shape[1:])) != width:
        raise InputError(f"qsa write: {name}: expected {T} rows of {width} values, found shape {list(a.shape)}")
    inner_ok = all(a.strides[d] == 4 * int(np.prod(a.shape[d + 1:])) for d in range(1, a.ndim))
    if T and (not inner_ok or a.strides[0] % 4 or a.strides[0] < 4 * width):
        a = cp.ascontiguousarray(a)
    return a, (a.strides[0] // 4 if T else width)


def qsa_write_tokens(idx_k, kv_k, kv_v, block_tables, rows, positions, idx_src, k_src, v_src, page_size: int,
                     block_keys=None):
    """Write each new token's raw indexer key, key and value at its pool slot, and return ``n_visible = pos + 1``
    (one launch on the GPU, replacing the slot arithmetic, the three scatters and the ``+ 1``).

    Args:
        idx_k: ``[num_slots, Di]``; kv_k, kv_v: ``[num_slots, Hkv, D]`` pools, written IN PLACE.
        block_tables: ``[max_seqs, max_pages]`` int32. rows, positions: ``[T]`` int (table row, absolute position).
        idx_src: ``[T, Di]`` raw indexer keys (a strided column slice is read in place). k_src, v_src:
            ``[T, Hkv, D]`` (roped, normed keys; values).
        page_size: int.
        block_keys: optional ``(blk_k, k_norm_weight, inv_freq, rotary_dim, ratio, eps)``: also write the block
            key of every block these tokens complete, as :func:`qsa_block_keys` (bitwise the same numbers on the
            GPU: the same operations in the same order). Only when no two tokens share a table row (decode: the
            block's other raw keys were written by earlier steps); otherwise call :func:`qsa_block_keys` after.
    Returns:
        ``[T]`` int64 ``positions + 1`` (same array module).
    Raises:
        InputError: shapes/dtypes inconsistent, or (NumPy path) a position without a page.
    A position without a page is not written on the GPU (the cupy scatter it replaces would have written slot -1).
    """
    xp = xp_of(idx_k)
    T = positions.shape[0]
    Di = idx_k.shape[1]
    _int_arr(xp, rows, "rows", T)
    _int_arr(xp, positions, "positions", T)
    if kv_k.ndim != 3 or kv_v.shape != kv_k.shape or kv_k.shape[0] != idx_k.shape[0]:
        raise InputError(f"qsa write: kv_k/kv_v: expected shape [{idx_k.shape[0]}, Hkv, D] each, found "
                         f"{list(kv_k.shape)} and {list(kv_v.shape)}")
    KVW = kv_k.shape[1] * kv_k.shape[2]
    if xp is np:  # NumPy twin: the slot rule, plain scatters, then the block keys twin
        pos = np.asarray(positions, dtype=np.int64)
        page = np.asarray(block_tables)[np.asarray(rows, dtype=np.int64), pos // page_size].astype(np.int64)
        if np.any(page < 0):
            raise InputError(f"qsa write: positions {pos[page < 0][:4].tolist()} have no page")
        sl = page * page_size + pos % page_size
        idx_k[sl] = np.asarray(idx_src).reshape(T, Di)
        kv_k[sl] = np.asarray(k_src).reshape((T,) + kv_k.shape[1:])
        kv_v[sl] = np.asarray(v_src).reshape((T,) + kv_k.shape[1:])
        if block_keys is not None:
            blk_k, w, invf, rot, ratio, eps = block_keys
            qsa_block_keys(idx_k, blk_k, block_tables, rows, positions, w, invf, rot, ratio, page_size, eps)
        return np.asarray(positions, dtype=np.int64) + 1
    import cupy as cp
    for n, a in (("idx_k", idx_k), ("kv_k", kv_k), ("kv_v", kv_v)):
        _f32_gpu(n, a)
    n_vis = cp.empty((T,), dtype=cp.int64)
    if T == 0:
        return n_vis
    isrc, ild = _rows_view(cp, idx_src, "idx_src", T, Di)
    ksrc, kld = _rows_view(cp, k_src, "k_src", T, KVW)
    vsrc, vld = _rows_view(cp, v_src, "v_src", T, KVW)
    after = None
    if block_keys is not None and Di > 1024:  # past the fused kernel's shared row: write, then the block-key op
        after, block_keys = block_keys, None
    if block_keys is not None:
        blk_k, w, invf, rot, ratio, eps = block_keys
        _f32_gpu("blk_k", blk_k)
        if blk_k.shape != idx_k.shape or rot % 2 or not 0 < rot <= Di:
            raise InputError(f"qsa write: block_keys: expected blk_k {list(idx_k.shape)} and an even rotary_dim <= "
                             f"{Di}, found {list(blk_k.shape)} and {rot}")
        bk = (np.int32(1), blk_k, cp.ascontiguousarray(w, dtype=cp.float32), cp.ascontiguousarray(invf, dtype=cp.float32),
              np.int32(rot), np.int32(ratio), np.float32(eps))
    else:
        bk = (np.int32(0), idx_k, idx_k, idx_k, np.int32(0), np.int32(1), np.float32(0))  # unused pointers
    load_module("qsa.cu").get_function("qsa_write_tokens")(
        (T,), (128,),
        (cp.ascontiguousarray(block_tables, dtype=cp.int32), cp.ascontiguousarray(rows, dtype=cp.int64),
         cp.ascontiguousarray(positions, dtype=cp.int64), n_vis, isrc, np.int64(ild), ksrc, np.int64(kld), vsrc,
         np.int64(vld), idx_k, kv_k, kv_v, np.int32(Di), np.int32(KVW), np.int32(page_size),
         np.int32(block_tables.shape[1])) + bk)
    if after is not None:
        blk_k, w, invf, rot, ratio, eps = after
        qsa_block_keys(idx_k, blk_k, block_tables, rows, positions, w, invf, rot, ratio, page_size, eps)
    return n_vis


# ------------------------------------------------------------------------------------------------ head prep
def _cols_view(cp, a, name, T, width):
    """``a`` as ``[T, >= width]`` float32 rows whose first ``width`` columns are read (unit column stride, any row
    stride); returns (array, row stride in elements). Anything else is made contiguous first."""
    if a.ndim != 2 or a.shape[0] != T or a.shape[1] < width or a.dtype != np.float32:
        raise InputError(f"qsa prep: {name}: expected float32 [{T}, >= {width}], found {a.dtype} {list(a.shape)}")
    if T > 1 and (a.strides[1] != 4 or a.strides[0] % 4 or a.strides[0] < 4 * a.shape[1]):
        a = cp.ascontiguousarray(a)
    if T <= 1 and not a.flags.c_contiguous:
        a = cp.ascontiguousarray(a)
    return a, a.strides[0] // 4 if T > 1 else a.shape[1]


def qsa_prep_heads(qk, qg, k_lin, w_q_idx, w_q, w_k, positions, inv_freq, rotary_dim: int, eps: float, Hi: int,
                   Di: int, Hq: int, Hkv: int, hd: int):
    """Per-head zero-centred RMSNorm then RoPE of a QSA layer's indexer queries, attention queries and keys, in one
    launch on the GPU; bitwise the unfused ``rms_norm`` + ``apply_rope`` (same operations, same order).

    Args:
        qk: ``[T, >= Hi*Di]`` float32 (the indexer projection; its first ``Hi*Di`` columns are the queries).
        qg: ``[T, Hq*2*hd]`` (per head ``hd`` query then ``hd`` gate channels). k_lin: ``[T, Hkv*hd]``.
            Column slices of one fused projection are read in place (row strides).
        w_q_idx ``[Di]``, w_q ``[hd]``, w_k ``[hd]``: the zero-centred norm weights (indexer ``q_layernorm``,
            ``q_norm``, ``k_norm``). positions: ``[T]`` int. inv_freq: ``[rotary_dim // 2]`` float32.
        rotary_dim, eps (``rms_norm_eps``), Hi, Di, Hq, Hkv, hd: ints / float.
    Returns:
        ``(q_idx [T, Hi, Di], q [T, Hq, hd], k [T, Hkv, hd])`` float32, normed and roped.
    Raises:
        InputError / KernelInputError: shapes or dtypes inconsistent.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (q_layernorm, RoPE) and ``Qwen4ExpTextAttention.forward``
    (q_norm / k_norm, RoPE); formulas as :func:`engine.kernels.norms.rms_norm` and
    :func:`engine.kernels.rope.apply_rope`.
    """
    from engine.kernels.norms import rms_norm
    from engine.kernels.rope import apply_rope
    xp = xp_of(qk)
    T = qk.shape[0]
    if xp is np or max(Di, hd) > 1024:  # NumPy twin (and very wide heads): the unfused ops
        qi = rms_norm(qk[:, :Hi * Di].reshape(T, Hi, Di), w_q_idx, eps=eps)
        q = rms_norm(xp.ascontiguousarray(qg.reshape(T, Hq, 2 * hd)[:, :, :hd]), w_q, eps=eps)
        k = rms_norm(k_lin.reshape(T, Hkv, hd), w_k, eps=eps)
        return tuple(apply_rope(a, positions, inv_freq, rotary_dim) for a in (qi, q, k))
    import cupy as cp
    from engine.kernels.dense_common import weight_as_float
    if rotary_dim % 2 or not 0 <= rotary_dim <= min(Di, hd) or inv_freq.shape != (rotary_dim // 2,):
        raise InputError(f"qsa prep: rotary_dim/inv_freq: expected an even rotary_dim <= {min(Di, hd)} and inv_freq "
                         f"[rotary_dim/2], found {rotary_dim} and {list(inv_freq.shape)}")
    a, a_ld = _cols_view(cp, qk, "qk", T, Hi * Di)
    b, b_ld = _cols_view(cp, qg, "qg", T, Hq * 2 * hd)
    c, c_ld = _cols_view(cp, k_lin, "k_lin", T, Hkv * hd)
    ws = []
    for n, wv, d in (("w_q_idx", w_q_idx, Di), ("w_q", w_q, hd), ("w_k", w_k, hd)):
        if tuple(wv.shape) != (d,):
            raise InputError(f"qsa prep: {n}: expected shape [{d}], found {list(wv.shape)}")
        ws.append(cp.ascontiguousarray(wv if wv.dtype == np.float32 else weight_as_float(wv)))
    qi = cp.empty((T, Hi, Di), dtype=cp.float32)
    q = cp.empty((T, Hq, hd), dtype=cp.float32)
    k = cp.empty((T, Hkv, hd), dtype=cp.float32)
    if T:
        load_module("qsa.cu").get_function("qsa_prep_heads")(
            (T, Hi + Hq + Hkv), (256,),
            (a, np.int64(a_ld), b, np.int64(b_ld), c, np.int64(c_ld), *ws, cp.ascontiguousarray(positions, dtype=cp.int64),
             cp.ascontiguousarray(inv_freq, dtype=cp.float32), np.int32(rotary_dim), np.int32(Hi), np.int32(Di),
             np.int32(Hq), np.int32(Hkv), np.int32(hd), np.float32(eps), qi, q, k))
    return qi, q, k


# ------------------------------------------------------------------------------------------------ block keys
def qsa_block_keys(idx_k, blk_k, block_tables, rows, positions, k_norm_weight, inv_freq, rotary_dim: int,
                   ratio: int, page_size: int, eps: float):
    """Write the compressed key of every block completed by the given tokens (call after their raw indexer keys
    are in ``idx_k``). Tokens whose position is not a block's last (``(pos+1) % ratio != 0``) do nothing.

    Args:
        idx_k: ``[num_slots, Di]`` raw indexer keys. blk_k: ``[num_slots, Di]``, written IN PLACE at the slot of
            each completing token: ``rope(rmsnorm(mean(raw keys of the block)) * (1 + w), pos = block start)``.
        block_tables: ``[max_seqs, max_pages]`` int32. rows, positions: ``[T]`` int (table row, absolute position).
        k_norm_weight: ``[Di]`` (indexer ``k_layernorm`` weight, zero-centred). inv_freq: ``[rotary_dim // 2]``.
        rotary_dim, ratio (``indexer_compress_ratio``), page_size: ints. eps: ``rms_norm_eps``.
    Returns:
        None.
    Raises:
        InputError: shape/dtype mismatch, or (NumPy path) a position without a page.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (pooled_keys, k_layernorm, apply_rotary_pos_emb at group_starts).
    """
    xp = xp_of(idx_k)
    T = positions.shape[0]
    Di = idx_k.shape[1]
    _int_arr(xp, rows, "rows", T)
    _int_arr(xp, positions, "positions", T)
    if blk_k.shape != idx_k.shape:
        raise InputError(f"qsa: blk_k: expected shape {list(idx_k.shape)} (idx_k), found {list(blk_k.shape)}")
    if k_norm_weight.shape != (Di,):
        raise InputError(f"qsa: k_norm_weight: expected shape [{Di}], found {list(k_norm_weight.shape)}")
    if rotary_dim % 2 or not 0 < rotary_dim <= Di or inv_freq.shape != (rotary_dim // 2,):
        raise InputError(f"qsa: rotary_dim/inv_freq: expected an even rotary_dim <= {Di} and inv_freq "
                         f"[rotary_dim/2], found {rotary_dim} and {list(inv_freq.shape)}")
    if T == 0:
        return None
    if xp is np:  # NumPy twin: gather each completed block's raw keys, then the reference's pool_block_keys
        pos = np.asarray(positions, dtype=np.int64)
        rw = np.asarray(rows, dtype=np.int64)
        cfg = _ref_cfg(ratio, Di, eps)
        invf = np.asarray(inv_freq, dtype=np.float32)
        w = np.asarray(k_norm_weight, dtype=idx_k.dtype)
        for t in np.nonzero((pos + 1) % ratio == 0)[0]:
            start = int(pos[t]) - (ratio - 1)
            raw = idx_k[_slots_np(block_tables, rw[t], np.arange(start, pos[t] + 1), page_size)]

            def cos_fn(p, start=start):  # the block's own position, not its index in `raw`
                c, s_ = _ref_rope.rope_cos_sin(np.asarray(p) + start, invf, [rotary_dim // 2, 0, 0])
                return c.astype(idx_k.dtype), s_.astype(idx_k.dtype)
            key = _ref_qsa.pool_block_keys(raw, 0, 1, w, cos_fn, cfg)
            blk_k[_slots_np(block_tables, rw[t], pos[t:t + 1], page_size)[0]] = key[0]
        return None
    import cupy as cp
    for n, a in (("idx_k", idx_k), ("blk_k", blk_k)):
        _f32_gpu(n, a)
    mod = load_module("qsa.cu")
    split = Di <= 1024  # the thread-per-channel kernel; wider keys: one warp per token
    mod.get_function("qsa_block_keys_split" if split else "qsa_block_keys")(
        (T,), (32 * (-(-Di // 32)) if split else 32,),
        (idx_k, blk_k, cp.ascontiguousarray(block_tables, dtype=cp.int32), cp.ascontiguousarray(rows, dtype=cp.int64),
         cp.ascontiguousarray(positions, dtype=cp.int64), cp.ascontiguousarray(k_norm_weight, dtype=cp.float32),
         cp.ascontiguousarray(inv_freq, dtype=cp.float32), np.int32(Di), np.int32(rotary_dim), np.int32(ratio),
         np.int32(page_size), np.int32(block_tables.shape[1]), np.float32(eps)),
        shared_mem=Di * 4)
    return None


# ------------------------------------------------------------------------------------------------ scoring
def qsa_index_scores(q_idx, blk_k, block_tables, rows, n_visible, n_blocks: int, ratio: int, page_size: int):
    """Indexer score of every complete block visible to each query token.

    Args:
        q_idx: ``[T, Hi, Di]`` float32 indexer queries (q_layernormed and roped at the query's position).
        blk_k: ``[num_slots, Di]`` block keys (see :func:`qsa_block_keys`). block_tables: ``[max_seqs, max_pages]``.
        rows: ``[T]`` int table rows. n_visible: ``[T]`` int visible tokens per query (``pos + 1``).
        n_blocks: int output width (>= max ``n_visible // ratio``; the caller knows it on the host).
        ratio, page_size: ints.
    Returns:
        ``[T, n_blocks]`` float32: ``sum_h relu(q_h . K_b) / sqrt(Di)`` for ``b < n_visible // ratio``, ``-inf``
        elsewhere (the registry's ``indexer.block_scores`` tap).
    Raises:
        InputError: shapes/dtypes inconsistent or ``n_blocks`` too small (NumPy path checks the latter).
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (scores).
    """
    xp = xp_of(q_idx)
    if q_idx.ndim != 3 or q_idx.shape[2] != blk_k.shape[1]:
        raise InputError(f"qsa: q_idx: expected shape [T, Hi, {blk_k.shape[1]}], found {list(q_idx.shape)}")
    T, Hi, Di = q_idx.shape
    _int_arr(xp, rows, "rows", T)
    _int_arr(xp, n_visible, "n_visible", T)
    n_blocks = int(n_blocks)
    if xp is np:  # NumPy twin: per table row, gather the block keys, then the reference's indexer_select
        nv = np.asarray(n_visible, dtype=np.int64)
        nc = nv // ratio
        if T and nc.max() > n_blocks:
            raise InputError(f"qsa: n_blocks: expected >= {int(nc.max())} (max n_visible // ratio), found {n_blocks}")
        out = np.full((T, n_blocks), -np.inf, dtype=np.float32)
        rw = np.asarray(rows, dtype=np.int64)
        cfg = _ref_cfg(ratio, Di)
        for r in np.unique(rw):
            ts = np.nonzero(rw == r)[0]
            nb = int(nc[ts].max())
            if nb == 0:
                continue
            keys = blk_k[_slots_np(block_tables, r, np.arange(nb, dtype=np.int64) * ratio + ratio - 1, page_size)]
            sc, _, _ = _ref_qsa.indexer_select(np.asarray(q_idx[ts], np.float32), keys.astype(np.float32),
                                               nv[ts] - 1, cfg)
            out[ts, :nb] = sc
        return out
    import cupy as cp
    _f32_gpu("q_idx", q_idx, pool=False)
    _f32_gpu("blk_k", blk_k)
    warps = 8
    if -(-n_blocks // warps) > 65535:
        raise InputError(f"qsa: n_blocks: the CUDA scoring grid covers at most {65535 * warps} blocks, found {n_blocks}")
    out = cp.empty((T, n_blocks), dtype=cp.float32)
    if T == 0 or n_blocks == 0:
        return out
    load_module("qsa.cu").get_function("qsa_index_scores")(
        (T, (n_blocks + warps - 1) // warps), (32 * warps,),
        (cp.ascontiguousarray(q_idx), blk_k, cp.ascontiguousarray(block_tables, dtype=cp.int32),
         cp.ascontiguousarray(rows, dtype=cp.int64), cp.ascontiguousarray(n_visible, dtype=cp.int64), out,
         np.int32(Hi), np.int32(Di), np.int64(n_blocks), np.int32(ratio), np.int32(page_size),
         np.int32(block_tables.shape[1]), np.float32(math.sqrt(Di))),
        shared_mem=Hi * Di * 4)
    return out


# ------------------------------------------------------------------------------------------------ top-k
def qsa_topk(scores, n_visible, ratio: int, k: int):
    """Exact, deterministic block top-k per query in the canonical order.

    Args:
        scores: ``[T, NB]`` float32 (from :func:`qsa_index_scores`). n_visible: ``[T]`` int. ratio: int.
        k: ``block_topk`` (``<= QSA_MAX_BLOCK_TOPK`` on the GPU).
    Returns:
        ``[T, k]`` int32: the ``min(k, n_visible // ratio)`` best complete blocks, ordered by score descending,
        then block index ascending (ties), then ``-1`` padding (the registry's ``indexer.selected_blocks``).
    Raises:
        InputError: shapes inconsistent, ``k < 1``, or ``k`` above the GPU limit.
    Source: ``Qwen4ExpTextQSAIndexer.forward`` (``scores.topk(min(block_topk, num_complete_blocks))``) with the
    project's canonical tie order.
    """
    xp = xp_of(scores)
    if scores.ndim != 2:
        raise InputError(f"qsa_topk: scores: expected shape [T, n_blocks], found {list(scores.shape)}")
    T, NB = scores.shape
    _int_arr(xp, n_visible, "n_visible", T)
    k = int(k)
    if k < 1:
        raise InputError(f"qsa_topk: k: expected >= 1, found {k}")
    if xp is np:  # NumPy twin: the reference's block_topk_select (canonical order, -1 padded)
        nc = np.minimum(np.asarray(n_visible, dtype=np.int64) // ratio, NB)
        return block_topk_select(np.asarray(scores), nc, k).astype(np.int32)
    import cupy as cp
    if k > QSA_MAX_BLOCK_TOPK:
        raise InputError(f"qsa_topk: k (block_topk): the CUDA top-k supports at most {QSA_MAX_BLOCK_TOPK}, found {k}")
    _f32_gpu("scores", scores, pool=False)
    out = cp.empty((T, k), dtype=cp.int32)
    if T == 0:
        return out
    p2 = 1
    while p2 < k:
        p2 *= 2
    load_module("qsa.cu").get_function("qsa_topk_split")(
        (T,), (_TOPK_THREADS,),
        (cp.ascontiguousarray(scores), cp.ascontiguousarray(n_visible, dtype=cp.int64), out, np.int64(NB),
         np.int32(ratio), np.int32(k), np.int32(p2)),
        shared_mem=max(p2 * 8, (_TOPK_THREADS // 32) * 256 * 4))
    return out


def qsa_select(q_idx, blk_k, block_tables, rows, n_visible, n_blocks: int, ratio: int, page_size: int, k: int):
    """Scores + top-k: ``(scores [T, n_blocks] float32, selected [T, k] int32)``; see :func:`qsa_index_scores`
    and :func:`qsa_topk`."""
    scores = qsa_index_scores(q_idx, blk_k, block_tables, rows, n_visible, n_blocks, ratio, page_size)
    return scores, qsa_topk(scores, n_visible, ratio, k)


# ------------------------------------------------------------------------------------------------ attention
def qsa_sparse_attention(q, kv_k, kv_v, block_tables, rows, n_visible, selected, ratio: int, page_size: int,
                         scale: float, n_blocks: int | None = None):
    """Softmax attention of each query over its selected blocks' tokens plus the incomplete tail, read from the
    paged K/V pools through the block table (GQA: query head ``h`` uses KV head ``h // (Hq / Hkv)``).

    Args:
        q: ``[T, Hq, D]`` float32 (q_normed, roped). kv_k, kv_v: ``[num_slots, Hkv, D]`` float32.
        block_tables: ``[max_seqs, max_pages]`` int32. rows, n_visible: ``[T]`` int.
        selected: ``[T, k]`` int32 from :func:`qsa_topk` (valid blocks first, -1 padded; the CUDA path reads the valid prefix). ratio, page_size: ints.
        scale: softmax scale (``head_dim ** -0.5``).
        n_blocks: optional host bound ``>= max(n_visible) // ratio`` (the scores width); the split CUDA kernel then
            sizes its token splits to the tokens that can be attended (``min(k, n_blocks) * ratio + ratio - 1``)
            instead of the selection's capacity (a bound that is too small stays correct: the last split takes the
            rest, only slower).
    Returns:
        ``[T, Hq, D]`` float32 (before the sigmoid output gate: the registry's ``self_attn.core_out``).
    Raises:
        InputError: shapes inconsistent, Hq not a multiple of Hkv.
    Source: ``Qwen4ExpTextAttention.forward`` / ``eager_attention_forward`` with the indexer's selection mask.
    """
    xp = xp_of(q)
    if q.ndim != 3:
        raise InputError(f"qsa attention: q: expected shape [T, Hq, D], found {list(q.shape)}")
    T, Hq, D = q.shape
    if kv_k.ndim != 3 or kv_k.shape[2] != D or kv_v.shape != kv_k.shape:
        raise InputError(f"qsa attention: kv_k/kv_v: expected shape [num_slots, Hkv, {D}] each, found "
                         f"{list(kv_k.shape)} and {list(kv_v.shape)}")
    Hkv = kv_k.shape[1]
    if Hq % Hkv:
        raise InputError(f"qsa attention: q heads: expected a multiple of the {Hkv} KV heads, found {Hq}")
    _int_arr(xp, rows, "rows", T)
    _int_arr(xp, n_visible, "n_visible", T)
    if selected.ndim != 2 or selected.shape[0] != T:
        raise InputError(f"qsa attention: selected: expected shape [{T}, block_topk], found {list(selected.shape)}")
    if xp is np:  # NumPy twin: per table row, gather K/V, then the reference's attention over the selection
        dt = np.float64 if q.dtype == np.float64 else np.float32
        out = np.empty((T, Hq, D), dtype=dt)
        nv = np.asarray(n_visible, dtype=np.int64)
        rw = np.asarray(rows, dtype=np.int64)
        for r in np.unique(rw):
            ts = np.nonzero(rw == r)[0]
            length = int(nv[ts].max())
            sl = _slots_np(block_tables, r, np.arange(length, dtype=np.int64), page_size)
            # the reference's attention (dense under the mask; over the attended tokens only past
            # DENSE_MAX_KEYS keys, so histories past 32768 positions stay affordable on the CPU)
            o = _ref_qsa.qsa_attention(q[ts].astype(dt), kv_k[sl].astype(dt), kv_v[sl].astype(dt),
                                       np.asarray(selected[ts], np.int64), nv[ts] - 1, nv[ts] // ratio, ratio, scale)
            out[ts] = o.reshape(len(ts), Hq, D)
        return out
    import cupy as cp
    _f32_gpu("q", q, pool=False)
    for n, a in (("kv_k", kv_k), ("kv_v", kv_v)):
        _f32_gpu(n, a)
    out = cp.empty((T, Hq, D), dtype=cp.float32)
    if T == 0:
        return out
    ksel = selected.shape[1]
    bound = ksel * ratio + ratio - 1  # most tokens one query can attend (QSA's budget + incomplete tail)
    if (0 < T and (QSA_SPLIT_MAX_T is None or T <= QSA_SPLIT_MAX_T) and D % 4 == 0
            and all(int(a.data.ptr) % 16 == 0 for a in (q, kv_k, kv_v))):
        qc = cp.ascontiguousarray(q)
        if int(qc.data.ptr) % 16 == 0:
            if n_blocks is not None:
                bound = min(ksel, max(int(n_blocks), 0)) * ratio + ratio - 1
            return _attention_split(cp, qc, kv_k, kv_v, block_tables, rows, n_visible, selected, ratio, page_size,
                                    scale, bound, out)
    mod = load_module("qsa.cu", (f"-DQSA_HEAD_DIM={D}",))
    # split the token list so that even one decode query fills the GPU (>= ~2048 CUDA blocks), and prefill gets
    # as many pieces as a 64 MiB scratch allows (pieces of >= 64 tokens either way)
    by_fill = -(-2048 // max(T * Hq, 1))
    by_memory = (64 << 20) // max(T * Hq * D * 4, 1)
    n_split = max(1, min(-(-bound // 64), max(by_fill, by_memory)))
    tps = -(-bound // n_split)
    pm = cp.empty((T, Hq, n_split), dtype=cp.float32)
    pl = cp.empty((T, Hq, n_split), dtype=cp.float32)
    pacc = cp.empty((T, Hq, n_split, D), dtype=cp.float32)
    bt = cp.ascontiguousarray(block_tables, dtype=cp.int32)
    mod.get_function("qsa_attn_partial")(
        (T, Hq, n_split), (32 * _ATTN_WARPS,),
        (cp.ascontiguousarray(q), kv_k, kv_v, bt, cp.ascontiguousarray(rows, dtype=cp.int64),
         cp.ascontiguousarray(n_visible, dtype=cp.int64), cp.ascontiguousarray(selected, dtype=cp.int32), pm, pl,
         pacc, np.int32(Hq), np.int32(Hkv), np.int32(ksel), np.int32(ratio), np.int32(page_size),
         np.int32(block_tables.shape[1]), np.int64(tps), np.float32(scale)))
    mod.get_function("qsa_attn_combine")((T, Hq), (min(256, ((D + 31) // 32) * 32),),
                                         (pm, pl, pacc, out, np.int32(Hq), np.int32(n_split)))
    return out


def _attention_split(cp, q, kv_k, kv_v, block_tables, rows, n_visible, selected, ratio, page_size, scale, bound, out):
    """The split CUDA attention (see ``qsa_attn_partial_split`` in qsa.cu): CTAs over (query, KV head, token
    split), each serving the KV head's whole query-head group; splits sized so that the launch has >= ~2 CTAs per
    SM, then an in-order combine. ``bound``: most tokens a query attends. Writes ``out [T, Hq, D]`` and returns it."""
    T, Hq, D = q.shape
    Hkv = kv_k.shape[1]
    G = Hq // Hkv
    ksel = selected.shape[1]
    tiles = max(1, -(-bound // _SPLIT_TILE))
    want = max(1, -(-2 * sm_count() // (T * Hkv)))
    per = -(-tiles // min(tiles, want))
    n_split = -(-tiles // per)
    tps = per * _SPLIT_TILE
    mod = load_module("qsa.cu", (f"-DQSA_HEAD_DIM={D}", f"-DQSA_GROUP={G}"))
    pm = cp.empty((T, Hq, n_split), dtype=cp.float32)
    pl = cp.empty((T, Hq, n_split), dtype=cp.float32)
    pacc = cp.empty((T, Hq, n_split, D), dtype=cp.float32)
    part = mod.get_function("qsa_attn_partial_split")
    smem = (G * D + 2 * _SPLIT_TILE * D + G * _SPLIT_TILE) * 4
    static = 8 * 256 + 3 * 4 * G + 4 * 8  # the kernel's static shared arrays (sslot, s_m/s_l/s_corr, s_first)
    if smem + static > 48 * 1024:  # past the default limit: opt in (Hopper allows up to 227 KiB per block)
        part.max_dynamic_shared_size_bytes = smem
    part((T, Hkv, n_split), (256,),
         (q, kv_k, kv_v, cp.ascontiguousarray(block_tables, dtype=cp.int32), cp.ascontiguousarray(rows, dtype=cp.int64),
          cp.ascontiguousarray(n_visible, dtype=cp.int64), cp.ascontiguousarray(selected, dtype=cp.int32), pm, pl,
          pacc, np.int32(Hq), np.int32(Hkv), np.int32(ksel), np.int32(ratio), np.int32(page_size),
          np.int32(block_tables.shape[1]), np.int64(tps), np.float32(scale)),
         shared_mem=smem)
    nt = 128 if D >= 128 else 32 * (-(-D // 32))
    mod.get_function("qsa_attn_combine_split")((T * Hq, -(-D // nt)), (nt,), (pm, pl, pacc, out, np.int32(n_split)),
                                               shared_mem=n_split * 4)
    return out
