"""GPU tests of the dense CUDA kernels: CUDA vs NumPy twin (float32) vs float64 (the twin on float64
inputs, itself checked against independent formulas and the official modules by the CPU tests).

Random inputs from the test's fixed seed (printed); every output the ops allocate is poisoned (NaN / -7)
before the launch (``dense_common.POISON``) so unwritten elements fail the finiteness check.
Tolerances (||a - b|| / ||b||): both sides use the same exactly-decoded BF16 (or float32) weights and
float32 activations, so the only differences are float32 summation orders: ~1e-7..1e-6 seen for
K <= 2560; 1e-5 keeps a 10x margin and is far below the 1e-3 a single perturbed weight causes.
Negative controls: a perturbed weight is caught and located; a reversed tie-break is caught; a
dropped state is caught; host synchronisation is caught by CUDA-graph capture of a decode step.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need cupy (pip install '.[gpu]')")

from engine.backend import gpu_available  # noqa: E402
from engine.kernels import dense_common  # noqa: E402
from engine.kernels import linear as L  # noqa: E402
from engine.kernels import moe as M  # noqa: E402
from engine.kernels import norms as N  # noqa: E402
from engine.kernels import ple as P  # noqa: E402
from ple_helpers import ple_layer  # noqa: E402
from engine.kernels.dense_common import to_bf16_bits  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to cupy")]
TOL = 1e-5  # see module docstring


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)


def rel(a, b):
    a = cp.asnumpy(a).astype(np.float64) if isinstance(a, cp.ndarray) else np.asarray(a, np.float64)
    b = cp.asnumpy(b).astype(np.float64) if isinstance(b, cp.ndarray) else np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), f"{np.count_nonzero(~np.isfinite(a))} non-finite (unwritten?) elements"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def g(a):
    return cp.asarray(a)


def three_way(gpu_out, twin32, twin64):
    """CUDA vs twin (float32) and vs float64; returns the two relative errors."""
    cp.cuda.Device().synchronize()
    return rel(gpu_out, twin64), rel(twin32, twin64)


BIG = -1  # N large enough that the kernels use one K range per warp (no split-K): set from the SM count


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
    assert rel(yb, ref) > 100 * TOL
    assert int(np.argmax(np.abs(yb - ref).max(axis=0))) == r


def test_router_topk_cuda_tie_order(rng):
    T, E, k = 9, 512, 10
    logits = rng.standard_normal((T, E)).astype(np.float32)
    for t in range(T):  # exact ties at the top and across the k boundary
        order = np.argsort(-logits[t])
        logits[t, order[1:4]] = logits[t, order[0]]
        logits[t, order[k + 2]] = logits[t, order[k - 1]]
    ids, w = M.router_topk(g(logits), k, True)
    tid, tw = M.router_topk(logits, k, True)
    np.testing.assert_array_equal(cp.asnumpy(ids), tid)
    assert rel(w, tw) < TOL
    # negative control: the opposite tie-break (higher id first) differs from what CUDA produced
    rev = (E - 1) - np.argsort(-logits[:, ::-1], axis=-1, kind="stable")[:, :k]
    assert (rev != cp.asnumpy(ids)).any()


@pytest.mark.parametrize("T", [1, 5, 16, 17, 70])
@pytest.mark.parametrize("wkind", ["bf16", "f32"])
def test_moe_block_cuda(rng, T, wkind):  # T = 17, 70: 16-row GEMV tiles (the prefill default here)
    E, H, I, Is, k = 64, 256, 96, 80, 6

    def mk(*shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        return to_bf16_bits(a) if wkind == "bf16" else a
    W = dict(router=mk(E, H), gate_up=mk(E, 2 * I, H), down=mk(E, H, I), sg=mk(Is, H), su=mk(Is, H), sd=mk(H, Is),
             sgate=mk(1, H))
    x = rng.standard_normal((T, H)).astype(np.float32)

    def run(xx, WW):
        return M.moe_block(xx, WW["router"], WW["gate_up"], WW["down"], top_k=k, shared_gate_proj=WW["sg"],
                           shared_up_proj=WW["su"], shared_down_proj=WW["sd"], shared_expert_gate=WW["sgate"])
    og = run(g(x), {n: g(a) for n, a in W.items()})
    o32 = run(x, W)
    o64 = run(x.astype(np.float64), W)
    # ids must agree wherever the twin's probabilities are not within float32 noise of a tie
    lg = o64.router_logits
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ps = np.sort(p, axis=1)[:, ::-1]
    clear = (ps[:, k - 1] - ps[:, k]) > 1e-6
    np.testing.assert_array_equal(cp.asnumpy(og.topk_ids)[clear], o32.topk_ids[clear])
    if clear.all():
        e_gpu, e_twin = three_way(og.out, o32.out, o64.out)
        assert e_gpu < TOL and e_twin < TOL
    assert rel(og.router_logits, o64.router_logits) < TOL
    # device tables agree with the twin's
    rt = M.moe_route_tables(og.topk_ids, E)
    rn = M.moe_route_tables(cp.asnumpy(og.topk_ids), E)
    np.testing.assert_array_equal(cp.asnumpy(rt.offsets), rn.offsets)
    sp, st = cp.asnumpy(rt.slot_pos), cp.asnumpy(rt.sorted_token)
    assert sorted(sp.tolist()) == list(range(T * k))
    assert all(st[sp[s]] == s // k for s in range(T * k))
    counts = np.diff(rn.offsets)
    assert int(rt.tiles.n_tiles.get()[0]) == int(sum(-(-c // rt.rows_per_tile) for c in counts))
    # negative control: swapping two used experts' weights on the GPU is caught at their tokens
    ids = cp.asnumpy(og.topk_ids)
    a, b = int(ids[0, 0]), int(ids[0, 1])
    dn = W["down"].copy()
    dn[[a, b]] = dn[[b, a]]
    bad = cp.asnumpy(M.moe_experts(g(x), og.topk_ids, og.topk_weights, g(W["gate_up"]), g(dn)))
    good = cp.asnumpy(M.moe_experts(g(x), og.topk_ids, og.topk_weights, g(W["gate_up"]), g(W["down"])))
    users = {t for t in range(T) if a in ids[t] or b in ids[t]}
    assert {int(t) for t in np.nonzero(np.abs(bad - good).max(1) > 1e-5)[0]} == users


@pytest.mark.parametrize("rpt", [1, 4, 16, 64])
def test_moe_experts_all_tile_kinds(rng, rpt):
    """Every tile size the grouped kernels support (GEMV 1/4/16 rows, GEMM 64 rows) gives the twin's result."""
    E, H, I, k, T = 24, 136, 72, 5, 90
    gu = to_bf16_bits(rng.standard_normal((E, 2 * I, H)) * 0.1)
    dn = to_bf16_bits(rng.standard_normal((E, H, I)) * 0.1)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    w = rng.random((T, k)).astype(np.float32)
    route = M.moe_route_tables(g(ids), E, rows_per_tile=rpt)
    out = M.moe_experts(g(x), g(ids), g(w), g(gu), g(dn), route=route)
    assert rel(out, M.moe_experts(x.astype(np.float64), ids, w, gu, dn)) < TOL
    assert int(route.tiles.n_tiles.get()[0]) <= route.tiles.max_tiles


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
        assert rel(N.gated_rms_norm(g(xh), g(gt), g(wg), eps=eps, activation=act),
                   N.gated_rms_norm(xh.astype(np.float64), gt.astype(np.float64), wg, eps=eps, activation=act)) < TOL
    down = to_bf16_bits(rng.standard_normal((r, hc * H)) * 0.05)
    up = to_bf16_bits(rng.standard_normal((hc * H, r)) * 0.05)
    inj = to_bf16_bits(rng.standard_normal((hc, hc * H)) * 0.05)
    og = N.hc_pre(g(x), g(nw), g(down), g(up), g(inj), hc_count=hc, eps=eps)
    o64 = N.hc_pre(x.astype(np.float64), nw, down, up, inj, hc_count=hc, eps=eps)
    assert rel(og.mixed, o64.mixed) < TOL and rel(og.injection_weights, o64.injection_weights) < TOL
    y = rng.standard_normal((T, H)).astype(np.float32)
    ref = N.hc_combine(x.astype(np.float64), y.astype(np.float64), o64.injection_weights)
    xg = g(x)
    N.hc_combine(xg, g(y), og.injection_weights, out=xg)  # in place
    assert rel(xg, ref) < TOL
    # negative control: swapped injection streams are caught in exactly those columns
    bad = inj.copy()
    bad[[1, 3]] = bad[[3, 1]]
    ob = N.hc_pre(g(x), g(nw), g(down), g(up), g(bad), hc_count=hc, eps=eps)
    cols = np.nonzero(np.abs(cp.asnumpy(ob.injection_weights) - o64.injection_weights).max(0) > 1e-4)[0]
    assert cols.tolist() == [1, 3]


