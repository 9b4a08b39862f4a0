"""Tensor-core prefill GEMM (engine/kernels/gemm_tc.py, cuda/gemm_tc.cu): host side on the CPU, the GEMMs on CUDA.

CPU tests of the tensor-core prefill GEMM's host side (engine/kernels/gemm_tc.py): the split's NumPy twin, the
exactness facts the design rests on, the dispatch rules, and the MoE's tile-padded layout composed as the kernels
compose it (an emulation tied to the kernel source). The CUDA side below.

GPU tests of the tensor-core prefill GEMM (engine/kernels/gemm_tc.py, cuda/gemm_tc.cu): cuBLAS BF16 GEMMs on
the exact 3-way split of the float32 activations.

References: float64 ``x @ W.T`` on the exactly decoded weights (BF16 bits; NVFP4 through the twin
``engine.kernels.quant.dequantize``), and the float32-FMA kernels of dense_linear.cu / quant_linear.cu (the path
switched off through ``gemm_tc.TC_ENABLED``).

Tolerances (as the tensor-core GEMV's in tests/engine/test_linear.py, whose GEMV uses the same split): the result is a
float32 sum of the exact products x_k * w_k, so it is held elementwise to the classical float32-summation bound K *
eps32 * sum_k |x_k w_k| (eps32 = 2^-23, twice the unit roundoff, covering the tensor core's non-IEEE internal
rounding) and to a relative Frobenius error of 1e-5 (the dense kernels' tolerance). NVFP4: the global scale moves from
each weight to each output (one more float32 rounding per output, ~eps32 relative: inside the same bounds). Sharp
checks are exact: a one-hot power-of-two weight matrix reproduces the activations bit for bit (any lost activation
bit, part mix-up or layout mistake shows). The split kernel equals its NumPy twin bit for bit. Negative controls: the
2-part split (lo dropped, ``gemm_tc.SPLITS = 2``) fails that exactness and is measurably less accurate; a perturbed
NVFP4 E4M3 scale and a perturbed global scale are caught and located; a swapped expert changes exactly its tokens. FP8
(dense and expert stacks): nine exact part products per weight, so the bound is (K + 9) eps32 sum_k |x_k w_k| (the
dense FP8 test and the MoE's grouped GEMM, window by window); a doubled block scale is caught and located. Every
output the ops allocate is pre-filled with NaN (POISON). Seeds are fixed.
"""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.kernels import gemm_tc as TC, dense_common, linear as L, moe as MO
from engine.kernels.dense_common import bf16_bits_to_float32, to_bf16_bits
from engine.kernels.quant import QuantWeight, dequantize
from reference.checkpoint import E2M1_VALUES
from op_devices import cp, on_cuda
from op_helpers import replayed, wide_floats

# the gpu marker, a skip without cupy / a GPU, and poison before every CUDA test
cuda = on_cuda("poison",
               skipif=(cp is not None and not TC.available(), "cupy's cuBLAS binding lacks gemmEx"))


ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _f64(bits):
    return bf16_bits_to_float32(bits).astype(np.float64)


def test_split3_twin_exact():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32), wide_floats(rng, 50_000),
                        np.float32([0.0, -0.0, 1.0, np.finfo(np.float32).max, -np.finfo(np.float32).max])])
    hi, mid, lo = TC.split3_twin(x)
    assert hi.dtype == mid.dtype == lo.dtype == np.uint16 and hi.shape == x.shape
    assert np.array_equal(_f64(hi) + _f64(mid) + _f64(lo), x.astype(np.float64))
    # |mid| <= 2^-7 |x| and |lo| <= 2^-15 |x| (each part carries the next 8 significant bits)
    nz = x != 0
    assert np.all(np.abs(_f64(mid)[nz]) <= 2.0 ** -7 * np.abs(x[nz].astype(np.float64)))
    assert np.all(np.abs(_f64(lo)[nz]) <= 2.0 ** -15 * np.abs(x[nz].astype(np.float64)))


def test_split3_negative_control_two_parts_not_exact():
    rng = np.random.default_rng(6)
    x = wide_floats(rng, 10_000)
    hi, mid, lo = TC.split3_twin(x)
    two = _f64(hi) + _f64(mid)
    assert np.count_nonzero(two != x.astype(np.float64)) > 9_000  # almost every value needs its lo part
    assert np.count_nonzero(lo) > 9_000


def test_split3_twin_is_the_cuda_formula():
    """The twin's operations are common.cuh:split3's (guards the twin against drift)."""
    src = (ROOT / "engine/kernels/cuda/common.cuh").read_text()
    for frag in ("hi = __float_as_uint(x) & 0xffff0000u;", "const float r = x - __uint_as_float(hi);",
                 "mid = __float_as_uint(r) & 0xffff0000u;", "lo = __float_as_uint(r - __uint_as_float(mid));"):
        assert frag in src, frag


