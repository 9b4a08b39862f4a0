"""GPU tests of the tensor-core prefill GEMM (engine/kernels/gemm_tc.py, cuda/gemm_tc.cu): cuBLAS BF16 GEMMs on
the exact 3-way split of the float32 activations.

References: float64 ``x @ W.T`` on the exactly decoded weights (BF16 bits; NVFP4 through the twin
``engine.kernels.quant.dequantize``), and the float32-FMA kernels of dense_linear.cu / quant_linear.cu (the path
switched off through ``gemm_tc.TC_ENABLED``).

Tolerances (as tests/engine/test_kernels_mma_gpu.py, whose GEMV uses the same split): the result is a float32 sum
of the exact products x_k * w_k, so it is held elementwise to the classical float32-summation bound
K * eps32 * sum_k |x_k w_k| (eps32 = 2^-23, twice the unit roundoff, covering the tensor core's non-IEEE internal
rounding) and to a relative Frobenius error of 1e-5 (the dense kernels' tolerance). NVFP4: the global scale moves
from each weight to each output (one more float32 rounding per output, ~eps32 relative: inside the same bounds).
Sharp checks are exact: a one-hot power-of-two weight matrix reproduces the activations bit for bit (any lost
activation bit, part mix-up or layout mistake shows). The split kernel equals its NumPy twin bit for bit.
Negative controls: the 2-part split (lo dropped, ``gemm_tc.SPLITS = 2``) fails that exactness and is measurably
less accurate; a perturbed NVFP4 E4M3 scale and a perturbed global scale are caught and located; a swapped expert
changes exactly its tokens. FP8 (dense and expert stacks): nine exact part products per weight, so the bound is
(K + 9) eps32 sum_k |x_k w_k| (the dense FP8 test and the MoE's grouped GEMM, window by window); a doubled
block scale is caught and located. Every output the ops allocate is pre-filled with NaN (POISON). Seeds are fixed.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need cupy (pip install '.[gpu]')")

from engine.backend import gpu_available  # noqa: E402
from engine.kernels import dense_common  # noqa: E402
from engine.kernels import gemm_tc as TC  # noqa: E402
from engine.kernels import linear as L  # noqa: E402
from engine.kernels import moe as MO  # noqa: E402
from engine.kernels.dense_common import bf16_bits_to_float32, to_bf16_bits  # noqa: E402
from engine.kernels.quant import QuantWeight, dequantize  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to cupy"),
              pytest.mark.skipif(not TC.available(), reason="cupy's cuBLAS binding lacks gemmEx")]
EPS32 = float(np.finfo(np.float32).eps)
REL_TOL = 1e-5  # see module docstring


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)
    monkeypatch.setattr(TC, "TC_ENABLED", True)
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 17)
    monkeypatch.setattr(TC, "SPLITS", 3)
    monkeypatch.setattr(TC, "K_CHUNK", 0)


def _rng(seed):
    return np.random.default_rng(seed)


def _w64(w):
    if isinstance(w, QuantWeight):
        return dequantize(w, np.float64)
    return bf16_bits_to_float32(np.asarray(w)).astype(np.float64)


def _check_bound(y, x, w64, what):
    """Elementwise float32-summation bound and relative Frobenius error vs float64; returns the relative error."""
    y = cp.asnumpy(y).astype(np.float64)
    assert np.all(np.isfinite(y)), f"{what}: {np.count_nonzero(~np.isfinite(y))} non-finite (unwritten?) elements"
    x64 = np.asarray(x, np.float64)
    ref = x64 @ w64.T
    bound = x64.shape[1] * EPS32 * (np.abs(x64) @ np.abs(w64).T)
    err = np.abs(y - ref)
    assert np.all(err <= bound), f"{what}: max err/bound {float((err / np.maximum(bound, 1e-300)).max()):.3g}"
    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    print(f"{what}: relative error vs float64 {rel:.3g}")
    assert rel < REL_TOL, f"{what}: relative error {rel:.3g}"
    return rel


def _wide_floats(rng, n):
    # all 24 significand bits random, exponents over a wide normal range
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-60, 60, n) * rng.choice([-1, 1], n)).astype(np.float32)


def _nvfp4(rng, shape, halves=True):
    *lead, N, K = shape
    lead = tuple(lead)
    q = rng.integers(0, 256, size=lead + (N, K // 2), dtype=np.uint8)
    sc = rng.integers(0x01, 0x7E, size=lead + (N, K // 16), dtype=np.uint8)  # every E4M3 but NaN (subnormals too)
    E = lead[0] if lead else 1
    s2_rows = N // 2 if halves and N % 2 == 0 else N
    s2 = rng.uniform(0.001, 0.01, size=(E * (N // s2_rows),)).astype(np.float32)
    return QuantWeight("nvfp4", shape, q, sc, s2, s2_rows=s2_rows)


# ----------------------------------------------------------------------------------------------- the split
@pytest.mark.parametrize("K", [2560, 130, 7])  # vec4 path, scalar path (K % 4 != 0), tiny K
def test_split_kernel_equals_twin(K):
    rng = _rng(11)
    M_ = 37
    x = _wide_floats(rng, M_ * K).reshape(M_, K)
    x[0, : min(K, 4)] = [0.0, -0.0, 1.0, -3.0][: min(K, 4)]
    parts = cp.asnumpy(TC._split_rows(cp, cp.asarray(x), M_)).reshape(3, M_, K)
    for got, want, name in zip(parts, TC.split3_twin(x), ("hi", "mid", "lo")):
        np.testing.assert_array_equal(got, want, err_msg=name)
    s = sum(bf16_bits_to_float32(p).astype(np.float64) for p in parts)
    assert np.array_equal(s, x.astype(np.float64))


def test_split_kernel_gathered_tile_layout():
    """The MoE gather: padded row t*R + j of tile t holds the split of x[sorted_token[start[t] + j]] (parts of a tile
    one after the other), zero rows past the tile's count."""
    rng = _rng(12)
    T, E, k, H, R = 50, 6, 2, 64, 16
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    route = MO.moe_route_tables(cp.asarray(ids), E, rows_per_tile=R)
    P = route.tiles.max_tiles * R
    parts = cp.asnumpy(TC._split_rows(cp, cp.asarray(x), P, row_index=route.sorted_token, tiles=route.tiles, tm=R))
    st, tc_, nt = (cp.asnumpy(a) for a in (route.tiles.start, route.tiles.count, route.tiles.n_tiles))
    tok = cp.asnumpy(route.sorted_token)
    twin = TC.split3_twin(x)
    for t in range(int(nt[0])):
        for p in range(3):
            blk = parts[(3 * t + p) * R:(3 * t + p + 1) * R]
            np.testing.assert_array_equal(blk[:tc_[t]], twin[p][tok[st[t]:st[t] + tc_[t]]])
            assert not blk[tc_[t]:].any()


