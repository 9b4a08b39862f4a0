"""CPU checks of the tensor-core BF16 GEMV design (engine/kernels/cuda/dense_linear_mma.cu), no GPU needed:

* a NumPy emulation of the warp-level fragments: each lane loads 8 consecutive k of its weight rows and
  of its token's activations exactly as the kernel does, the registers are placed into the operand
  matrices by the PTX ISA's m16n8k16 .bf16 layout rules (A: row = groupID (+8 for a2,a3,a6,a7), col =
  2*threadID_in_group + (i & 1) (+8 for i >= 4); B: row = 2*threadID_in_group + (i & 1) (+8 for i >= 2),
  col = groupID; C: row = groupID (+8 for c2,c3), col = 2*threadID_in_group + (i & 1)), multiplied, and
  the C fragments scattered back: the result must equal W @ X^T exactly (integer-valued data, so any
  misplaced element shows). Negative control: swapping the two k-pairs of B only (A and B permuted
  differently) gives a wrong product;
* the three-way BF16 split of float32 activations: hi + mid + lo == x exactly and each part is a BF16
  value; the 2-way split (hi + mid) is not exact (negative control); products with BF16 weights exact;
* the dispatch rule (which kernel for which rows / K / dtype / alignment; the tensor-core GEMV is the default).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from engine.kernels import linear as L

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


def _wide_floats(rng, n):
    # all 24 significand bits random, exponents over most of the normal range
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-100, 100, n) * rng.choice([-1, 1], n)).astype(np.float32)


def test_split3_exact_and_bf16_parts():
    rng = np.random.default_rng(2)
    x = np.concatenate([rng.standard_normal(100_000).astype(np.float32), _wide_floats(rng, 100_000),
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
    x = _wide_floats(rng, 10_000)
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
