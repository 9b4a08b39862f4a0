"""GDN: gates, causal conv and the gated delta rule (engine/kernels/gdn.py) on the CPU and on CUDA (prefill and
the split decode kernels). How the sequence kernels are judged (float64 twins, poisoned device memory, negative
controls caught and located, graph replay and determinism): tests/kernels_seq_common.py.

The GPU algorithm of the chunked prefill (``gdn._chunked_xp``) is array code; it is run here on numpy too.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import gdn, rope
from tests.kernels_seq_common import (DK, DV, HK, HV, TOL, dense_conv, dense_gdn, gdn_inputs, seeded_rng,
                                      split_dispatch, rel_err)
from op_devices import cp, on_cuda
from op_helpers import g, no_poison

# the gpu marker, a skip without cupy / a GPU, and poisoned_allocations (conftest.py) before every CUDA test
cuda = on_cuda("poisoned_allocations")


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


# ------------------------------------------------------------------------------------------------ GDN
@cuda
def test_gdn_gates_cuda_matches_twin():
    seed, rng = seeded_rng()
    _, _, _, a, b, A_log, dtb, _ = gdn_inputs(rng, 33)
    gg, bb = gdn.gdn_gates(g(a), g(b), g(A_log), g(dtb))
    tg, tb = gdn.gdn_gates(a, b, A_log, dtb)
    assert rel_err(gg.get(), tg) < TOL and rel_err(bb.get(), tb) < TOL, seed


@cuda
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
    assert no_poison(y) and no_poison(ck), seed
    assert rel_err(y.get(), ty) < TOL and rel_err(y.get(), dense_conv(x[:T], w, st[1])[0]) < TOL, seed
    assert np.array_equal(dst.get(), tst), seed
    for t in (0, 1, T - 1):
        assert np.array_equal(ck[t].get(), dense_conv(x[:t + 1], w, st[1])[1].astype(np.float32)), seed
    yd = gdn.causal_conv_decode(g(x[T:T + 3]), g(w), dst, g(np.array([1, 3, 0])))
    td = gdn.causal_conv_decode(x[T:T + 3], w, tst, np.array([1, 3, 0]))
    assert no_poison(yd) and rel_err(yd.get(), td) < TOL and rel_err(dst.get(), tst) < TOL, seed
    assert np.array_equal(dst[2].get(), st[2]), seed  # untouched row


@cuda
@pytest.mark.parametrize("algorithm", ["chunked", "auto"])  # auto = the recurrent kernel on the GPU
@pytest.mark.parametrize("T,chunk", [(1, 64), (200, 64), (77, 32), (150, 100)])
def test_gdn_prefill_cuda(T, chunk, algorithm):
    seed, rng = seeded_rng()
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, T)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    dst, tst = g(state), state.copy()
    out = gdn.gated_delta_prefill(g(q), g(k), g(v), g(gg), g(bb), dst, 2, chunk, algorithm=algorithm)
    tout = gdn.gated_delta_prefill(q, k, v, gg, bb, tst, 2, chunk)
    assert no_poison(out), seed
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


@cuda
def test_gdn_recurrent_cuda_decode_batch_and_verify_checkpoints():
    seed, rng = seeded_rng()
    lens = [1, 1, 4, 1, 0, 1]
    N = sum(lens)
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, N, S=8)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    slots = np.array([5, 0, 3, 7, 1, 2])
    cu = np.concatenate([[0], np.cumsum(lens)])
    dst, tst = g(state), state.copy()
    ck = cp.empty((N, HV, DK, DV), cp.float32)
    tck = np.zeros((N, HV, DK, DV), np.float32)
    out = gdn.gated_delta_recurrent(g(q), g(k), g(v), g(gg), g(bb), dst, g(slots), g(cu), checkpoints=ck)
    tout = gdn.gated_delta_recurrent(q, k, v, gg, bb, tst, slots, cu, checkpoints=tck)
    assert no_poison(out) and no_poison(ck), seed
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


@pytest.fixture
def impl(monkeypatch):
    """impl('prefill') / impl('split'): the kernels decode-sized calls take (kernels_seq_common.split_dispatch)."""
    return split_dispatch(monkeypatch)


# ------------------------------------------------------------------------------------------------ GDN
def _locate(got, want):
    """(slot, head, row) of the largest |got - want| in a [S, Hv, Dk, Dv] state."""
    e = np.abs(np.asarray(got, np.float64) - want).max(axis=-1)
    return tuple(int(i) for i in np.unravel_index(int(np.argmax(e)), e.shape))


@cuda
@pytest.mark.parametrize("B", [1, 16])
def test_split_gdn_decode_matches_prefill_kernel_twin_dense_and_locates_a_dropped_state(B, impl):
    seed, rng = seeded_rng()
    S = B + 3
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, B, S)
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
            assert no_poison(o), (seed, name, fused)
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


@cuda
def test_split_gdn_verify_checkpoints_and_forced_prefill(impl, monkeypatch):
    seed, rng = seeded_rng()
    N = 6
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, N, 4)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    slots, cu = np.array([3, 1]), np.array([0, 2, 6])
    tst, tck = state.copy(), np.zeros((N, HV, DK, DV), np.float32)
    tout = gdn.gated_delta_recurrent(q, k, v, gg, bb, tst, slots, cu, checkpoints=tck)
    for name in ("prefill", "split"):
        impl(name)
        dst, ck = g(state), cp.empty((N, HV, DK, DV), cp.float32)
        o = gdn.gated_delta_recurrent(g(q), g(k), g(v), g(gg), g(bb), dst, g(slots), g(cu), checkpoints=ck)
        assert no_poison(o) and no_poison(ck), (seed, name)
        assert rel_err(o.get(), tout) < TOL and rel_err(dst.get(), tst) < TOL and rel_err(ck.get(), tck) < TOL, \
            (seed, name)
    # a prefill through the split kernel (the default for float32 at any length)
    monkeypatch.setattr(gdn, "GDN_SPLIT_MAX_TPS", None)
    T = 40
    q, k, v, a, b, A_log, dtb, state = gdn_inputs(rng, T, 1)
    gg, bb = gdn.gdn_gates(a, b, A_log, dtb)
    tst = state.copy()
    tout = gdn.gated_delta_prefill(q, k, v, gg, bb, tst, 0, 16)
    dst = g(state)
    o = gdn.gated_delta_prefill(g(q), g(k), g(v), g(gg), g(bb), dst, 0, 16)
    assert rel_err(o.get(), tout) < TOL and rel_err(dst.get(), tst) < TOL, seed