# ----------------------------------------------------------------------------------------------- dense
@pytest.mark.parametrize("M_,N_,K", [(64, 333, 2560), (200, 1280, 640), (17, 65, 36), (1000, 96, 130)])
def test_linear_tc_bf16_vs_float64_and_fma(monkeypatch, M_, N_, K):
    rng = _rng(21)
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((N_, K)) * 0.1)
    assert TC.use_tc(M_, w)
    y = L.linear(cp.asarray(x), cp.asarray(w))
    rel_tc = _check_bound(y, x, _w64(w), "tensor-core GEMM")
    monkeypatch.setattr(TC, "TC_ENABLED", False)
    y_old = L.linear(cp.asarray(x), cp.asarray(w))
    rel_old = _check_bound(y_old, x, _w64(w), "float32-FMA GEMM")
    print(f"M={M_} N={N_} K={K}: tensor core {rel_tc:.3g}, float32 FMA {rel_old:.3g}")


def test_linear_tc_k_chunks_same_bound(monkeypatch):
    rng = _rng(22)
    x = rng.standard_normal((128, 2560)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((512, 2560)) * 0.1)
    rels = {}
    for kc in (0, 640, 1000):  # 1000: a ragged last chunk
        monkeypatch.setattr(TC, "K_CHUNK", kc)
        rels[kc] = _check_bound(L.linear(cp.asarray(x), cp.asarray(w)), x, _w64(w), f"K_CHUNK={kc}")
    print("relative error by K chunk:", rels)


def test_linear_tc_float32_weights_are_sgemm():
    rng = _rng(23)
    x = rng.standard_normal((300, 2560)).astype(np.float32)
    w = rng.standard_normal((512, 2560)).astype(np.float32) * 0.1
    _check_bound(L.linear(cp.asarray(x), cp.asarray(w)), x, w.astype(np.float64), "SGEMM (router)")


