"""Numba kernels for the loops that would otherwise run in Python.

* :func:`delta_rule_recurrent` -- the gated delta-rule recurrence, one token at a time (decode path and
  the exact sequential oracle for the chunked form).
* :func:`ngram_hash_rows` / :func:`ngram_hash_rows_batch` -- the PLE n-gram hash with the official int64
  wrap-around arithmetic (one sequence / a batch; the engine's host hash calls the batch form).
* :func:`unit_lower_solve` -- the triangular solve of the chunked delta rule.
* :func:`block_topk_select` -- the QSA per-query block top-k in the canonical order.
* :func:`selected_attention` -- QSA softmax attention over each query's selected tokens only (cost
  ``T * budget``, not ``T * L``: histories past 32768 positions).
* :func:`bf16_matmul_t` -- ``x @ W.T`` straight from a BF16 weight's stored bits (no float32 copy of ``W``).
* :func:`split_k_matmul_t` -- ``x @ W.T`` as a split-K sum (the evaluation orders of ``reference.order``).
* :func:`bf16_upcast` -- a BF16 array as float32/float64 (exact), on all threads.

Every kernel is ``@njit(cache=True)`` and called with at most two signatures (float32 / float64), so
the JIT cost is paid once per machine. Each has a plain NumPy twin in the block modules that the
tests hold it to.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

__all__ = ["delta_rule_recurrent", "ngram_hash_rows", "ngram_hash_rows_batch", "unit_lower_solve", "block_topk_select",
           "selected_attention", "bf16_matmul_t", "split_k_matmul_t", "bf16_upcast"]


@njit(cache=True, fastmath=False, parallel=True)
def _delta_rule_kernel(q, k, v, g, beta, state, out):  # pragma: no cover - compiled
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    dv = v.shape[2]
    rep = Hv // Hk
    for h in prange(Hv):   # the value heads are independent recurrences (each its own state and outputs)
        kh = h // rep
        S = state[h]
        for t in range(T):
            decay = np.exp(g[t, h])
            for i in range(dk):
                for j in range(dv):
                    S[i, j] *= decay
            b = beta[t, h]
            for j in range(dv):
                acc = 0.0
                for i in range(dk):
                    acc += S[i, j] * k[t, kh, i]
                delta = (v[t, h, j] - acc) * b
                for i in range(dk):
                    S[i, j] += k[t, kh, i] * delta
            for j in range(dv):
                acc = 0.0
                for i in range(dk):
                    acc += S[i, j] * q[t, kh, i]
                out[t, h, j] = acc


def delta_rule_recurrent(q: np.ndarray, k: np.ndarray, v: np.ndarray, g: np.ndarray, beta: np.ndarray,
                         state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Gated delta rule, token by token.

    Per value head ``h`` (key head ``h // (Hv // Hk)``) and token ``t``:
    ``S = exp(g_t) S``; ``S += k_t ((v_t - S^T k_t) * beta_t)^T``; ``o_t = S^T q_t``.

    Args:
        q, k: ``[T, Hk, dk]`` already l2-normalised (and ``q`` scaled by ``dk**-0.5``).
        v: ``[T, Hv, dv]``; g (log decay, ``<= 0``), beta: ``[T, Hv]``.
        state: ``[Hv, dk, dv]`` the carried recurrent state (not modified).
    Returns:
        ``(out [T, Hv, dv], new_state [Hv, dk, dv])``, all in ``q.dtype``.
    Source: modeling_qwen4_exp.py ``torch_recurrent_gated_delta_rule``.
    """
    dt = q.dtype
    S = np.array(state, dtype=dt, copy=True, order="C")
    out = np.empty((q.shape[0], v.shape[1], v.shape[2]), dtype=dt)
    args = [np.ascontiguousarray(a, dtype=dt) for a in (q, k, v, g, beta)]
    _delta_rule_kernel(*args, S, out)
    return out, S