def test_nvfp4_code_times_scale_is_exact_in_bf16():
    """Every E2M1 x E4M3 product (all 16 x 255 non-NaN pairs) is a BF16 value: the scratch of nvfp4_to_bf16 is
    exact, and only the float32 global scale is left for the output."""
    e4 = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)
    e4 = e4[~np.isnan(e4)]
    p32 = (E2M1_VALUES[:, None] * e4[None, :]).astype(np.float32)
    p64 = E2M1_VALUES[:, None].astype(np.float64) * e4[None, :].astype(np.float64)
    assert np.array_equal(p32.astype(np.float64), p64)  # exact in float32
    assert not np.any(p32.view(np.uint32) & np.uint32(0xFFFF))  # and in BF16 (low 16 bits zero)
    # negative control: a product with one more significant bit is not a BF16 value
    assert np.float32(1.5 * 1.1171875).view(np.uint32) & np.uint32(0xFFFF)


def _nvfp4_weight(shape):
    *lead, N, K = shape
    lead = tuple(lead)
    E = lead[0] if lead else 1
    return QuantWeight("nvfp4", shape, np.zeros(lead + (N, K // 2), np.uint8), np.zeros(lead + (N, K // 16), np.uint8),
                       np.ones(E, np.float32), s2_rows=N)


def test_use_tc_dispatch_rule():
    w = to_bf16_bits(np.ones((8, 32), np.float32))
    assert TC.use_tc(64, w, enabled=True, min_rows=64)
    assert not TC.use_tc(63, w, enabled=True, min_rows=64)   # decode / short chunks: the existing kernels
    assert TC.use_tc(1, w, enabled=True, min_rows=0) and not TC.use_tc(0, w, enabled=True, min_rows=0)
    assert not TC.use_tc(4096, w, enabled=False, min_rows=64)  # the A/B switch
    assert TC.use_tc(4096, np.ones((8, 32), np.float32), enabled=True, min_rows=64)  # float32: SGEMM
    assert TC.use_tc(4096, _nvfp4_weight((8, 32)), enabled=True, min_rows=64)
    fp8 = QuantWeight("fp8", (8, 32), np.zeros((8, 32), np.uint8), np.ones((1, 1), np.float32), rb=128, cb=128)
    assert TC.use_tc(4096, fp8, enabled=True, min_rows=64, fp8=True)  # nine GEMMs on the weight's parts
    assert not TC.use_tc(4096, fp8, enabled=True, min_rows=64, fp8=False)  # quant_linear.cu's tiled GEMM
    assert not TC.use_tc(4096, np.ones((8, 32), np.float64), enabled=True, min_rows=64)


def test_use_tc_moe_padding_rule_at_real_widths():
    E, I, H, k = 512, 640, 2560, 10
    gu = to_bf16_bits(np.zeros((2, 4, 8), np.float32))  # (only the kind matters)
    kw = dict(enabled=True, min_rows=64, tile_rows=64, max_pad=4.0)
    # T = 4096: 40960 slots, (640 + 512) tiles x 64 rows = 73728 padded rows: 1.8x -> tensor cores
    assert TC.moe_tc_max_tiles(4096 * k, E, 64) == 640 + 512
    assert TC.use_tc_moe(4096, k, E, gu, gu, **kw)
    # T = 512: (80 + 512) x 64 = 37888 rows for 5120 slots (7.4x) -> the grouped GEMV tiles stay
    assert not TC.use_tc_moe(512, k, E, gu, gu, **kw)
    assert TC.use_tc_moe(512, k, E, gu, gu, **{**kw, "max_pad": 8.0})
    assert not TC.use_tc_moe(4096, k, E, gu, gu, **{**kw, "enabled": False})
    assert not TC.use_tc_moe(16, k, E, gu, gu, **{**kw, "max_pad": 1e9})  # decode: never
    f32 = np.zeros((2, 4, 8), np.float32)
    assert not TC.use_tc_moe(4096, k, E, f32, gu, **kw)  # float32 experts: the grouped path
    fp8 = QuantWeight("fp8", (2, 4, 8), np.zeros((2, 4, 8), np.uint8), np.ones((2, 1, 1), np.float32), rb=128, cb=128)
    assert TC.use_tc_moe(4096, k, E, fp8, fp8, **kw, fp8=True)  # FP8 experts: nine part GEMMs per projection
    assert not TC.use_tc_moe(4096, k, E, fp8, fp8, **kw, fp8=False)  # QWEN4EXP_TC_FP8=0: the grouped kernels
    nv = _nvfp4_weight((2, 4, 32))
    assert TC.use_tc_moe(4096, k, E, nv, nv, **kw)
    # NVFP4 (float32-FMA grouped kernels): the wider default padding bound (64): 512 tokens (7.4x) and 64 (52x)
    kw_nv = {x: v for x, v in kw.items() if x != "max_pad"}
    assert TC.use_tc_moe(512, k, E, nv, nv, **kw_nv) and TC.use_tc_moe(64, k, E, nv, nv, **kw_nv)
    assert not TC.use_tc_moe(64, 1, E, nv, nv, **kw_nv)  # 64 slots over 512 experts: (1 + 64) x 64 rows, 65x
    assert not TC.use_tc_moe(512, k, E, gu, gu, **kw_nv)  # BF16: MOE_MAX_PAD (4)
    # batched-GEMM pointers 16-byte aligned: tile rows and expert sizes multiples of 8, else the grouped path
    assert not TC.use_tc_moe(4096, k, E, gu, gu, **{**kw, "tile_rows": 60})
    odd = to_bf16_bits(np.zeros((2, 3, 5), np.float32))
    assert not TC.use_tc_moe(4096, k, E, odd, gu, **kw)
    del I, H


def test_use_tc_moe_fp8_experts_take_their_own_padding_bound(monkeypatch):
    """FP8 expert stacks are held to MOE_MAX_PAD_FP8 (not the BF16 or NVFP4 bound): 512 tokens x top-10 over 512
    experts pad 7.4x, 256 tokens 13.8x, 64 tokens 52x."""
    E, k = 512, 10
    fp8 = QuantWeight("fp8", (2, 4, 8), np.zeros((2, 4, 8), np.uint8), np.ones((2, 1, 1), np.float32), rb=128, cb=128)
    kw = dict(enabled=True, min_rows=64, tile_rows=64, fp8=True)
    # the default bound (3, from the measured prefill times in its comment): 4096 and 2048 tokens (1.8x, 2.6x) on
    # the tensor cores, 1024 (4.2x) and 512 on the grouped kernels
    assert TC.use_tc_moe(4096, k, E, fp8, fp8, **kw) and TC.use_tc_moe(2048, k, E, fp8, fp8, **kw)
    assert not TC.use_tc_moe(1024, k, E, fp8, fp8, **kw) and not TC.use_tc_moe(512, k, E, fp8, fp8, **kw)
    monkeypatch.setattr(TC, "MOE_MAX_PAD", 1.0)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_NVFP4", 1e9)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_FP8", 8.0)
    assert TC.use_tc_moe(512, k, E, fp8, fp8, **kw) and not TC.use_tc_moe(256, k, E, fp8, fp8, **kw)
    monkeypatch.setattr(TC, "MOE_MAX_PAD_FP8", 16.0)
    assert TC.use_tc_moe(256, k, E, fp8, fp8, **kw) and not TC.use_tc_moe(64, k, E, fp8, fp8, **kw)


def test_moe_fp8_windows_cover_the_tiles_within_the_budget():
    """The FP8 MoE's windows: consecutive, covering every tile once, each window's experts (at most one per tile,
    at most E) inside the scratch budget; at real widths 2 GiB holds 109 experts (11 windows at 4096 tokens)."""
    N, K = 1280, 2560
    per = 6 * N * K
    for MT, E, budget in [(1152, 512, 2 << 30), (1152, 512, 1 << 40), (7, 3, 2 * per), (5, 8, 1), (1, 8, per),
                          (600, 512, 100 * per + 5)]:
        wins = TC.moe_fp8_windows(MT, E, N, K, budget)
        assert wins[0][0] == 0 and all(a + c == b for (a, c, _), (b, _, _) in zip(wins, wins[1:]))
        assert sum(c for _, c, _ in wins) == MT
        assert all(ns == min(c, E) and ns * per <= max(budget, per) for _, c, ns in wins)
    assert len(TC.moe_fp8_windows(1152, 512, N, K, 2 << 30)) == 11
    assert TC.moe_fp8_windows(1152, 512, N, K, 2 << 30)[0] == (0, 109, 109)
    assert TC.moe_fp8_windows(1152, 512, N, K, 1 << 40) == [(0, 1152, 512)]  # everything at once: E slots


def test_moe_max_tiles_matches_route_tables_formula():
    """The batch of the MoE's batched GEMM is the tile table's worst case (moe_route_tables: S // R + min(E, S))."""
    src = (ROOT / "engine/kernels/tiles.py").read_text()  # moe_route_tables
    assert "max_tiles = S // rpt + min(E, S)" in src
    for S, E, R in [(40960, 512, 64), (14, 8, 16), (3, 8, 16), (0, 8, 16)]:
        assert TC.moe_tc_max_tiles(S, E, R) == S // R + min(E, S)


def test_fp8_pair_order_smallest_first_and_complete(monkeypatch):
    """The FP8 path's nine GEMMs: every (activation part, weight part) pair once, by increasing magnitude
    2^(-8 (i + j)); with SPLITS = 2 (the negative control) the activation's lo part is dropped."""
    order = TC._pair_order()
    assert sorted(order) == [(i, j) for i in range(3) for j in range(3)]
    mags = [-(i + j) for i, j in order]
    assert mags == sorted(mags)
    monkeypatch.setattr(TC, "SPLITS", 2)
    assert sorted(TC._pair_order()) == [(i, j) for i in range(2) for j in range(3)]


def test_k_chunks_cover_k_aligned(monkeypatch):
    """The hi part's K chunks: contiguous, covering K, 8-column aligned starts, at most K_CHUNK each, near-equal."""
    monkeypatch.setattr(TC, "K_CHUNK", 1024)
    for K in (1, 7, 640, 1024, 1025, 2560, 6144, 10240, 12345):
        ch = TC._k_chunks(K, True)
        assert ch[0][0] == 0 and all(a + n == b for (a, n), (b, _) in zip(ch, ch[1:])) and sum(n for _, n in ch) == K
        assert all(a % 8 == 0 for a, _ in ch) and all(0 < n <= 1024 for _, n in ch)
        assert max(n for _, n in ch) - min(n for _, n in ch) <= 8 * len(ch)
        assert TC._k_chunks(K, False) == [(0, K)]
    monkeypatch.setattr(TC, "K_CHUNK", 0)
    assert TC._k_chunks(10240, True) == [(0, 10240)]
    monkeypatch.setattr(TC, "K_CHUNK", 4096)  # the default: K = 2560 unchunked, 6144 / 10240 in 2 / 3 chunks
    assert [len(TC._k_chunks(K, True)) for K in (2560, 6144, 10240)] == [1, 2, 3]


def test_cublas_caller_without_gpu():
    """No GPU: no cuBLAS caller, nothing available (the CPU path never needs one); the library search lists the
    sonames last."""
    if TC.cupy_or_none() is not None:
        pytest.skip("a GPU is visible")
    assert TC.blas_backend() == "none" and not TC.available() and not TC.available(grouped=True)
    assert TC._libcublas_candidates()[-3:] == ["libcublas.so.13", "libcublas.so.12", "libcublas.so"]


def test_splits_out_of_range_is_one_clear_error(monkeypatch):
    monkeypatch.setattr(TC, "SPLITS", 4)
    with pytest.raises(TC.KernelInputError, match="SPLITS"):
        TC._part_order()


def test_cpu_linear_unchanged_by_the_switch(monkeypatch):
    """The NumPy twin never takes the tensor-core path (it is float32/float64 already)."""
    from engine.kernels import linear as L
    rng = np.random.default_rng(7)
    x = rng.standard_normal((100, 32)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((16, 32)))
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 1)
    a = L.linear(x, w)
    monkeypatch.setattr(TC, "TC_ENABLED", False)
    assert np.array_equal(a, L.linear(x, w))
    assert np.array_equal(a, x @ bf16_bits_to_float32(w).T)


