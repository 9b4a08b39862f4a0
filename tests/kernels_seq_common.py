"""Shared helpers for the sequence-kernel tests (tests/engine/test_gdn.py, test_qsa.py, test_rope.py,
test_kernels_seq_oracle.py): seeded random problems, scrambled paged pools, and float64 dense re-statements of
the official semantics that know nothing of pages.
For the op modules also: their tolerance ``TOL``, the GDN inputs at the real model's widths (:func:`gdn_inputs`) and
the choice between the prefill and the split decode kernels (:func:`split_dispatch`).

Not a test module. Every generator takes an ``np.random.Generator``; tests draw the fixed seed of the running test
(:func:`seeded_rng`) and put it in their failure messages.

How the sequence-kernel tests judge (tests/engine/test_gdn.py, test_qsa.py, test_rope.py):
- the NumPy path against float64 dense re-statements of the official semantics (this module) on seeded random
  inputs, with negative controls;
- the CUDA path (prefill and the decode-oriented "split" kernels) against its NumPy twins and float64, at the real
  model's head sizes; every device allocation poisoned (bytes 0x7F: float 3.4e38, int 2139062143) so an output a
  kernel forgot to write cannot match; negative controls (a perturbed input or score, a wrong twin, a wrong
  tie-break, a wrong block in a selection, a token written at the wrong position, a dropped slice of a GDN state)
  caught by the same comparisons AND located (query / block / slot / head + rows); graph capture + replay equal to
  the eager run bitwise, two runs bitwise equal; without cupy or a GPU the CUDA cases skip.
"""
from __future__ import annotations

import math

import numpy as np


# float32 computations against float64 truth. Conv / RoPE / scores are a handful of float32 products per element
# (relative error ~1e-7); the delta rule carries float32 state through up to ~130 tokens (measured ~1e-6);
# 1e-5 leaves an order of magnitude of margin while every negative control there moves results by >= 1e-2.
# CUDA: float32 kernels vs float32 NumPy twins and float64 truth: per element a few float32 roundings (different
# summation orders, cosf vs numpy cos, online vs two-pass softmax) -> ~1e-6 relative; 1e-5 per METHOD.md's fp32
# guidance ("far under 1e-3"), while every negative control moves results by >= 1e-2 (>= 1e-3 for the split kernels).
TOL = 1e-5  # the op modules' (test_gdn.py, test_qsa.py, test_rope.py)

# the real model's GDN widths: key heads, value heads, key and value head dims
HK, HV, DK, DV = 16, 48, 128, 128


def seeded_rng():
    """``(seed, rng)`` with the running test's fixed seed (:func:`fixture_helpers.seed_for_test`)."""
    from fixture_helpers import seed_for_test
    seed = seed_for_test()
    return seed, np.random.default_rng(seed)


def rel_err(a, b) -> float:
    """max |a - b| / max(|b|, tiny) over all elements (float64)."""
    a = np.asarray(a, dtype=np.float64)
    b = np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)) if b.size else 0.0