@njit(cache=True)
def _ngram_hash_kernel(history, ctx, eos, mult, sizes, offsets, heads_per_ngram, out):  # pragma: no cover
    B, L = history.shape
    n = mult.shape[0]
    T = L - ctx
    shifted = np.empty(n, dtype=np.int64)
    for b in range(B):
        for t in range(T):
            p = ctx + t
            shifted[0] = history[b, p]
            blocked = False  # an EOS at p-s .. p-1 resets every longer shift
            for s in range(1, n):
                src = p - s
                if src < 0 or blocked or history[b, src] == eos:
                    blocked = True
                    shifted[s] = eos
                else:
                    shifted[s] = history[b, src]
            for ng in range(2, n + 1):
                mixed = shifted[0] * mult[0]
                for s in range(1, ng):
                    mixed = mixed ^ (shifted[s] * mult[s])
                start = (ng - 2) * heads_per_ngram
                for hh in range(heads_per_ngram):
                    h = start + hh
                    out[b, t, h] = (mixed % sizes[h]) + offsets[h]


def ngram_hash_rows_batch(contexts: np.ndarray, ids: np.ndarray, eos: int, multipliers, head_vocab_sizes,
                          head_offsets, heads_per_ngram: int) -> np.ndarray:
    """PLE n-gram table rows of ``B`` sequences at once (Numba; one call for a whole decode batch).

    Args:
        contexts: ``[B, C]`` int64, each sequence's tokens before its ``ids`` (``C = ngram_size - 1``
            carried tokens, EOS-filled at sequence start).
        ids: ``[B, T]`` int64 new token ids.
        eos, multipliers, head_vocab_sizes, head_offsets, heads_per_ngram: as
            :func:`reference.blocks.ple.ngram_rows_numpy`.
    Returns:
        ``[B, T, ngram_heads]`` int64 rows (head offsets added); row ``b`` equals
        ``ngram_rows_numpy(contexts[b], ids[b], ...)``.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` / ``_shift_right_ignore_eos``.
    """
    contexts = np.asarray(contexts, dtype=np.int64)
    ids = np.asarray(ids, dtype=np.int64)
    history = np.ascontiguousarray(np.concatenate([contexts, ids], axis=1))
    mult = np.ascontiguousarray(np.asarray(multipliers, dtype=np.int64))
    sizes = np.ascontiguousarray(np.asarray(head_vocab_sizes, dtype=np.int64))
    offs = np.ascontiguousarray(np.asarray(head_offsets, dtype=np.int64))
    out = np.empty((ids.shape[0], ids.shape[1], sizes.shape[0]), dtype=np.int64)
    _ngram_hash_kernel(history, np.int64(contexts.shape[1]), np.int64(eos), mult, sizes, offs,
                       np.int64(heads_per_ngram), out)
    return out


def ngram_hash_rows(context: np.ndarray, ids: np.ndarray, eos: int, multipliers, head_vocab_sizes,
                    head_offsets, heads_per_ngram: int) -> np.ndarray:
    """PLE n-gram table rows of ``ids`` given the carried ``ngram_size - 1`` token context (Numba).

    Same contract as :func:`reference.blocks.ple.ngram_rows_numpy` (the readable twin); one sequence of
    :func:`ngram_hash_rows_batch`.
    Returns:
        ``[T, ngram_heads]`` int64.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` / ``_shift_right_ignore_eos``.
    """
    return ngram_hash_rows_batch(np.asarray(context, dtype=np.int64)[None], np.asarray(ids, dtype=np.int64)[None],
                                 eos, multipliers, head_vocab_sizes, head_offsets, heads_per_ngram)[0]


@njit(cache=True, parallel=True)
def _unit_lower_solve_kernel(A, B, X):  # pragma: no cover - compiled
    n_batch, C, _ = A.shape
    m = B.shape[2]
    for h in prange(n_batch):   # independent systems
        for i in range(C):
            for j in range(m):
                acc = B[h, i, j]
                for t in range(i):
                    acc -= A[h, i, t] * X[h, t, j]
                X[h, i, j] = acc