def _one_hot_case(rng, M_=96, K=160, N_=40):
    x = _wide_floats(rng, M_ * K).reshape(M_, K)
    cols = rng.integers(0, K, N_)
    pw = 2.0 ** rng.integers(-8, 8, N_)
    w = np.zeros((N_, K), np.float32)
    w[np.arange(N_), cols] = pw
    return x, to_bf16_bits(w), (x[:, cols] * pw.astype(np.float32)).astype(np.float32)


def test_one_hot_exact_and_two_part_negative_control(monkeypatch):
    rng = _rng(24)
    x, w, want = _one_hot_case(rng)
    y = cp.asnumpy(L.linear(cp.asarray(x), cp.asarray(w)))
    np.testing.assert_array_equal(y.view(np.uint32), want.view(np.uint32))
    # negative control: lo dropped -> not exact, and measurably less accurate on random data
    monkeypatch.setattr(TC, "SPLITS", 2)
    y2 = cp.asnumpy(L.linear(cp.asarray(x), cp.asarray(w)))
    assert not np.array_equal(y2, want), "the 2-part split reproduced the activations: the check cannot fail"
    # (K = 64: a short accumulation chain, so the float32 summation error stays far below lo's 2^-16 share)
    xr = rng.standard_normal((256, 64)).astype(np.float32)
    wr = to_bf16_bits(rng.standard_normal((256, 64)) * 0.1)
    ref = xr.astype(np.float64) @ _w64(wr).T

    def r(yy):
        return float(np.linalg.norm(cp.asnumpy(yy) - ref) / np.linalg.norm(ref))
    rel2 = r(L.linear(cp.asarray(xr), cp.asarray(wr)))
    monkeypatch.setattr(TC, "SPLITS", 3)
    rel3 = r(L.linear(cp.asarray(xr), cp.asarray(wr)))
    print(f"relative error: 3 parts {rel3:.3g}, 2 parts {rel2:.3g}")
    assert rel2 > 4 * rel3


@pytest.mark.parametrize("N_,K,halves", [(256, 2560, True), (130, 96, False), (1280, 640, True)])
def test_linear_tc_nvfp4(N_, K, halves, monkeypatch):
    rng = _rng(25)
    w = _nvfp4(rng, (N_, K), halves)
    x = rng.standard_normal((150, K)).astype(np.float32)
    wg = w.to(cp)
    # the BF16 scratch is code x scale exactly (the twin without the global scale)
    bf, s2 = TC._bf16_weight(cp, wg)
    unscaled = QuantWeight("nvfp4", w.shape, w.q, w.scale, np.ones_like(w.scale2), s2_rows=w.s2_rows)
    np.testing.assert_array_equal(bf16_bits_to_float32(cp.asnumpy(bf)), dequantize(unscaled))
    y = L.linear(cp.asarray(x), wg)
    _check_bound(y, x, _w64(w), "nvfp4 tensor-core GEMM")
    # negative control 1: one E4M3 block scale changed -> caught and located in its output column
    r_ = int(rng.integers(N_))
    b_ = int(np.argmax(w.scale[r_]))  # the row's largest block scale: its change dwarfs float32 noise elsewhere
    bad = w.to(np)
    bad.scale = bad.scale.copy()
    c_ = int(bad.scale[r_, b_])
    bad.scale[r_, b_] = c_ + 8 if c_ < 0x70 else c_ - 8  # exponent + 1 or - 1: the block's weights x2 or /2
    yb = cp.asnumpy(L.linear(cp.asarray(x), bad.to(cp)))
    ref = x.astype(np.float64) @ _w64(w).T
    assert int(np.argmax(np.abs(yb - ref).max(axis=0))) == r_
    # negative control 2: the second global scale (up half) perturbed -> exactly that half's columns change
    if w.scale2.size > 1:
        bad2 = w.to(np)
        bad2.scale2 = bad2.scale2.copy()
        bad2.scale2[1] *= np.float32(1.001)
        y2 = cp.asnumpy(L.linear(cp.asarray(x), bad2.to(cp)))
        changed = np.nonzero(np.abs(y2 - cp.asnumpy(y)).max(axis=0) > 0)[0]
        assert changed.min() >= N_ // 2 and changed.size > 0.9 * (N_ // 2)


