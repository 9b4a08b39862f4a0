"""Sequence kernels on the GPU (CUDA / cupy path) vs their NumPy twins vs float64 dense semantics, at the real
model's head sizes, on seeded random inputs. Every device allocation is poisoned (byte 0x7F: float 3.4e38, int
2139062143) so an output element a kernel forgot to write cannot match the twin. Negative controls: perturbed
inputs, a wrong twin and a wrong tie-break must be detected by the same comparisons.

Skips cleanly without cupy or a GPU.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from tests.kernels_seq_common import (Pool, canonical_topk, dense_attention, dense_conv, dense_gdn, dense_rope,
                                      seeded_rng, rel_err)

pytestmark = pytest.mark.gpu

cp = pytest.importorskip("cupy", reason="cupy is not installed (GPU tests need cupy-cuda13x and a CUDA GPU)")
from engine.backend import gpu_available  # noqa: E402

if not gpu_available():
    pytest.skip("no CUDA GPU visible to cupy", allow_module_level=True)

from engine.kernels import gdn, qsa, rope  # noqa: E402

# float32 kernels vs float32 NumPy twins and float64 truth: per element a few float32 roundings (different
# summation orders, cosf vs numpy cos, online vs two-pass softmax) -> ~1e-6 relative; 1e-5 per METHOD.md's fp32
# guidance ("far under 1e-3"), while every negative control moves results by >= 1e-2.
TOL = 1e-5
POISON_I32 = 0x7F7F7F7F


@pytest.fixture(autouse=True)
def poisoned_allocations():
    """Every cupy allocation made during a test starts as bytes 0x7F."""
    pool = cp.get_default_memory_pool()

    def alloc(size):
        mp = pool.malloc(size)
        if size:
            cp.cuda.runtime.memsetAsync(mp.ptr, 0x7F, size, cp.cuda.get_current_stream().ptr)
        return mp

    cp.cuda.set_allocator(alloc)
    yield
    cp.cuda.set_allocator(pool.malloc)


def g(a):
    return cp.asarray(a)


def _no_poison(a):
    a = cp.asnumpy(a)
    if a.dtype.kind == "f":
        return not np.any(a.astype(np.float64) >= 3e38)
    return not np.any(a == POISON_I32)


# ------------------------------------------------------------------------------------------------ RoPE
def test_rope_cuda_matches_twin_and_dense():
    seed, rng = seeded_rng()
    x = rng.standard_normal((7, 24, 256)).astype(np.float32)
    pos = np.array([0, 1, 5, 999, 65536, 200001, 262143])
    invf = (1.0 / 1e7 ** (np.arange(0, 64, 2) / 64)).astype(np.float32)
    got = rope.apply_rope(g(x), g(pos), g(invf), 64)
    assert _no_poison(got), seed
    twin = rope.apply_rope(x, pos, invf, 64)
    assert rel_err(got.get(), twin) < TOL and rel_err(got.get(), dense_rope(x, pos, invf, 64)) < TOL, seed
    y = g(x)
    rope.apply_rope(y, g(pos), g(invf), 64, out=y)
    assert rel_err(y.get(), twin) < TOL, seed
    wide = g(np.concatenate([x, x], axis=2))  # a strided view, rotated in place
    view = wide[:, :, :256]
    rope.apply_rope(view, g(pos), g(invf), 64, out=view)
    assert rel_err(view.get(), twin) < TOL and np.array_equal(wide[:, :, 256:].get(), x), seed
    assert rel_err(rope.apply_rope(g(x), g(pos + 1), g(invf), 64).get(), twin) > 1e-2, "off-by-one not caught"


# ------------------------------------------------------------------------------------------------ GDN
HK, HV, DK, DV = 16, 48, 128, 128


def _gdn(rng, T, S=6):
    q = rng.standard_normal((T, HK, DK)).astype(np.float32)
    k = rng.standard_normal((T, HK, DK)).astype(np.float32)
    v = rng.standard_normal((T, HV, DV)).astype(np.float32)
    a = rng.standard_normal((T, HV)).astype(np.float32)
    b = rng.standard_normal((T, HV)).astype(np.float32)
    A_log = (rng.standard_normal(HV) * 0.5).astype(np.float32)
    dtb = rng.standard_normal(HV).astype(np.float32)
    state = (rng.standard_normal((S, HV, DK, DV)) * 0.1).astype(np.float32)
    return q, k, v, a, b, A_log, dtb, state


def test_gdn_gates_cuda_matches_twin():
    seed, rng = seeded_rng()
    _, _, _, a, b, A_log, dtb, _ = _gdn(rng, 33)
    gg, bb = gdn.gdn_gates(g(a), g(b), g(A_log), g(dtb))
    tg, tb = gdn.gdn_gates(a, b, A_log, dtb)
    assert rel_err(gg.get(), tg) < TOL and rel_err(bb.get(), tb) < TOL, seed


def test_gdn_conv_cuda_prefill_decode_checkpoints():
    seed, rng = seeded_rng()
    C, K, T = 10240, 4, 37
    x = rng.standard_normal((T + 3, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    st = rng.standard_normal((4, K - 1, C)).astype(np.float32)
    dst, tst = g(st), st.copy()
    ck = cp.empty((T, K - 1, C), cp.float32)
    y = gdn.causal_conv_prefill(g(x[:T]), g(w), dst, 1, checkpoints=ck)
    ty = gdn.causal_conv_prefill(x[:T], w, tst, 1)
    assert _no_poison(y) and _no_poison(ck), seed
    assert rel_err(y.get(), ty) < TOL and rel_err(y.get(), dense_conv(x[:T], w, st[1])[0]) < TOL, seed
    assert np.array_equal(dst.get(), tst), seed
    for t in (0, 1, T - 1):
        assert np.array_equal(ck[t].get(), dense_conv(x[:t + 1], w, st[1])[1].astype(np.float32)), seed
    yd = gdn.causal_conv_decode(g(x[T:T + 3]), g(w), dst, g(np.array([1, 3, 0])))
    td = gdn.causal_conv_decode(x[T:T + 3], w, tst, np.array([1, 3, 0]))
    assert _no_poison(yd) and rel_err(yd.get(), td) < TOL and rel_err(dst.get(), tst) < TOL, seed
    assert np.array_equal(dst[2].get(), st[2]), seed  # untouched row


@pytest.mark.parametrize("algorithm", ["chunked", "auto"])  # auto = the recurrent kernel on the GPU
@pytest.mark.parametrize("T,chunk", [(1, 64), (200, 64), (77, 32), (150, 100)])
def test_gdn_prefill_cuda(T, chunk, algorithm):
    seed, rng = seeded_rng()
    q, k, v, a, b, A_log, dtb, state = _gdn(rng, T)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    dst, tst = g(state), state.copy()
    out = gdn.gated_delta_prefill(g(q), g(k), g(v), g(gg), g(bb), dst, 2, chunk, algorithm=algorithm)
    tout = gdn.gated_delta_prefill(q, k, v, gg, bb, tst, 2, chunk)
    assert _no_poison(out), seed
    # chunks longer than 64 take the array-code forward substitution (cuBLAS batched products, ~100 dependent
    # rows): measured 1.5e-5 against the twin on the H200 (CPU: 2e-6), so that path is held to 1e-4; every other
    # path to TOL
    tol = 1e-4 if (chunk > 64 and algorithm == "chunked") else TOL
    assert rel_err(out.get(), tout) < tol and rel_err(dst.get(), tst) < tol, seed
    if T <= 77:
        ro, rs = dense_gdn(q, k, v, gg, bb, state[2])
        assert rel_err(out.get(), ro) < TOL and rel_err(dst[2].get(), rs) < TOL, seed
    # negative control: a dropped state is caught by the same comparison
    dz = g(state)
    dz[2] = 0
    assert rel_err(gdn.gated_delta_prefill(g(q), g(k), g(v), g(gg), g(bb), dz, 2, chunk,
                                           algorithm=algorithm).get(), tout) > 1e-2, seed


def test_gdn_recurrent_cuda_decode_batch_and_verify_checkpoints():
    seed, rng = seeded_rng()
    lens = [1, 1, 4, 1, 0, 1]
    N = sum(lens)
    q, k, v, a, b, A_log, dtb, state = _gdn(rng, N, S=8)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    slots = np.array([5, 0, 3, 7, 1, 2])
    cu = np.concatenate([[0], np.cumsum(lens)])
    dst, tst = g(state), state.copy()
    ck = cp.empty((N, HV, DK, DV), cp.float32)
    tck = np.zeros((N, HV, DK, DV), np.float32)
    out = gdn.gated_delta_recurrent(g(q), g(k), g(v), g(gg), g(bb), dst, g(slots), g(cu), checkpoints=ck)
    tout = gdn.gated_delta_recurrent(q, k, v, gg, bb, tst, slots, cu, checkpoints=tck)
    assert _no_poison(out) and _no_poison(ck), seed
    assert rel_err(out.get(), tout) < TOL and rel_err(dst.get(), tst) < TOL and rel_err(ck.get(), tck) < TOL, seed
    assert np.array_equal(dst[[4, 6]].get(), state[[4, 6]]), seed
    ro, rs = dense_gdn(q[2:6], k[2:6], v[2:6], gg[2:6], bb[2:6], state[3])
    assert rel_err(out[2:6].get(), ro) < TOL and rel_err(dst[3].get(), rs) < TOL, seed
    # decode: one token per slot, single launch
    d2 = g(state)
    o2 = gdn.gated_delta_decode(g(q[:3]), g(k[:3]), g(v[:3]), g(gg[:3]), g(bb[:3]), d2, g(np.array([6, 4, 1])))
    t2 = state.copy()
    r2 = gdn.gated_delta_decode(q[:3], k[:3], v[:3], gg[:3], bb[:3], t2, np.array([6, 4, 1]))
    assert rel_err(o2.get(), r2) < TOL and rel_err(d2.get(), t2) < TOL, seed
    # negative control: a twin fed swapped slots disagrees with the kernel
    t3 = state.copy()
    r3 = gdn.gated_delta_decode(q[:3], k[:3], v[:3], gg[:3], bb[:3], t3, np.array([4, 6, 1]))
    assert rel_err(o2.get(), r3) > 1e-2, seed


# ------------------------------------------------------------------------------------------------ QSA
RATIO, TOPK, DI, HI, HQ, HKV, D, ROT, EPS = 4, 512, 128, 4, 24, 2, 256, 64, 1e-6


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
    assert _no_poison(s_d) and _no_poison(sel_d), seed
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
    assert _no_poison(out) and rel_err(out.get(), tout) < TOL, seed
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
        q, k, v, a, b, A_log, dtb, state = _gdn(rng, B, S=B)
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
    q, k, v, a, b, A_log, dtb, state = _gdn(rng, T, S=1)
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