def unit_lower_solve(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    """Solve ``(I + L) X = B`` per batch by forward substitution, ``L`` = strictly lower part of ``A``.

    Args:
        A: ``[N, C, C]`` (only the strictly lower triangle is read); B: ``[N, C, m]``.
    Returns:
        ``X [N, C, m]`` in ``A.dtype``. (LAPACK's ``trsm`` through SciPy costs ~10 ms per call here from
        thread start-up, which dominated small chunks.)
    """
    dt = A.dtype
    X = np.empty(B.shape, dtype=dt)
    _unit_lower_solve_kernel(np.ascontiguousarray(A), np.ascontiguousarray(B, dtype=dt), X)
    return X


@njit(cache=True)
def _topk_row(scores, n_complete, k, out, t):  # pragma: no cover - compiled
    nc = n_complete[t]
    kk = min(k, nc)
    if kk <= 0:
        return
    row = scores[t, :nc]
    neg = -row
    if kk < nc and not np.isnan(neg).any():
        # the kk-th best score; everything strictly better is in, then the ties AT it by lower index, then
        # a stable sort of the kept kk: exactly the canonical order (score descending, lower index first)
        # at O(nc + kk log kk) instead of sorting all nc blocks
        thr = np.partition(neg, kk - 1)[kk - 1]
        keep = np.empty(kk, np.int64)
        n_in = 0
        for j in range(nc):
            if neg[j] < thr:
                keep[n_in] = j
                n_in += 1
        for j in range(nc):
            if n_in == kk:
                break
            if neg[j] == thr:
                keep[n_in] = j
                n_in += 1
        # sort the kept blocks by index first (mergesort is stable): equal scores then stay in index order
        keep = np.sort(keep)
        order = np.argsort(neg[keep], kind="mergesort")
        for j in range(kk):
            out[t, j] = keep[order[j]]
    else:
        # stable sort of -score over the visible blocks (NaN last): score descending, lower index first
        order = np.argsort(neg, kind="mergesort")
        for j in range(kk):
            out[t, j] = order[j]


@njit(cache=True)
def _block_topk_kernel(scores, n_complete, k, out):  # pragma: no cover - compiled
    for t in range(scores.shape[0]):
        _topk_row(scores, n_complete, k, out, t)


# a second kernel (own name: Numba's cache keys on the function, not on its flags) running the rows in parallel
@njit(cache=True, parallel=True)
def _block_topk_kernel_par(scores, n_complete, k, out):  # pragma: no cover - compiled
    for t in prange(scores.shape[0]):
        _topk_row(scores, n_complete, k, out, t)


#: queries at and above which the parallel kernels run (below: one thread; a parallel region costs a barrier
#: that a descheduled sibling thread stretches on a loaded machine -- see _bf16_matmul_kernel)
PARALLEL_MIN_ROWS = 256


def block_topk_select(scores: np.ndarray, n_complete: np.ndarray, k: int) -> np.ndarray:
    """QSA block selection per query: the ``min(k, n_t)`` best of the first ``n_t`` blocks, canonical order.

    Args:
        scores: ``[T, NB]`` float; n_complete: ``[T]`` int (``n_t <= NB``); k: ``block_topk``.
    Returns:
        ``[T, k]`` int64, ``-1`` padded. Same result as ``reference.blocks.qsa.canonical_topk`` on the visible
        blocks (tests hold them equal, exact ties at the cut included).
    """
    out = np.full((scores.shape[0], k), -1, dtype=np.int64)
    kern = _block_topk_kernel_par if scores.shape[0] >= PARALLEL_MIN_ROWS else _block_topk_kernel
    kern(np.ascontiguousarray(scores), np.asarray(n_complete, dtype=np.int64), np.int64(k), out)
    return out


# reassociation (SIMD dot products over head_dim) and FMA contraction only, as _FM below; no finite-math assumption
_FM_ATT = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=_FM_ATT)
def _selected_attention_row(q2, K2, V2, sel, pos, n_complete, r, nH, nKV, L, scaling, zero, out, t):  # pragma: no cover
    hd = q2.shape[1]
    rep = nH // nKV
    NB = L // r
    ksel = sel.shape[1]
    p = pos[t]
    tail0 = n_complete[t] * r
    # the attended token set, ascending: selected blocks (valid ids, each once; a block token inside the
    # tail range is the tail's) then the tail n_complete*r .. p -- the set selection_mask marks
    blocks = np.empty(ksel, np.int64)
    nb = 0
    for j in range(ksel):
        b = sel[t, j]
        if 0 <= b < NB:
            blocks[nb] = b
            nb += 1
    blocks = np.sort(blocks[:nb])
    idx = np.empty(nb * r + max(0, p - tail0 + 1), np.int64)
    n = 0
    prev = -1
    for j in range(nb):
        b = blocks[j]
        if b == prev:
            continue
        prev = b
        for i in range(r):
            tok = b * r + i
            if tok < tail0 or tok > p:
                idx[n] = tok
                n += 1
    for tok in range(max(tail0, 0), min(p, L - 1) + 1):
        idx[n] = tok
        n += 1
    if n == 0:  # nothing visible (inconsistent inputs): NaN, as the masked softmax gives
        for h in range(nH):
            for d in range(hd):
                out[t, h, d] = np.nan
        return
    sc = np.empty((rep, n), q2.dtype)
    acc = np.empty(hd, q2.dtype)
    for g in range(nKV):
        # the scores of the rep query heads reading KV head g: one pass over its keys
        for j in range(n):
            kr = K2[idx[j] * nKV + g]
            for hh in range(rep):
                qr = q2[t * nH + g * rep + hh]
                a = zero
                for d in range(hd):
                    a += qr[d] * kr[d]
                sc[hh, j] = a * scaling
        for hh in range(rep):
            m = sc[hh, 0]
            for j in range(1, n):
                if sc[hh, j] > m:
                    m = sc[hh, j]
            tot = zero
            for j in range(n):
                e = np.exp(sc[hh, j] - m)
                sc[hh, j] = e
                tot += e
            for d in range(hd):
                acc[d] = zero
            for j in range(n):
                w = sc[hh, j] / tot
                vr = V2[idx[j] * nKV + g]
                for d in range(hd):
                    acc[d] += w * vr[d]
            h = g * rep + hh
            for d in range(hd):
                out[t, h, d] = acc[d]


