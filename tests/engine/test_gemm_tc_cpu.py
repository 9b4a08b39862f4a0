"""CPU tests of the tensor-core prefill GEMM's host side (engine/kernels/gemm_tc.py): the split's NumPy twin, the
exactness facts the design rests on, and the dispatch rules. The GPU side: tests/engine/test_gemm_tc_gpu.py."""
from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from engine.kernels import gemm_tc as TC
from engine.kernels.dense_common import bf16_bits_to_float32, to_bf16_bits
from engine.kernels.quant import QuantWeight
from reference.checkpoint import E2M1_VALUES

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


def _wide_floats(rng, n):
    return (rng.uniform(1, 2, n) * 2.0 ** rng.integers(-100, 100, n) * rng.choice([-1, 1], n)).astype(np.float32)


def _f64(bits):
    return bf16_bits_to_float32(bits).astype(np.float64)


def test_split3_twin_exact():
    rng = np.random.default_rng(5)
    x = np.concatenate([rng.standard_normal(50_000).astype(np.float32), _wide_floats(rng, 50_000),
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
    x = _wide_floats(rng, 10_000)
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
    assert not TC.use_tc_moe(4096, k, E, fp8, fp8, **kw)  # FP8 experts: the grouped path
    nv = _nvfp4_weight((2, 4, 32))
    assert TC.use_tc_moe(4096, k, E, nv, nv, **kw)
    # batched-GEMM pointers 16-byte aligned: tile rows and expert sizes multiples of 8, else the grouped path
    assert not TC.use_tc_moe(4096, k, E, gu, gu, **{**kw, "tile_rows": 60})
    odd = to_bf16_bits(np.zeros((2, 3, 5), np.float32))
    assert not TC.use_tc_moe(4096, k, E, odd, gu, **kw)
    del I, H


def test_moe_max_tiles_matches_route_tables_formula():
    """The batch of the MoE's batched GEMM is the tile table's worst case (moe_route_tables: S // R + min(E, S))."""
    src = (ROOT / "engine/kernels/moe.py").read_text()
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
