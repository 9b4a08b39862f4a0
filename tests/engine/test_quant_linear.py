"""Quantised GEMV (FP8 / NVFP4 weights: engine/kernels/quant.py, cuda/quant_linear.cu) on CUDA; the CPU twin
and the dispatch: tests/engine/test_engine_quant.py.

GPU tests of the quantised-weight kernels (engine/kernels/cuda/quant_linear.cu): CUDA vs the NumPy twin.

Random FP8 / NVFP4 codes and scales (every code value but the E4M3 NaN), fresh seed per run (printed);
outputs poisoned before the launch. The kernels' dequantisation is checked bit for bit against the twin
(``qdequant_*``, same products); the products against the twin in float64 with the dense kernels'
tolerance (1e-5: float32 summation order only, see tests/engine/test_linear.py). Negative controls: one
perturbed code is caught and located in its output column; a swapped expert is caught.

The decode GEMVs are the tensor-core ``qmma_*`` (FP8 / NVFP4 where the shapes fit), the streaming ``qgemv2_*``
(16-byte chunks) and the scalar ``qgemv_*_s`` (unaligned shapes); the ``impl`` fixture runs the dispatch as shipped
and with ``qmma`` off (so ``qgemv2`` serves every 16-byte shape). Every instantiated ``qgemv2`` configuration (parsed from the source) is checked to decode
bit for bit through its own fast path: with one-hot activation rows, ``y[t, n] = deq[n, k_t]`` exactly
(one product by 1.0 plus exact zeros), over all FP8 codes and every finite E4M3 scale code; every ``qmma``
entry likewise.
"""
from __future__ import annotations

import secrets

import numpy as np
import pytest

from engine.kernels import dense_common, linear as L, moe as M
from engine.kernels.dense_common import kernel
from engine.kernels.quant import QuantWeight, dequantize
from op_devices import cp, on_cuda
from op_helpers import rel_dev

# the gpu marker, a skip without cupy / a GPU, and poison (conftest.py) before every CUDA test
cuda = on_cuda("poison")


TOL = 1e-5


@pytest.fixture(params=["qmma", "qgemv2"])
def impl(request, monkeypatch):
    """The engine's GEMV dispatch: ``qmma`` = as shipped (NVFP4 with K % 128 == 0 on the tensor cores, the rest
    on qgemv2 / the scalar kernels); ``qgemv2`` = the tensor-core NVFP4 GEMV off, so qgemv2 serves those shapes."""
    monkeypatch.setattr(L, "QMMA_ENABLED", request.param == "qmma")
    return request.param


@pytest.fixture
def rng():
    seed = secrets.randbits(32)
    print(f"seed={seed}")
    return np.random.default_rng(seed)