@njit(cache=True)
def _selected_attention_kernel(q, K, V, sel, pos, n_complete, r, scaling, zero, out):  # pragma: no cover
    T, nH, hd = q.shape
    L, nKV = K.shape[0], K.shape[1]
    q2, K2, V2 = q.reshape(T * nH, hd), K.reshape(L * nKV, hd), V.reshape(L * nKV, hd)
    for t in range(T):
        _selected_attention_row(q2, K2, V2, sel, pos, n_complete, r, nH, nKV, L, scaling, zero, out, t)


@njit(cache=True, parallel=True)
def _selected_attention_kernel_par(q, K, V, sel, pos, n_complete, r, scaling, zero, out):  # pragma: no cover
    T, nH, hd = q.shape
    L, nKV = K.shape[0], K.shape[1]
    q2, K2, V2 = q.reshape(T * nH, hd), K.reshape(L * nKV, hd), V.reshape(L * nKV, hd)
    for t in prange(T):
        _selected_attention_row(q2, K2, V2, sel, pos, n_complete, r, nH, nKV, L, scaling, zero, out, t)


def selected_attention(q: np.ndarray, K: np.ndarray, V: np.ndarray, selected: np.ndarray, positions: np.ndarray,
                       n_complete: np.ndarray, r: int, scaling: float) -> np.ndarray:
    """QSA softmax attention of each query over its attended tokens only: the tokens of its selected blocks
    plus its incomplete tail ``n_complete*r .. p`` (GQA: head ``h`` reads KV head ``h // (nH // nKV)``).

    The same quantity as ``reference.blocks.qsa.sparse_attention`` with ``selection_mask(selected, positions,
    n_complete, L, r)`` (its NumPy twin; tests hold them equal), at a cost of ``T * (budget + r)`` key reads
    instead of ``T * L`` and no ``[T, L]`` mask: what lets the truth run histories past 32768 positions.

    Args:
        q: ``[T, nH, hd]`` (normed, rotated); K, V: ``[L, nKV, hd]`` the caches, index = absolute position.
        selected: ``[T, block_topk]`` int, ``-1`` padded; positions, n_complete: ``[T]`` int. r: compress ratio.
        scaling: ``head_dim ** -0.5``.
    Returns:
        ``[T, nH * hd]`` in ``q.dtype`` (float32 or float64).
    Raises:
        ValueError: mismatched shapes or dtypes.
    Source: ``eager_attention_forward`` under the indexer's mask (``Qwen4ExpTextAttention.forward``).
    """
    dt = q.dtype
    if q.ndim != 3 or K.ndim != 3 or K.shape != V.shape or K.shape[2] != q.shape[2] or q.shape[1] % K.shape[1]:
        raise ValueError(f"selected_attention: expected q [T, nH, hd], K = V [L, nKV, hd] with nKV | nH, found "
                         f"{q.shape}, {K.shape}, {V.shape}")
    T = q.shape[0]
    out = np.empty(q.shape, dtype=dt)
    if T == 0:
        return out.reshape(T, -1)
    kern = _selected_attention_kernel_par if T >= PARALLEL_MIN_ROWS else _selected_attention_kernel
    kern(np.ascontiguousarray(q), np.ascontiguousarray(K, dtype=dt), np.ascontiguousarray(V, dtype=dt),
         np.ascontiguousarray(selected, dtype=np.int64).reshape(T, -1), np.asarray(positions, dtype=np.int64),
         np.asarray(n_complete, dtype=np.int64), np.int64(r), dt.type(scaling), dt.type(0), out)
    return out.reshape(T, -1)


