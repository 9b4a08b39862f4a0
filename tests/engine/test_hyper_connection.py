"""Hyper-connection sites (engine/kernels/norms.py hc_pre / hc_combine, cuda/hc_fused.cu): the stream mix,
the injection weights, the combine, and the fused hc_pre kernels.

CPU: the twin against float64 formulas (``hc_ref64``), TOL32 = 1e-5 relative; swapped injection streams are caught
in exactly those columns. CUDA (fused hc_pre): fused vs unfused kernels vs float64, TOL 1e-5, outputs poisoned;
negative controls caught and located; graph capture bit exact; the combine + norm kernel bit identical to the
separate ops.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import norms as N, dense_common
from engine.kernels.dense_common import KernelInputError, to_bf16_bits
from op_devices import cp, on_cuda
from op_helpers import rel, rel_dev, replayed, rms_ref64, sig64, to_f64

# the gpu marker, a skip without cupy / a GPU, and poison before every CUDA test
cuda = on_cuda("poison")


TOL32 = 1e-5  # see module docstring


# ----------------------------------------------------------------------------------------------- norms


def hc_ref64(x, nw, down, up, inj_w, hc, eps):
    T, W = x.shape
    H = W // hc
    n = rms_ref64(x, nw, H, eps)
    a = n @ to_f64(down).T / hc
    a = a * sig64(a)
    m = sig64(a @ to_f64(up).T)
    mixed = sum((m * n)[:, s * H:(s + 1) * H] for s in range(hc)) / hc
    inj = 2.0 * sig64(n @ to_f64(inj_w).T / hc)
    return mixed, inj


def test_hc_pre_and_combine(rng):
    T, hc, H, r, eps = 6, 4, 16, 8, 1e-6
    x = rng.standard_normal((T, hc * H)).astype(np.float32)
    nw = (rng.standard_normal(hc * H) * 0.1).astype(np.float32)
    down = to_bf16_bits(rng.standard_normal((r, hc * H)) * 0.2)
    up = to_bf16_bits(rng.standard_normal((hc * H, r)) * 0.2)
    inj_w = to_bf16_bits(rng.standard_normal((hc, hc * H)) * 0.2)
    o = N.hc_pre(x, nw, down, up, inj_w, hc_count=hc, eps=eps)
    mixed, inj = hc_ref64(x, nw, down, up, inj_w, hc, eps)
    assert rel(o.mixed, mixed) < TOL32 and rel(o.injection_weights, inj) < TOL32
    assert N.hc_pre(x, nw, down, up, None, hc_count=hc, eps=eps).injection_weights is None
    # negative control: swapped streams of the injection weight are caught, in exactly those columns
    bad = inj_w.copy()
    bad[[0, 2]] = bad[[2, 0]]
    ob = N.hc_pre(x, nw, down, up, bad, hc_count=hc, eps=eps)
    cols = np.nonzero(np.abs(ob.injection_weights - inj).max(axis=0) > 1e-4)[0]
    assert cols.tolist() == [0, 2]
    y = rng.standard_normal((T, H)).astype(np.float32)
    ref = x.astype(np.float64).copy()
    for s in range(hc):
        ref[:, s * H:(s + 1) * H] += y * inj[:, s:s + 1]
    assert rel(N.hc_combine(x, y, o.injection_weights), ref) < TOL32
    with pytest.raises(KernelInputError, match="block_out"):
        N.hc_combine(x, y[:, :-1], o.injection_weights)


TOL = 1e-5  # see module docstring


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)
    # the kernels take up to 16 tokens; the engine's default dispatch uses them at T = 1 only (measured faster there)
    monkeypatch.setattr(N, "HC_FUSED_MAX_TOKENS", 16)


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


@cuda
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
        ef, eu = rel_dev(getattr(of, name), getattr(o64, name)), rel_dev(getattr(ou, name), getattr(o64, name))
        assert ef <= 4 * eu + 1.2e-7 and ef < TOL, (name, ef, eu)


@cuda
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
    assert rel_dev(ob.mixed, o64.mixed) > 100 * TOL


@cuda
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


@cuda
def test_fused_captures_as_cuda_graph_bit_exact(rng, monkeypatch):
    hc, H, r, T = 4, 256, 32, 3
    nw, down, up, inj = (cp.asarray(a) for a in _weights(rng, hc, H, r, True))
    di = cp.ascontiguousarray(cp.concatenate([down, inj], axis=0))
    x = cp.asarray(rng.standard_normal((T, hc * H)).astype(np.float32))

    def step():
        return N.hc_pre(x, nw, down, up, inj, hc_count=hc, eps=1e-6, down_inject=di)
    step()
    eager = step()
    out = replayed(step, launches=3)
    assert rel_dev(out.mixed, cp.asnumpy(eager.mixed)) == 0.0
    assert rel_dev(out.injection_weights, cp.asnumpy(eager.injection_weights)) == 0.0


@cuda
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
    assert rel_dev(out, o64) < TOL and rel_dev(normed, n64) < TOL
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


@cuda
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
        assert rel_dev(outs[True], cp.asnumpy(outs[False]).astype(np.float64)) < TOL
    print("\nDENSE HC-PRE combine + input side at real widths (graph replays): " + ", ".join(line))
