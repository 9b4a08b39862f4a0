"""Block-level tests of the reference (no torch needed): n-gram hashing against hand arithmetic,
Numba kernels against their NumPy twins, chunked == recurrent delta rule, canonical top-k order,
norms and RoPE, each with a negative control."""
from __future__ import annotations

import numpy as np
import pytest

from reference.blocks.gdn import delta_rule_chunked, delta_rule_recurrent_numpy, l2norm
from reference.blocks.norms import gated_rms_norm, rms_norm
from reference.blocks.ple import dilated_causal_conv, ngram_rows_numpy, shift_ignore_eos
from reference.blocks.qsa import canonical_topk
from reference.blocks.rope import apply_rope, inv_freq, rope_cos_sin
from reference.config import build_layer_multipliers
from reference.numba_kernels import delta_rule_recurrent, ngram_hash_rows

REAL_VOCAB = 248320
REAL_EOS = 248044
M64 = 1 << 64


def _s64(v: int) -> int:
    """Python int -> the int64 two's-complement value of its low 64 bits."""
    v &= M64 - 1
    return v - M64 if v >= 1 << 63 else v


def _hand_rows(ctx, ids, eos, mult, sizes, offsets, hpn):
    """The hash written out with Python big ints (an independent spelling of the official arithmetic)."""
    hist = [int(t) for t in ctx] + [int(t) for t in ids]
    mult = [int(m) for m in mult]
    n = len(mult)
    rows = []
    for p in range(len(ctx), len(hist)):
        sh = [hist[p]]
        for s in range(1, n):
            window = hist[p - s:p] if p - s >= 0 else None
            sh.append(eos if window is None or eos in window else hist[p - s])
        row = []
        for ng in range(2, n + 1):
            mixed = _s64(sh[0] * mult[0])
            for s in range(1, ng):
                mixed = _s64(mixed ^ _s64(sh[s] * mult[s]))
            for h in range((ng - 2) * hpn, (ng - 1) * hpn):
                row.append(mixed % sizes[h] + offsets[h])  # Python % = non-negative for a positive divisor
        rows.append(row)
    return np.array(rows, dtype=np.int64)


REAL_SIZES = [20000003, 20000023, 20000033, 20000047, 20000059, 20000063, 20000069, 20000077, 20000081,
              20000093, 20000107, 20000147, 20000153, 20000159, 20000161, 20000171]  # model-facts.md
REAL_OFFS = list(np.concatenate([[0], np.cumsum(REAL_SIZES)[:-1]]))