# Float32 reassociation (SIMD reductions) and FMA contraction only: the products are exact (a float32
# activation times an exactly upcast BF16 weight), the sums differ from BLAS's in rounding order alone.
_FM = {"reassoc", "contract", "nsz"}


@njit(cache=True, fastmath=_FM)
def _bf16_matmul_kernel(x, w, out):  # pragma: no cover - compiled
    # One thread on purpose: a parallel region measured 2-10x slower per call on the shared 2-core machine
    # (threads wait at the barrier for a descheduled sibling). Each weight row is upcast once into an
    # L1-resident buffer (BF16 bits are the high half of the float32), then dotted with 4 activation rows at
    # a time. (A 2-weight-row x 4-activation-row variant measured ~40% slower on one-row decode.)
    N, K = x.shape
    O = w.shape[0]
    buf = np.empty(K, np.uint32)
    row = buf.view(np.float32)
    N4 = N - N % 4
    for o in range(O):
        for k in range(K):
            buf[k] = np.uint32(w[o, k]) << 16
        for n in range(0, N4, 4):
            a0 = np.float32(0.0)
            a1 = np.float32(0.0)
            a2 = np.float32(0.0)
            a3 = np.float32(0.0)
            for k in range(K):
                r = row[k]
                a0 += x[n, k] * r
                a1 += x[n + 1, k] * r
                a2 += x[n + 2, k] * r
                a3 += x[n + 3, k] * r
            out[n, o] = a0
            out[n + 1, o] = a1
            out[n + 2, o] = a2
            out[n + 3, o] = a3
        for n in range(N4, N):
            acc = np.float32(0.0)
            for k in range(K):
                acc += x[n, k] * row[k]
            out[n, o] = acc


