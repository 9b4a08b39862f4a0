"""QSA: block keys, index scores, top-k, sparse attention, token writes and head prep (engine/kernels/qsa.py) on
the CPU and on CUDA (prefill and the split decode kernels, contexts 1025 and 8192, batch 1 and 16), and the sequence
kernels' limits. How the sequence kernels are judged: tests/kernels_seq_common.py.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from engine.kernels import gdn, qsa
from tests.kernels_seq_common import (TOL, Pool, canonical_topk, dense_attention, dense_block_keys, dense_scores,
                                      gdn_inputs, seeded_rng, split_dispatch, rel_err)
from op_devices import cp, on_cuda
from op_helpers import g, no_poison

# the gpu marker, a skip without cupy / a GPU, and poisoned_allocations (conftest.py) before every CUDA test
cuda = on_cuda("poisoned_allocations")


# ------------------------------------------------------------------------------------------------ QSA
# the CPU tests' problem sizes (the CUDA tests': the real model's, below; RATIO, HKV and EPS are the same)
RATIO, TOPK_SMALL, DI_SMALL, HI_SMALL, HQ_SMALL, HKV, D_SMALL, ROT_SMALL, EPS = 4, 3, 16, 2, 4, 2, 16, 8, 1e-6


def _qsa_problem(rng, lengths, page_size):
    pool = Pool(rng, lengths, page_size,
                {"idx_k": (DI_SMALL,), "blk_k": (DI_SMALL,), "kv_k": (HKV, D_SMALL), "kv_v": (HKV, D_SMALL)})
    raw = [rng.standard_normal((L, DI_SMALL)).astype(np.float32) for L in lengths]
    K = [rng.standard_normal((L, HKV, D_SMALL)).astype(np.float32) for L in lengths]
    V = [rng.standard_normal((L, HKV, D_SMALL)).astype(np.float32) for L in lengths]
    for r, L in enumerate(lengths):
        sl = pool.slots(r, np.arange(L))
        pool.arrays["idx_k"][sl] = raw[r]
        pool.arrays["kv_k"][sl] = K[r]
        pool.arrays["kv_v"][sl] = V[r]
    w = (rng.standard_normal(DI_SMALL) * 0.3).astype(np.float32)
    invf = (1.0 / 1e4 ** (np.arange(0, ROT_SMALL, 2) / ROT_SMALL)).astype(np.float32)
    return pool, raw, K, V, w, invf


def _write_block_keys(ops, pool, lengths, w, invf, split):
    """Block keys written the way the engine does: a prefill chunk [0, split) then one token per step."""
    rows = np.concatenate([np.full(min(split, L), r) for r, L in enumerate(lengths)])
    pos = np.concatenate([np.arange(min(split, L)) for L in lengths])
    ops.qsa_block_keys(pool.arrays["idx_k"], pool.arrays["blk_k"], pool.block_tables, rows, pos, w, invf, ROT_SMALL,
                       RATIO, pool.page_size, EPS)
    for p in range(split, max(lengths)):
        rr = np.array([r for r, L in enumerate(lengths) if p < L])
        if rr.size:
            ops.qsa_block_keys(pool.arrays["idx_k"], pool.arrays["blk_k"], pool.block_tables, rr,
                               np.full(rr.size, p), w, invf, ROT_SMALL, RATIO, pool.page_size, EPS)


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_qsa_pipeline_matches_dense_any_page_size(page_size):
    seed, rng = seeded_rng()
    lengths = [37, 2, 70]
    pool, raw, K, V, w, invf = _qsa_problem(rng, lengths, page_size)
    _write_block_keys(qsa, pool, lengths, w, invf, split=21)
    # block keys at block-end slots
    for r, L in enumerate(lengths):
        ref_keys = dense_block_keys(raw[r], w, invf, ROT_SMALL, RATIO, EPS)
        got = pool.arrays["blk_k"][pool.slots(r, np.arange(L // RATIO) * RATIO + RATIO - 1)]
        assert rel_err(got, ref_keys) < TOL, (seed, r)
    # queries: every position of every sequence, one call (prefill and decode use the same op)
    rows = np.concatenate([np.full(L, r) for r, L in enumerate(lengths)])
    pos = np.concatenate([np.arange(L) for L in lengths])
    nv = pos + 1
    qi = rng.standard_normal((len(pos), HI_SMALL, DI_SMALL)).astype(np.float32)
    nb = int(nv.max() // RATIO)
    scores, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, rows, nv, nb, RATIO, page_size,
                                 TOPK_SMALL)
    q = rng.standard_normal((len(pos), HQ_SMALL, D_SMALL)).astype(np.float32)
    out = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, rows, nv, sel,
                                   RATIO, page_size, D_SMALL ** -0.5)
    dense = np.full(scores.shape, -np.inf)
    for t in range(len(pos)):
        r, n = int(rows[t]), int(nv[t])
        keys = dense_block_keys(raw[r][:n], w, invf, ROT_SMALL, RATIO, EPS)
        dense[t, :len(keys)] = dense_scores(qi[t], keys) if len(keys) else np.zeros(0)
    # one comparison over all finite scores: a single small score (relu-sum cancellation) is judged against the
    # scale of the whole matrix, not against itself
    fin = np.isfinite(dense)
    assert np.array_equal(np.isfinite(scores), fin) and rel_err(scores[fin], dense[fin]) < TOL, seed
    for t in range(len(pos)):
        r, n = int(rows[t]), int(nv[t])
        rs = scores[t, :n // RATIO]  # the canonical order is checked on the op's own scores
        top = canonical_topk(rs, TOPK_SMALL)
        assert sel[t, :len(top)].tolist() == top and np.all(sel[t, len(top):] == -1), (seed, t)
        toks = [b * RATIO + j for b in top for j in range(RATIO)] + list(range(n // RATIO * RATIO, n))
        assert rel_err(out[t], dense_attention(q[t], K[r], V[r], toks, D_SMALL ** -0.5)) < TOL, (seed, t)


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
    q = rng.standard_normal((1, HQ_SMALL, D_SMALL)).astype(np.float32)
    qi = rng.standard_normal((1, HI_SMALL, DI_SMALL)).astype(np.float32)
    scores, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, rows, nv, 7, RATIO, 3, TOPK_SMALL)
    args = (pool.arrays["kv_k"], pool.arrays["kv_v"])
    good = qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, nv, sel, RATIO, 3, D_SMALL ** -0.5)
    # a stale (garbage) page in the block table: under the top block's last token (its block key) for the
    # scores, under its first token (K/V) for the attention
    spare = sorted(set(range(pool.num_pages)) - set(pool.block_tables[pool.block_tables >= 0].tolist()))[0]
    top = int(sel[0, 0])
    bt = pool.block_tables.copy()
    bt[0, (top * RATIO + RATIO - 1) // 3] = spare
    s2, _ = qsa.qsa_select(qi, pool.arrays["blk_k"], bt, rows, nv, 7, RATIO, 3, TOPK_SMALL)
    assert rel_err(s2, scores) > 1e-2, seed
    bt = pool.block_tables.copy()
    bt[0, top * RATIO // 3] = spare
    assert rel_err(qsa.qsa_sparse_attention(q, *args, bt, rows, nv, sel, RATIO, 3, D_SMALL ** -0.5), good) > 1e-2, seed
    assert rel_err(qsa.qsa_sparse_attention(q[:, ::-1].copy(), *args, pool.block_tables, rows, nv, sel, RATIO, 3,
                                            D_SMALL ** -0.5)[:, ::-1], good) > 1e-2, seed
    # dropped tail: 30 visible = 7 blocks + 2 tail tokens; pretending 28 visible drops them
    assert rel_err(qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, np.array([28]), sel, RATIO, 3,
                                            D_SMALL ** -0.5), good) > 1e-3, seed
    # the tail is always visible: a huge value on the last token dominates the output
    pool.arrays["kv_v"][pool.slots(0, [29])] = 1e4
    big = qsa.qsa_sparse_attention(q, *args, pool.block_tables, rows, nv, sel, RATIO, 3, D_SMALL ** -0.5)
    assert np.abs(big).max() > 10 * np.abs(good).max(), seed


def test_qsa_all_blocks_selected_below_budget_is_full_causal_attention():
    seed, rng = seeded_rng()
    L = 14  # 3 complete blocks <= TOPK_SMALL: every token visible
    pool, raw, K, V, w, invf = _qsa_problem(rng, [L], 16)
    _write_block_keys(qsa, pool, [L], w, invf, split=L)
    qi = rng.standard_normal((1, HI_SMALL, DI_SMALL)).astype(np.float32)
    q = rng.standard_normal((1, HQ_SMALL, D_SMALL)).astype(np.float32)
    nv = np.array([L])
    _, sel = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, np.array([0]), nv, 3, RATIO, 16, TOPK_SMALL)
    assert sorted(sel[0].tolist()) == [0, 1, 2]
    out = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, np.array([0]), nv,
                                   sel, RATIO, 16, D_SMALL ** -0.5)
    assert rel_err(out[0], dense_attention(q[0], K[0], V[0], list(range(L)), D_SMALL ** -0.5)) < TOL, seed


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


# ------------------------------------------------------------------------------------------------ QSA
RATIO, TOPK, DI, HI, HQ, HKV, D, ROT, EPS = 4, 512, 128, 4, 24, 2, 256, 64, 1e-6


@cuda
@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_qsa_cuda_matches_twin_and_dense_any_page_size(page_size):
    seed, rng = seeded_rng()
    lengths = [2600, 9, 2100]  # 650 blocks > TOPK (selection active), 2 blocks, 525 blocks
    pool = Pool(rng, lengths, page_size, {"idx_k": (DI,), "blk_k": (DI,), "kv_k": (HKV, D), "kv_v": (HKV, D)})
    w = (rng.standard_normal(DI) * 0.3).astype(np.float32)
    invf = (1.0 / 1e7 ** (np.arange(0, ROT, 2) / ROT)).astype(np.float32)
    for r, L in enumerate(lengths):
        sl = pool.slots(r, np.arange(L))
        pool.arrays["idx_k"][sl] = rng.standard_normal((L, DI))
        pool.arrays["kv_k"][sl] = rng.standard_normal((L, HKV, D))
        pool.arrays["kv_v"][sl] = rng.standard_normal((L, HKV, D))
    dev = {k: g(v) for k, v in pool.arrays.items()}
    bt = g(pool.block_tables)
    rows = np.concatenate([np.full(L, r) for r, L in enumerate(lengths)])
    pos = np.concatenate([np.arange(L) for L in lengths])
    qsa.qsa_block_keys(dev["idx_k"], dev["blk_k"], bt, g(rows), g(pos), g(w), g(invf), ROT, RATIO, page_size, EPS)
    qsa.qsa_block_keys(pool.arrays["idx_k"], pool.arrays["blk_k"], pool.block_tables, rows, pos, w, invf, ROT,
                       RATIO, page_size, EPS)
    assert rel_err(dev["blk_k"].get(), pool.arrays["blk_k"]) < TOL, seed
    # queries: last positions (decode-like) and a few mid-sequence (prefill-like), one launch each op
    qr = np.array([0, 0, 0, 1, 1, 2, 2])
    qp = np.array([2599, 2048, 17, 8, 3, 2099, 2051])
    nv = qp + 1
    qi = rng.standard_normal((len(qp), HI, DI)).astype(np.float32)
    q = rng.standard_normal((len(qp), HQ, D)).astype(np.float32)
    nb = int(nv.max() // RATIO)
    s_d, sel_d = qsa.qsa_select(g(qi), dev["blk_k"], bt, g(qr), g(nv), nb, RATIO, page_size, TOPK)
    s_t, sel_t = qsa.qsa_select(qi, pool.arrays["blk_k"], pool.block_tables, qr, nv, nb, RATIO, page_size, TOPK)
    assert no_poison(s_d) and no_poison(sel_d), seed
    fin = np.isfinite(s_t)
    assert np.array_equal(np.isfinite(s_d.get()), fin) and rel_err(s_d.get()[fin], s_t[fin]) < TOL, seed
    # selections equal up to genuine near-ties (scores within 1e-5 relative of the k-th best)
    sd, st = sel_d.get(), sel_t
    for t in range(len(qp)):
        if not np.array_equal(sd[t], st[t]):
            diff = set(sd[t].tolist()) ^ set(st[t].tolist())
            kth = s_t[t][st[t][st[t] >= 0][-1]]
            assert all(abs(s_t[t][i] - kth) <= 1e-5 * abs(kth) for i in diff if i >= 0), (seed, t)
    # top-k of the device's own scores must be exactly the canonical order
    for t in range(len(qp)):
        n = int(nv[t]) // RATIO
        ref = canonical_topk(s_d.get()[t, :n], TOPK)
        assert sd[t, :len(ref)].tolist() == ref and np.all(sd[t, len(ref):] == -1), (seed, t)
    out = qsa.qsa_sparse_attention(g(q), dev["kv_k"], dev["kv_v"], bt, g(qr), g(nv), sel_d, RATIO, page_size,
                                   D ** -0.5)
    tout = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, qr, nv, sd,
                                    RATIO, page_size, D ** -0.5)
    assert no_poison(out) and rel_err(out.get(), tout) < TOL, seed
    # float64 dense truth for one selecting query and one short one
    for t in (0, 3):
        r, n = int(qr[t]), int(nv[t])
        sl = pool.slots(r, np.arange(lengths[r]))
        K, V = pool.arrays["kv_k"][sl], pool.arrays["kv_v"][sl]
        blocks = [int(b) for b in sd[t] if b >= 0]
        toks = [b * RATIO + j for b in blocks for j in range(RATIO)] + list(range(n // RATIO * RATIO, n))
        assert rel_err(out[t].get(), dense_attention(q[t], K, V, toks, D ** -0.5)) < TOL, seed
    # negative control: perturbing one selected token's value is caught; a wrong twin (swapped heads) is caught
    b0 = int(sd[0, 0])
    dev["kv_v"][int(pool.slots(0, [b0 * RATIO])[0])] += 5.0
    bad = qsa.qsa_sparse_attention(g(q), dev["kv_k"], dev["kv_v"], bt, g(qr), g(nv), sel_d, RATIO, page_size,
                                   D ** -0.5)
    assert rel_err(bad.get()[0], tout[0]) > 1e-3, seed
    assert rel_err(out.get(), tout[:, ::-1]) > 1e-2, seed


@cuda
def test_qsa_topk_cuda_ties_exact_and_wrong_tiebreak_caught():
    seed, rng = seeded_rng()
    NB = 20000
    scores = rng.choice(np.array([0.0, 0.25, 1.0, 3.0], np.float32), size=(5, NB))
    scores[1] = 2.0
    scores[2, :100] = -0.0
    nv = np.array([NB * RATIO, NB * RATIO + 3, 401 * RATIO, 100 * RATIO, 0])
    got = qsa.qsa_topk(g(scores), g(nv), RATIO, TOPK).get()
    twin = qsa.qsa_topk(scores, nv, RATIO, TOPK)
    assert np.array_equal(got, twin), seed
    assert got[1].tolist() == list(range(TOPK)) and np.all(got[4] == -1), seed
    assert np.all(got[3, 100:] == -1) and sorted(got[3, :100].tolist()) == list(range(100)), seed
    wrong = sorted(range(NB), key=lambda i: (-float(scores[0, i]), -i))[:TOPK]
    assert wrong != got[0].tolist(), seed


@cuda
def test_seq_kernels_timing_summary(capsys):
    """Not a pass/fail benchmark: prints per-op device time at real widths (batch 1 and 16) for the report."""
    seed, rng = seeded_rng()
    res = {}

    def timeit(name, fn, n=20):
        fn()
        cp.cuda.Device().synchronize()
        e0, e1 = cp.cuda.Event(), cp.cuda.Event()
        e0.record()
        for _ in range(n):
            fn()
        e1.record()
        e1.synchronize()
        res[name] = cp.cuda.get_elapsed_time(e0, e1) / n * 1e3

    for B in (1, 16):
        q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, B, S=B)
        gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
        args = [g(x) for x in (q, k, v, gg, bb)]
        dst, sl = g(state), g(np.arange(B))
        timeit(f"gdn_decode B={B}", lambda: gdn.gated_delta_decode(*args, dst, sl))
        cs = cp.zeros((B, 3, 10240), cp.float32)
        xw, ww = g(rng.standard_normal((B, 10240)).astype(np.float32)), g(rng.standard_normal((10240, 4)).astype(np.float32))
        timeit(f"conv_decode B={B}", lambda: gdn.causal_conv_decode(xw, ww, cs, sl))
        L = 65536 * RATIO // 4  # 65536 visible tokens per sequence -> 16384 blocks
        nbk = L // RATIO
        blk = g(rng.standard_normal((L, DI)).astype(np.float32))
        kv = g(rng.standard_normal((L, HKV, D)).astype(np.float32))
        bt = g(np.tile(np.arange(L // 16, dtype=np.int32), (B, 1)))
        rows, nv = g(np.arange(B)), g(np.full(B, L))
        qi, qq = g(rng.standard_normal((B, HI, DI)).astype(np.float32)), g(rng.standard_normal((B, HQ, D)).astype(np.float32))
        timeit(f"qsa_scores nb={nbk} B={B}", lambda: qsa.qsa_index_scores(qi, blk, bt, rows, nv, nbk, RATIO, 16))
        sc = qsa.qsa_index_scores(qi, blk, bt, rows, nv, nbk, RATIO, 16)
        timeit(f"qsa_topk nb={nbk} k={TOPK} B={B}", lambda: qsa.qsa_topk(sc, nv, RATIO, TOPK))
        sel = qsa.qsa_topk(sc, nv, RATIO, TOPK)
        timeit(f"qsa_attention 2048 tok B={B}", lambda: qsa.qsa_sparse_attention(qq, kv, kv, bt, rows, nv, sel, RATIO,
                                                                                 16, D ** -0.5))
    T = 2048
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, T, S=1)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    args = [g(x) for x in (q, k, v, gg, bb)]
    dst = g(state)
    t0 = time.perf_counter()
    timeit(f"gdn_prefill_chunked T={T}", lambda: gdn.gated_delta_prefill(*args, dst, 0, 64, algorithm="chunked"),
           n=3)
    timeit(f"gdn_prefill_recurrent T={T}", lambda: gdn.gated_delta_recurrent(*args, dst, g(np.array([0])),
                                                                             g(np.array([0, T]))), n=3)
    qp = g(rng.standard_normal((512, HQ, D)).astype(np.float32))
    selp = cp.tile(sel[:1], (512, 1))
    rp, nvp = g(np.zeros(512, np.int64)), g(np.full(512, L))
    timeit("qsa_attention prefill T=512", lambda: qsa.qsa_sparse_attention(qp, kv, kv, bt, rp, nvp, selp, RATIO, 16,
                                                                           D ** -0.5), n=3)
    with capsys.disabled():
        print("\nSEQ-KERNEL TIMINGS (us per call): " + "; ".join(f"{k}: {v:.1f}" for k, v in res.items()))
    assert all(v > 0 for v in res.values()) and time.perf_counter() - t0 > 0


@pytest.fixture
def impl(monkeypatch):
    """impl('prefill') / impl('split'): the kernels decode-sized calls take (kernels_seq_common.split_dispatch)."""
    return split_dispatch(monkeypatch)


def _fill(rng, pool, lengths, names):
    """Unit-normal values at every sequence token's slot (the Pool's garbage, x50, stays elsewhere): a softmax that
    spreads over many tokens, so that one wrong block moves the output measurably."""
    for r, L in enumerate(lengths):
        sl = pool.slots(r, np.arange(L))
        for n in names:
            pool.arrays[n][sl] = rng.standard_normal((L,) + pool.arrays[n].shape[1:])


def _selection(rng, nv, k):
    """A valid selection row per query: min(k, nc) distinct complete blocks in a random order, -1 padded."""
    sel = np.full((len(nv), k), -1, np.int32)
    for t, n in enumerate(nv):
        nc = int(n) // RATIO
        kk = min(k, nc)
        sel[t, :kk] = rng.permutation(nc)[:kk]
    return sel


# ------------------------------------------------------------------------------------------------ attention
@cuda
@pytest.mark.parametrize("page_size", [3, 16])
def test_split_attention_matches_prefill_kernel_twin_dense_and_catches_a_wrong_block(page_size, impl):
    seed, rng = seeded_rng()
    lengths = [1025, 8192, 9, 2051]
    pool = Pool(rng, lengths, page_size, {"kv_k": (HKV, D), "kv_v": (HKV, D)})
    _fill(rng, pool, lengths, ("kv_k", "kv_v"))
    dev = {k: g(v) for k, v in pool.arrays.items()}
    bt = g(pool.block_tables)
    # batch 1 (decode at 1025 and at 8192), a batch of 16 (decode rows + verify-like mid positions)
    # and a prefill chunk: 300 consecutive queries of one sequence (the split kernel serves prefill too)
    cases = [(np.array([0]), np.array([1024])), (np.array([1]), np.array([8191])),
             (np.full(300, 3), np.arange(1751, 2051)),
             (np.array([0, 1, 2, 3, 1, 1, 0, 3, 2, 1, 0, 1, 3, 1, 0, 1]),
              np.array([1024, 8191, 8, 2050, 8190, 4003, 17, 2047, 3, 2048, 1023, 2049, 0, 7, 1, 6000]))]
    for rows, qp in cases:
        nv = qp + 1
        T = len(qp)
        q = rng.standard_normal((T, HQ, D)).astype(np.float32)
        sel = _selection(rng, nv, TOPK)
        nb = int(nv.max()) // RATIO
        twin = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, rows, nv,
                                        sel, RATIO, page_size, D ** -0.5)
        outs = {}
        # hints: none (the selection's capacity), the true bound, and one far too small (the last split takes the rest)
        for name, hint in (("prefill", None), ("split", None), ("split", nb), ("split", 1)):
            impl(name)
            o = qsa.qsa_sparse_attention(g(q), dev["kv_k"], dev["kv_v"], bt, g(rows), g(nv), g(sel), RATIO,
                                         page_size, D ** -0.5, n_blocks=hint)
            assert no_poison(o), (seed, name, hint)
            outs[(name, hint)] = o.get()
            assert rel_err(outs[(name, hint)], twin) < TOL, (seed, name, hint, T)
        assert rel_err(outs[("split", None)], outs[("prefill", None)]) < TOL, seed
        # float64 dense truth on the first query
        t = 0
        sl = pool.slots(int(rows[t]), np.arange(lengths[int(rows[t])]))
        toks = [int(b) * RATIO + j for b in sel[t] if b >= 0 for j in range(RATIO)] + \
            list(range(int(nv[t]) // RATIO * RATIO, int(nv[t])))
        ref = dense_attention(q[t], pool.arrays["kv_k"][sl], pool.arrays["kv_v"][sl], toks, D ** -0.5)
        assert rel_err(outs[("split", nb)][t], ref) < TOL, seed
    # negative control: a wrong block picked for one query of the batch is caught, and located at that query
    t_bad = 5
    bad = sel.copy()
    nc = int(nv[t_bad]) // RATIO
    unused = sorted(set(range(nc)) - set(bad[t_bad].tolist()))
    bad[t_bad, 7] = unused[0]
    impl("split")
    ob = qsa.qsa_sparse_attention(g(q), dev["kv_k"], dev["kv_v"], bt, g(rows), g(nv), g(bad), RATIO, page_size,
                                  D ** -0.5).get()
    per_query = [rel_err(ob[t], twin[t]) for t in range(T)]
    assert max(per_query) > 1e-3, (seed, per_query)
    assert int(np.argmax(per_query)) == t_bad and sorted(per_query)[-2] < TOL, (seed, per_query)


@cuda
def test_split_attention_reads_the_valid_prefix_of_the_selection_row(impl):
    """A selection hook may hand a row whose valid blocks stop at the first -1 (qsa.cu's valid-prefix rule):
    entries after it are ignored by both kernels; the twin gets the row truncated there."""
    seed, rng = seeded_rng()
    lengths = [1025]
    pool = Pool(rng, lengths, 16, {"kv_k": (HKV, D), "kv_v": (HKV, D)})
    _fill(rng, pool, lengths, ("kv_k", "kv_v"))
    dev = {k: g(v) for k, v in pool.arrays.items()}
    rows, nv = np.array([0, 0]), np.array([1025, 1025])
    q = rng.standard_normal((2, HQ, D)).astype(np.float32)
    sel = _selection(rng, nv, TOPK)
    sel[0, 5] = -1  # blocks 6.. of row 0 must be ignored
    trunc = sel.copy()
    trunc[0, 5:] = -1
    twin = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, rows, nv, trunc,
                                    RATIO, 16, D ** -0.5)
    got = {}
    for name in ("prefill", "split"):
        impl(name)
        got[name] = qsa.qsa_sparse_attention(g(q), dev["kv_k"], dev["kv_v"], g(pool.block_tables), g(rows), g(nv),
                                             g(sel), RATIO, 16, D ** -0.5).get()
        assert rel_err(got[name], twin) < TOL, (seed, name)
    full = qsa.qsa_sparse_attention(q, pool.arrays["kv_k"], pool.arrays["kv_v"], pool.block_tables, rows, nv,
                                    np.where(sel >= 0, sel, -1), RATIO, 16, D ** -0.5)
    assert rel_err(got["split"][0], full[0]) > 1e-3, seed  # the rule matters: reading past the -1 is caught


# ------------------------------------------------------------------------------------------------ top-k
@cuda
def test_split_topk_exact_equals_twin_and_canonical_order_and_locates_a_perturbed_score(impl):
    seed, rng = seeded_rng()
    NB = 20000
    scores = rng.choice(np.array([0.0, 0.25, 1.0, 3.0], np.float32), size=(9, NB))
    scores[1] = 2.0                      # all tied
    scores[2, :100] = -0.0               # -0 ties +0
    scores[5] = rng.standard_normal(NB).astype(np.float32)
    scores[6, :] = -np.inf
    scores[6, :600] = rng.choice(np.array([1.0, 2.0], np.float32), size=600)
    scores[7] = np.repeat(rng.standard_normal(NB // 40).astype(np.float32), 40)  # runs of 40 equal scores
    nv = np.array([NB * RATIO, NB * RATIO + 3, 401 * RATIO, 100 * RATIO, 0, 2048 * RATIO + 1, 600 * RATIO,
                   NB * RATIO, 513 * RATIO])
    twin = qsa.qsa_topk(scores, nv, RATIO, TOPK)
    got = {}
    for name in ("split",):
        impl(name)
        got[name] = qsa.qsa_topk(g(scores), g(nv), RATIO, TOPK).get()
        assert np.array_equal(got[name], twin), (seed, name)
    for t in range(len(nv)):
        n = min(int(nv[t]) // RATIO, NB)
        ref = canonical_topk(scores[t, :n], TOPK)
        assert got["split"][t, :len(ref)].tolist() == ref and np.all(got["split"][t, len(ref):] == -1), (seed, t)
    # negative control: lowering one selected block's score below every other drops exactly that block (located)
    t = 5
    victim = int(got["split"][t, 10])
    pert = scores.copy()
    pert[t, victim] = -1e30
    impl("split")
    gp = qsa.qsa_topk(g(pert), g(nv), RATIO, TOPK).get()
    dropped = set(got["split"][t].tolist()) - set(gp[t].tolist())
    assert dropped == {victim}, (seed, dropped)
    assert all(np.array_equal(gp[u], got["split"][u]) for u in range(len(nv)) if u != t), seed


# ------------------------------------------------------------------------------------------------ block keys, token write
@cuda
@pytest.mark.parametrize("page_size", [1, 3, 16])
def test_split_block_keys_and_fused_token_write(page_size, impl):
    seed, rng = seeded_rng()
    lengths = [1025, 8192, 9]
    pool = Pool(rng, lengths, page_size, {"idx_k": (DI,), "blk_k": (DI,), "kv_k": (HKV, D), "kv_v": (HKV, D)})
    _fill(rng, pool, lengths, ("idx_k",))
    w = (rng.standard_normal(DI) * 0.3).astype(np.float32)
    invf = (1.0 / 1e7 ** (np.arange(0, ROT, 2) / ROT)).astype(np.float32)
    bt = g(pool.block_tables)
    # block keys over a prefill-like token set (every position of rows 0 and 2)
    rows = np.concatenate([np.zeros(1025, np.int64), np.full(9, 2)])
    pos = np.concatenate([np.arange(1025), np.arange(9)])
    keys = {}
    for name in ("split",):
        impl(name)
        d = g(pool.arrays["blk_k"])
        qsa.qsa_block_keys(g(pool.arrays["idx_k"]), d, bt, g(rows), g(pos), g(w), g(invf), ROT, RATIO, page_size, EPS)
        keys[name] = d.get()
    tw = pool.arrays["blk_k"].copy()
    qsa.qsa_block_keys(pool.arrays["idx_k"], tw, pool.block_tables, rows, pos, w, invf, ROT, RATIO, page_size, EPS)
    # compared where keys were written (the pool's x50 garbage elsewhere must stay untouched, exactly)
    done = np.concatenate([pool.slots(int(r_), [int(p_)]) for r_, p_ in zip(rows, pos) if (p_ + 1) % RATIO == 0])
    rest = np.setdiff1d(np.arange(len(tw)), done)
    for name in ("split",):
        assert rel_err(keys[name][done], tw[done]) < TOL and np.array_equal(keys[name][rest], tw[rest]), (seed, name)
    # the fused decode write: one token per row, at block-completing and non-completing positions
    rows_d, pos_d = np.array([0, 1, 2]), np.array([1023, 8190, 7])  # 1024 % 4 == 0 completes; 8191 does not
    src = rng.standard_normal((3, 640)).astype(np.float32)
    isrc = src[:, 512:]  # a strided column slice, like the fused in_proj's indexer-key columns
    ksrc = rng.standard_normal((3, HKV, D)).astype(np.float32)
    vsrc = rng.standard_normal((3, HKV, D)).astype(np.float32)
    devs = {k: g(v) for k, v in pool.arrays.items()}
    impl("split")
    n_vis = qsa.qsa_write_tokens(devs["idx_k"], devs["kv_k"], devs["kv_v"], bt, g(rows_d), g(pos_d), g(src)[:, 512:],
                                 g(ksrc), g(vsrc), page_size, block_keys=(devs["blk_k"], g(w), g(invf), ROT, RATIO, EPS))
    twin = {k: v.copy() for k, v in pool.arrays.items()}
    tn = qsa.qsa_write_tokens(twin["idx_k"], twin["kv_k"], twin["kv_v"], pool.block_tables, rows_d, pos_d, isrc, ksrc,
                              vsrc, page_size, block_keys=(twin["blk_k"], w, invf, ROT, RATIO, EPS))
    assert np.array_equal(n_vis.get(), tn) and np.array_equal(tn, pos_d + 1), seed
    for k in ("idx_k", "kv_k", "kv_v"):
        assert np.array_equal(devs[k].get(), twin[k]), (seed, k)
    done = np.concatenate([pool.slots(int(r_), [int(p_)]) for r_, p_ in zip(rows_d, pos_d) if (p_ + 1) % RATIO == 0])
    assert len(done) == 2 and rel_err(devs["blk_k"].get()[done], twin["blk_k"][done]) < TOL, seed
    assert np.array_equal(np.delete(devs["blk_k"].get(), done, 0), np.delete(twin["blk_k"], done, 0)), seed
    # the fused block key equals the block-key kernel run after a plain write: to float32 rounding at the written
    # slots (the two kernels reduce the block's RMS norm in different orders; TOL, this file's kernel-vs-kernel
    # float32 tolerance, ~170 unit roundoffs), exactly everywhere else (nothing else is written)
    impl("prefill")
    ref = {k: g(v) for k, v in pool.arrays.items()}
    qsa.qsa_write_tokens(ref["idx_k"], ref["kv_k"], ref["kv_v"], bt, g(rows_d), g(pos_d), g(isrc), g(ksrc), g(vsrc),
                         page_size)
    qsa.qsa_block_keys(ref["idx_k"], ref["blk_k"], bt, g(rows_d), g(pos_d), g(w), g(invf), ROT, RATIO, page_size, EPS)
    assert rel_err(devs["blk_k"].get()[done], ref["blk_k"].get()[done]) < TOL, seed
    assert np.array_equal(np.delete(devs["blk_k"].get(), done, 0), np.delete(ref["blk_k"].get(), done, 0)), seed
    # negative control: a token written one position late is caught and located at exactly two slots
    impl("split")
    bad = {k: g(v) for k, v in pool.arrays.items()}
    qsa.qsa_write_tokens(bad["idx_k"], bad["kv_k"], bad["kv_v"], bt, g(rows_d), g(pos_d + np.array([0, 1, 0])),
                         g(isrc), g(ksrc), g(vsrc), page_size)
    diff = np.nonzero(np.any(bad["kv_k"].get().reshape(len(twin["kv_k"]), -1) != twin["kv_k"].reshape(len(twin["kv_k"]), -1),
                             axis=1))[0]
    want = sorted(int(pool.slots(1, [p])[0]) for p in (8190, 8191))
    assert diff.tolist() == want, (seed, diff.tolist(), want)


# ------------------------------------------------------------------------------------------------ graphs, determinism
@cuda
def test_split_kernels_capture_in_a_cuda_graph_and_are_deterministic(impl):
    """The decode ops capture (no host sync), replay equal to the eager run bitwise, and repeat bitwise."""
    seed, rng = seeded_rng()
    impl("split")
    lengths = [8192] * 4
    pool = Pool(rng, lengths, 16, {"kv_k": (HKV, D), "kv_v": (HKV, D)})
    _fill(rng, pool, lengths, ("kv_k", "kv_v"))
    dev = {k: g(v) for k, v in pool.arrays.items()}
    rows, nv = g(np.arange(4)), g(np.full(4, 8192))
    q = g(rng.standard_normal((4, HQ, D)).astype(np.float32))
    sc = g(rng.choice(np.array([0.0, 1.0, 2.0], np.float32), size=(4, 2048)))
    gq, gk, gv, ga, gb, gA, gd, gst = (g(x) for x in gdn_inputs(rng, 4, 4))
    bt = g(pool.block_tables)

    def step(st):
        sel = qsa.qsa_topk(sc, nv, RATIO, TOPK)
        att = qsa.qsa_sparse_attention(q, dev["kv_k"], dev["kv_v"], bt, rows, nv, sel, RATIO, 16, D ** -0.5,
                                       n_blocks=2048)
        o = gdn.gated_delta_decode_gates(gq, gk, gv, ga, gb, gA, gd, st, g(np.arange(4)))
        return sel, att, o

    s0 = gst.copy()
    e1 = [x.get() for x in step(s0)]
    s1 = gst.copy()
    e2 = [x.get() for x in step(s1)]
    assert all(np.array_equal(x, y) for x, y in zip(e1, e2)) and np.array_equal(s0.get(), s1.get()), seed
    s2 = gst.copy()
    idx = g(np.arange(4))
    cp.cuda.Device().synchronize()  # inputs in place: the capture stream does not wait for the default stream
    stream = cp.cuda.Stream(non_blocking=True)
    mem = cp.cuda.MemoryPool()
    with stream, cp.cuda.using_allocator(mem.malloc):
        stream.begin_capture()
        try:
            sel = qsa.qsa_topk(sc, nv, RATIO, TOPK)
            att = qsa.qsa_sparse_attention(q, dev["kv_k"], dev["kv_v"], bt, rows, nv, sel, RATIO, 16, D ** -0.5,
                                           n_blocks=2048)
            o = gdn.gated_delta_decode_gates(gq, gk, gv, ga, gb, gA, gd, s2, idx)
        finally:
            graph = stream.end_capture()
        graph.launch(stream=stream)
        stream.synchronize()
    got = [sel.get(), att.get(), o.get()]
    assert all(np.array_equal(x, y) for x, y in zip(e1, got)) and np.array_equal(s2.get(), s0.get()), seed


# ------------------------------------------------------------------------------------------------ head prep
@cuda
@pytest.mark.parametrize("T", [1, 16])
def test_prep_heads_equals_unfused_norm_rope_and_locates_a_wrong_weight(T):
    """qsa_prep_heads (indexer q, attention q, k: zero-centred RMSNorm + RoPE in one launch, reading column slices
    of one fused projection in place) vs the engine's rms_norm + apply_rope on the GPU (the same operations: equal
    to float32 rounding, normally bitwise) and the NumPy twin; a wrong k_norm weight changes k only."""
    from engine.kernels.norms import rms_norm
    from engine.kernels.rope import apply_rope
    seed, rng = seeded_rng()
    fused = rng.standard_normal((T, HI * DI + DI + HQ * 2 * D + 2 * HKV * D)).astype(np.float32)
    o1, o2, o3 = HI * DI + DI, HI * DI + DI + HQ * 2 * D, HI * DI + DI + HQ * 2 * D + HKV * D
    ws = [(rng.standard_normal(n) * 0.3).astype(np.float32) for n in (DI, D, D)]
    pos = rng.integers(0, 262144, size=T)
    invf = (1.0 / 1e7 ** (np.arange(0, ROT, 2) / ROT)).astype(np.float32)
    fd = g(fused)
    got = qsa.qsa_prep_heads(fd[:, :o1], fd[:, o1:o2], fd[:, o2:o3], *(g(w) for w in ws), g(pos), g(invf), ROT, EPS,
                             HI, DI, HQ, HKV, D)
    assert all(no_poison(a) for a in got), seed
    qi = rms_norm(g(np.ascontiguousarray(fused[:, :HI * DI].reshape(T, HI, DI))), g(ws[0]), eps=EPS)
    qq = rms_norm(g(np.ascontiguousarray(fused[:, o1:o2].reshape(T, HQ, 2 * D)[:, :, :D])), g(ws[1]), eps=EPS)
    kk = rms_norm(g(np.ascontiguousarray(fused[:, o2:o3].reshape(T, HKV, D))), g(ws[2]), eps=EPS)
    unf = [apply_rope(a, g(pos), g(invf), ROT).get() for a in (qi, qq, kk)]
    twin = qsa.qsa_prep_heads(fused[:, :o1], fused[:, o1:o2], fused[:, o2:o3], *ws, pos, invf, ROT, EPS, HI, DI, HQ,
                              HKV, D)
    bitwise = all(np.array_equal(a.get(), b) for a, b in zip(got, unf))
    print(f"\nqsa_prep_heads T={T}: bitwise equal to rms_norm + apply_rope: {bitwise}")
    for a, b, c in zip(got, unf, twin):
        assert rel_err(a.get(), b) < 1e-6 and rel_err(a.get(), c) < TOL, seed
    bad = qsa.qsa_prep_heads(fd[:, :o1], fd[:, o1:o2], fd[:, o2:o3], g(ws[0]), g(ws[1]), g(ws[2] + 0.5), g(pos),
                             g(invf), ROT, EPS, HI, DI, HQ, HKV, D)
    errs = [rel_err(a.get(), b.get()) for a, b in zip(bad, got)]
    assert errs[0] == 0 and errs[1] == 0 and errs[2] > 1e-2, (seed, errs)