def test_hash_largest_ids_bit_exact_and_wraps():
    mult = build_layer_multipliers(REAL_VOCAB, 3, 0, 1234)
    ids = np.array([REAL_VOCAB - 1, REAL_VOCAB - 2, REAL_VOCAB - 1, REAL_VOCAB - 1, 0, REAL_VOCAB - 1])
    ctx = np.array([REAL_EOS, REAL_EOS])
    want = _hand_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
    # the official multiplier bound ((2**63-1) // vocab) keeps id * multiplier below 2**63 for real ids
    assert max(int(i) * int(m) for i in ids for m in mult) < (1 << 63)
    assert np.array_equal(ngram_rows_numpy(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    assert np.array_equal(ngram_hash_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    assert (want >= 0).all() and (want < sum(REAL_SIZES)).all()


def test_hash_wraps_like_int64():
    """Multipliers beyond the official bound overflow: the kernels must wrap mod 2**64 like torch int64."""
    mult = [(1 << 62) + 12345, (1 << 62) + 777, (1 << 61) + 3]
    ids = np.array([REAL_VOCAB - 1, 3, REAL_VOCAB - 7, 11, 12])
    ctx = np.array([REAL_VOCAB - 2, 5])
    assert max(int(i) * m for i in ids for m in mult) > (1 << 63)
    want = _hand_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
    assert np.array_equal(ngram_rows_numpy(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    assert np.array_equal(ngram_hash_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    assert (want >= 0).all()  # non-negative remainder even for negative wrapped values


def test_hash_negative_control_no_wrap_differs():
    """Computing the mix in float64 (no wrap) gives different rows: the test above can fail."""
    mult = [(1 << 62) + 12345, (1 << 62) + 777, (1 << 61) + 3]
    ids = [REAL_VOCAB - 1, REAL_VOCAB - 2]
    bad = (ids[1] * mult[0]) % REAL_SIZES[0]  # unbounded product, C-style truncation never applied
    good = _hand_rows([REAL_EOS, REAL_EOS], ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)[1, 0]
    assert bad != good


@pytest.mark.parametrize("eos_pos", range(8))
def test_hash_eos_at_every_position(eos_pos):
    rng = np.random.default_rng(eos_pos)
    mult = build_layer_multipliers(REAL_VOCAB, 3, 1, 1234)
    ids = rng.integers(0, REAL_VOCAB, 8)
    ids[ids == REAL_EOS] = 1
    ids[eos_pos] = REAL_EOS
    ctx = rng.integers(0, REAL_VOCAB, 2)
    want = _hand_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
    assert np.array_equal(ngram_hash_rows(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    assert np.array_equal(ngram_rows_numpy(ctx, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8), want)
    # negative control: ignoring the reset changes the rows right after the EOS (if any follow)
    if eos_pos < 7:
        wrong = _hand_rows(ctx, ids, -1, mult, REAL_SIZES, REAL_OFFS, 8)
        assert not np.array_equal(wrong, want)


def test_hash_context_spanning_calls():
    rng = np.random.default_rng(5)
    mult = build_layer_multipliers(REAL_VOCAB, 3, 0, 1234)
    ids = rng.integers(0, REAL_VOCAB, 12)
    ids[4] = REAL_EOS
    ctx0 = np.array([REAL_EOS, REAL_EOS])
    whole = ngram_hash_rows(ctx0, ids, REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
    for cut in range(1, 12):
        a = ngram_hash_rows(ctx0, ids[:cut], REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
        ctx = np.concatenate([ctx0, ids[:cut]])[-2:]
        b = ngram_hash_rows(ctx, ids[cut:], REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
        assert np.array_equal(np.concatenate([a, b]), whole), cut
    # negative control: dropping the carried context (restarting with EOS) changes the first rows
    b_bad = ngram_hash_rows(ctx0, ids[6:], REAL_EOS, mult, REAL_SIZES, REAL_OFFS, 8)
    assert not np.array_equal(b_bad, whole[6:])


def test_hash_literal_hand_example():
    """Worked by hand: multipliers (3, 5, 7), one bigram head (vocab 11) and one trigram head (vocab 13,
    offset 11), EOS = 9, fresh context (9, 9), ids (2, 4).
    t=0: bigram 2*3 ^ 9*5 = 6 ^ 45 = 43 -> 43 % 11 = 10; trigram 43 ^ 9*7 = 43 ^ 63 = 20 -> 20 % 13 + 11 = 18.
    t=1: bigram 4*3 ^ 2*5 = 12 ^ 10 = 6 -> 6; trigram 6 ^ 63 = 57 -> 57 % 13 + 11 = 16 (the EOS two back)."""
    want = [[10, 18], [6, 16]]
    args = ([9, 9], [2, 4], 9, [3, 5, 7], [11, 13], [0, 11], 1)
    assert ngram_hash_rows(*args).tolist() == want
    assert ngram_rows_numpy(*args).tolist() == want


def test_shift_ignore_eos_hand_example():
    e = 9
    hist = np.array([e, e, 1, 2, e, 3, 4, 5])
    assert shift_ignore_eos(hist, 1, e).tolist() == [e, e, e, 1, 2, e, 3, 4]
    assert shift_ignore_eos(hist, 2, e).tolist() == [e, e, e, e, 1, e, e, 3]


def _delta_inputs(T, Hk, Hv, dk, dv, dtype, seed=0):
    rng = np.random.default_rng(seed)
    q = l2norm(rng.standard_normal((T, Hk, dk)).astype(dtype)) * dtype(dk ** -0.5)
    k = l2norm(rng.standard_normal((T, Hk, dk)).astype(dtype))
    v = rng.standard_normal((T, Hv, dv)).astype(dtype)
    g = -rng.uniform(0, 1.5, (T, Hv)).astype(dtype)
    b = rng.uniform(0, 1, (T, Hv)).astype(dtype)
    S = rng.standard_normal((Hv, dk, dv)).astype(dtype)
    return q, k, v, g, b, S


@pytest.mark.parametrize("T", [1, 63, 64, 65, 150])
def test_delta_rule_chunked_equals_recurrent(T):
    args = _delta_inputs(T, 2, 4, 16, 8, np.float64)
    o1, s1 = delta_rule_recurrent(*args)
    o2, s2 = delta_rule_chunked(*args)
    o3, s3 = delta_rule_recurrent_numpy(*args)
    # float64: the two forms differ only by rounding; 1e-12 relative leaves ~1e3 ulps of headroom
    scale = np.abs(o1).max()
    assert np.abs(o1 - o2).max() <= 1e-12 * scale and np.abs(s1 - s2).max() <= 1e-12 * np.abs(s1).max()
    assert np.abs(o1 - o3).max() <= 1e-12 * scale and np.abs(s1 - s3).max() <= 1e-12 * np.abs(s1).max()
    # float32: same check at float32 rounding (1e-5 relative)
    a32 = [a.astype(np.float32) for a in args]
    o4, _ = delta_rule_chunked(*a32)
    assert o4.dtype == np.float32 and np.abs(o4 - o1).max() <= 1e-5 * scale


def test_delta_rule_negative_control_dropped_state():
    q, k, v, g, b, S = _delta_inputs(70, 2, 4, 16, 8, np.float64)
    o1, _ = delta_rule_recurrent(q, k, v, g, b, S)
    o2, _ = delta_rule_chunked(q, k, v, g, b, np.zeros_like(S))
    assert np.abs(o1 - o2).max() > 1e-3


def test_canonical_topk_tie_order():
    s = np.array([[0.0, 1.0, 0.0, 1.0, 0.0, -np.inf]])
    assert canonical_topk(s, 3).tolist() == [[1, 3, 0]]
    assert canonical_topk(s, 5).tolist() == [[1, 3, 0, 2, 4]]
    # negative control: an unstable/reversed tie-break is distinguishable
    rev = np.argsort(-s[:, ::-1], axis=-1, kind="stable")[:, :3]
    assert (s.shape[1] - 1 - rev).tolist() != canonical_topk(s, 3).tolist()


def test_block_topk_kernel_equals_canonical():
    from reference.numba_kernels import block_topk_select
    rng = np.random.default_rng(3)
    for dt in (np.float32, np.float64):
        s = np.maximum(rng.standard_normal((40, 12)), 0).astype(dt)  # many exact zero ties
        s[:, 6] = s[:, 2]
        nc = rng.integers(0, 13, 40)
        s[np.arange(12)[None, :] >= nc[:, None]] = -np.inf
        got = block_topk_select(s, nc, 4)
        want = canonical_topk(s, 4)
        want[np.arange(4)[None, :] >= np.minimum(4, nc)[:, None]] = -1
        assert np.array_equal(got, want)



@pytest.mark.parametrize("rows", [40, 300])  # below / above PARALLEL_MIN_ROWS: the serial and the parallel kernel
def test_block_topk_partition_path_ties_at_the_cut_and_nan(rows):
    """The partition path (k < visible blocks) keeps exactly the canonical set and order when exact ties
    straddle the cut; a row holding NaN takes the full stable sort (NaN last) as before."""
    from reference.numba_kernels import PARALLEL_MIN_ROWS, block_topk_select
    assert (rows >= PARALLEL_MIN_ROWS) == (rows == 300)
    rng = np.random.default_rng(5)
    for dt in (np.float32, np.float64):
        s = np.round(rng.standard_normal((rows, 64)), 1).astype(dt)  # ~40 distinct values: many exact ties
        s[:, 10:20] = s[:, :1]  # a tie group of 11 that the cut at k=8 splits
        s[3, 7] = np.nan
        s[0] = 0.0
        s[0, 40] = 1.0
        nc = rng.integers(0, 65, rows)
        nc[:4] = [64, 9, 8, 64]
        s[np.arange(64)[None, :] >= nc[:, None]] = -np.inf
        got = block_topk_select(s, nc, 8)
        want = np.full_like(got, -1)
        for t in range(rows):
            c = canonical_topk(s[t:t + 1, :nc[t]], min(8, nc[t]))[0]
            want[t, :len(c)] = c
        assert np.array_equal(got, want)
        assert got[0].tolist() == [40, 0, 1, 2, 3, 4, 5, 6]  # row 0: one best block, then 63 exact ties
        # negative control: the cut's ties taken from the top index down are a different selection
        assert (63 - np.argsort(-s[0, ::-1], kind="stable")[:8]).tolist() != got[0].tolist()


@pytest.mark.parametrize("T,L", [(7, 41), (300, 300), (1, 1200)])  # serial / parallel kernel; decode past a bound
def test_selected_attention_equals_masked_dense(T, L):
    """``selected_attention`` (the model's QSA attention) is ``sparse_attention`` under ``selection_mask``: the
    same token set (selected blocks, -1 padding, duplicates, the tail, a reused smaller n_complete) within
    float32 summation order; a one-block shift of the selection is far outside that."""
    from reference.blocks.qsa import selection_mask, sparse_attention
    from reference.numba_kernels import selected_attention
    rng = np.random.default_rng(T)
    r, k = 4, 6
    for dt, tol in ((np.float32, 1e-5), (np.float64, 1e-12)):
        q = rng.standard_normal((T, 4, 32)).astype(dt)
        K, V = (rng.standard_normal((L, 2, 32)).astype(dt) for _ in range(2))
        pos = np.arange(L - T, L)
        nc = (pos + 1) // r
        sel = np.full((T, k), -1, np.int64)
        for t in range(T):
            n = min(k - 1, nc[t])
            sel[t, :n] = rng.choice(nc[t], n, replace=False) if nc[t] else []
        sel[0, -1] = sel[0, 0]  # a duplicate block id counts once
        nc_used = nc.copy()
        nc_used[-1] = max(0, nc[-1] - 2)  # a reused (older) n_complete: a longer tail
        a = selected_attention(q, K, V, sel, pos, nc_used, r, 32 ** -0.5)
        b = sparse_attention(q, K, V, selection_mask(sel, pos, nc_used, L, r), 32 ** -0.5)
        assert a.shape == b.shape == (T, 4 * 32)
        err = float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
        assert err <= tol, err  # tol: float32 (float64) rounding of a 32-wide dot product and a <=L-term softmax
        shifted = np.where(sel >= 0, np.maximum(sel - 1, 0), -1)
        c = selected_attention(q, K, V, shifted, pos, nc_used, r, 32 ** -0.5)
        if (shifted != sel).any():
            assert float(np.max(np.abs(c - b)) / np.max(np.abs(b))) > 100 * tol


def test_norms():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 12))
    y = rms_norm(x, np.zeros(12), 1e-6, group_size=4)
    assert np.allclose(np.sqrt((y.reshape(5, 3, 4) ** 2).mean(-1)), 1.0, atol=1e-5)
    # zero-centred: weight w scales by (1 + w)
    y2 = rms_norm(x, np.full(12, 0.5), 1e-6, group_size=4)
    assert np.allclose(y2, 1.5 * y)
    # gated norm uses the plain weight: a zero weight zeroes the output
    assert np.all(gated_rms_norm(x, x, np.zeros(12), 1e-6, "sigmoid") == 0)
    with pytest.raises(ValueError):
        gated_rms_norm(x, x, np.ones(12), 1e-6, "relu")


def test_rope_rotation_and_off_by_one():
    f = inv_freq(10000.0, 8, np.float64)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, 2, 16))
    pos = np.array([0, 5, 17])
    c, s = rope_cos_sin(pos, f, [2, 1, 1])
    y = apply_rope(x, c, s)
    assert np.allclose(y[0], x[0])  # position 0: identity
    assert np.allclose(np.linalg.norm(y[..., :8], axis=-1), np.linalg.norm(x[..., :8], axis=-1))
    assert np.array_equal(y[..., 8:], x[..., 8:])  # partial rotary: the rest passes through
    # relative property: <R(p) a, R(p) b> is position independent
    a, b = x[1, 0], x[2, 1]
    c1, s1 = rope_cos_sin(np.array([3, 3]), f, [2, 1, 1])
    c2, s2 = rope_cos_sin(np.array([11, 11]), f, [2, 1, 1])
    d1 = apply_rope(np.stack([a, b]), c1, s1)
    d2 = apply_rope(np.stack([a, b]), c2, s2)
    assert np.isclose(d1[0] @ d1[1], d2[0] @ d2[1])
    # mrope: explicit equal T/H/W rows == text positions; different rows change the interleaved slots
    c3, _ = rope_cos_sin(np.stack([pos, pos, pos]), f, [2, 1, 1])
    assert np.array_equal(c3, c)
    c4, _ = rope_cos_sin(np.stack([pos, pos + 1, pos]), f, [2, 1, 1])
    assert not np.array_equal(c4, c) and np.array_equal(c4[:, 0], c[:, 0])
    # negative control: off-by-one position is visible
    cb, sb = rope_cos_sin(pos + 1, f, [2, 1, 1])
    assert np.abs(apply_rope(x, cb, sb) - y).max() > 1e-3


def test_dilated_conv_state_carry():
    rng = np.random.default_rng(2)
    x = rng.standard_normal((10, 3))
    w = rng.standard_normal((3, 4))
    st0 = np.zeros((9, 3))
    full, _ = dilated_causal_conv(x, st0, w, 3)
    a, st = dilated_causal_conv(x[:4], st0, w, 3)
    b, _ = dilated_causal_conv(x[4:], st, w, 3)
    assert np.allclose(np.concatenate([a, b]), full)
    # hand value: y[9] = sum_j w[:, j] * x[9 - (3 - j) * 3]
    assert np.allclose(full[9], sum(w[:, j] * x[9 - (3 - j) * 3] for j in range(4)))
    b_bad, _ = dilated_causal_conv(x[4:], st0, w, 3)
    assert np.abs(b_bad - full[4:]).max() > 1e-3