def test_ple_ops_cuda(rng):
    B, hc, H, D, K, dil, eps = 2, 4, 160, 320, 4, 3, 1e-6
    W = hc * H
    Lh = (K - 1) * dil
    kp = to_bf16_bits(rng.standard_normal((W, D)) * 0.05)
    vp = to_bf16_bits(rng.standard_normal((H, D)) * 0.05)
    nk, nq, nc = ((rng.standard_normal(W) * 0.1).astype(np.float32) for _ in range(3))
    cw = rng.standard_normal((W, K)).astype(np.float32)
    slab_n = rng.standard_normal((4, Lh, W)).astype(np.float32)
    slab_64 = slab_n.astype(np.float64)
    slab_g = g(slab_n)
    slots = np.array([2, 0])
    for T in (7, 1, 1, 12):  # a prefill chunk, two decode steps, another chunk: state carried throughout
        hidden = rng.standard_normal((B, T, W)).astype(np.float32)
        emb = rng.standard_normal((B, T, D)).astype(np.float32)
        og, gg = ple_layer(g(hidden), g(emb), g(kp), g(vp), g(nk), g(nq), g(nc), g(cw), slab_g, g(slots),
                           hc_count=hc, eps=eps, dilation=dil)
        o64, g64 = ple_layer(hidden.astype(np.float64), emb.astype(np.float64), kp, vp, nk, nq, nc, cw, slab_64,
                             slots, hc_count=hc, eps=eps, dilation=dil)
        assert rel(og, o64) < TOL and rel(gg, g64) < TOL
        assert rel(slab_g, slab_64) < TOL
    # negative control: a dropped conv state is caught in the first L positions of the next chunk only
    x = rng.standard_normal((1, 12, W)).astype(np.float32)
    keep = P.ple_conv(g(x), slab_g.copy(), g(np.array([2])), g(cw), dilation=dil)
    dropped = slab_g.copy()
    dropped[2] = 0
    lost = P.ple_conv(g(x), dropped, g(np.array([2])), g(cw), dilation=dil)
    bad_t = np.nonzero(cp.asnumpy(cp.abs(keep - lost).max(axis=2))[0] > 1e-6)[0]
    assert len(bad_t) and bad_t.max() < Lh