def make(rng, fmt, shape, rb=128, cb=128):
    *lead, N, K = shape
    lead = tuple(lead)
    if fmt == "fp8":
        q = rng.integers(0, 256, size=lead + (N, K), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F  # no NaN codes
        s = rng.uniform(0.001, 0.02, size=lead + (-(-N // rb), -(-K // cb))).astype(np.float32)
        return QuantWeight("fp8", shape, q, s, rb=rb, cb=cb)
    q = rng.integers(0, 256, size=lead + (N, K // 2), dtype=np.uint8)
    sc = rng.integers(0x20, 0x48, size=lead + (N, K // 16), dtype=np.uint8)  # E4M3 ~2^-3 .. 2^2
    E = lead[0] if lead else 1
    s2 = rng.uniform(0.001, 0.01, size=(E * 2,) if N % 2 == 0 else (E,)).astype(np.float32)
    return QuantWeight("nvfp4", shape, q, sc, s2, s2_rows=N // 2 if N % 2 == 0 else N)


@cuda
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("M_,K,N_", [(1, 2560, 334), (3, 96, 64), (4, 160, 40), (5, 2560, 78), (16, 320, 130),
                                      (17, 96, 70), (130, 2560, 200), (1, 640, 4000), (2, 48, 1000),
                                      (1, 256, 9001), (3, 160, 9002), (16, 96, 9003),  # large N: 4-row warps
                                      (1, 640, 2560), (4, 640, 2563), (16, 640, 301),  # short rows (down)
                                      (1, 10240, 96), (4, 32, 33), (1, 4096, 7)])  # long rows, tails
def test_quant_linear_cuda(rng, impl, fmt, M_, K, N_):
    w = make(rng, fmt, (N_, K), rb=64 if N_ % 64 == 0 else 128)
    x = rng.standard_normal((M_, K)).astype(np.float32)
    wg = w.to(cp)
    # the kernel's decode equals the twin's bit for bit
    deq = cp.empty((N_, K), cp.float32)
    if fmt == "fp8":
        args = (wg.q, wg.scale, np.int64(0), np.int64(0), np.int32(w.rb), np.int32(w.cb), np.int32(w.scale.shape[-1]))
    else:
        args = (wg.q, wg.scale, wg.scale2, np.int64(0), np.int64(0), np.int32(w.s2_rows), np.int32(N_ // w.s2_rows))
    n = N_ * K
    kernel("quant_linear.cu", f"qdequant_{fmt}")((-(-n // 256),), (256,), args + (np.int32(1), np.int32(N_),
                                                                                np.int32(K), deq))
    np.testing.assert_array_equal(cp.asnumpy(deq).view(np.uint32), dequantize(w).view(np.uint32))
    y = L.linear(cp.asarray(x), wg)
    ref = L.linear(x.astype(np.float64), w)
    assert rel_dev(y, ref) < TOL
    # negative control: one code changed -> caught and located in its output column
    r = int(rng.integers(N_))
    wb = w.to(np)
    wb.q = wb.q.copy()
    wb.q[r, 0] ^= 0x40 if fmt == "fp8" else 0x07
    yb = cp.asnumpy(L.linear(cp.asarray(x), wb.to(cp)))
    assert int(np.argmax(np.abs(yb - ref).max(axis=0))) == r


@cuda
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("rpt", [1, 4, 16, 64])
@pytest.mark.parametrize("E,H,I,k,T", [(24, 256, 96, 5, 90), (7, 96, 640, 3, 5)])  # odd expert count, K = 640
def test_quant_moe_experts_all_tile_kinds(rng, impl, fmt, rpt, E, H, I, k, T):
    gu = make(rng, fmt, (E, 2 * I, H), rb=32)
    dn = make(rng, fmt, (E, H, I), rb=128)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    route = M.moe_route_tables(cp.asarray(ids), E, rows_per_tile=rpt)
    out = M.moe_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(w), gu.to(cp), dn.to(cp), route=route)
    ref = M.moe_experts(x.astype(np.float64), ids, w, gu, dn)
    assert rel_dev(out, ref) < TOL
    # negative control: experts a and b swapped in down -> exactly their tokens change
    a, b = int(ids[0, 0]), int(ids[0, 1])
    bad = dn.to(np)
    order = np.arange(E)
    order[[a, b]] = order[[b, a]]
    bad = QuantWeight(fmt, bad.shape, bad.q[order], bad.scale[order],
                      None if bad.scale2 is None else bad.scale2.reshape(E, -1)[order].reshape(-1), rb=bad.rb,
                      cb=bad.cb, s2_rows=bad.s2_rows)
    ob = cp.asnumpy(M.moe_experts(cp.asarray(x), cp.asarray(ids), cp.asarray(w), gu.to(cp), bad.to(cp), route=route))
    users = {t for t in range(T) if a in ids[t] or b in ids[t]}
    assert {int(t) for t in np.nonzero(np.abs(ob - cp.asnumpy(out)).max(1) > 1e-6)[0]} == users


@cuda
def test_synthetic_fill_matches_hash_twin():
    """synthetic_fill.cu's hash and fills equal their NumPy twins (parity/bench/synthetic.py) element for
    element, so a full-depth bench's device weights are what the CPU tests describe."""
    from parity.bench import synthetic as S
    for seed in (0, 12345):
        a = S._fill_u8(cp, (7, 1001), seed, 0xBF, 0)
        np.testing.assert_array_equal(cp.asnumpy(a), S._fill_u8(np, (7, 1001), seed, 0xBF, 0))
        b = S._fill_bf16(cp, (3, 999), seed)
        np.testing.assert_array_equal(cp.asnumpy(b), S._fill_bf16(np, (3, 999), seed))
    assert not np.array_equal(cp.asnumpy(S._fill_u8(cp, (5, 5), 1, 0xFF, 0)), S._fill_u8(np, (5, 5), 2, 0xFF, 0))


def _qgemv2_configs():
    """(fmt, NT, G, RL, KS, U) of every qgemv2 entry quant_linear.cu instantiates."""
    import re

    from engine.backend import CUDA_DIR
    src = (CUDA_DIR / "quant_linear.cu").read_text()
    fam = src[src.index("// qgemv2 instances begin"):src.index("// qgemv2 instances end")]
    lines = re.findall(r"QGEMV2_KS\(FMT, LD, (\d+), (\d+), (\d+), (\d+)\)", fam)
    assert len(lines) >= 3
    return [(fmt, int(nt), int(g), int(rl), ks, int(u)) for fmt in ("fp8", "nvfp4") for nt, g, rl, u in lines
            for ks in (1, 2, 4, 8)]


def _make_all_codes(rng, fmt, N, K):
    """A weight using every finite code: all FP8 codes but NaN; NVFP4 every nibble and every finite E4M3 scale
    code (zero, subnormal, negative included): the fast decodes' exactness claims cover the whole range."""
    if fmt == "fp8":
        return make(rng, fmt, (N, K), rb=16, cb=16)
    q = rng.integers(0, 256, size=(N, K // 2), dtype=np.uint8)
    sc = rng.integers(0, 256, size=(N, K // 16), dtype=np.uint8)
    sc[(sc & 0x7F) == 0x7F] = 0x7E  # no NaN scales
    s2 = rng.uniform(0.001, 10.0, size=(2,)).astype(np.float32)
    return QuantWeight("nvfp4", (N, K), q, sc, s2, s2_rows=N // 2)


def _check_one_hot_decode(rng, fmt, NT, N, K, name, rows_per_block, epl, w=None):
    """One-hot activation rows through entry ``name`` of quant_linear.cu (``NT``-row tiles, ``rows_per_block``
    weight rows per block): y[t, n] == deq[n, k_t] bit for bit (as values; the accumulator turns -0.0 into +0.0).
    The columns: every position of one random chunk of ``epl`` weights, and a random sample. Negative control: a
    changed code in a checked column is caught at that element. ``w``: the weight (default _make_all_codes)."""
    w = _make_all_codes(rng, fmt, N, K) if w is None else w
    deq = dequantize(w)
    assert np.all(np.isfinite(deq))
    wg = w.to(cp)
    c = int(rng.integers(K // epl))
    cols = np.concatenate([np.arange(c * epl, (c + 1) * epl), rng.choice(K, size=NT * 2, replace=False)])
    cols = cols[: (len(cols) // NT) * NT] if len(cols) >= NT else cols
    fn = kernel("quant_linear.cu", name)
    null = dense_common.NULL_PTR

    def run(wgpu, ks_cols):
        x = np.zeros((len(ks_cols), K), np.float32)
        x[np.arange(len(ks_cols)), ks_cols] = 1.0
        xg = cp.asarray(x)
        y = cp.full((len(ks_cols), N), np.nan, cp.float32)
        vec, fargs = L._quant_fargs(wgpu, xg, N, K)
        assert vec
        M_ = len(ks_cols)
        fn((-(-N // rows_per_block), -(-M_ // NT), 1), (256, 1, 1),
           fargs + (xg, null, y, null, null, null, null, np.int32(M_), np.int32(N), np.int32(K)))
        return cp.asnumpy(y)

    for i in range(0, len(cols), NT):
        part = cols[i:i + NT]
        y = run(wg, part)
        np.testing.assert_array_equal(y, deq[:, part].T)
    # negative control: one code of a checked column changed -> exactly that element differs
    k0 = int(cols[0])
    wb = w.to(np)
    wb.q = wb.q.copy()
    for n0 in rng.permutation(N):  # a row where the change alters the value (not under a zero scale)
        old = int(wb.q[n0, k0 if fmt == "fp8" else k0 // 2])
        new = (old ^ 0x10 if (old ^ 0x08) & 0x7F == 0x7F else old ^ 0x08) if fmt == "fp8" else \
            old ^ (0x01 if k0 % 2 == 0 else 0x10)
        wb.q[n0, k0 if fmt == "fp8" else k0 // 2] = new
        if dequantize(wb)[n0, k0] != deq[n0, k0]:
            break
        wb.q[n0, k0 if fmt == "fp8" else k0 // 2] = old
    yb = run(wb.to(cp), np.array([k0] * NT))
    assert list(np.nonzero(yb[0] != deq[:, k0])[0]) == [n0]


@cuda
@pytest.mark.parametrize("cfg", _qgemv2_configs(), ids=lambda c: "qgemv2_{}_nt{}_g{}_r{}_ks{}_u{}".format(*c))
def test_qgemv2_decodes_exactly_every_config(rng, cfg):
    """Every qgemv2 entry decodes exactly (_check_one_hot_decode)."""
    fmt, NT, G, RL, KS, U = cfg
    N, K = 70, 32 * G * KS * U + (32 if fmt == "nvfp4" else 16)  # rows: a tail; K: more than one load round
    _check_one_hot_decode(rng, fmt, NT, N, K, "qgemv2_{}_nt{}_g{}_r{}_ks{}_u{}".format(*cfg),
                          (8 // KS) * (32 // G) * RL, 32 if fmt == "nvfp4" else 16)


@cuda
@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
@pytest.mark.parametrize("NT", [1, 4, 16])
@pytest.mark.parametrize("KS", [1, 2, 4, 8])
def test_qmma_decodes_exactly_every_config(rng, fmt, NT, KS):
    """Every tensor-core entry decodes exactly (_check_one_hot_decode): NVFP4 every E2M1 code (the subnormal 0.5
    through the BF16 subnormal path included) and every finite E4M3 scale; FP8 every code but NaN, scale blocks
    of 16 x 64. K: more than one group per warp and, at 16 rows, more than one staged tile; N: a partial row
    group (and a partial scale block)."""
    kg = 128 if fmt == "nvfp4" else 64
    N, K = 70, kg * (2 * KS + 3)
    w = make(rng, "fp8", (N, K), rb=16, cb=64) if fmt == "fp8" else None
    _check_one_hot_decode(rng, fmt, NT, N, K, f"qmma_{fmt}_nt{NT}_ks{KS}", (8 // KS) * 16, kg, w=w)
