"""Norms (engine/kernels/norms.py): zero-centred RMSNorm over groups, the gated RMSNorm (silu / sigmoid).

CPU: the twin against float64 formulas (``rms_ref64``), TOL32 = 1e-5 relative; a norm over the wrong group size is
the negative control. CUDA: CUDA vs twin vs float64 (poisoned outputs), TOL 1e-5, with the hyper-connection ops
(hc_pre / hc_combine) of the same kernels' file.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import norms as N
from engine.kernels.dense_common import KernelInputError, to_bf16_bits
from op_devices import cp, on_cuda
from op_helpers import g, rel, rel_dev, rms_ref64, sig64, three_way

# the gpu marker, a skip without cupy / a GPU, and poison (conftest.py) before every CUDA test
cuda = on_cuda("poison")


TOL32 = 1e-5  # see module docstring


# ----------------------------------------------------------------------------------------------- norms


def test_rms_norm_grouped_and_gated(rng):
    T, hc, H, eps = 5, 4, 24, 1e-6
    x = rng.standard_normal((T, hc * H)).astype(np.float32)
    w = (rng.standard_normal(hc * H) * 0.1).astype(np.float32)
    assert rel(N.rms_norm(x, w, eps=eps, group_size=H), rms_ref64(x, w, H, eps)) < TOL32
    assert rel(N.rms_norm(x, w, eps=eps), rms_ref64(x, w, hc * H, eps)) < TOL32
    # negative control: a norm over the wrong group size is detected
    assert rel(N.rms_norm(x, w, eps=eps, group_size=H // 2), rms_ref64(x, w, H, eps)) > 1e-3
    g = rng.standard_normal((T, H)).astype(np.float32)
    xx = rng.standard_normal((T, H)).astype(np.float32)
    wg = rng.standard_normal(H).astype(np.float32)
    base = xx.astype(np.float64) / np.sqrt((xx.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + eps) * wg
    for act, fn in (("silu", lambda v: v * sig64(v)), ("sigmoid", sig64)):
        assert rel(N.gated_rms_norm(xx, g, wg, eps=eps, activation=act), base * fn(g.astype(np.float64))) < TOL32
    with pytest.raises(KernelInputError, match="activation"):
        N.gated_rms_norm(xx, g, wg, eps=eps, activation="tanh")
    with pytest.raises(KernelInputError, match="group_size"):
        N.rms_norm(x, w, eps=eps, group_size=7)


TOL = 1e-5  # see module docstring


@cuda
def test_norms_and_hc_cuda(rng):
    T, hc, H, r, eps = 7, 4, 640, 80, 1e-6
    x = rng.standard_normal((T, hc * H)).astype(np.float32)
    nw = (rng.standard_normal(hc * H) * 0.1).astype(np.float32)
    e_gpu, e_twin = three_way(N.rms_norm(g(x), g(nw), eps=eps, group_size=H), N.rms_norm(x, nw, eps=eps, group_size=H),
                              N.rms_norm(x.astype(np.float64), nw, eps=eps, group_size=H))
    assert e_gpu < TOL and e_twin < TOL
    gt = rng.standard_normal((T, H)).astype(np.float32)
    xh = rng.standard_normal((T, H)).astype(np.float32)
    wg = rng.standard_normal(H).astype(np.float32)
    for act in ("silu", "sigmoid"):
        assert rel_dev(N.gated_rms_norm(g(xh), g(gt), g(wg), eps=eps, activation=act),
                   N.gated_rms_norm(xh.astype(np.float64), gt.astype(np.float64), wg, eps=eps, activation=act)) < TOL
    down = to_bf16_bits(rng.standard_normal((r, hc * H)) * 0.05)
    up = to_bf16_bits(rng.standard_normal((hc * H, r)) * 0.05)
    inj = to_bf16_bits(rng.standard_normal((hc, hc * H)) * 0.05)
    og = N.hc_pre(g(x), g(nw), g(down), g(up), g(inj), hc_count=hc, eps=eps)
    o64 = N.hc_pre(x.astype(np.float64), nw, down, up, inj, hc_count=hc, eps=eps)
    assert rel_dev(og.mixed, o64.mixed) < TOL and rel_dev(og.injection_weights, o64.injection_weights) < TOL
    y = rng.standard_normal((T, H)).astype(np.float32)
    ref = N.hc_combine(x.astype(np.float64), y.astype(np.float64), o64.injection_weights)
    xg = g(x)
    N.hc_combine(xg, g(y), og.injection_weights, out=xg)  # in place
    assert rel_dev(xg, ref) < TOL
    # negative control: swapped injection streams are caught in exactly those columns
    bad = inj.copy()
    bad[[1, 3]] = bad[[3, 1]]
    ob = N.hc_pre(g(x), g(nw), g(down), g(up), g(bad), hc_count=hc, eps=eps)
    cols = np.nonzero(np.abs(cp.asnumpy(ob.injection_weights) - o64.injection_weights).max(0) > 1e-4)[0]
    assert cols.tolist() == [1, 3]
