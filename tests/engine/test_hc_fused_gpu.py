"""GPU tests of the fused hyper-connection input side (``engine/kernels/cuda/hc_fused.cu``, three launches
instead of six for decode-sized steps) against the unfused chain and float64.

Tolerance: the fused kernels multiply the same exactly-decoded weights by the same float32 activations as the
unfused GEMVs; only the order of the float32 sums inside the two dot products differs. A float32 sum's error
bound (gamma_n * sum |terms|) does not depend on the order, so the fused error vs float64 is bounded like the
unfused one: it must stay within 4x the unfused path's measured error (the spread between two summation orders)
plus one float32 ulp of the scale, and below the 1e-5 of the dense GEMV tests. A perturbed weight row (a fault of
about 1e-3 relative) is far outside both.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need cupy (pip install '.[gpu]')")

from engine.backend import gpu_available  # noqa: E402
from engine.kernels import dense_common  # noqa: E402
from engine.kernels import norms as N  # noqa: E402
from engine.kernels.dense_common import to_bf16_bits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to cupy")]
TOL = 1e-5  # see module docstring


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)
    # the kernels take up to 16 tokens; the engine's default dispatch uses them at T = 1 only (measured faster there)
    monkeypatch.setattr(N, "HC_FUSED_MAX_TOKENS", 16)


def rel(a, b):
    a = cp.asnumpy(a).astype(np.float64) if isinstance(a, cp.ndarray) else np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), f"{np.count_nonzero(~np.isfinite(a))} non-finite (unwritten?) elements"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def _weights(rng, hc, H, r, bf16):
    conv = to_bf16_bits if bf16 else (lambda a: a.astype(np.float32))
    nw = (rng.standard_normal(hc * H) * 0.1).astype(np.float32)
    down = conv(rng.standard_normal((r, hc * H)) * 0.05)
    up = conv(rng.standard_normal((hc * H, r)) * 0.05)
    inj = conv(rng.standard_normal((hc, hc * H)) * 0.05)
    return nw, down, up, inj


def _run(x, nw, down, up, inj, hc, fused: bool, monkeypatch):
    monkeypatch.setattr(N, "HC_FUSED_ENABLED", fused)
    di = cp.ascontiguousarray(cp.concatenate([cp.asarray(down), cp.asarray(inj)], axis=0))
    o = N.hc_pre(cp.asarray(x), cp.asarray(nw), cp.asarray(down), cp.asarray(up), cp.asarray(inj), hc_count=hc,
                 eps=1e-6, down_inject=di)
    cp.cuda.Device().synchronize()
    return o


@pytest.mark.parametrize("hc,H,r,bf16", [(4, 2560, 320, True), (2, 64, 16, True), (3, 96, 24, False),
                                         (4, 64, 16, False)])
@pytest.mark.parametrize("T", [1, 3, 4, 16])
def test_fused_matches_unfused_and_float64(rng, hc, H, r, bf16, T, monkeypatch):
    nw, down, up, inj = _weights(rng, hc, H, r, bf16)
    x = rng.standard_normal((T, hc * H)).astype(np.float32)
    assert N.hc_pre_fused_ok(T, hc, H, r, cp.asarray(down), cp.asarray(up))
    o64 = N.hc_pre(x.astype(np.float64), nw, down, up, inj, hc_count=hc, eps=1e-6)
    of = _run(x, nw, down, up, inj, hc, True, monkeypatch)
    ou = _run(x, nw, down, up, inj, hc, False, monkeypatch)
    for name in ("mixed", "injection_weights"):
        ef, eu = rel(getattr(of, name), getattr(o64, name)), rel(getattr(ou, name), getattr(o64, name))
        assert ef <= 4 * eu + 1.2e-7 and ef < TOL, (name, ef, eu)


def test_fused_negative_controls_caught_and_located(rng, monkeypatch):
    hc, H, r, T = 4, 256, 32, 2
    nw, down, up, inj = _weights(rng, hc, H, r, True)
    x = rng.standard_normal((T, hc * H)).astype(np.float32)
    o64 = N.hc_pre(x.astype(np.float64), nw, down, up, inj, hc_count=hc, eps=1e-6)
    # an up row of stream 2, feature 17 perturbed: only mixed[:, 17] moves
    bad_up = up.copy()
    bad_up[2 * H + 17] = to_bf16_bits(np.ones(r) * 0.5)
    ob = _run(x, nw, down, bad_up, inj, hc, True, monkeypatch)
    cols = np.nonzero(np.abs(cp.asnumpy(ob.mixed) - o64.mixed).max(0) > 1e-4)[0]
    assert cols.tolist() == [17]
    # swapped injection streams: caught in exactly those columns
    bad_inj = inj.copy()
    bad_inj[[0, 3]] = bad_inj[[3, 0]]
    ob = _run(x, nw, down, up, bad_inj, hc, True, monkeypatch)
    cols = np.nonzero(np.abs(cp.asnumpy(ob.injection_weights) - o64.injection_weights).max(0) > 1e-4)[0]
    assert cols.tolist() == [0, 3]
    # a down row perturbed moves every mixed feature (it feeds every up row) beyond the tolerance
    bad_down = down.copy()
    bad_down[5] = to_bf16_bits(np.ones(hc * H) * 0.05)
    ob = _run(x, nw, bad_down, up, inj, hc, True, monkeypatch)
    assert rel(ob.mixed, o64.mixed) > 100 * TOL


def test_fused_dispatch_limits(rng, monkeypatch):
    hc, H, r = 4, 64, 16
    _, down, up, _ = _weights(rng, hc, H, r, True)
    d, u = cp.asarray(down), cp.asarray(up)
    assert N.hc_pre_fused_ok(16, hc, H, r, d, u)
    assert not N.hc_pre_fused_ok(17, hc, H, r, d, u)  # prefill chunks keep the unfused chain
    assert not N.hc_pre_fused_ok(1, hc, H, 12, d, u)  # r not a multiple of 8
    assert not N.hc_pre_fused_ok(1, hc, H, 520, d, u)  # r above the register tile
    assert not N.hc_pre_fused_ok(1, 9, H, r, d, u)  # more streams than the register tile
    assert not N.hc_pre_fused_ok(1, hc, H, r, d.astype(cp.float64), u)
    assert not N.hc_pre_fused_ok(1, hc, H, r, d[:, 1:], u)  # not contiguous
    monkeypatch.setattr(N, "HC_FUSED_ENABLED", False)
    assert not N.hc_pre_fused_ok(1, hc, H, r, d, u)


def test_fused_captures_as_cuda_graph_bit_exact(rng, monkeypatch):
    hc, H, r, T = 4, 256, 32, 3
    nw, down, up, inj = (cp.asarray(a) for a in _weights(rng, hc, H, r, True))
    di = cp.ascontiguousarray(cp.concatenate([down, inj], axis=0))
    x = cp.asarray(rng.standard_normal((T, hc * H)).astype(np.float32))

    def step():
        return N.hc_pre(x, nw, down, up, inj, hc_count=hc, eps=1e-6, down_inject=di)
    step()
    eager = step()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = step()
        graph = s.end_capture()
    for _ in range(3):
        graph.launch(stream=s)
    s.synchronize()
    assert rel(out.mixed, cp.asnumpy(eager.mixed)) == 0.0
    assert rel(out.injection_weights, cp.asnumpy(eager.injection_weights)) == 0.0


@pytest.mark.parametrize("T,hc,H", [(1, 4, 2560), (5, 2, 64), (40, 3, 96), (3, 4, 300)])
def test_combine_norm_bit_identical_to_separate_ops(rng, T, hc, H):
    res = rng.standard_normal((T, hc * H)).astype(np.float32)
    y = rng.standard_normal((T, H)).astype(np.float32)
    inj = rng.uniform(0, 2, (T, hc)).astype(np.float32)
    nw = (rng.standard_normal(hc * H) * 0.1).astype(np.float32)
    out, normed = N.hc_combine_norm(cp.asarray(res), cp.asarray(y), cp.asarray(inj), cp.asarray(nw), eps=1e-6)
    ref_out = N.hc_combine(cp.asarray(res), cp.asarray(y), cp.asarray(inj))
    ref_norm = N.rms_norm(ref_out, cp.asarray(nw), eps=1e-6, group_size=H)
    assert cp.array_equal(out, ref_out) and cp.array_equal(normed, ref_norm)
    # and both agree with float64 (the NumPy twin) within the float32 tolerance
    o64, n64 = N.hc_combine_norm(res.astype(np.float64), y.astype(np.float64), inj.astype(np.float64), nw, eps=1e-6)
    assert rel(out, o64) < TOL and rel(normed, n64) < TOL
    # negative control: the norm weight of another stream (a wrong group) is caught in exactly that stream
    bad = nw.copy()
    bad[:H] = bad[H:2 * H]
    _, nb = N.hc_combine_norm(cp.asarray(res), cp.asarray(y), cp.asarray(inj), cp.asarray(bad), eps=1e-6)
    moved = np.abs(cp.asnumpy(nb) - n64).reshape(T, hc, H).max(axis=(0, 2)) > 1e-4
    assert moved.tolist() == [True] + [False] * (hc - 1)


def _graph_us(fn, reps: int = 200) -> float:
    """Median CUDA-event time of one replay of ``fn`` captured 10 times in a graph (us per call)."""
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        fn()
        s.synchronize()
        s.begin_capture()
        for _ in range(10):
            fn()
        graph = s.end_capture()
        graph.launch(stream=s)
        times = []
        for _ in range(reps // 10):
            a, b = cp.cuda.Event(), cp.cuda.Event()
            a.record(s)
            graph.launch(stream=s)
            b.record(s)
            b.synchronize()
            times.append(cp.cuda.get_elapsed_time(a, b) * 1e3 / 10)
    return float(np.median(times))


def test_fused_hc_pre_timing_printed(rng, monkeypatch):
    """Prints the real-width timing (information for ci/gpu's summary, not asserted: no timed assertions); asserts
    only that both paths ran and agree."""
    hc, H, r = 4, 2560, 320
    nw, down, up, inj = (cp.asarray(a) for a in _weights(rng, hc, H, r, True))
    di = cp.ascontiguousarray(cp.concatenate([down, inj], axis=0))
    line = []
    for T in (1, 16):
        res = cp.asarray(rng.standard_normal((T, hc * H)).astype(np.float32))
        y = cp.asarray(rng.standard_normal((T, H)).astype(np.float32))
        w = cp.asarray(rng.uniform(0, 2, (T, hc)).astype(np.float32))
        outs = {}
        for fused in (False, True):
            monkeypatch.setattr(N, "HC_FUSED_ENABLED", fused)
            if fused:
                def step():
                    h, nrm = N.hc_combine_norm(res, y, w, nw, eps=1e-6)
                    return N.hc_pre(h, nw, down, up, inj, hc_count=hc, eps=1e-6, down_inject=di, normed=nrm)
            else:
                def step():
                    h = N.hc_combine(res, y, w)
                    return N.hc_pre(h, nw, down, up, inj, hc_count=hc, eps=1e-6, down_inject=di)
            outs[fused] = step().mixed
            line.append(f"T={T} {'fused' if fused else 'unfused'} {_graph_us(step):.1f} us")
        assert rel(outs[True], cp.asnumpy(outs[False]).astype(np.float64)) < TOL
    print("\nDENSE HC-PRE combine + input side at real widths (graph replays): " + ", ".join(line))