# (100, 130, 64): K % 4 != 0, the scalar path of fp8_to_bf16x3
@pytest.mark.parametrize("N_,K,rb", [(512, 2560, 128), (300, 200, 64), (1280, 640, 32), (100, 130, 64)])
def test_linear_tc_fp8(monkeypatch, N_, K, rb):
    """FP8: the nine part-by-part GEMMs on the reader's float32 weights, within the float32 bound (K + 9 terms)."""
    rng = _rng(27)
    q = rng.integers(0, 256, size=(N_, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    sc = rng.uniform(0.001, 0.02, size=(-(-N_ // rb), -(-K // 128))).astype(np.float32)
    w = QuantWeight("fp8", (N_, K), q, sc, rb=rb, cb=128)
    x = rng.standard_normal((130, K)).astype(np.float32)
    assert TC.use_tc(130, w)
    # the parts are the split of the reader's dequantised weights, bit for bit
    parts = cp.asnumpy(TC._fp8_parts(cp, w.to(cp))).reshape(3, N_, K)
    for got, want in zip(parts, TC.split3_twin(dequantize(w))):
        np.testing.assert_array_equal(got, want)
    y = L.linear(cp.asarray(x), w.to(cp))
    rel_tc = _check_bound(y, x, _w64(w), "fp8 nine-GEMM")
    monkeypatch.setattr(TC, "TC_ENABLED", False)
    rel_old = _check_bound(L.linear(cp.asarray(x), w.to(cp)), x, _w64(w), "fp8 quant_linear.cu")
    print(f"fp8 N={N_} K={K}: tensor core {rel_tc:.3g}, float32 FMA {rel_old:.3g}")
    # negative control: one block scale doubled -> caught and located in its rows (output columns)
    monkeypatch.setattr(TC, "TC_ENABLED", True)
    bad = w.to(np)
    bad.scale = bad.scale.copy()
    b0, b1 = int(rng.integers(bad.scale.shape[0])), int(rng.integers(bad.scale.shape[1]))
    bad.scale[b0, b1] *= 2
    yb = cp.asnumpy(L.linear(cp.asarray(x), bad.to(cp)))
    ref = x.astype(np.float64) @ _w64(w).T
    bound = K * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(_w64(w)).T)
    cols = set(np.nonzero((np.abs(yb - ref) > bound).any(axis=0))[0].tolist())
    assert cols and cols <= set(range(b0 * rb, min(N_, (b0 + 1) * rb))), sorted(cols)[:5]


def test_linear_tc_graph_capture_replay_bit_exact(monkeypatch):
    """cuBLAS through libcublas directly (ctypes) is captured into a CUDA graph and replays bit-exactly. (cupy's own
    binding refuses cuBLAS during capture: with that fallback caller the capture takes the float32-FMA kernels,
    and the replay must equal them.)"""
    rng = _rng(26)
    x = cp.asarray(rng.standard_normal((256, 640)).astype(np.float32))
    w = cp.asarray(to_bf16_bits(rng.standard_normal((1280, 640)) * 0.1))
    wq = _nvfp4(rng, (512, 640)).to(cp)
    backend = TC.blas_backend()
    print(f"cuBLAS caller: {TC.blas_backend(verbose=True)}")
    calls = []
    lin = TC.linear_tc
    monkeypatch.setattr(TC, "linear_tc", lambda *a, **kw: calls.append(1) or lin(*a, **kw))

    def step():
        return L.linear(x, w), L.linear(x, wq)
    if backend != "ctypes":  # the reference is the fallback the capture takes
        monkeypatch.setattr(TC, "TC_ENABLED", False)
    eager = step()
    eager = step()  # (warms the pool and the modules)
    monkeypatch.setattr(TC, "TC_ENABLED", True)
    calls.clear()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = step()
        graph = s.end_capture()
    assert len(calls) == (2 if backend == "ctypes" else 0), (backend, calls)
    for _ in range(3):
        graph.launch(stream=s)
    s.synchronize()
    for a, b in zip(out, eager):
        np.testing.assert_array_equal(cp.asnumpy(a).view(np.uint32), cp.asnumpy(b).view(np.uint32))


# ----------------------------------------------------------------------------------------------- MoE
def _fp8_stack(rng, E, N, K, blk=64):
    q = rng.integers(0, 256, size=(E, N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    sc = rng.uniform(0.001, 0.02, size=(E, -(-N // blk), -(-K // blk))).astype(np.float32)
    return QuantWeight("fp8", (E, N, K), q, sc, rb=blk, cb=blk)


def _moe_case(rng, fmt, E=24, H=256, I=96, k=5, T=300):
    if fmt == "bf16":
        gu = to_bf16_bits(rng.standard_normal((E, 2 * I, H)) * 0.1)
        dn = to_bf16_bits(rng.standard_normal((E, H, I)) * 0.1)
    elif fmt == "fp8":  # 64 x 64 blocks: scales vary along K inside every expert (down: a partial last block)
        gu, dn = _fp8_stack(rng, E, 2 * I, H), _fp8_stack(rng, E, H, I)
    else:
        gu, dn = _nvfp4(rng, (E, 2 * I, H)), _nvfp4(rng, (E, H, I), halves=False)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.random((T, k)).astype(np.float32)
    return gu, dn, x, ids, wts


def _dev(w):
    return w.to(cp) if isinstance(w, QuantWeight) else cp.asarray(w)


def _swap_experts(w, a, b):
    """Stack ``w`` with experts a and b swapped (BF16 bits or a QuantWeight: codes and every per-expert scale)."""
    E = w.shape[0]
    order = np.arange(E)
    order[[a, b]] = order[[b, a]]
    if not isinstance(w, QuantWeight):
        return w[order]
    if w.fmt == "fp8":
        return QuantWeight("fp8", w.shape, w.q[order], w.scale[order], rb=w.rb, cb=w.cb)
    return QuantWeight("nvfp4", w.shape, w.q[order], w.scale[order], w.scale2.reshape(E, -1)[order].reshape(-1),
                       s2_rows=w.s2_rows)


@pytest.mark.parametrize("fmt", ["bf16", "nvfp4", "fp8"])
@pytest.mark.parametrize("R", [16, 64])
def test_moe_experts_tc_vs_grouped_and_float64(monkeypatch, fmt, R):
    rng = _rng(31)
    gu, dn, x, ids, wts = _moe_case(rng, fmt)
    monkeypatch.setattr(TC, "MOE_TILE_ROWS", R)
    monkeypatch.setattr(TC, "MOE_MAX_PAD", 1e9)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_FP8", 1e9)
    if fmt == "fp8":  # scratch for 5 experts: the tiles run in several windows (a window's experts: <= its tiles)
        monkeypatch.setattr(TC, "MOE_FP8_SCRATCH_BYTES", 5 * 6 * 2 * 96 * 256)
    T, k = ids.shape
    assert TC.use_tc_moe(T, k, gu.shape[0], gu, dn)
    assert TC.available(grouped=True), f"no batched GEMM: caller {TC.blas_backend(verbose=True)}"
    sh = rng.standard_normal((T, x.shape[1])).astype(np.float32)
    sg = rng.standard_normal((T, 1)).astype(np.float32)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(wts), _dev(gu), _dev(dn))
    out = MO.moe_experts(*args, shared=cp.asarray(sh), shared_gate=cp.asarray(sg))
    ref = MO.moe_experts(x.astype(np.float64), ids, wts.astype(np.float64), gu, dn, shared=sh.astype(np.float64),
                         shared_gate=sg.astype(np.float64))
    o = cp.asnumpy(out).astype(np.float64)
    assert np.all(np.isfinite(o))
    rel = float(np.linalg.norm(o - ref) / np.linalg.norm(ref))
    monkeypatch.setattr(TC, "TC_ENABLED", False)
    old = cp.asnumpy(MO.moe_experts(*args, shared=cp.asarray(sh), shared_gate=cp.asarray(sg))).astype(np.float64)
    rel_old = float(np.linalg.norm(old - ref) / np.linalg.norm(ref))
    print(f"moe {fmt} R={R}: tensor core {rel:.3g}, grouped float32 path {rel_old:.3g} (vs float64)")
    assert rel < REL_TOL and rel_old < REL_TOL
    # negative control: experts a and b swapped in down -> exactly their tokens change
    monkeypatch.setattr(TC, "TC_ENABLED", True)
    a, b = int(ids[0, 0]), int(ids[0, 1])
    bad = _swap_experts(dn, a, b)
    ob = cp.asnumpy(MO.moe_experts(args[0], args[1], args[2], args[3], _dev(bad), shared=cp.asarray(sh),
                                   shared_gate=cp.asarray(sg)))
    users = {t for t in range(T) if a in ids[t] or b in ids[t]}
    assert {int(t) for t in np.nonzero(np.abs(ob - o).max(1) > 1e-6)[0]} == users


@pytest.mark.parametrize("budget_experts", [1, 3, 1000])
def test_moe_fp8_grouped_gemm_within_the_float32_bound(monkeypatch, budget_experts):
    """FP8 experts, one projection (gate_up) through the windows of tiles: every valid padded row's sum of the
    three part products is held elementwise to (K + 9) eps32 sum_k |x_k w_k| against float64 on the reader's weights
    (the nine exact part products per weight, float32 accumulation), for scratches of 1 and 3 experts (windows that
    split an expert's tiles) and of all experts. Negative control: one block scale of one expert doubled is caught
    in exactly that expert's rows and that block's columns."""
    rng = _rng(35)
    E, H, I, k, T, R = 12, 256, 96, 3, 200, 16
    gu = _fp8_stack(rng, E, 2 * I, H)
    x = _wide_floats(rng, T * H).reshape(T, H)  # all 24 bits random, exponents 2^-60..2^60
    # expert 0 unused: a window's slots are not the expert ids (only the used experts are dequantised)
    ids = np.stack([1 + rng.choice(E - 1, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    monkeypatch.setattr(TC, "MOE_FP8_SCRATCH_BYTES", budget_experts * 6 * 2 * I * H)
    route = MO.moe_route_tables(cp.asarray(ids), E, rows_per_tile=R)
    tiles = route.tiles
    P = tiles.max_tiles * R
    w64 = _w64(gu)
    te, ts, tc = (cp.asnumpy(a) for a in (tiles.expert, tiles.start, tiles.count))
    nt = int(cp.asnumpy(tiles.n_tiles)[0])
    tok = cp.asnumpy(route.sorted_token)

    def run(w, xx):
        parts = TC._split_rows(cp, cp.asarray(xx), P, row_index=route.sorted_token, tiles=tiles, tm=R)
        c3 = cp.full((3 * P, 2 * I), cp.nan, dtype=cp.float32)
        TC._grouped_gemm(cp, w.to(cp), parts, c3, tiles, R, 2 * I, H)
        c3 = cp.asnumpy(c3).reshape(-1, 3, R, 2 * I)  # [tile, part, row, n]
        return (c3[:, 2] + c3[:, 1]) + c3[:, 0]  # sum3's order
    got = run(gu, x)
    x64 = x.astype(np.float64)
    rows = [(t, j, int(tok[ts[t] + j])) for t in range(nt) for j in range(tc[t])]
    assert len(rows) == T * k
    worst = 0.0
    for t, j, s in rows:
        ref = w64[te[t]] @ x64[s]
        bound = (H + 9) * EPS32 * (np.abs(w64[te[t]]) @ np.abs(x64[s]))
        err = np.abs(got[t, j].astype(np.float64) - ref)
        worst = max(worst, float((err / bound).max()))
        assert np.all(err <= bound), f"tile {t} row {j}: max err/bound {float((err / bound).max()):.3g}"
    print(f"fp8 grouped GEMM, scratch of {budget_experts} experts: max err / bound {worst:.3g}")
    # negative control (standard normal activations: every row's sum is not dominated by one huge term): expert e's
    # block (1, 2) scale doubled -> caught in every row of e, in columns 64..127 only
    x = rng.standard_normal((T, H)).astype(np.float32)
    x64 = x.astype(np.float64)
    bad = gu.to(np)
    bad.scale = bad.scale.copy()
    e = int(te[nt // 2])
    bad.scale[e, 1, 2] *= 2
    gb = run(bad, x)
    caught = set()
    for t, j, s in rows:
        ref = w64[te[t]] @ x64[s]
        bound = (H + 9) * EPS32 * (np.abs(w64[te[t]]) @ np.abs(x64[s]))
        cols = np.nonzero(np.abs(gb[t, j].astype(np.float64) - ref) > bound)[0]
        if cols.size:
            assert te[t] == e and cols.min() >= 64 and cols.max() < 128, (t, j, cols[:5])
            caught.add((t, j))
    assert len(caught) == sum(int(tc[t]) for t in range(nt) if te[t] == e)


def test_moe_experts_tc_token_chunks(monkeypatch):
    """Long prefill chunks are cut into MOE_MAX_TOKENS-token passes (each routed on its own): same result within
    the float32 tolerance (cuBLAS may pick another kernel for another batch count, so not bit for bit)."""
    rng = _rng(33)
    gu, dn, x, ids, wts = _moe_case(rng, "bf16", T=300)
    monkeypatch.setattr(TC, "MOE_MAX_PAD", 1e9)
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(wts), cp.asarray(gu), cp.asarray(dn))
    ref = MO.moe_experts(x.astype(np.float64), ids, wts.astype(np.float64), gu, dn)
    whole = cp.asnumpy(MO.moe_experts(*args))
    monkeypatch.setattr(TC, "MOE_MAX_TOKENS", 128)
    chunked = cp.asnumpy(MO.moe_experts(*args))
    for y in (whole, chunked):
        assert float(np.linalg.norm(y - ref) / np.linalg.norm(ref)) < REL_TOL
    assert float(np.linalg.norm(chunked - whole) / np.linalg.norm(whole)) < REL_TOL


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_moe_experts_tc_two_part_negative_control_and_graph(monkeypatch, fmt):
    rng = _rng(32)
    gu, dn, x, ids, wts = _moe_case(rng, fmt, T=200)
    monkeypatch.setattr(TC, "MOE_MAX_PAD", 1e9)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_FP8", 1e9)
    monkeypatch.setattr(TC, "MOE_FP8_SCRATCH_BYTES", 4 * 6 * 2 * 96 * 256)  # FP8: windows of 4 tiles
    args = (cp.asarray(x), cp.asarray(ids), cp.asarray(wts), _dev(gu), _dev(dn))
    ref = MO.moe_experts(x.astype(np.float64), ids, wts.astype(np.float64), gu, dn)

    def r(o):
        return float(np.linalg.norm(cp.asnumpy(o) - ref) / np.linalg.norm(ref))
    e3 = MO.moe_experts(*args)
    monkeypatch.setattr(TC, "SPLITS", 2)
    rel2 = r(MO.moe_experts(*args))
    monkeypatch.setattr(TC, "SPLITS", 3)
    rel3 = r(e3)
    print(f"moe relative error: 3 parts {rel3:.3g}, 2 parts {rel2:.3g}")
    assert rel2 > 1.5 * rel3
    # capture + replay: bit-exact with eager (no host synchronisation in the routed path)
    route = MO.moe_route_tables(args[1], gu.shape[0], rows_per_tile=TC.MOE_TILE_ROWS)

    def step():
        return MO.moe_experts(*args, route=route)
    eager = step()
    eager = step()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = step()
        graph = s.end_capture()
    graph.launch(stream=s)
    graph.launch(stream=s)
    s.synchronize()
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint32), cp.asnumpy(eager).view(np.uint32))


# ----------------------------------------------------------------------------------------------- whole engine
@pytest.mark.parametrize("name", ["tiny", "tiny-nvfp4", "tiny-fp8"])
def test_engine_prefill_on_tensor_cores_within_selfcheck_bounds(monkeypatch, name):
    from engine import selfcheck
    from reference.paths import FIXTURES
    if not (FIXTURES / name / "golden.npz").exists():
        pytest.skip(f"fixture {name} absent")
    monkeypatch.setattr(dense_common, "POISON", False)
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 2)  # every multi-token prefill chunk (the fixtures' prompts are short)
    monkeypatch.setattr(TC, "MOE_MAX_PAD", 1e9)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_FP8", 1e9)
    monkeypatch.setattr(TC, "MOE_TILE_ROWS", 16)
    calls = {"linear": 0, "moe": 0}
    lin, moe = TC.linear_tc, TC.moe_experts_tc

    def count_lin(*a, **kw):
        calls["linear"] += 1
        return lin(*a, **kw)

    def count_moe(*a, **kw):
        calls["moe"] += 1
        return moe(*a, **kw)
    monkeypatch.setattr(TC, "linear_tc", count_lin)
    monkeypatch.setattr(TC, "moe_experts_tc", count_moe)
    f = selfcheck.fixture_figures(name, "cuda")
    print(name, f, calls)
    assert calls["linear"] > 0 and calls["moe"] > 0, calls
    assert selfcheck.verdict(f) == [], f