@njit(cache=True, parallel=True)
def _bf16_upcast_kernel(bits, out):  # pragma: no cover - compiled
    n = bits.shape[0]
    step = 1 << 16
    for c in prange((n + step - 1) // step):
        for i in range(c * step, min(n, (c + 1) * step)):
            out[i] = np.uint32(bits[i]) << np.uint32(16)


def bf16_upcast(w: np.ndarray, dtype=np.float32) -> np.ndarray:
    """A BF16 array (``ml_dtypes.bfloat16`` or its ``uint16`` bits, any shape) as a new float32/float64 array,
    exactly (each BF16 value is the float32 value of its bits shifted left by 16), on all Numba threads: the
    upcast of a real vocabulary's lm_head (636M values) single-threaded in NumPy takes ~2 s per forward.

    Raises:
        TypeError: ``w`` is not 16-bit or ``dtype`` is not float32/float64.
    """
    dt = np.dtype(dtype)
    if dt not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise TypeError(f"bf16_upcast: expected dtype float32 or float64, found {dt}")
    bits = _bits(w)
    out = np.empty(bits.shape, dtype=np.uint32)
    _bf16_upcast_kernel(bits.reshape(-1), out.reshape(-1))
    f = out.view(np.float32)
    return f if dt == np.dtype(np.float32) else f.astype(np.float64)


def _bits(w: np.ndarray) -> np.ndarray:
    a = np.asarray(w)
    if a.dtype != np.dtype(np.uint16) and a.dtype.name != "bfloat16":
        raise TypeError(f"bf16 bits: expected a bfloat16 or uint16 array, found {a.dtype}")
    return np.ascontiguousarray(a.view(np.uint16))


def bf16_matmul_t(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """``x @ upcast(w).T`` in float32 without materialising the upcast weight (Numba).

    Args:
        x: ``[N, K]`` float32 activations; w: ``[O, K]`` BF16 weight (``ml_dtypes.bfloat16`` or its
            ``uint16`` bits), e.g. a memory-mapped slice of a checkpoint.
    Returns:
        ``[N, O]`` float32. Equal to the BLAS product of the float32 upcast up to float32 summation order.
    Raises:
        TypeError: ``w`` is not 16-bit.  ValueError: inner dimensions differ.
    """
    bits = _bits(w)
    x = np.ascontiguousarray(x, dtype=np.float32)
    if x.ndim != 2 or bits.ndim != 2 or x.shape[1] != bits.shape[1]:
        raise ValueError(f"bf16_matmul_t: expected x [N, K] and w [O, K], found {x.shape} and {bits.shape}")
    out = np.empty((x.shape[0], bits.shape[0]), dtype=np.float32)
    _bf16_matmul_kernel(x, bits, out)
    return out



@njit(cache=True, parallel=True, fastmath={'contract'})
def _split_k_kernel(xt, w, block, out):  # pragma: no cover - compiled
    # four outputs per task share each load of a row of xt (the rows of x transposed: the loops over t vectorise);
    # per output the operations are those of a one-output loop: each block's partial summed in feature order,
    # the partials accumulated from the last block to the first
    K, N = xt.shape
    O = w.shape[0]
    nb = (K + block - 1) // block
    for og in prange((O + 3) // 4):
        o0 = og * 4
        o1, o2, o3 = min(o0 + 1, O - 1), min(o0 + 2, O - 1), min(o0 + 3, O - 1)  # a short last group repeats O - 1
        a0, a1, a2, a3 = np.zeros(N, xt.dtype), np.zeros(N, xt.dtype), np.zeros(N, xt.dtype), np.zeros(N, xt.dtype)
        p0, p1, p2, p3 = np.empty(N, xt.dtype), np.empty(N, xt.dtype), np.empty(N, xt.dtype), np.empty(N, xt.dtype)
        for bi in range(nb - 1, -1, -1):      # the last block's partial first, then the earlier ones
            for t in range(N):
                p0[t] = 0
                p1[t] = 0
                p2[t] = 0
                p3[t] = 0
            for j in range(bi * block, min(K, (bi + 1) * block)):
                w0, w1, w2, w3 = w[o0, j], w[o1, j], w[o2, j], w[o3, j]
                for t in range(N):
                    xv = xt[j, t]
                    p0[t] += xv * w0
                    p1[t] += xv * w1
                    p2[t] += xv * w2
                    p3[t] += xv * w3
            for t in range(N):
                a0[t] += p0[t]
                a1[t] += p1[t]
                a2[t] += p2[t]
                a3[t] += p3[t]
        for t in range(N):
            out[t, o0] = a0[t]
            out[t, o1] = a1[t]
            out[t, o2] = a2[t]
            out[t, o3] = a3[t]


def split_k_matmul_t(x: np.ndarray, w: np.ndarray, block: int) -> np.ndarray:
    """``x @ w.T`` as a split-K sum in ``x.dtype`` (Numba, parallel over the rows of ``w``).

    Args:
        x: ``[N, K]`` float32/float64 activations; w: ``[O, K]`` of the same dtype; block: ``>= 1`` input
            features per partial.
    Returns:
        ``[N, O]`` in ``x.dtype``: per output, each block ``[s, s + block)``'s partial summed in order of the
        features, the partials accumulated from the LAST block to the first (a split-K GEMM's order; the
        rounding sequence ``reference.order`` names). A partial's multiply-adds may fuse (FMA, as GEMM kernels
        do): the only floating-point liberty taken.
    Raises:
        ValueError: shapes or dtypes do not match, or ``block < 1``.
    Cost: ``N * O * K`` multiply-adds vectorised over ``N``, one pass over ``w``, each row of ``x`` read once per
    four outputs (2x the one-output loop on a real vocabulary's lm_head; a NumPy loop of ``K / block`` products
    re-reads an ``[N, O]`` array per block, 2.4-20x slower still).
    """
    if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1] or x.dtype != w.dtype or block < 1:
        raise ValueError(f"split_k_matmul_t: expected x [N, K], w [O, K] of one dtype and block >= 1, found "
                         f"{x.shape} {x.dtype}, {w.shape} {w.dtype}, block {block}")
    out = np.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
    _split_k_kernel(np.ascontiguousarray(x.T), np.ascontiguousarray(w), int(block), out)
    return out
