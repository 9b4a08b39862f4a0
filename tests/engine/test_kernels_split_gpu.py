"""The decode-oriented ("split") QSA / GDN CUDA kernels vs the prefill kernels of the same ops (run on decode-sized
inputs), the NumPy twins and float64 dense semantics, at the real model's widths, on seeded random inputs (contexts
1025 and 8192, batch 1 and 16).

Every device allocation is poisoned (bytes 0x7F) so an output a kernel forgot to write cannot match. Negative
controls: a wrong block in a selection, a perturbed score, a token written at the wrong position and a dropped slice
of a GDN state must each be caught by the same comparisons AND located (query / block / slot / head + rows).
Also: graph capture + replay equals the eager run bitwise, and two runs agree bitwise (deterministic).
Skips cleanly without cupy or a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from tests.kernels_seq_common import Pool, canonical_topk, dense_attention, dense_gdn, rel_err, seeded_rng

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="cupy is not installed (GPU tests need cupy-cuda13x and a CUDA GPU)")
from engine.backend import gpu_available  # noqa: E402

if not gpu_available():
    pytest.skip("no CUDA GPU visible to cupy", allow_module_level=True)

from engine.kernels import gdn, qsa  # noqa: E402

# float32 kernels vs float32 twins / float64 truth: a few float32 roundings per element in different summation
# orders -> ~1e-6 relative; 1e-5 as in test_kernels_seq_gpu.py, while every negative control moves by >= 1e-3.
TOL = 1e-5
RATIO, TOPK, DI, HI, HQ, HKV, D, ROT, EPS = 4, 512, 128, 4, 24, 2, 256, 64, 1e-6
HK, HV, DK, DV = 16, 48, 128, 128


@pytest.fixture(autouse=True)
def poisoned_allocations():
    pool = cp.get_default_memory_pool()

    def alloc(size):
        mp = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mp.ptr, 0x7F, size, cp.cuda.get_current_stream().ptr)
        return mp

    cp.cuda.set_allocator(alloc)
    yield
    cp.cuda.set_allocator(pool.malloc)


@pytest.fixture
def impl(monkeypatch):
    """impl('prefill'): even decode-sized calls take the prefill kernels (the per-query-head attention, the
    one-warp-per-32-columns GDN recurrence) by lowering the dispatch thresholds; impl('split'): the dispatch as
    shipped. (Top-k and the block keys at these widths have one kernel each.)"""
    split_t, split_tps = qsa.QSA_SPLIT_MAX_T, gdn.GDN_SPLIT_MAX_TPS

    def set_(name):
        assert name in ("prefill", "split"), name
        monkeypatch.setattr(qsa, "QSA_SPLIT_MAX_T", 0 if name == "prefill" else split_t)
        monkeypatch.setattr(gdn, "GDN_SPLIT_MAX_TPS", 0 if name == "prefill" else split_tps)
    return set_


def g(a):
    return cp.asarray(a)


def _poison_free(a):
    a = cp.asnumpy(a)
    return not np.any(a.astype(np.float64) >= 3e38) if a.dtype.kind == "f" else not np.any(a == 0x7F7F7F7F)


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
@pytest.mark.parametrize("page_size", [3, 16])
def test_split_attention_matches_prefill_kernel_twin_dense_and_catches_a_wrong_block(page_size, impl):
    seed, rng = seeded_rng()
    lengths = [1025, 8192, 9, 2051]
    pool = Pool(rng, lengths, page_size, {"kv_k": (HKV, D), "kv_v": (HKV, D)})
    _fill(rng, pool, lengths, ("kv_k", "kv_v"))
    dev = {k: g(v) for k, v in pool.arrays.items()}
    bt = g(pool.block_tables)
    # batch 1 (decode at 1025 and at 8192) and a batch of 16 (decode rows + verify-like mid positions)
    cases = [(np.array([0]), np.array([1024])), (np.array([1]), np.array([8191])),
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
            assert _poison_free(o), (seed, name, hint)
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


# ------------------------------------------------------------------------------------------------ GDN
def _gdn_inputs(rng, N, S):
    q = rng.standard_normal((N, HK, DK)).astype(np.float32)
    k = rng.standard_normal((N, HK, DK)).astype(np.float32)
    v = rng.standard_normal((N, HV, DV)).astype(np.float32)
    a = rng.standard_normal((N, HV)).astype(np.float32)
    b = rng.standard_normal((N, HV)).astype(np.float32)
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    dtb = rng.standard_normal(HV).astype(np.float32)
    state = (rng.standard_normal((S, HV, DK, DV)) * 0.1).astype(np.float32)
    return q, k, v, a, b, A_log, dtb, state


def _locate(got, want):
    """(slot, head, row) of the largest |got - want| in a [S, Hv, Dk, Dv] state."""
    e = np.abs(np.asarray(got, np.float64) - want).max(axis=-1)
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(e)), e.shape))


@pytest.mark.parametrize("B", [1, 16])
def test_split_gdn_decode_matches_prefill_kernel_twin_dense_and_locates_a_dropped_state(B, impl):
    seed, rng = seeded_rng()
    S = B + 3
    q, k, v, a, b, A_log, dtb, state = _gdn_inputs(rng, B, S)
    slots = rng.permutation(S)[:B]
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    tst = state.copy()
    tout = gdn.gated_delta_decode(q, k, v, gg, bb, tst, slots)
    res = {}
    for name in ("prefill", "split"):
        impl(name)
        for fused in (False, True):
            dst = g(state)
            if fused:
                o = gdn.gated_delta_decode_gates(g(q), g(k), g(v), g(a), g(b), g(A_log), g(dtb), dst, g(slots))
            else:
                o = gdn.gated_delta_decode(g(q), g(k), g(v), g(gg), g(bb), dst, g(slots))
            assert _poison_free(o), (seed, name, fused)
            res[(name, fused)] = (o.get(), dst.get())
            assert rel_err(res[(name, fused)][0], tout) < TOL and rel_err(res[(name, fused)][1], tst) < TOL, \
                (seed, name, fused)
    # fusing the gates is NOT bitwise (H200: last-ulp differences, e.g. -6.9068568e-03 vs -6.9068559e-03):
    # the in-kernel gates and the gdn_gates ElementwiseKernel are compiled separately and may round exp / log1p
    # differently by an ulp. An ulp of g or beta moves the read-out by ~1e-7 relative; 1e-6 = ~8 float32 ulps of
    # margin, while every negative control below moves it by >= 1e-3.
    assert rel_err(res[("split", True)][0], res[("split", False)][0]) < 1e-6, seed
    assert rel_err(res[("split", True)][1], res[("split", False)][1]) < 1e-6, seed
    # q / k / v as column slices of one conv-output-like row (read in place through row strides): same bits
    conv = g(np.concatenate([q.reshape(B, -1), k.reshape(B, -1), v.reshape(B, -1)], axis=1))
    kd = HK * DK
    dst = g(state)
    o = gdn.gated_delta_decode_gates(conv[:, :kd].reshape(B, HK, DK), conv[:, kd:2 * kd].reshape(B, HK, DK),
                                     conv[:, 2 * kd:].reshape(B, HV, DV), g(a), g(b), g(A_log), g(dtb), dst, g(slots))
    assert np.array_equal(o.get(), res[("split", True)][0]) and np.array_equal(dst.get(), res[("split", True)][1])
    ro, rs = dense_gdn(q[:1], k[:1], v[:1], gg[:1], bb[:1], state[slots[0]])
    assert rel_err(res[("split", True)][0][0], ro[0]) < TOL and rel_err(res[("split", True)][1][slots[0]], rs) < TOL
    # negative control: one warp's 16 key rows of one head's state dropped (zeroed) before the step -> caught in
    # the new state and the read-out, located at that slot / head / row block
    impl("split")
    hv0, w0 = int(np.argmax(gg[-1])), 3  # the head whose state decays least this step: the drop shows most
    dst = g(state)
    dst[int(slots[-1]), hv0, 16 * w0:16 * (w0 + 1)] = 0
    o = gdn.gated_delta_decode_gates(g(q), g(k), g(v), g(a), g(b), g(A_log), g(dtb), dst, g(slots)).get()
    sl, hv, row = _locate(dst.get(), tst)
    assert rel_err(dst.get(), tst) > 1e-3 and (sl, hv) == (int(slots[-1]), hv0) and row // 16 == w0, (seed, sl, hv, row)
    eh = np.abs(o[-1] - tout[-1]).max(axis=-1)
    assert int(np.argmax(eh)) == hv0 and eh[hv0] > 1e-3 * np.abs(tout).max(), seed


def test_split_gdn_verify_checkpoints_and_forced_prefill(impl, monkeypatch):
    seed, rng = seeded_rng()
    N = 6
    q, k, v, a, b, A_log, dtb, state = _gdn_inputs(rng, N, 4)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    slots, cu = np.array([3, 1]), np.array([0, 2, 6])
    tst, tck = state.copy(), np.zeros((N, HV, DK, DV), np.float32)
    tout = gdn.gated_delta_recurrent(q, k, v, gg, bb, tst, slots, cu, checkpoints=tck)
    for name in ("prefill", "split"):
        impl(name)
        dst, ck = g(state), cp.empty((N, HV, DK, DV), cp.float32)
        o = gdn.gated_delta_recurrent(g(q), g(k), g(v), g(gg), g(bb), dst, g(slots), g(cu), checkpoints=ck)
        assert _poison_free(o) and _poison_free(ck), (seed, name)
        assert rel_err(o.get(), tout) < TOL and rel_err(dst.get(), tst) < TOL and rel_err(ck.get(), tck) < TOL, \
            (seed, name)
    # a prefill through the split kernel (forced; the default sends long sequences to the one-warp kernel)
    monkeypatch.setattr(gdn, "GDN_SPLIT_MAX_TPS", 1 << 30)
    T = 40
    q, k, v, a, b, A_log, dtb, state = _gdn_inputs(rng, T, 1)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    tst = state.copy()
    tout = gdn.gated_delta_prefill(q, k, v, gg, bb, tst, 0, 16)
    dst = g(state)
    o = gdn.gated_delta_prefill(g(q), g(k), g(v), g(gg), g(bb), dst, 0, 16)
    assert rel_err(o.get(), tout) < TOL and rel_err(dst.get(), tst) < TOL, seed


# ------------------------------------------------------------------------------------------------ graphs, determinism
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
    gq, gk, gv, ga, gb, gA, gd, gst = (g(x) for x in _gdn_inputs(rng, 4, 4))
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
    assert all(_poison_free(a) for a in got), seed
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