def test_decode_step_captures_as_cuda_graph(rng):
    """No host synchronisation in the dense decode ops: they are captured into a CUDA graph (capture
    fails on any device->host copy or synchronisation) and the replay equals eager execution."""
    E, H, I, k, hc, r = 32, 256, 64, 4, 4, 32
    mk = lambda *s: g(to_bf16_bits(rng.standard_normal(s) * 0.1))  # noqa: E731
    Wr, gu, dn, sg, su, sd, sgt = mk(E, H), mk(E, 2 * I, H), mk(E, H, I), mk(48, H), mk(48, H), mk(H, 48), mk(1, H)
    nw = g(np.zeros(hc * H, np.float32))
    down, up, inj = mk(r, hc * H), mk(hc * H, r), mk(hc, hc * H)
    x = g(rng.standard_normal((3, hc * H)).astype(np.float32))

    def step():
        o = N.hc_pre(x, nw, down, up, inj, hc_count=hc, eps=1e-6)
        m = M.moe_block(o.mixed, Wr, gu, dn, top_k=k, shared_gate_proj=sg, shared_up_proj=su, shared_down_proj=sd,
                        shared_expert_gate=sgt)
        return N.hc_combine(x, m.out, o.injection_weights)
    eager = step()  # also warms the memory pool and the compiled modules
    eager = step()
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        out = step()
        graph = s.end_capture()
    graph.launch(stream=s)
    s.synchronize()
    assert rel(out, eager) == 0.0