class Pool:
    """A paged pool of ``num_pages`` pages for ``n_seqs`` sequences of given lengths, pages handed out in a
    scrambled order so that page adjacency never coincides with token adjacency."""

    def __init__(self, rng, lengths, page_size, width_shapes, num_spare_pages=3, dtype=np.float32):
        self.page_size = page_size
        need = [-(-L // page_size) for L in lengths]
        self.num_pages = sum(need) + num_spare_pages
        perm = rng.permutation(self.num_pages)
        self.max_pages = max(max(need), 1) + 2
        self.block_tables = np.full((len(lengths) + 1, self.max_pages), -1, np.int32)  # one unused row
        i = 0
        for r, n in enumerate(need):
            self.block_tables[r, :n] = perm[i:i + n]
            i += n
        S = self.num_pages * page_size
        # garbage everywhere: only slots the kernels are supposed to read must matter
        self.arrays = {name: (rng.standard_normal((S,) + shp) * 50).astype(dtype) for name, shp in width_shapes.items()}

    def slots(self, row, positions):
        pos = np.asarray(positions, dtype=np.int64)
        return self.block_tables[row, pos // self.page_size].astype(np.int64) * self.page_size + pos % self.page_size


# --------------------------------------------------------------------------------- float64 dense semantics (QSA)
def dense_rms_norm(x, w, eps):
    x = np.asarray(x, np.float64)
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (1.0 + np.asarray(w, np.float64))


def dense_rope(x, pos, inv_freq, rot):
    """float64 rotate-half RoPE of ``x [..., D]`` at scalar/array position(s) ``pos`` (angles from float32
    ``pos * inv_freq`` like the official forward)."""
    x = np.asarray(x, np.float64).copy()
    ang = (np.asarray(pos, np.float32)[..., None] * np.asarray(inv_freq, np.float32)).astype(np.float64)
    c, s = np.cos(ang), np.sin(ang)
    h = rot // 2
    a, b = x[..., :h].copy(), x[..., h:rot].copy()
    if x.ndim == 3 and c.ndim == 2:
        c, s = c[:, None, :], s[:, None, :]
    x[..., :h] = a * c - b * s
    x[..., h:rot] = b * c + a * s
    return x


def dense_block_keys(raw, w, inv_freq, rot, ratio, eps):
    """Block keys ``[L // ratio, Di]`` of one sequence's raw indexer keys ``raw [L, Di]`` (float64)."""
    nb = raw.shape[0] // ratio
    if nb == 0:
        return np.zeros((0, raw.shape[1]))
    pooled = np.asarray(raw[:nb * ratio], np.float64).reshape(nb, ratio, -1).mean(1)
    return dense_rope(dense_rms_norm(pooled, w, eps), np.arange(nb) * ratio, inv_freq, rot)


def dense_scores(qi, keys):
    """``sum_h relu(q_h . k_b) / sqrt(Di)`` for ``qi [Hi, Di]``, ``keys [nb, Di]`` -> ``[nb]``."""
    return np.maximum(np.asarray(qi, np.float64) @ np.asarray(keys, np.float64).T, 0).sum(0) / math.sqrt(qi.shape[-1])


def canonical_topk(scores, k):
    """Indices of the ``min(k, n)`` best entries: higher score first, ties to the lower index."""
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    return order[:min(k, len(scores))]


def dense_attention(q, K, V, positions, scale):
    """float64 GQA softmax attention of ``q [Hq, D]`` over ``K, V [L, Hkv, D]`` restricted to ``positions``."""
    Hq, D = q.shape
    Hkv = K.shape[1]
    G = Hq // Hkv
    out = np.empty((Hq, D))
    for h in range(Hq):
        kk = np.asarray(K[positions, h // G], np.float64)
        vv = np.asarray(V[positions, h // G], np.float64)
        s = kk @ np.asarray(q[h], np.float64) * scale
        p = np.exp(s - s.max())
        out[h] = (p / p.sum()) @ vv
    return out


# --------------------------------------------------------------------------------- float64 dense semantics (GDN)
def dense_gdn(q, k, v, g, beta, S0):
    """Token-by-token float64 gated delta rule (q, k un-normalised; l2norm + Dk**-0.5 applied here).
    Returns ``(out [T, Hv, Dv], S [Hv, Dk, Dv])``."""
    q = np.asarray(q, np.float64)
    k = np.asarray(k, np.float64)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(q.shape[-1])
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    Hv = v.shape[1]
    rep = Hv // q.shape[1]
    S = np.asarray(S0, np.float64).copy()
    out = np.empty(v.shape)
    for t in range(q.shape[0]):
        for h in range(Hv):
            qq, kk = q[t, h // rep], k[t, h // rep]
            S[h] *= math.exp(g[t, h])
            delta = (v[t, h] - kk @ S[h]) * beta[t, h]
            S[h] += np.outer(kk, delta)
            out[t, h] = qq @ S[h]
    return out, S


def dense_conv(x, w, state):
    """float64 causal depthwise conv + silu over ``concat(state, x)``; returns ``(y, new_state)``."""
    K = w.shape[1]
    z = np.concatenate([np.asarray(state, np.float64), np.asarray(x, np.float64)], 0)
    T = x.shape[0]
    y = sum(z[j:j + T] * np.asarray(w, np.float64)[:, j] for j in range(K))
    return y / (1 + np.exp(-y)), z[T:]


def gdn_inputs(rng, T, S=6):
    """A GDN step at the real model's widths: q, k, v, gate inputs a, b, A_log, dt_bias for ``T`` tokens and ``S``
    state slots [S, Hv, Dk, Dv]."""
    q = rng.standard_normal((T, HK, DK)).astype(np.float32)
    k = rng.standard_normal((T, HK, DK)).astype(np.float32)
    v = rng.standard_normal((T, HV, DV)).astype(np.float32)
    a = rng.standard_normal((T, HV)).astype(np.float32)
    b = rng.standard_normal((T, HV)).astype(np.float32)
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    dtb = rng.standard_normal(HV).astype(np.float32)
    state = (rng.standard_normal((S, HV, DK, DV)) * 0.1).astype(np.float32)
    return q, k, v, a, b, A_log, dtb, state


def split_dispatch(monkeypatch):
    """set_('prefill'): even decode-sized calls take the prefill kernels (the per-query-head attention, the
    one-warp-per-32-columns GDN recurrence) by lowering the dispatch thresholds; set_('split'): the dispatch as
    shipped. (Top-k and the block keys at these widths have one kernel each.)"""
    from engine.kernels import gdn, qsa
    split_t, split_tps = qsa.QSA_SPLIT_MAX_T, gdn.GDN_SPLIT_MAX_TPS

    def set_(name):
        assert name in ("prefill", "split"), name
        monkeypatch.setattr(qsa, "QSA_SPLIT_MAX_T", 0 if name == "prefill" else split_t)
        monkeypatch.setattr(gdn, "GDN_SPLIT_MAX_TPS", 0 if name == "prefill" else split_tps)
    return set_
