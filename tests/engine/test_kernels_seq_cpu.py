"""Sequence kernels (GDN conv + delta rule, RoPE, QSA) on the NumPy path, held to float64 dense re-statements of
the official semantics (tests/kernels_seq_common.py) on seeded random inputs, with negative controls.

The GPU algorithm of the chunked prefill (``gdn._chunked_xp``) is array code; it is run here on numpy too.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import gdn, qsa, rope
from tests.kernels_seq_common import (Pool, canonical_topk, dense_attention, dense_block_keys, dense_conv, dense_gdn,
                                      dense_rope, dense_scores, seeded_rng, rel_err)

# float32 computations against float64 truth. Conv / RoPE / scores are a handful of float32 products per element
# (relative error ~1e-7); the delta rule carries float32 state through up to ~130 tokens (measured ~1e-6);
# 1e-5 leaves an order of magnitude of margin while every negative control below moves results by >= 1e-2.
TOL = 1e-5


def _gdn_problem(rng, T, Hk=2, Dk=16, Hv=4, Dv=8, S=3):
    q = rng.standard_normal((T, Hk, Dk)).astype(np.float32)
    k = rng.standard_normal((T, Hk, Dk)).astype(np.float32)
    v = rng.standard_normal((T, Hv, Dv)).astype(np.float32)
    a = rng.standard_normal((T, Hv)).astype(np.float32)
    b = rng.standard_normal((T, Hv)).astype(np.float32)
    A_log = (rng.standard_normal(Hv) * 0.5).astype(np.float32)
    dt_bias = rng.standard_normal(Hv).astype(np.float32)
    g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    state = (rng.standard_normal((S, Hv, Dk, Dv)) * 0.3).astype(np.float32)
    return q, k, v, g, beta, state, (a, b, A_log, dt_bias)


def test_gdn_gates_match_formula():
    seed, rng = seeded_rng()
    *_, (a, b, A_log, dt_bias) = _gdn_problem(rng, 9)
    a[0, 0] = 30.0  # softplus identity branch (> 20)
    g, beta = gdn.gdn_gates(a, b, A_log, dt_bias)
    x = a.astype(np.float64) + dt_bias
    sp = np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))
    assert rel_err(g, -np.exp(A_log.astype(np.float64)) * sp) < TOL, seed
    assert rel_err(beta, 1 / (1 + np.exp(-b.astype(np.float64)))) < TOL, seed
    assert np.all(g <= 0)


@pytest.mark.parametrize("T,chunk", [(1, 64), (5, 4), (64, 64), (100, 16), (37, 7)])
def test_delta_prefill_twin_and_gpu_algorithm_match_dense(T, chunk):
    seed, rng = seeded_rng()
    q, k, v, g, beta, state, _ = _gdn_problem(rng, T)
    ref_out, ref_S = dense_gdn(q, k, v, g, beta, state[1])
    for name, fn in (("twin", gdn.gated_delta_prefill), ("gpu-algorithm", lambda *a: gdn._chunked_xp(np, *a)),
                     ("recurrent", lambda *a: gdn.gated_delta_prefill(*a, algorithm="recurrent"))):
        st = state.copy()
        out = fn(q, k, v, g, beta, st, 1, chunk)
        assert out.shape == (T, 4, 8) and out.dtype == np.float32
        assert rel_err(out, ref_out) < TOL, (name, seed)
        assert rel_err(st[1], ref_S) < TOL, (name, seed)
        assert np.array_equal(st[[0, 2]], state[[0, 2]]), f"{name}: other slab rows touched (seed {seed})"


def test_delta_recurrent_batched_segments_and_checkpoints():
    seed, rng = seeded_rng()
    lens = [1, 3, 0, 2]
    N = sum(lens)
    q, k, v, g, beta, state, _ = _gdn_problem(rng, N, S=6)
    slots = np.array([4, 0, 2, 5])
    cu = np.concatenate([[0], np.cumsum(lens)])
    st = state.copy()
    ck = np.full((N, 4, 16, 8), np.nan, np.float32)
    out = gdn.gated_delta_recurrent(q, k, v, g, beta, st, slots, cu, checkpoints=ck)
    for b, s in enumerate(slots):
        lo, hi = cu[b], cu[b + 1]
        ro, rs = dense_gdn(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], state[s])
        assert rel_err(out[lo:hi], ro) < TOL, seed
        assert rel_err(st[s], rs) < TOL, seed
        for t in range(lo, hi):
            _, rs_t = dense_gdn(q[lo:t + 1], k[lo:t + 1], v[lo:t + 1], g[lo:t + 1], beta[lo:t + 1], state[s])
            assert rel_err(ck[t], rs_t) < TOL, seed
    assert np.array_equal(st[[1, 3]], state[[1, 3]])
    # decode form: one token per slot
    st2 = state.copy()
    o2 = gdn.gated_delta_decode(q[:2], k[:2], v[:2], g[:2], beta[:2], st2, np.array([3, 1]))
    assert rel_err(o2[1], dense_gdn(q[1:2], k[1:2], v[1:2], g[1:2], beta[1:2], state[1])[0][0]) < TOL, seed


def test_delta_negative_controls_are_caught():
    """A dropped state, a wrong slot and swapped value heads each move the output far beyond TOL."""
    seed, rng = seeded_rng()
    q, k, v, g, beta, state, _ = _gdn_problem(rng, 6)
    ref_out, _ = dense_gdn(q, k, v, g, beta, state[1])
    st = state.copy()
    st[1] = 0  # dropped state
    assert rel_err(gdn.gated_delta_prefill(q, k, v, g, beta, st, 1), ref_out) > 1e-2, seed
    st = state.copy()  # wrong slot
    assert rel_err(gdn.gated_delta_prefill(q, k, v, g, beta, st, 2), ref_out) > 1e-2, seed
    st = state.copy()  # swapped value heads
    assert rel_err(gdn.gated_delta_prefill(q, k, v[:, ::-1].copy(), g, beta, st, 1), ref_out) > 1e-2, seed


def test_conv_prefill_decode_and_checkpoints_match_dense():
    seed, rng = seeded_rng()
    C, K, T = 12, 4, 7
    x = rng.standard_normal((T + 2, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    cs = rng.standard_normal((3, K - 1, C)).astype(np.float32)
    orig = cs.copy()
    ck = np.full((T, K - 1, C), np.nan, np.float32)
    y = gdn.causal_conv_prefill(x[:T], w, cs, 2, checkpoints=ck)
    ry, rstate = dense_conv(x[:T], w, orig[2])
    assert rel_err(y, ry) < TOL and rel_err(cs[2], rstate) < TOL, seed
    for t in range(T):
        assert rel_err(ck[t], dense_conv(x[:t + 1], w, orig[2])[1]) < TOL, seed
    # decode two sequences in one call; row 2 continues from the prefill
    xd = x[T:T + 2]
    before = cs.copy()
    yd = gdn.causal_conv_decode(xd, w, cs, np.array([2, 0]))
    assert rel_err(yd[0], dense_conv(xd[:1], w, before[2])[0][0]) < TOL, seed
    assert rel_err(yd[1], dense_conv(xd[1:], w, before[0])[0][0]) < TOL, seed
    assert np.array_equal(cs[1], orig[1])
    # negative control: an off-by-one state (shifted history) is caught
    shifted = np.roll(orig[2], 1, axis=0)
    assert rel_err(dense_conv(x[:T], w, shifted)[0], ry) > 1e-2, seed


def test_conv_short_prefill_shorter_than_kernel():
    seed, rng = seeded_rng()
    C, K = 5, 4
    w = rng.standard_normal((C, K)).astype(np.float32)
    cs = rng.standard_normal((1, K - 1, C)).astype(np.float32)
    orig = cs.copy()
    x = rng.standard_normal((1, C)).astype(np.float32)
    y = gdn.causal_conv_prefill(x, w, cs, 0)
    ry, rs = dense_conv(x, w, orig[0])
    assert rel_err(y, ry) < TOL and rel_err(cs[0], rs) < TOL, seed


def test_input_errors_are_clear():
    from reference.errors import UserError
    q = np.zeros((3, 2, 4), np.float32)
    with pytest.raises(UserError, match="v heads"):
        gdn.gated_delta_prefill(q, q, np.zeros((3, 3, 4), np.float32), np.zeros((3, 3), np.float32),
                                np.zeros((3, 3), np.float32), np.zeros((1, 3, 4, 4), np.float32), 0)
    with pytest.raises(UserError, match="slot"):
        gdn.gated_delta_prefill(q, q, np.zeros((3, 2, 4), np.float32), np.zeros((3, 2), np.float32),
                                np.zeros((3, 2), np.float32), np.zeros((1, 2, 4, 4), np.float32), 5)
    with pytest.raises(UserError, match="algorithm"):
        gdn.gated_delta_prefill(q, q, np.zeros((3, 2, 4), np.float32), np.zeros((3, 2), np.float32),
                                np.zeros((3, 2), np.float32), np.zeros((1, 2, 4, 4), np.float32), 0, algorithm="fast")
    with pytest.raises(UserError, match="rotary_dim"):
        rope.apply_rope(np.zeros((2, 1, 8), np.float32), np.arange(2), np.zeros(5, np.float32), 10)


# ------------------------------------------------------------------------------------------------ RoPE
def test_rope_matches_dense_at_large_positions_and_in_place():
    seed, rng = seeded_rng()
    x = rng.standard_normal((6, 3, 32)).astype(np.float32)
    pos = np.array([0, 1, 17, 4095, 131072, 262143])
    invf = (1.0 / 1e7 ** (np.arange(0, 16, 2) / 16)).astype(np.float32)
    out = rope.apply_rope(x, pos, invf, 16)
    ref = dense_rope(x, pos, invf, 16)
    # cos/sin of float32 angles up to 2.6e5 rad: both sides use the same float32 angle, the float32 cos/sin then
    # differ from float64 by < 1e-7 absolute
    assert rel_err(out, ref) < TOL, seed
    assert np.array_equal(out[..., 16:], x[..., 16:])
    y = x.copy()
    rope.apply_rope(y, pos, invf, 16, out=y)
    assert np.array_equal(y, out)
    assert rel_err(rope.apply_rope(x, pos + 1, invf, 16), ref) > 1e-2, "off-by-one position not caught"


# ------------------------------------------------------------------------------------------------ QSA
RATIO, TOPK, DI, HI, HQ, HKV, D, ROT, EPS = 4, 3, 16, 2, 4, 2, 16, 8, 1e-6


def _qsa_problem(rng, lengths, page_size):
    pool = Pool(rng, lengths, page_size, {"idx_k": (DI,), "blk_k": (DI,), "kv_k": (HKV, D), "kv_v": (HKV, D)})
    raw = [rng.standard_normal((L, DI)).astype(np.float32) for L in lengths]
    K = [rng.standard_normal((L, HKV, D)).astype(np.float32) for L in lengths]
    V = [rng.standard_normal((L, HKV, D)).astype(np.float32) for L in lengths]
    for r, L in enumerate(lengths):
        sl = pool.slots(r, np.arange(L))
        pool.arrays["idx_k"][sl] = raw[r]
        pool.arrays["kv_k"][sl] = K[r]
        pool.arrays["kv_v"][sl] = V[r]
    w = (rng.standard_normal(DI) * 0.3).astype(np.float32)
    invf = (1.0 / 1e4 ** (np.arange(0, ROT, 2) / ROT)).astype(np.float32)
    return pool, raw, K, V, w, invf


def _write_block_keys(ops, pool, lengths, w, invf, split):
    """Block keys written the way the engine does: a prefill chunk [0, split) then one token per step."""
    rows = np.concatenate([np.full(min(split, L), r) for r, L in enumerate(lengths)])
    pos = np.concatenate([np.arange(min(split, L)) for L in lengths])
    ops.qsa_block_keys(pool.arrays["idx_k"], pool.arrays["blk_k"], pool.block_tables, rows, pos, w, invf, ROT,
                       RATIO, pool.page_size, EPS)
    for p in range(split, max(lengths)):
        rr = np.array([r for r, L in enumerate(lengths) if p < L])
        if rr.size:
            ops.qsa_block_keys(pool.arrays["idx_k"], pool.arrays["blk_k"], pool.block_tables, rr,
                               np.full(rr.size, p), w, invf, ROT, RATIO, pool.page_size, EPS)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_qsa_pipeline_matches_dense_any_page_size(page_size):
    seed, rng = seeded_rng()
    lengths = [37, 2, 70]
    pool, raw, K, V, w, invf = _qsa_problem(rng, lengths, page_size)
    _write_block_keys(qsa, pool, lengths, w, invf, split=21)
    # block keys at block-end slots
    for r, L in enumerate(lengths):
        ref_keys = dense_block_keys(raw[r], w, invf, ROT, RATIO, EPS)
        got = pool.arrays["blk_k"][pool.slots(r, np.arange(L // RATIO) * RATIO + RATIO - 1)]
        assert rel_err(got, ref_keys) < TOL, (seed, r)
    # queries: every position of every sequence, one call (prefill and decode use the same op)
    rows = np.concatenate([np.full(L, r) for r, L in enumerate(lengths)])
    pos = np.concatenate([np.arange(L) for L in lengths])
    nv = pos + 1
    qi = rng.standard_normal((len(pos), HI, DI)).astype(np.float32)
    nb = int(nv.max() // RATIO)
    scores, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, rows, nv, nb, RATIO, page_size, TOPK)
    q = rng.standard_normal((len(pos), HQ, D)).astype(np.float32)
    out = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, rows, nv, sel,
                                   RATIO, page_size, D ** -0.5)
    dense = np.full(scores.shape, -np.inf)
    for t in range(len(pos)):
        r, n = int(rows[t]), int(nv[t])
        keys = dense_block_keys(raw[r][:n], w, invf, ROT, RATIO, EPS)
        dense[t, :len(keys)] = dense_scores(qi[t], keys) if len(keys) else np.zeros(0)
    # one comparison over all finite scores: a single small score (relu-sum cancellation) is judged against the
    # scale of the whole matrix, not against itself
    fin = np.isfinite(dense)
    assert np.array_equal(np.isfinite(scores), fin) and rel_err(scores[fin], dense[fin]) < TOL, seed
    for t in range(len(pos)):
        r, n = int(rows[t]), int(nv[t])
        rs = scores[t, :n // RATIO]  # the canonical order is checked on the op's own scores
        top = canonical_topk(rs, TOPK)
        assert sel[t, :len(top)].tolist() == top and np.all(sel[t, len(top):] == -1), (seed, t)
        toks = [b * RATIO + j for b in top for j in range(RATIO)] + list(range(n // RATIO * RATIO, n))
        assert rel_err(out[t], dense_attention(q[t], K[r], V[r], toks, D ** -0.5)) < TOL, (seed, t)


def test_qsa_topk_canonical_ties_and_wrong_tiebreak_is_caught():
    seed, rng = seeded_rng()
    T, NB, k = 5, 40, 7
    scores = rng.choice(np.array([0.0, 0.5, 1.0, 2.0], np.float32), size=(T, NB))  # heavy ties
    scores[1, :] = 1.0  # all equal
    scores[2, 3] = -0.0  # -0 ties with +0
    nv = np.array([160, 160, 160, 13, 2])  # 40, 40, 40, 3, 0 complete blocks
    sel = qsa.qsa_topk(scores, nv, RATIO, k)
    for t in range(T):
        nc = int(nv[t]) // RATIO
        ref = canonical_topk(scores[t, :nc], k)
        assert sel[t, :len(ref)].tolist() == ref and np.all(sel[t, len(ref):] == -1), (seed, t)
    assert sel[1].tolist() == list(range(k))
    # negative control: the opposite tie-break (higher index first) differs from the canonical order
    wrong = sorted(range(NB), key=lambda i: (-float(scores[1, i]), -i))[:k]
    assert wrong != sel[1].tolist()


def test_qsa_negative_controls_are_caught():
    """A stale page in the block table, swapped query heads and a dropped tail each change the result beyond TOL."""
    seed, rng = seeded_rng()
    lengths = [30]
    pool, raw, K, V, w, invf = _qsa_problem(rng, lengths, 3)
    _write_block_keys(qsa, pool, lengths, w, invf, split=30)
    nv = np.array([30])
    rows = np.array([0])
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    qi = rng.standard_normal((1, HI, DI)).astype(np.float32)
    scores, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, rows, nv, 7, RATIO, 3, TOPK)
    args = (pool.arrays["kv_k"], pool.arrays["kv_v"])
    good = qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, nv, sel, RATIO, 3, D ** -0.5)
    # a stale (garbage) page in the block table: under the top block's last token (its block key) for the
    # scores, under its first token (K/V) for the attention
    spare = sorted(set(range(pool.num_pages)) - set(pool.block_tables[pool.block_tables >= 0].tolist()))[0]
    top = int(sel[0, 0])
    bt = pool.block_tables.copy()
    bt[0, (top * RATIO + RATIO - 1) // 3] = spare
    s2, _ = qsa.qsa_select(qi, pool.arrays["blk_k"], bt, rows, nv, 7, RATIO, 3, TOPK)
    assert rel_err(s2, scores) > 1e-2, seed
    bt = pool.block_tables.copy()
    bt[0, top * RATIO // 3] = spare
    assert rel_err(qsa.qsa_sparse_attention(q, *args, bt, rows, nv, sel, RATIO, 3, D ** -0.5), good) > 1e-2, seed
    assert rel_err(qsa.qsa_sparse_attention(q[:, ::-1].copy(), *args, pool.block_tables, rows, nv, sel, RATIO, 3,
                                            D ** -0.5)[:, ::-1], good) > 1e-2, seed
    # dropped tail: 30 visible = 7 blocks + 2 tail tokens; pretending 28 visible drops them
    assert rel_err(qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, np.array([28]), sel, RATIO, 3,
                                            D ** -0.5), good) > 1e-3, seed
    # the tail is always visible: a huge value on the last token dominates the output
    pool.arrays["kv_v"][pool.slots(0, [29])] = 1e4
    big = qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, nv, sel, RATIO, 3, D ** -0.5)
    assert np.abs(big).max() > 10 * np.abs(good).max(), seed


def test_qsa_all_blocks_selected_below_budget_is_full_causal_attention():
    seed, rng = seeded_rng()
    L = 14  # 3 complete blocks <= TOPK: every token visible
    pool, raw, K, V, w, invf = _qsa_problem(rng, [L], 16)
    _write_block_keys(qsa, pool, [L], w, invf, split=L)
    qi = rng.standard_normal((1, HI, DI)).astype(np.float32)
    q = rng.standard_normal((1, HQ, D)).astype(np.float32)
    nv = np.array([L])
    _, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, np.array([0]), nv, 3, RATIO, 16, TOPK)
    assert sorted(sel[0].tolist()) == [0, 1, 2]
    out = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, np.array([0]), nv,
                                   sel, RATIO, 16, D ** -0.5)
    assert rel_err(out[0], dense_attention(q[0], K[0], V[0], list(range(L)), D ** -0.5)) < TOL, seed


def test_token_slots_any_page_size():
    seed, rng = seeded_rng()
    for ps in (1, 3, 16, 64):
        pool = Pool(rng, [50, 7], ps, {})
        rows = np.array([0, 0, 1, 1])
        pos = np.array([0, 49, 0, 6])
        got = qsa.token_slots(pool.block_tables, rows, pos, ps)
        assert got.tolist() == [int(pool.slots(r, [p])[0]) for r, p in zip(rows, pos)], seed


def test_seq_kernel_limits_stated_and_enforced():
    from reference.config import ConfigError
    from engine.kernels.seq_limits import seq_kernel_limits
    from tests.reference_helpers import tiny_config
    # the shipped model's QSA numbers: budget 2048 / ratio 4 at 262144 positions
    lim = seq_kernel_limits(tiny_config(indexer_budget=2048, indexer_compress_ratio=4, max_position_embeddings=262144))
    assert lim["block_topk"] == 512 and lim["max_blocks"] == 65536 and lim["max_attended_tokens"] == 2051
    assert lim["max_blocks"] <= lim["max_scored_blocks"] and lim["block_topk"] <= lim["max_block_topk"]
    with pytest.raises(ConfigError, match="block_topk=8192"):
        seq_kernel_limits(tiny_config(indexer_budget=32768, indexer_compress_ratio=4))
    with pytest.raises(ConfigError, match="linear_conv_kernel_dim"):
        seq_kernel_limits(tiny_config(linear_conv_kernel_dim=40))
    assert seq_kernel_limits(tiny_config(linear_conv_kernel_dim=40), gpu=False)["conv_state_rows"] == 39


# ------------------------------------------------------------------------------------------------ split-kernel twins
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_qsa_write_tokens_twin_is_the_slot_rule_and_catches_a_wrong_position(page_size):
    """qsa_write_tokens (NumPy twin of the one-launch token write): each row lands at
    ``block_tables[row, pos // page] * page + pos % page``, n_visible = pos + 1, and block keys (when asked) equal
    a separate qsa_block_keys call; a token written one position late is caught at exactly two slots."""
    rng = np.random.default_rng(11)
    lengths = [40, 9]
    pool = Pool(rng, lengths, page_size, {"idx_k": (8,), "blk_k": (8,), "kv_k": (2, 4), "kv_v": (2, 4)})
    rows, pos = np.array([0, 1]), np.array([35, 7])  # both complete a block of 4
    src = rng.standard_normal((2, 12)).astype(np.float32)
    k_src = rng.standard_normal((2, 2, 4)).astype(np.float32)
    v_src = rng.standard_normal((2, 2, 4)).astype(np.float32)
    w, invf = (rng.standard_normal(8) * 0.3).astype(np.float32), np.array([1.0, 0.1], np.float32)
    a = {k: v.copy() for k, v in pool.arrays.items()}
    nv = qsa.qsa_write_tokens(a["idx_k"], a["kv_k"], a["kv_v"], pool.block_tables, rows, pos, src[:, 4:], k_src,
                              v_src, page_size, block_keys=(a["blk_k"], w, invf, 4, 4, 1e-6))
    assert nv.tolist() == [36, 8]
    b = {k: v.copy() for k, v in pool.arrays.items()}
    for t in range(2):
        sl = pool.slots(int(rows[t]), [int(pos[t])])[0]
        b["idx_k"][sl], b["kv_k"][sl], b["kv_v"][sl] = src[t, 4:], k_src[t], v_src[t]
    qsa.qsa_block_keys(b["idx_k"], b["blk_k"], pool.block_tables, rows, pos, w, invf, 4, 4, page_size, 1e-6)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    c = {k: v.copy() for k, v in pool.arrays.items()}
    qsa.qsa_write_tokens(c["idx_k"], c["kv_k"], c["kv_v"], pool.block_tables, rows, pos + np.array([1, 0]), src[:, 4:],
                         k_src, v_src, page_size)
    diff = np.nonzero(np.any(c["kv_k"].reshape(len(c["kv_k"]), -1) != b["kv_k"].reshape(len(b["kv_k"]), -1), axis=1))[0]
    assert diff.tolist() == sorted(int(pool.slots(0, [p])[0]) for p in (35, 36))
    with pytest.raises(qsa.InputError, match="no page"):
        qsa.qsa_write_tokens(c["idx_k"], c["kv_k"], c["kv_v"], pool.block_tables, rows, np.array([35, -(-9 // page_size) * page_size]),
                             src[:, 4:], k_src, v_src, page_size)


def test_gdn_decode_with_fused_gates_twin_equals_gates_then_decode():
    rng = np.random.default_rng(12)
    B, Hk, Hv, Dk, Dv = 3, 2, 4, 8, 8
    q, k = (rng.standard_normal((B, Hk, Dk)).astype(np.float32) for _ in range(2))
    v = rng.standard_normal((B, Hv, Dv)).astype(np.float32)
    a, b = (rng.standard_normal((B, Hv)).astype(np.float32) for _ in range(2))
    A_log, dtb = (rng.standard_normal(Hv).astype(np.float32) for _ in range(2))
    state = rng.standard_normal((5, Hv, Dk, Dv)).astype(np.float32)
    slots = np.array([4, 0, 2])
    s1, s2 = state.copy(), state.copy()
    o1 = gdn.gated_delta_decode_gates(q, k, v, a, b, A_log, dtb, s1, slots)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    o2 = gdn.gated_delta_decode(q, k, v, gg, bb, s2, slots)
    assert np.array_equal(o1, o2) and np.array_equal(s1, s2)
    s3 = state.copy()  # negative control: gates of a shifted b are caught
    o3 = gdn.gated_delta_decode_gates(q, k, v, a, b + 1.0, A_log, dtb, s3, slots)
    assert rel_err(o3, o2) > 1e-2