# ------------------------------------------------------------------ the MoE's tile-padded layout, emulated on the CPU
# Python transliterations of gemm_tc.cu's index formulas (guarded against drift by the source check below), composed
# as moe_experts_tc composes the kernels: a layout mistake between kernels (split, batched-GEMM pointers, part sums,
# slot map) shows as a wrong MoE output here, without a GPU.
def _part_row(r, p, TM, rows, interleave):
    if not interleave:
        return p * rows + r
    t = r // TM
    return (3 * t + p) * TM + (r - t * TM)


def _tables(ids, E, TM):
    """moe_tables' outputs (dense_moe.cu): experts ascending, each expert's tiles consecutive."""
    flat = ids.reshape(-1)
    S, k = flat.size, ids.shape[1]
    order = np.argsort(flat, kind="stable")
    counts = np.bincount(flat, minlength=E)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    te, ts, tc = [], [], []
    for e in range(E):
        for q in range(-(-counts[e] // TM)):
            te.append(e), ts.append(offsets[e] + q * TM), tc.append(min(TM, counts[e] - q * TM))
    slot_pos = np.empty(S, np.int64)
    slot_pos[order] = np.arange(S)
    return dict(sorted_token=order // k, slot_pos=slot_pos, expert=np.array(te), start=np.array(ts),
                count=np.array(tc), n_tiles=len(te), max_tiles=S // TM + min(E, S))


_SLOT_SLIP = False  # negative control of the FP8 windows: tile_ptrs' slot replaced by the tile's expert


def _emulate_moe_tc(x, ids, wts, gu, dn, TM, budget=None):
    T, H = x.shape
    E, I2, _ = gu.shape
    I, k = I2 // 2, ids.shape[1]
    tb = _tables(ids, E, TM)
    MT, nt = tb["max_tiles"], tb["n_tiles"]
    P = MT * TM
    parts_of = TC.split3_twin

    def split_rows(src_rows, K):  # split3_rows, interleaved: src_rows[r] = source row or -1 (zero) / -2 (skip)
        buf = np.full((3 * P, K), np.nan)
        for r in range(P):
            s = src_rows[r]
            if s == -2:
                continue
            pr = parts_of(np.zeros(K, np.float32) if s < 0 else x_src[s])
            for p in range(3):
                buf[_part_row(r, p, TM, P, 1)] = bf16_bits_to_float32(pr[p])
        return buf

    def padded_source(r, row_index):
        t = r // TM
        if t >= nt:
            return -2
        j = r - t * TM
        if j >= tb["count"][t]:
            return -1
        s = tb["start"][t] + j
        return row_index[s] if row_index is not None else s

    def grouped_gemm(w, B3):  # tile_ptrs + gemmBatchedEx: tile t's 3 TM rows times its expert's weights
        N, K = w.shape[1], w.shape[2]
        C3 = np.full((3 * P, N), np.nan)
        if not isinstance(w, QuantWeight):
            w = _f64w(w)
            for t in range(MT):
                e = tb["expert"][t] if t < nt else 0
                rows = slice(t * 3 * TM, (t + 1) * 3 * TM)  # b_tile = c_tile = 3 TM rows
                C3[rows] = B3[rows] @ w[e].T
            return C3
        te = tb["expert"]
        for t0, cnt, ns in TC.moe_fp8_windows(MT, E, N, K, budget):
            slot_expert, slot = np.full(ns, -1), {}
            for i in range(cnt):  # tile_ptrs, windowed
                t = t0 + i
                slot[t] = 0
                if t < nt:
                    d = sum(int(te[u] != te[u - 1]) for u in range(t0 + 1, t + 1))
                    if i == 0 or te[t] != te[t - 1]:
                        slot_expert[d] = te[t]
                    slot[t] = te[t] if _SLOT_SLIP else d
            # fp8_to_bf16x3 over the window's slots (unused slots: whatever the scratch held, here NaN)
            scratch = [[bf16_bits_to_float32(p).astype(np.float64) for p in TC.split3_twin(w[int(e)].dequantize())]
                       if e >= 0 else [np.full((N, K), np.nan)] * 3 for e in slot_expert]
            for t in range(t0, t0 + cnt):
                rows = slice(t * 3 * TM, (t + 1) * 3 * TM)
                s = slot[t] if slot[t] < ns else 0
                C3[rows] = sum(B3[rows] @ scratch[s][j].T for j in (2, 1, 0))  # weight parts lo, mid, hi
        return C3

    def sum3(C3, r, n):
        t, j = r // TM, r % TM
        base = (3 * t) * TM + j
        return (C3[base + 2 * TM, n] + C3[base + TM, n]) + C3[base, n]

    x_src = x
    xp3 = split_rows([padded_source(r, tb["sorted_token"]) for r in range(P)], H)
    gu3 = grouped_gemm(gu, xp3)
    h = np.zeros((P, I), np.float32)
    for r in range(P):
        t = r // TM
        if t < nt and r - t * TM < tb["count"][t]:
            g, u = sum3(gu3, r, np.arange(I)), sum3(gu3, r, I + np.arange(I))
            h[r] = (g / (1 + np.exp(-g))) * u
    x_src = h
    hp3 = split_rows([r if padded_source(r, None) >= 0 else padded_source(r, None) for r in range(P)], I)
    y3 = grouped_gemm(dn, hp3)
    y = np.array([sum3(y3, r, np.arange(H)) if r // TM < nt else np.full(H, np.nan) for r in range(P)])
    pad = np.full(ids.size, -1)
    for r in range(P):  # pad_of_sorted
        t = r // TM
        if t < nt and r - t * TM < tb["count"][t]:
            pad[tb["start"][t] + r - t * TM] = r
    sp = pad[tb["slot_pos"]]  # slot_pad
    out = np.zeros((T, H))
    for j in range(k):  # moe_combine
        out += y[sp.reshape(T, k)[:, j]] * wts[:, j:j + 1]
    return out


def _f64w(w):
    return bf16_bits_to_float32(w).astype(np.float64)


@pytest.mark.parametrize("TM", [8, 16])
def test_moe_tile_layout_emulation_equals_the_twin(TM):
    from engine.kernels import moe as MO
    rng = np.random.default_rng(8)
    E, H, I, k, T = 5, 16, 8, 2, 23
    gu = to_bf16_bits(rng.standard_normal((E, 2 * I, H)) * 0.3)
    dn = to_bf16_bits(rng.standard_normal((E, H, I)) * 0.3)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.random((T, k)).astype(np.float32)
    got = _emulate_moe_tc(x, ids, wts, gu, dn, TM)
    ref = MO.moe_experts(x.astype(np.float64), ids, wts.astype(np.float64), gu, dn)
    assert np.all(np.isfinite(got))
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-6  # float32 h only: ~1e-7
    # negative control: a layout slip (parts of a tile read with the dense stride) is caught
    bad = _part_row
    globals()["_part_row"] = lambda r, p, TM_, rows, inter: p * rows + r
    try:
        wrong = _emulate_moe_tc(x, ids, wts, gu, dn, TM)
    finally:
        globals()["_part_row"] = bad
    assert not (np.all(np.isfinite(wrong)) and np.linalg.norm(wrong - ref) / np.linalg.norm(ref) < 1e-3)


def _fp8_stack(rng, E, N, K, blk):
    q = rng.integers(0, 256, size=(E, N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    sc = rng.uniform(0.01, 0.2, size=(E, -(-N // blk), -(-K // blk))).astype(np.float32)
    return QuantWeight("fp8", (E, N, K), q, sc, rb=blk, cb=blk)


@pytest.mark.parametrize("windows", [1, 2, None])
def test_moe_tile_layout_emulation_fp8_windows_equal_the_twin(windows):
    """FP8 experts: the windows of tiles (their slot tables, the dequantised parts of each slot, three weight-part
    GEMMs) composed as the kernels compose them equal the twin's MoE on the reader's weights; a slot mix-up (the
    tile's expert used as its slot in the window's scratch) is caught."""
    global _SLOT_SLIP
    from engine.kernels import moe as MO
    rng = np.random.default_rng(9)
    E, H, I, k, T, TM = 6, 16, 8, 2, 29, 8
    gu, dn = _fp8_stack(rng, E, 2 * I, H, 8), _fp8_stack(rng, E, H, I, 8)
    x = rng.standard_normal((T, H)).astype(np.float32)
    used = np.array([0, 1, 3, 4, 5])  # expert 2 unused: slots differ from expert ids even in one window
    ids = np.stack([rng.choice(used, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    wts = rng.random((T, k)).astype(np.float32)
    budget = None if windows is None else windows * 6 * 2 * I * H  # slots of one / two experts: windows straddle
    got = _emulate_moe_tc(x, ids, wts, gu, dn, TM, budget=budget if budget else 1 << 40)
    ref = MO.moe_experts(x.astype(np.float64), ids, wts.astype(np.float64), gu, dn)
    assert np.all(np.isfinite(got))
    assert float(np.linalg.norm(got - ref) / np.linalg.norm(ref)) < 1e-6  # float32 h only: ~1e-7
    _SLOT_SLIP = True
    try:
        wrong = _emulate_moe_tc(x, ids, wts, gu, dn, TM, budget=budget if budget else 1 << 40)
    finally:
        _SLOT_SLIP = False
    assert not (np.all(np.isfinite(wrong)) and np.linalg.norm(wrong - ref) / np.linalg.norm(ref) < 1e-3)


def test_layout_formulas_are_the_kernels():
    """The emulated formulas are gemm_tc.cu's (guards the emulation above against drift)."""
    src = (ROOT / "engine/kernels/cuda/gemm_tc.cu").read_text()
    for frag in ("if (!interleave) return p * rows + r;", "return (3 * t + p) * TM + (r - t * TM);",
                 "const float* c = C3 + ((3 * t) * TM + j) * N + n;", "return (c[2 * ps] + c[ps]) + c[0];",
                 "ptrs[(long long)nw * count + i] = B + (unsigned long long)(t * (long long)b_tile);",
                 "ptrs[(long long)j * count + i] = W + (unsigned long long)(j * a_part + slot * a_stride);",
                 "for (int u = t0 + 1; u <= t; ++u) d += tile_expert[u] != tile_expert[u - 1];",
                 "if (i == 0 || tile_expert[t] != tile_expert[t - 1]) slot_expert[d] = tile_expert[t];",
                 "const long long e = slot_expert != nullptr ? (long long)slot_expert[s] : (long long)s;",
                 "if (e < 0) return;",
                 "if (j < tile_count[t]) pad[tile_start[t] + j] = (int)r;", "out[s] = p >= 0 ? pad[p] : -1;",
                 "(g / (1.f + expf(-g))) * u"):
        assert frag in src, frag
    py = (ROOT / "engine/kernels/gemm_tc.py").read_text()
    for frag in ("b_tile, c_tile = np.int64(3 * R * K * 2), np.int64(3 * R * N * 4)",
                 "blas.gemm_batched(h, _OP_T, _OP_N, N, 3 * R, K,",
                 "for j, beta in ((2, _ZERO), (1, _ONE), (0, _ONE)):",
                 "_fp8_dequant3(cp, w, scratch, ns, cap, slot_expert)"):
        assert frag in py, frag


# ------------------------------------------------------------------ the ctypes cuBLAS caller, against a fake libcublas
_FAKE_CUBLAS = r"""
#include <stddef.h>
static long long rec[24];
static float scal[2];
long long* fake_rec(void) { return rec; }
float* fake_scal(void) { return scal; }
int cublasCreate_v2(void** h) { *h = (void*)0x1234; return 0; }
int cublasSetStream_v2(void* h, void* s) { rec[0] = (long long)h; rec[1] = (long long)s; return 0; }
int cublasSetWorkspace_v2(void* h, void* w, size_t n) { rec[2] = (long long)w; rec[3] = (long long)n; return 0; }
int cublasSetMathMode(void* h, int m) { rec[4] = m; return 0; }
#define GEMM_ARGS void* h, int ta, int tb, int m, int n, int k, const float* al, const void* A, int At, int lda, \
    const void* B, int Bt, int ldb, const float* be, void* C, int Ct, int ldc
#define GEMM_REC rec[0] = (long long)h; rec[1] = ta; rec[2] = tb; rec[3] = m; rec[4] = n; rec[5] = k; \
    rec[6] = (long long)A; rec[7] = At; rec[8] = lda; rec[9] = (long long)B; rec[10] = Bt; rec[11] = ldb; \
    rec[12] = (long long)C; rec[13] = Ct; rec[14] = ldc; scal[0] = *al; scal[1] = *be;
int cublasGemmEx(GEMM_ARGS, int ct, int algo) { GEMM_REC rec[15] = -1; rec[16] = ct; rec[17] = algo;
    return m < 0 ? 7 : 0; }
int cublasGemmBatchedEx(GEMM_ARGS, int batch, int ct, int algo) { GEMM_REC rec[15] = batch; rec[16] = ct;
    rec[17] = algo; return m < 0 ? 7 : 0; }
"""


@pytest.fixture
def fake_blas(tmp_path, monkeypatch):
    import ctypes
    import shutil
    import subprocess
    if shutil.which("gcc") is None:
        pytest.skip("gcc absent: the fake libcublas cannot be built")
    src, lib = tmp_path / "fake_cublas.c", tmp_path / "libcublas.so.99"
    src.write_text(_FAKE_CUBLAS)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O0", "-o", str(lib), str(src)], check=True)
    monkeypatch.setattr(TC, "_libcublas_candidates", lambda: ["/nonexistent/libcublas.so", str(lib)])
    blas = TC._CtypesBlas()
    fake = ctypes.CDLL(str(lib))
    fake.fake_rec.restype = ctypes.POINTER(ctypes.c_longlong)
    fake.fake_scal.restype = ctypes.POINTER(ctypes.c_float)
    return blas, fake.fake_rec(), fake.fake_scal()


def test_ctypes_caller_passes_every_argument_in_place(fake_blas):
    """Every argument of cublasGemmEx / cublasGemmBatchedEx arrives where cublas_api.h puts it (a fake libcublas
    records them): a wrong or missing argtype would shift them; a non-zero status is one clear error."""
    blas, rec, scal = fake_blas
    h = blas.create()
    assert h == 0x1234 and rec[4] == TC._DISALLOW_REDUCED_PRECISION_REDUCTION

    class WS:
        class data:
            ptr = 0xABC00
    blas.bind(h, 0x77, WS)
    assert (rec[0], rec[1], rec[2], rec[3]) == (0x1234, 0x77, 0xABC00, TC._WORKSPACE_BYTES)
    args = (TC._OP_T, TC._OP_N, 11, 12, 13, TC._ONE.ctypes.data, 0x1000, TC._R_16BF, 21, 0x2000, TC._R_16BF, 22,
            TC._ZERO.ctypes.data, 0x3000, TC._R_32F, 23)
    want = [0x1234, TC._OP_T, TC._OP_N, 11, 12, 13, 0x1000, TC._R_16BF, 21, 0x2000, TC._R_16BF, 22, 0x3000, TC._R_32F,
            23]
    blas.gemm(h, *args, TC._COMPUTE_32F, TC._GEMM_DEFAULT)
    assert [rec[i] for i in range(15)] == want and (rec[15], rec[16], rec[17]) == (-1, TC._COMPUTE_32F, -1)
    assert (scal[0], scal[1]) == (1.0, 0.0)
    blas.gemm_batched(h, *args, 1152, TC._COMPUTE_32F, TC._GEMM_DEFAULT)
    assert [rec[i] for i in range(15)] == want and (rec[15], rec[16], rec[17]) == (1152, TC._COMPUTE_32F, -1)
    # negative control: the fake's error status (m < 0) is raised, naming the call and the status
    bad = (TC._OP_T, TC._OP_N, -1) + args[3:]
    with pytest.raises(RuntimeError, match="cublasGemmEx: status 7"):
        blas.gemm(h, *bad, TC._COMPUTE_32F, TC._GEMM_DEFAULT)
    with pytest.raises(RuntimeError, match="cublasGemmBatchedEx: status 7"):
        blas.gemm_batched(h, *bad, 3, TC._COMPUTE_32F, TC._GEMM_DEFAULT)


def test_ctypes_caller_refuses_a_library_without_the_symbols(tmp_path, monkeypatch):
    import shutil
    import subprocess
    if shutil.which("gcc") is None:
        pytest.skip("gcc absent")
    src, lib = tmp_path / "empty.c", tmp_path / "libempty.so"
    src.write_text("int nothing(void) { return 0; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    monkeypatch.setattr(TC, "_libcublas_candidates", lambda: [str(lib)])
    with pytest.raises(OSError, match="cublasCreate"):
        TC._CtypesBlas()


EPS32 = float(np.finfo(np.float32).eps)


REL_TOL = 1e-5  # see module docstring


@pytest.fixture
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


def _wide_floats_dev(rng, n):
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
@cuda
@pytest.mark.parametrize("K", [2560, 130, 7])  # vec4 path, scalar path (K % 4 != 0), tiny K
def test_split_kernel_equals_twin(K):
    rng = _rng(11)
    M_ = 37
    x = _wide_floats_dev(rng, M_ * K).reshape(M_, K)
    x[0, : min(K, 4)] = [0.0, -0.0, 1.0, -3.0][: min(K, 4)]
    parts = cp.asnumpy(TC._split_rows(cp, cp.asarray(x), M_)).reshape(3, M_, K)
    for got, want, name in zip(parts, TC.split3_twin(x), ("hi", "mid", "lo")):
        np.testing.assert_array_equal(got, want, err_msg=name)
    s = sum(bf16_bits_to_float32(p).astype(np.float64) for p in parts)
    assert np.array_equal(s, x.astype(np.float64))


@cuda
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
@cuda
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


@cuda
def test_linear_tc_k_chunks_same_bound(monkeypatch):
    rng = _rng(22)
    x = rng.standard_normal((128, 2560)).astype(np.float32)
    w = to_bf16_bits(rng.standard_normal((512, 2560)) * 0.1)
    rels = {}
    for kc in (0, 640, 1000):  # 1000: a ragged last chunk
        monkeypatch.setattr(TC, "K_CHUNK", kc)
        rels[kc] = _check_bound(L.linear(cp.asarray(x), cp.asarray(w)), x, _w64(w), f"K_CHUNK={kc}")
    print("relative error by K chunk:", rels)


@cuda
def test_linear_tc_float32_weights_are_sgemm():
    rng = _rng(23)
    x = rng.standard_normal((300, 2560)).astype(np.float32)
    w = rng.standard_normal((512, 2560)).astype(np.float32) * 0.1
    _check_bound(L.linear(cp.asarray(x), cp.asarray(w)), x, w.astype(np.float64), "SGEMM (router)")


def _one_hot_case(rng, M_=96, K=160, N_=40):
    x = _wide_floats_dev(rng, M_ * K).reshape(M_, K)
    cols = rng.integers(0, K, N_)
    pw = 2.0 ** rng.integers(-8, 8, N_)
    w = np.zeros((N_, K), np.float32)
    w[np.arange(N_), cols] = pw
    return x, to_bf16_bits(w), (x[:, cols] * pw.astype(np.float32)).astype(np.float32)


@cuda
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


@cuda
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
@cuda
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


@cuda
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
def _fp8_stack_dev(rng, E, N, K, blk=64):
    q = rng.integers(0, 256, size=(E, N, K), dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
    sc = rng.uniform(0.001, 0.02, size=(E, -(-N // blk), -(-K // blk))).astype(np.float32)
    return QuantWeight("fp8", (E, N, K), q, sc, rb=blk, cb=blk)


def _moe_case(rng, fmt, E=24, H=256, I=96, k=5, T=300):
    if fmt == "bf16":
        gu = to_bf16_bits(rng.standard_normal((E, 2 * I, H)) * 0.1)
        dn = to_bf16_bits(rng.standard_normal((E, H, I)) * 0.1)
    elif fmt == "fp8":  # 64 x 64 blocks: scales vary along K inside every expert (down: a partial last block)
        gu, dn = _fp8_stack_dev(rng, E, 2 * I, H), _fp8_stack_dev(rng, E, H, I)
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


@cuda
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


@cuda
@pytest.mark.parametrize("budget_experts", [1, 3, 1000])
def test_moe_fp8_grouped_gemm_within_the_float32_bound(monkeypatch, budget_experts):
    """FP8 experts, one projection (gate_up) through the windows of tiles: every valid padded row's sum of the
    three part products is held elementwise to (K + 9) eps32 sum_k |x_k w_k| against float64 on the reader's weights
    (the nine exact part products per weight, float32 accumulation), for scratches of 1 and 3 experts (windows that
    split an expert's tiles) and of all experts. Negative control: one block scale of one expert doubled is caught
    in exactly that expert's rows and that block's columns."""
    rng = _rng(35)
    E, H, I, k, T, R = 12, 256, 96, 3, 200, 16
    gu = _fp8_stack_dev(rng, E, 2 * I, H)
    x = _wide_floats_dev(rng, T * H).reshape(T, H)  # all 24 bits random, exponents 2^-60..2^60
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


@cuda
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


@cuda
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
    out = replayed(step, launches=2)
    np.testing.assert_array_equal(cp.asnumpy(out).view(np.uint32), cp.asnumpy(eager).view(np.uint32))


# ----------------------------------------------------------------------------------------------- whole engine
@cuda
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
