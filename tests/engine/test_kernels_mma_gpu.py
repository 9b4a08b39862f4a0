"""GPU tests of the tensor-core BF16 GEMV (engine/kernels/cuda/dense_linear_mma.cu, dispatched by
engine.kernels.linear for BF16 weights and 2..16 rows per weight pass).

References: float64 ``x @ W.T`` on the exactly decoded BF16 weights, and the float32-FMA GEMV of
dense_linear.cu (the MMA path switched off through ``linear.MMA_GEMV_ENABLED``).

Tolerances. The kernel splits every float32 activation into three BF16 parts whose sum is exact and
multiplies them with the BF16 weights on the tensor cores (exact products, float32 accumulation), so the
result is a float32 sum of the exact products x_k * w_k. Any float32 summation of K terms (in any order,
rounding to nearest or not) is within K * eps32 * sum_k |x_k w_k| of the exact sum (the classical
gamma_K bound, with eps32 = 2^-23 = twice the unit roundoff to cover the tensor core's non-IEEE internal
rounding); that worst-case bound is asserted elementwise. Statistically the errors are far smaller
(~sqrt(K) u); the relative Frobenius error is held to 1e-5 like tests/engine/test_kernels_dense_gpu.py. The
sharp checks are exact: a one-hot power-of-two weight matrix must reproduce the activations bit for bit
(this locates any fragment/permutation mistake and any lost low-order activation bits).
Negative controls: the 2-way (hi + mid) debug kernel fails the bit-exactness check; a perturbed weight
is caught and located at its (row, column) of Y; every output is pre-filled with NaN (POISON).
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need cupy (pip install '.[gpu]')")

from engine.backend import CUDA_DIR, gpu_available  # noqa: E402
from engine.kernels import dense_common  # noqa: E402
from engine.kernels import linear as L  # noqa: E402
from engine.kernels import moe as MO  # noqa: E402
from engine.kernels.dense_common import NULL_PTR, bf16_bits_to_float32, to_bf16_bits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to cupy")]
EPS32 = float(np.finfo(np.float32).eps)
REL_TOL = 1e-5  # see module docstring
SRC = (CUDA_DIR / "dense_linear_mma.cu").read_text()


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)


def _w64(w_bits):
    return bf16_bits_to_float32(np.asarray(w_bits)).astype(np.float64)


def _check_bound(y, x, w_bits, what):
    """Elementwise float32-summation bound K * eps32 * sum|x||w| and relative error vs float64."""
    y = cp.asnumpy(y).astype(np.float64)
    assert np.all(np.isfinite(y)), f"{what}: {np.count_nonzero(~np.isfinite(y))} non-finite (unwritten?) elements"
    w = _w64(w_bits)
    x64 = np.asarray(x, np.float64)
    ref = x64 @ w.T
    bound = x64.shape[1] * EPS32 * (np.abs(x64) @ np.abs(w).T)
    err = np.abs(y - ref)
    assert np.all(err <= bound), f"{what}: max err/bound {float((err / np.maximum(bound, 1e-300)).max()):.3g}"
    rel = float(np.linalg.norm(y - ref) / np.linalg.norm(ref))
    assert rel < REL_TOL, f"{what}: relative error {rel:.3g}"
    return rel


def _choice(M, N, K, rpt=None):
    rpt = L.gemv_tile_rows(M) if rpt is None else rpt
    return L.dense_kernel_choice("bf16", rpt, N, K, -(-M // rpt) if M else 1)


@pytest.mark.parametrize("K", [2560, 640])
@pytest.mark.parametrize("M_", [2, 3, 4, 8, 9, 13, 16])
@pytest.mark.parametrize("wide", [False, True])
def test_mma_linear_vs_float64_and_fma(rng, monkeypatch, M_, K, wide):
    # wide=False: N = 333 (not a multiple of 16, split-K ks8 kernel); True: enough row tiles for ks1
    N_ = dense_common.sm_count() * 128 + 13 if wide else 333
    fname, kname, _ = _choice(M_, N_, K)
    assert fname == "dense_linear_mma.cu" and ("_ks1_" if wide else "_ks8_") in kname, kname
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((N_, K)) * 0.1)
    wg = cp.asarray(w)
    y = L.linear(cp.asarray(x), wg)
    rel_mma = _check_bound(y, x, w, kname)
    monkeypatch.setattr(L, "MMA_GEMV_ENABLED", False)
    assert _choice(M_, N_, K)[0] == "dense_linear.cu"
    y_fma = L.linear(cp.asarray(x), wg)
    rel_fma = _check_bound(y_fma, x, w, "fp32-fma gemv")
    # the two kernels agree within the same float32 bound (twice: both sides err)
    d = np.abs(cp.asnumpy(y).astype(np.float64) - cp.asnumpy(y_fma))
    bound = K * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(_w64(w)).T)
    assert np.all(d <= 2 * bound)
    print(f"DENSE-MMA M={M_} N={N_} K={K} {kname}: rel err mma {rel_mma:.2e} fma {rel_fma:.2e}")


@pytest.mark.parametrize("M_,K,N_", [(16, 640, 200), (5, 2560, 77), (2, 96, 40)])
def test_mma_perturbed_weight_located(rng, M_, K, N_):
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w32 = (rng.standard_normal((N_, K)) * 0.1).astype(np.float32)
    w = to_bf16_bits(w32)
    assert _choice(M_, N_, K)[0] == "dense_linear_mma.cu"
    r, c = int(rng.integers(N_)), int(rng.integers(K))
    wb = w.copy()
    wb[r, c] = to_bf16_bits(np.float32(w32[r, c] + 8.0))
    yb = cp.asnumpy(L.linear(cp.asarray(x), cp.asarray(wb))).astype(np.float64)
    ref = x.astype(np.float64) @ _w64(w).T
    err = np.abs(yb - ref)
    bound = K * EPS32 * (np.abs(x.astype(np.float64)) @ np.abs(_w64(w)).T)
    bad = err > bound
    # exactly column r is wrong, in every row whose x[:, c] is not ~0
    assert set(np.nonzero(bad.any(0))[0].tolist()) == {r}
    clear = np.abs(x[:, c]) * 8.0 > 4 * bound[:, r]  # rows where the fault is well above the bound
    assert clear.any() and bad[clear, r].all()


def _raw(kname, x, w, M_, N_, K):
    y = cp.full((M_, N_), np.nan, dtype=cp.float32)
    rpt = 16 if "nt16" in kname else 8
    ks = 8 if "_ks8" in kname else 1
    mt = 2 if "_mt2" in kname else 1
    grid = (-(-N_ // ((8 // ks) * 16 * mt)), -(-M_ // rpt), 1)
    dense_common.kernel("dense_linear_mma.cu", kname)(
        grid, (256, 1, 1), (x, NULL_PTR, w, np.int64(0), y, NULL_PTR, NULL_PTR, NULL_PTR, NULL_PTR, np.int32(M_),
                            np.int32(N_), np.int32(K)))
    return cp.asnumpy(y)


@pytest.mark.parametrize("kname", ["gemv_bf16_mma_nt16_ks1_mt1_sx", "gemv_bf16_mma_nt8_ks1_mt1_sx",
                                   "gemv_bf16_mma_nt16_ks8_mt1", "gemv_bf16_mma_nt8_ks8_mt1",
                                   "gemv_bf16_mma_nt16_ks1_mt1"])
def test_mma_one_hot_bit_exact(rng, kname):
    """W[n, perm[n]] = 2^s (else 0): Y[m, n] must equal x[m, perm[n]] * 2^s bit for bit for every lane,
    fragment position and k-permutation slot (K = 160: five steps: full groups and tail steps)."""
    K, N_ = 160, 2 * 160 + 5
    M_ = 16 if "nt16" in kname else 8
    perm = np.concatenate([rng.permutation(K), rng.permutation(K), rng.permutation(K)[:5]])
    scale = 2.0 ** rng.integers(-3, 4, size=N_)
    w = np.zeros((N_, K), np.float32)
    w[np.arange(N_), perm] = scale
    # activations with all 24 significand bits in use (lo part non-zero) over a wide exponent range
    x = (rng.uniform(1, 2, (M_, K)) * 2.0 ** rng.integers(-40, 40, (M_, K))).astype(np.float32)
    x[0, 0] = -x[0, 0]
    y = _raw(kname, cp.asarray(x), cp.asarray(to_bf16_bits(w)), M_, N_, K)
    want = (x[:, perm] * scale[None, :].astype(np.float32))
    np.testing.assert_array_equal(y, want)
    # negative control: the 2-way split (lo dropped) is not exact on these activations
    if f"MMA_GEMV_ENTRY({kname}_split2," in SRC or f"MMA_GEMV_SX_ENTRY({kname}_split2," in SRC:
        y2 = _raw(kname + "_split2", cp.asarray(x), cp.asarray(to_bf16_bits(w)), M_, N_, K)
        assert np.isfinite(y2).all() and np.count_nonzero(y2 != want) > want.size // 2


@pytest.mark.parametrize("rpt", [4, 16])
def test_mma_grouped_tile_table(rng, rpt):
    """Grouped (MoE) operation with a device tile table and gathered rows, 2..16-row tiles."""
    E, H, N_, k, T = 12, 640, 200, 4, 23
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    route = MO.moe_route_tables(cp.asarray(ids), E, rows_per_tile=rpt)
    assert route.tiles.rows_per_tile == rpt
    assert L.dense_kernel_choice("bf16", rpt, N_, H, route.tiles.max_tiles)[0] == "dense_linear_mma.cu"
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((E, N_, H)) * 0.1)
    y = L.grouped_linear(cp.asarray(x), cp.asarray(w), route.offsets, row_index=route.sorted_token,
                         tiles=route.tiles)
    off = cp.asnumpy(route.offsets)
    st = cp.asnumpy(route.sorted_token)
    yh = cp.asnumpy(y).astype(np.float64)
    assert np.all(np.isfinite(yh))
    for e in range(E):
        a, b = off[e], off[e + 1]
        if b > a:
            xe = x[st[a:b]]
            _check_bound(cp.asarray(yh[a:b].astype(np.float32)), xe, w[e], f"expert {e}")
    # negative control: one expert's weights swapped with another's are caught at exactly its slots
    e0 = int(ids[0, 0])
    e1 = (e0 + 1) % E
    wb = w.copy()
    wb[[e0, e1]] = wb[[e1, e0]]
    yb = cp.asnumpy(L.grouped_linear(cp.asarray(x), cp.asarray(wb), route.offsets, row_index=route.sorted_token,
                                     tiles=route.tiles))
    changed = set(np.nonzero(np.abs(yb - yh).max(1) > 1e-3)[0].tolist())
    assert changed == set(range(off[e0], off[e0 + 1])) | set(range(off[e1], off[e1 + 1]))


def test_mma_timing_lm_head(rng, monkeypatch):
    """Printed, not asserted: lm_head-like 131072 x 2560 BF16 at 1/4/16 rows, MMA vs float32-FMA GEMV."""
    N_, K = 131072, 2560
    w = (cp.random.standard_normal((N_, K), dtype=cp.float32) * 0.05).view(cp.uint32) >> 16
    w = w.astype(cp.uint16)

    def med(fn, reps=15):
        for _ in range(3):
            fn()
        ev = [(cp.cuda.Event(), cp.cuda.Event()) for _ in range(reps)]
        for a, b in ev:
            a.record()
            fn()
            b.record()
        ev[-1][1].synchronize()
        return sorted(cp.cuda.get_elapsed_time(a, b) for a, b in ev)[reps // 2] * 1e3

    out = []
    for m in (1, 2, 4, 8, 16):
        x = cp.random.standard_normal((m, K), dtype=cp.float32)
        y = cp.empty((m, N_), cp.float32)
        monkeypatch.setattr(L, "MMA_GEMV_ENABLED", True)
        t_mma = med(lambda: L.linear(x, w, out=y))
        y1 = y.copy()
        monkeypatch.setattr(L, "MMA_GEMV_ENABLED", False)
        t_fma = med(lambda: L.linear(x, w, out=y))
        assert float(cp.abs(y1 - y).max()) <= 1e-3 * float(cp.abs(y).max())
        out.append(f"M={m}: mma {t_mma:.0f} us, fma {t_fma:.0f} us")
    print("DENSE-MMA timing 131072x2560 bf16 (" + w.nbytes.__str__() + " B): " + "; ".join(out))
