"""Numba kernels for the loops that would otherwise run in Python.

* :func:`delta_rule_recurrent` -- the gated delta-rule recurrence, one token at a time (decode path and
  the exact sequential oracle for the chunked form).
* :func:`ngram_hash_rows` -- the PLE n-gram hash with the official int64 wrap-around arithmetic.
* :func:`unit_lower_solve` -- the triangular solve of the chunked delta rule.
* :func:`block_topk_select` -- the QSA per-query block top-k in the canonical order.

Every kernel is ``@njit(cache=True)`` and called with at most two signatures (float32 / float64), so
the JIT cost is paid once per machine. Each has a plain NumPy twin in the block modules that the
tests hold it to.
"""
from __future__ import annotations

import numpy as np
from numba import njit

__all__ = ["delta_rule_recurrent", "ngram_hash_rows", "unit_lower_solve", "block_topk_select"]


@njit(cache=True, fastmath=False)
def _delta_rule_kernel(q, k, v, g, beta, state, out):  # pragma: no cover - compiled
    T, Hk, dk = q.shape
    Hv = v.shape[1]
    dv = v.shape[2]
    rep = Hv // Hk
    for h in range(Hv):
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
    L = history.shape[0]
    n = mult.shape[0]
    T = L - ctx
    shifted = np.empty(n, dtype=np.int64)
    for t in range(T):
        p = ctx + t
        shifted[0] = history[p]
        blocked = False  # an EOS at p-s .. p-1 resets every longer shift
        for s in range(1, n):
            src = p - s
            if src < 0 or blocked or history[src] == eos:
                blocked = True
                shifted[s] = eos
            else:
                shifted[s] = history[src]
        for ng in range(2, n + 1):
            mixed = shifted[0] * mult[0]
            for s in range(1, ng):
                mixed = mixed ^ (shifted[s] * mult[s])
            start = (ng - 2) * heads_per_ngram
            for hh in range(heads_per_ngram):
                h = start + hh
                out[t, h] = (mixed % sizes[h]) + offsets[h]


def ngram_hash_rows(context: np.ndarray, ids: np.ndarray, eos: int, multipliers, head_vocab_sizes,
                    head_offsets, heads_per_ngram: int) -> np.ndarray:
    """PLE n-gram table rows of ``ids`` given the carried ``ngram_size - 1`` token context (Numba).

    Same contract as :func:`reference.blocks.ple.ngram_rows_numpy` (the readable twin).
    Returns:
        ``[T, ngram_heads]`` int64.
    Source: modeling_qwen4_exp.py ``Qwen4ExpTextNGramEmbedding.forward`` / ``_shift_right_ignore_eos``.
    """
    history = np.concatenate([np.asarray(context, dtype=np.int64), np.asarray(ids, dtype=np.int64)])
    mult = np.asarray(multipliers, dtype=np.int64)
    sizes = np.asarray(head_vocab_sizes, dtype=np.int64)
    offs = np.asarray(head_offsets, dtype=np.int64)
    T = len(ids)
    out = np.empty((T, sizes.shape[0]), dtype=np.int64)
    _ngram_hash_kernel(history, np.int64(len(context)), np.int64(eos), mult, sizes, offs,
                       np.int64(heads_per_ngram), out)
    return out


@njit(cache=True)
def _unit_lower_solve_kernel(A, B, X):  # pragma: no cover - compiled
    n_batch, C, _ = A.shape
    m = B.shape[2]
    for h in range(n_batch):
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
def _block_topk_kernel(scores, n_complete, k, out):  # pragma: no cover - compiled
    T = scores.shape[0]
    for t in range(T):
        nc = n_complete[t]
        kk = min(k, nc)
        if kk > 0:
            # stable sort of -score over the visible blocks: score descending, lower index first on ties
            order = np.argsort(-scores[t, :nc], kind="mergesort")
            for j in range(kk):
                out[t, j] = order[j]


def block_topk_select(scores: np.ndarray, n_complete: np.ndarray, k: int) -> np.ndarray:
    """QSA block selection per query: the ``min(k, n_t)`` best of the first ``n_t`` blocks, canonical order.

    Args:
        scores: ``[T, NB]`` float; n_complete: ``[T]`` int (``n_t <= NB``); k: ``block_topk``.
    Returns:
        ``[T, k]`` int64, ``-1`` padded. Same result as ``reference.blocks.qsa.canonical_topk`` on the visible
        blocks (tests hold them equal).
    """
    out = np.full((scores.shape[0], k), -1, dtype=np.int64)
    _block_topk_kernel(np.ascontiguousarray(scores), np.asarray(n_complete, dtype=np.int64), np.int64(k), out)
    return out
