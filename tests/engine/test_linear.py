"""Linear / GEMV: the dense linear and grouped linear (engine/kernels/linear.py, cuda/dense_linear.cu) and the
tensor-core BF16 GEMV (cuda/dense_linear_mma.cu), on the CPU (NumPy twins, fragment emulation, dispatch rules)
and on CUDA.

CPU twin tests draw random inputs from the test's fixed seed (``rng`` of tests/conftest.py, printed) and compare
with independent float64 formulas written here. Tolerance: ||out - ref|| / ||ref|| < 1e-5 (TOL32): float32
arithmetic over K <= 96 terms lands near 1e-7..1e-6, a single perturbed weight gives > 1e-3.

CUDA tests: CUDA vs NumPy twin (float32) vs float64 (the twin on float64 inputs); every output the ops allocate is
poisoned (NaN / -7, ``dense_common.POISON``) so unwritten elements fail the finiteness check. TOL 1e-5: both sides
use the same exactly-decoded weights, only float32 summation orders differ (~1e-7..1e-6 for K <= 2560).

Tensor-core GEMV (CPU): a NumPy emulation of the warp-level m16n8k16 .bf16 fragments must reproduce W @ X^T exactly
(integer data; swapping B's k-pairs only is the negative control); the three-way BF16 split of float32 activations
is exact (the 2-way split is not); the dispatch rule (the tensor-core GEMV is the default).
Tensor-core GEMV (CUDA): vs float64 ``x @ W.T`` on the decoded BF16 weights and vs the float32-FMA GEMV (MMA path
switched off through ``linear.MMA_GEMV_ENABLED``). Each output element within K * eps32 * sum_k |x_k w_k| (the
classical float32-summation bound, eps32 = 2^-23 covering the tensor core's internal rounding) and a relative
Frobenius error of 1e-5 (REL_TOL); a one-hot power-of-two weight matrix reproduces the activations bit for bit; the
2-way debug kernel fails that exactness; a perturbed weight is caught and located.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.kernels import linear as L, dense_common, moe as MO
from engine.kernels.dense_common import KernelInputError, to_bf16_bits, NULL_PTR, bf16_bits_to_float32
from engine.backend import CUDA_DIR
from op_devices import cp, on_cuda
from op_helpers import bf16_to_f64, g, rel, rel_dev, three_way, wide_floats

# the gpu marker, a skip without cupy / a GPU, and poison (conftest.py) before every CUDA test
cuda = on_cuda("poison")


TOL32 = 1e-5  # see module docstring


# ----------------------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("wkind", ["bf16", "f32"])
@pytest.mark.parametrize("M_", [1, 5, 40])
def test_linear_twin_matches_float64(rng, wkind, M_):
    K, Nn = 96, 24
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w32 = rng.standard_normal((Nn, K)).astype(np.float32)
    w = to_bf16_bits(w32) if wkind == "bf16" else w32
    w64 = bf16_to_f64(w) if wkind == "bf16" else w32.astype(np.float64)
    ref = np.array([[sum(float(x[m, k]) * w64[n, k] for k in range(K)) for n in range(Nn)] for m in range(M_)])
    y = L.linear(x, w)
    assert y.dtype == np.float32 and y.shape == (M_, Nn)
    assert rel(y, ref) < TOL32
    # out= is written in full
    out = np.full((M_, Nn), np.nan, np.float32)
    L.linear(x, w, out=out)
    assert rel(out, ref) < TOL32
    # negative control: one perturbed weight is caught and located in its output column
    bad = w.copy()
    # the perturbed input column is the one with the largest |x|: the fault's output error (4 |x[:, c]|)
    # is then always far above the tolerance (a small |x[:, c]| once hid it for M_ = 1)
    r, c = int(rng.integers(Nn)), int(np.argmax(np.abs(x).max(axis=0)))
    bad[r, c] = to_bf16_bits(np.float32(w64[r, c] + 4.0)) if wkind == "bf16" else np.float32(w64[r, c] + 4.0)
    yb = L.linear(x, bad)
    assert rel(yb, ref) > 100 * TOL32
    col_err = np.abs(yb.astype(np.float64) - ref).max(axis=0)
    assert int(np.argmax(col_err)) == r


def test_linear_bad_input_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(KernelInputError, match="w"):
        L.linear(x, np.zeros((3, 9), np.float32))
    with pytest.raises(KernelInputError, match="weight"):
        L.linear(x, np.zeros((3, 8), np.int32))
    with pytest.raises(KernelInputError, match="out"):
        L.linear(x, np.zeros((3, 8), np.float32), out=np.zeros((2, 2), np.float32))


def test_grouped_linear_twin(rng):
    E, Nn, K, R = 5, 12, 40, 9
    w = to_bf16_bits(rng.standard_normal((E, Nn, K)))
    counts = rng.integers(0, 5, size=E)
    S = int(counts.sum())
    offsets = np.concatenate([[0], np.cumsum(counts)])
    x = rng.standard_normal((R, K)).astype(np.float32)
    row_index = rng.integers(0, R, size=S).astype(np.int32)
    y = L.grouped_linear(x, w, offsets, row_index=row_index)
    w64 = bf16_to_f64(w)
    ref = np.zeros((S, Nn))
    for s in range(S):
        e = int(np.searchsorted(offsets, s, side="right") - 1)
        ref[s] = w64[e] @ x[row_index[s]].astype(np.float64)
    assert rel(y, ref) < TOL32
    # negative control: two experts' weights swapped -> exactly their rows are wrong
    used = [e for e in range(E) if counts[e] > 0]
    if len(used) >= 2:
        a, b = used[0], used[1]
        ws = w.copy()
        ws[[a, b]] = ws[[b, a]]
        ys = L.grouped_linear(x, ws, offsets, row_index=row_index)
        bad_rows = np.nonzero(np.abs(ys - ref).max(axis=1) > 1e-3)[0]
        expect = np.r_[offsets[a]:offsets[a + 1], offsets[b]:offsets[b + 1]]
        assert set(bad_rows.tolist()) == set(expect.tolist())
    with pytest.raises(KernelInputError, match="offsets"):
        L.grouped_linear(x, w, offsets[::-1], row_index=row_index)


ROOT = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------- fragment emulation (one warp, one 32-k step)
def _lane_loads(rows8: np.ndarray, t: int) -> np.ndarray:
    """The 8 consecutive k (8t .. 8t+7) a lane with threadID_in_group t loads from a row (16-byte load)."""
    return rows8[..., 8 * t: 8 * t + 8]


def _emulate_step(W: np.ndarray, X: np.ndarray, b_pairs=((0, 1), (0, 1))) -> np.ndarray:
    """One warp step: W [16, 32] (features x k), X [8, 32] (tokens x k) -> C [16, 8] = sum of 2 MMAs.

    ``b_pairs[h]`` = which of the lane's two 2-element pairs of the h-th MMA half (elements 4h..4h+3)
    form its B registers b0b1 and b2b3; the kernel uses (0, 1) in both halves (the same as for A).
    """
    C = np.zeros((16, 8), dtype=np.float64)
    for half in range(2):  # first MMA: lane elements 0..3, second: 4..7
        A = np.full((16, 16), np.nan)
        B = np.full((16, 8), np.nan)
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            wa = _lane_loads(W[g], t)[4 * half: 4 * half + 4]      # row g: 2 pairs (a0a1, a4a5)
            wb = _lane_loads(W[g + 8], t)[4 * half: 4 * half + 4]  # row g+8: (a2a3, a6a7)
            xv = _lane_loads(X[g], t)[4 * half: 4 * half + 4]      # token g: (b0b1, b2b3)
            regs_a = [wa[0:2], wb[0:2], wa[2:4], wb[2:4]]           # a0a1, a2a3, a4a5, a6a7
            for i in range(8):
                val = regs_a[i // 2][i & 1]
                row = g if (i < 2 or 4 <= i < 6) else g + 8
                col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
                assert np.isnan(A[row, col])
                A[row, col] = val
            p0, p1 = b_pairs[half]
            regs_b = [xv[2 * p0: 2 * p0 + 2], xv[2 * p1: 2 * p1 + 2]]
            for i in range(4):
                row = 2 * t + (i & 1) + (8 if i >= 2 else 0)
                assert np.isnan(B[row, g])
                B[row, g] = regs_b[i // 2][i & 1]
        assert not np.isnan(A).any() and not np.isnan(B).any()  # every operand element placed once
        D = A @ B
        # scatter the C fragment back as the kernel does
        for lane in range(32):
            g, t = lane >> 2, lane & 3
            for c in range(4):
                feat = g + 8 * (c >> 1)
                tok = 2 * t + (c & 1)
                C[feat, tok] += D[feat, tok]
    return C


def test_fragment_mapping_reproduces_product():
    rng = np.random.default_rng(0)
    W = rng.integers(-50, 50, (16, 32)).astype(np.float64)
    X = rng.integers(-50, 50, (8, 32)).astype(np.float64)
    np.testing.assert_array_equal(_emulate_step(W, X), W @ X.T)


def test_fragment_mapping_negative_control_mismatched_permutation():
    rng = np.random.default_rng(1)
    W = rng.integers(-50, 50, (16, 32)).astype(np.float64)
    X = rng.integers(-50, 50, (8, 32)).astype(np.float64)
    bad = _emulate_step(W, X, b_pairs=((1, 0), (0, 1)))  # B's k-pairs swapped, A's not
    assert np.count_nonzero(bad != W @ X.T) > 100


def _sx_stage_map(NT: int, U: int):
    """The shared-memory staging of mma_gemv_body_sx: thread f (float4 number f of a group) holds
    x[token f // 8U][32 u + 4 (v % 8) .. + 3] (v = f % 8U, u = v // 8) and stores its two pairs at
    sx[u][token // 8][lane = (token % 8) * 4 + (v % 8) // 2][part][2 * (v % 2) .. + 1]. Returns the k index
    (within the group) and token held by every (u, j, lane, pair) slot."""
    kmap = np.full((U, NT // 8, 32, 4, 2), -1)
    tmap = np.full((U, NT // 8, 32, 4, 2), -1)
    for f in range(NT * 8 * U):
        tok, v = f // (8 * U), f % (8 * U)
        u = v // 8
        lane = (tok % 8) * 4 + (v % 8) // 2
        half = v % 2
        for q in range(4):  # the 4 floats of the float4 -> pairs 2*half, 2*half+1
            pair, el = 2 * half + q // 2, q % 2
            assert kmap[u, tok // 8, lane, pair, el] == -1
            kmap[u, tok // 8, lane, pair, el] = 32 * u + 4 * (v % 8) + q
            tmap[u, tok // 8, lane, pair, el] = tok
    return kmap, tmap


@pytest.mark.parametrize("NT,U", [(8, 4), (16, 4), (16, 2)])
def test_sx_staging_matches_lane_loads(NT, U):
    """Every B-register slot the staging fills holds what the per-lane load of the register-split path
    would give lane (g, t): token 8 j + g, k = 32 u + 8 t + (2 pair + el)."""
    kmap, tmap = _sx_stage_map(NT, U)
    for u in range(U):
        for j in range(NT // 8):
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                for pair in range(4):
                    for el in range(2):
                        assert tmap[u, j, lane, pair, el] == 8 * j + g
                        assert kmap[u, j, lane, pair, el] == 32 * u + 8 * t + 2 * pair + el
    # negative control: a staging that swapped the float4 halves would misplace k
    assert not np.array_equal(kmap[..., [1, 0, 3, 2], :], kmap)


def test_sx_staging_formula_in_source():
    """The emulated formulas are the ones in the kernel source (guards the emulation against drift)."""
    from engine.backend import cuda_source
    src = cuda_source("dense_linear_mma.cu")  # the text NVRTC compiles (the bodies live in gemv_mma.cuh)
    for frag in ("const int tokn = f / (8 * U), v = f % (8 * U);", "s_u[r] = v / 8;",
                 "s_lane[r] = (tokn % 8) * 4 + (v % 8) / 2;", "s_half[r] = v % 2;",
                 "+ s_u[r] * 8 + (v % 8);", "const int o = 2 * s_half[r];"):
        assert frag in src, frag


# ---------------------------------------------------------------- the activation split
def split3(x: np.ndarray):
    """NumPy twin of split_pair() (common.cuh:split3; the engine's twin engine.kernels.gemm_tc.split3_twin): the
    truncating BF16 split, parts as float32."""
    from engine.kernels.gemm_tc import split3_twin
    return tuple((p.astype(np.uint32) << np.uint32(16)).view(np.float32) for p in split3_twin(x))


def test_split3_exact_and_bf16_parts():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32), wide_floats(rng, 100_000),
                        np.float32([0.0, -0.0, 1.0, np.finfo(np.float32).max, -np.finfo(np.float32).max])])
    hi, mid, lo = split3(x)
    for part in (hi, mid, lo):
        assert np.all(part.view(np.uint32) & np.uint32(0xFFFF) == 0), "a part is not a BF16 value"
    # exact: the float64 sum of the parts equals x
    assert np.array_equal(hi.astype(np.float64) + mid.astype(np.float64) + lo.astype(np.float64),
                          x.astype(np.float64))
    # products with BF16 weights are exact in float32 (8 x 8 significand bits)
    w = (rng.standard_normal(x.size).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    for part in (hi[:-2], mid[:-2], lo[:-2]):  # (skip FLT_MAX: its product may overflow)
        p32 = (part * w[:-2]).astype(np.float64)
        p64 = part.astype(np.float64) * w[:-2].astype(np.float64)
        finite = np.isfinite(p32) & (np.abs(p64) > 2.0 ** -126)
        assert np.array_equal(p32[finite], p64[finite])


def test_split2_is_not_exact_negative_control():
    rng = np.random.default_rng(3)
    x = wide_floats(rng, 10_000)
    hi, mid, lo = split3(x)
    two = hi.astype(np.float64) + mid.astype(np.float64)
    assert np.count_nonzero(two != x.astype(np.float64)) > 0.9 * x.size
    # and the emulated GEMV with the 2-way split misses the float32 result by far more than rounding
    W = (rng.standard_normal((4, 64)).astype(np.float32).view(np.uint32) & np.uint32(0xFFFF0000)).view(np.float32)
    X = rng.uniform(1, 2, (3, 64)).astype(np.float32)
    h, m, lo2 = split3(X)
    exact = X.astype(np.float64) @ W.astype(np.float64).T
    three = (h.astype(np.float64) + m + lo2) @ W.astype(np.float64).T
    twoway = (h.astype(np.float64) + m) @ W.astype(np.float64).T
    assert np.array_equal(three, exact)
    assert np.abs(twoway - exact).max() > 0


# ---------------------------------------------------------------- dispatch rule
@pytest.mark.parametrize("M,K,kind,aligned,expect", [
    (1, 2560, "bf16", True, "dense_linear.cu"),       # 1 row: the FMA GEMV is already at HBM speed
    (2, 2560, "bf16", True, "dense_linear_mma.cu"),
    (4, 640, "bf16", True, "dense_linear_mma.cu"),
    (5, 2560, "bf16", True, "dense_linear_mma.cu"),
    (16, 2560, "bf16", True, "dense_linear_mma.cu"),
    (16, 2560, "f32", True, "dense_linear.cu"),       # float32 weights: not for the BF16 tensor cores
    (16, 2568, "bf16", True, "dense_linear.cu"),      # K % 32 != 0
    (16, 2560, "bf16", False, "dense_linear.cu"),     # unaligned pointers
])
def test_dispatch_rule(M, K, kind, aligned, expect):
    rpt = L.gemv_tile_rows(M)
    fname, kname, gx = L.dense_kernel_choice(kind, rpt, 131072, K, -(-M // rpt), aligned=aligned, sms=132, mma=True)
    assert fname == expect
    if fname == "dense_linear_mma.cu":
        assert kname.startswith(f"gemv_bf16_mma_nt{8 if M <= 4 else 16}_ks1_")
        assert kname.endswith("_sx") and gx * 8 * 16 >= 131072
    # the switch off: always the float32-FMA kernel
    assert L.dense_kernel_choice(kind, rpt, 131072, K, 1, aligned=aligned, sms=132, mma=False)[0] == "dense_linear.cu"


def test_dispatch_split_k_for_short_wide():
    f, k, gx = L.dense_kernel_choice("bf16", 16, 2560, 10240, 1, sms=132, mma=True)
    assert (f, k, gx) == ("dense_linear_mma.cu", "gemv_bf16_mma_nt16_ks8_mt1", 160)
    with pytest.raises(L.KernelInputError, match="rows_per_tile"):
        L.dense_kernel_choice("bf16", 8, 2560, 10240, 1, sms=132)


def test_kernel_names_exist_in_source():
    src = (ROOT / "engine/kernels/cuda/dense_linear_mma.cu").read_text()
    for M in (2, 16):
        for N in (2560, 131072):
            rpt = L.gemv_tile_rows(M)
            k = L.dense_kernel_choice("bf16", rpt, N, 2560, 1, sms=132, mma=True)[1]
            assert f"MMA_GEMV_ENTRY({k}," in src or f"MMA_GEMV_SX_ENTRY({k}," in src


def test_tensor_core_gemv_is_the_default_and_no_environment_switch_selects_another():
    assert L.MMA_GEMV_ENABLED is True
    # linear.py reads no environment switch at all (the retired GEMV switch is held absent everywhere by
    # tests/test_environment_switches.py)
    assert "QWEN4EXP_" not in (ROOT / "engine/kernels/linear.py").read_text()
    assert L.dense_kernel_choice("bf16", 16, 4096, 2560, 1, sms=132)[0] == "dense_linear_mma.cu"
    # one row, float32 weights, K not a multiple of 32: the FMA GEMV
    assert L.dense_kernel_choice("bf16", 1, 4096, 2560, 1, sms=132)[0] == "dense_linear.cu"
    assert L.dense_kernel_choice("f32", 16, 4096, 2560, 1, sms=132)[0] == "dense_linear.cu"
    assert L.dense_kernel_choice("bf16", 16, 4096, 2576, 1, sms=132)[0] == "dense_linear.cu"


TOL = 1e-5  # see module docstring


BIG = -1  # N large enough that the kernels use one K range per warp (no split-K): set from the SM count


@cuda
@pytest.mark.parametrize("wkind", ["bf16", "f32"])
@pytest.mark.parametrize("M_,K,N_", [(1, 2560, 333), (3, 96, 64), (4, 100, 40), (5, 2560, 77), (16, 320, 129),
                                      (17, 96, 70), (130, 2560, 200), (64, 36, 65), (1, 264, BIG), (3, 136, BIG),
                                      (16, 72, BIG), (7, 20, BIG)])
def test_linear_cuda(rng, wkind, M_, K, N_):
    if N_ == BIG:  # 2 blocks per SM of 32-row blocks + a ragged tail: exercises the ks=1 kernels
        N_ = 2 * dense_common.sm_count() * 32 + 13
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w32 = (rng.standard_normal((N_, K)) * 0.1).astype(np.float32)
    w = to_bf16_bits(w32) if wkind == "bf16" else w32
    y = L.linear(g(x), g(w))
    e_gpu, e_twin = three_way(y, L.linear(x, w), L.linear(x.astype(np.float64), w))
    assert e_gpu < TOL and e_twin < TOL
    # negative control: perturbed weight -> caught and located in its output column
    # the input column with the largest |x| (a random one can be near 0 and hide the fault)
    r, c = int(rng.integers(N_)), int(np.argmax(np.abs(x).max(axis=0)))
    wb = w.copy()
    wb[r, c] = to_bf16_bits(np.float32(w32[r, c] + 8.0)) if wkind == "bf16" else np.float32(w32[r, c] + 8.0)
    yb = cp.asnumpy(L.linear(g(x), g(wb)))
    ref = L.linear(x.astype(np.float64), w)
    assert rel_dev(yb, ref) > 100 * TOL
    assert int(np.argmax(np.abs(yb - ref).max(axis=0))) == r


EPS32 = float(np.finfo(np.float32).eps)


REL_TOL = 1e-5  # see module docstring


SRC = (CUDA_DIR / "dense_linear_mma.cu").read_text()


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


@cuda
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


@cuda
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


@cuda
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


@cuda
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


@cuda
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
