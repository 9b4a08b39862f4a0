"""The MoE decode block (engine/kernels/moe.py, cuda/moe_decode.cu): host side on the CPU, the kernels on CUDA.

CPU checks of the MoE decode block's host side (engine/kernels/moe.py, cuda/moe_decode.cu), no GPU needed.

* The decode block is the engine's decode path (no environment switch selects another).
* The NumPy twin ignores the module flag.
* The decode kernels' top-k, SwiGLU and combine are the grouped chain's expressions; no float atomics.
* Every kernel name the host builds exists in the source, in the NVRTC module the options select.

GPU tests of the MoE decode block (``moe.FUSED_DECODE``, the default for 1..16 tokens: the three launches of
engine/kernels/cuda/moe_decode.cu) against the grouped chain of ``moe.moe_experts`` and the float64 twin.

The decode block sums every dot product (router logits, gate/up, down) in another order than the grouped chain, so
the two agree to float32 rounding, not bit for bit. The tolerance is derived per output element from K and the
values (:func:`exact_and_bound`): with u = 2^-24 and gamma(n) = n u / (1 - n u), a float32 sum of n products of
exactly representable factors (the dequantised weights are exact in float32) is within gamma(n) * sum |terms| of the
exact sum in any summation order (Higham, Accuracy and Stability of Numerical Algorithms, 3.1). The bound carries
those errors through SwiGLU (|silu'| <= 1.1), the down projection, the routing weights (softmax and renormalisation:
relative error <= 2 (2 dl + (E + 4) u) + (k + 1) u to first order, dl the largest logit error) and the combine
(gamma(k + 1), |sigmoid'| <= 1/4). Each path must lie within the bound B of the float64 twin evaluated on its own
routing, which bounds their difference by 2 B; the grouped chain's own check shows the bound is not tuned to the
new kernels. Negative controls (a swapped expert, a dropped shared expert, a wrong top-k selection) exceed the
bound at exactly the tokens concerned. Routing (ids) must agree except at near-ties (a probability gap at rank k
below the logit error bound). Determinism, graph replays and batch invariance (a token's outputs are the same bits
whatever else is in the step) are checked bit for bit. Outputs are poisoned (NaN / -7) before each launch, so a
step that did not run is caught.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from engine.backend import CUDA_DIR, cuda_source
from engine.kernels import moe as M, dense_common
from engine.kernels.dense_common import _MOE_FORMATS, kernel_module_options, to_bf16_bits, weight_as_float
from engine.kernels.quant import QuantWeight
from op_devices import cp, on_cuda

# the gpu marker, a skip without cupy / a GPU, and poison before every CUDA test
cuda = on_cuda("poison")


def test_decode_block_is_the_default_and_not_switchable_by_the_environment():
    assert M.FUSED_DECODE is True
    text = open(M.__file__).read()
    assert not re.findall(r"QWEN4EXP_[A-Z0-9_]*[A-Z0-9]", text)


def test_decode_block_default_only_where_measured_faster():
    """The default runs the decode block for one token of every expert format only (docs/performance.md: faster than
    the grouped chain there, slower at 16 tokens); no format of the kernels is left out of the table."""
    assert M.DECODE_BLOCK_MAX_TOKENS == {"bf16": 1, "fp8": 1, "nvfp4": 1}
    assert set(M.DECODE_BLOCK_MAX_TOKENS) == set(_MOE_FORMATS)


def test_numpy_twin_ignores_the_flag(rng, monkeypatch):
    E, H, I, Is, k, T = 8, 16, 8, 8, 2, 3
    W = [(rng.standard_normal(s) * 0.1).astype(np.float32) for s in
         ((E, H), (E, 2 * I, H), (E, H, I), (Is, H), (Is, H), (H, Is), (1, H))]
    x = rng.standard_normal((T, H))

    def run():
        return M.moe_block(x, W[0], W[1], W[2], top_k=k, shared_gate_proj=W[3], shared_up_proj=W[4],
                           shared_down_proj=W[5], shared_expert_gate=W[6]).out
    monkeypatch.setattr(M, "FUSED_DECODE", False)
    a = run()
    monkeypatch.setattr(M, "FUSED_DECODE", True)
    np.testing.assert_array_equal(run(), a)


def test_decode_formulas_are_the_grouped_ones():
    """The decode block's SwiGLU and combine use the grouped chain's expressions (guards drift): the shared expert's
    sigmoid gate, the combine's product order; the top-k is one function (moe_route.cuh's moe_topk_block) that
    both modules include and call, not two copies."""
    dec = cuda_source("moe_decode.cu")
    unf = cuda_source("dense_moe.cu")
    pairs = [("acc += (1.f / (1.f + expf(-g))) * shared[", "acc += (1.f / (1.f + expf(-g))) * ssh[t * MOE_DOWN_ROWS + r];"),
             ("acc += Y[(long long)p * H + h] * w[t * k + j];",
              "acc += ysh[(t * k + j) * MOE_DOWN_ROWS + r] * wts[t * k + j];"),
             ("h[i] = (g / (1.f + expf(-g))) * u;", "= (g / (1.f + expf(-g))) * u;")]
    for u, f in pairs:
        assert u in unf, u
        assert f in dec, f
    topk = (Path(CUDA_DIR) / "moe_route.cuh").read_text()
    head = "__device__ __forceinline__ void moe_topk_block("
    assert topk.count(head) == 1
    for src in (dec, unf):   # the header's text inlined once, and called; no second softmax / arg-max of its own
        assert src.count(head) == 1 and src.count("moe_topk_block(") == 2, src.count("moe_topk_block(")
        assert src.count("expf(probs[e] - m)") == 1 and src.count("moe_better(") == topk.count("moe_better(")
    # integer tickets and counts only: every atomicAdd's target is an int / unsigned counter
    targets = re.findall(r"atomicAdd\(([^,]+),", dec)
    assert targets and set(targets) == {"counter"}, targets


def test_every_host_kernel_name_is_in_its_module():
    src = cuda_source("moe_decode.cu")
    routers = {int(m) for m in re.findall(r"^MOE_ROUTER_ENTRY\((\d+)\)$", src, re.M)}
    pairs = set(re.findall(r"^MOE_PAIR\((\w+), (\w+)\)$", src, re.M))
    assert routers == {M._token_bound(t) for t in range(1, 17)} == {1, 4, 16}
    assert pairs == {(a, b) for a in _MOE_FORMATS for b in _MOE_FORMATS}
    for a, b in pairs:  # each pair's entries compiled in the module of its defines, the routers in the base one
        opts = kernel_module_options("moe_decode.cu", f"moe_down_{a}_{b}_t16")
        assert opts == (f"-DMOE_FR={_MOE_FORMATS.index(a)}", f"-DMOE_FS={_MOE_FORMATS.index(b)}")
        sel = f"#if MOE_SEL({_MOE_FORMATS.index(a)}, {_MOE_FORMATS.index(b)})\nMOE_PAIR({a}, {b})\n#endif"
        assert sel in src, sel
    assert kernel_module_options("moe_decode.cu", "moe_router_f32_t4") == ()
    assert kernel_module_options("moe_decode.cu", "moe_down_f32_bf16_t4") == ()  # not a pair: no such entry


def test_nvrtc_text_has_every_header_inlined():
    """NVRTC resolves no local include: cuda_source must inline every header of moe_decode.cu (an include line with
    a trailing comment is not matched by its pattern and would reach NVRTC as is)."""
    assert not [ln for ln in cuda_source("moe_decode.cu").splitlines() if ln.lstrip().startswith("#include")]


U32 = 2.0 ** -24  # float32 unit roundoff


# wide: many blocks per launch; narrow: few experts and rows
SHAPES = {"wide": dict(E=64, H=256, I=96, Is=96, k=6), "narrow": dict(E=16, H=128, I=64, Is=64, k=2)}


@pytest.fixture
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)
    # the decode block for every format and token count (the default runs it only where it is measured faster)
    monkeypatch.setattr(M, "DECODE_BLOCK_MAX_TOKENS", dict.fromkeys(("bf16", "fp8", "nvfp4"), 16))


def bits(a):
    a = cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def same(a, b):
    np.testing.assert_array_equal(bits(a), bits(b))


def qmake(rng, fmt, shape):
    """Random stored-format experts (every code but the E4M3 NaN), as tests/engine/test_quant_linear.py builds them."""
    *lead, N, K = shape
    lead = tuple(lead)
    if fmt == "fp8":
        q = rng.integers(0, 256, size=lead + (N, K), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F
        s = rng.uniform(0.001, 0.02, size=lead + (-(-N // 128), -(-K // 128))).astype(np.float32)
        return QuantWeight("fp8", shape, q, s, rb=128, cb=128).to(cp)
    q = rng.integers(0, 256, size=lead + (N, K // 2), dtype=np.uint8)
    sc = rng.integers(0x20, 0x48, size=lead + (N, K // 16), dtype=np.uint8)
    s2 = rng.uniform(0.001, 0.01, size=((lead[0] if lead else 1) * 2,)).astype(np.float32)
    return QuantWeight("nvfp4", shape, q, sc, s2, s2_rows=N // 2).to(cp)


def weights(rng, fmt, E, H, I, Is, k, router_bf16=False, shared_fmt="bf16"):
    def dense(*shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        return a if fmt == "f32" else to_bf16_bits(a)
    router = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)  # float32, as the engine loads it
    sg, su = dense(Is, H), dense(Is, H)
    W = dict(router=to_bf16_bits(router) if router_bf16 else router, sg=sg, su=su, sd=dense(H, Is),
             sgate=dense(1, H), sgu=np.concatenate([sg, su]))
    W = {n: cp.asarray(a) for n, a in W.items()}
    if shared_fmt in ("fp8", "nvfp4"):  # stored-format shared expert: the stacked gate/up and down
        W["sgu"], W["sd"] = qmake(rng, shared_fmt, (2 * Is, H)), qmake(rng, shared_fmt, (H, Is))
        # gate_proj / up_proj are not read when the stacked gate_up is given (only gate_proj's row count)
        W["sg"] = W["su"] = cp.zeros((Is, H), dtype=cp.uint16)
    if fmt in ("fp8", "nvfp4"):
        W["gate_up"], W["down"] = qmake(rng, fmt, (E, 2 * I, H)), qmake(rng, fmt, (E, H, I))
    else:
        W["gate_up"], W["down"] = cp.asarray(dense(E, 2 * I, H)), cp.asarray(dense(E, H, I))
    return W, k


def run(W, k, x, *, shared=True, stacked=True):
    kw = dict(shared_gate_proj=W["sg"], shared_up_proj=W["su"], shared_down_proj=W["sd"], shared_expert_gate=W["sgate"],
              shared_gate_up=W["sgu"] if stacked else None) if shared else {}
    return M.moe_block(x, W["router"], W["gate_up"], W["down"], top_k=k, **kw)


def both(monkeypatch, W, k, x, **kw):
    """(grouped chain, decode block) results, and the decode block's record of whether it ran (not a fallback)."""
    monkeypatch.setattr(M, "FUSED_DECODE", False)
    ref = run(W, k, x, **kw)
    monkeypatch.setattr(M, "FUSED_DECODE", True)
    log = []
    dec = M._moe_block_decode

    def logged(*a, **k_):
        r = dec(*a, **k_)
        log.append(r is not None)
        return r
    monkeypatch.setattr(M, "_moe_block_decode", logged)
    fused = run(W, k, x, **kw)
    monkeypatch.setattr(M, "_moe_block_decode", dec)
    cp.cuda.Device().synchronize()
    return ref, fused, log


def gam(n):
    return n * U32 / (1 - n * U32)


def host(W):
    """float64 host copies of every weight (dequantised exactly)."""
    return {n: weight_as_float(a.to(np) if isinstance(a, QuantWeight) else cp.asnumpy(a), np.float64)
            for n, a in W.items()}


def exact_and_bound(Wh, x, ids, k, *, shared=True, norm=True):
    """float64 block output on the routing ``ids`` and the per-element bound B of a float32 evaluation (module
    docstring). Also the probability gap at rank k and the logit error bound per token (near-tie test).

    Returns: (out [T, H], B [T, H], weights [T, k], gap [T], dl [T])."""
    x = np.asarray(x, np.float64)
    T, H = x.shape
    Wr = Wh["router"]
    E = Wr.shape[0]
    L, AL = x @ Wr.T, np.abs(x) @ np.abs(Wr).T
    dl = gam(H) * AL.max(1)
    p = np.exp(L - L.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ps = np.sort(p, 1)[:, ::-1]
    gap = ps[:, k - 1] - ps[:, k] if k < E else np.full(T, np.inf)
    w = np.take_along_axis(p, ids.astype(np.int64), 1)
    if norm:
        w = w / w.sum(1, keepdims=True)
    relw = 2 * (2 * dl + (E + 4) * U32) + (k + 1) * U32
    silu = lambda z: z / (1 + np.exp(-z))  # noqa: E731

    def mlp(GU, D, xt):
        I = GU.shape[0] // 2
        gu, agu = GU @ xt, np.abs(GU) @ np.abs(xt)
        dgu = gam(xt.size) * agu
        g, u, dg, du = gu[:I], gu[I:], dgu[:I], dgu[I:]
        h = silu(g) * u
        dh = 1.1 * dg * (np.abs(u) + du) + np.abs(silu(g)) * du
        dh += 8 * U32 * (np.abs(silu(g)) + 1.1 * dg) * (np.abs(u) + du)
        y = D @ h
        dy = gam(I) * (np.abs(D) @ (np.abs(h) + dh)) + np.abs(D) @ dh
        return y, dy
    out, B = np.zeros((T, H)), np.zeros((T, H))
    for t in range(T):
        mag = np.zeros(H)
        for j in range(k):
            e = int(ids[t, j])
            y, dy = mlp(Wh["gate_up"][e], Wh["down"][e], x[t])
            out[t] += w[t, j] * y
            B[t] += w[t, j] * dy + relw[t] * w[t, j] * (np.abs(y) + dy)
            mag += w[t, j] * np.abs(y)
        if shared:
            ys, dys = mlp(Wh["sgu"], Wh["sd"], x[t])
            gs = float(Wh["sgate"][0] @ x[t])
            dgs = gam(H) * float(np.abs(Wh["sgate"][0]) @ np.abs(x[t]))
            sig = 1 / (1 + np.exp(-gs))
            out[t] += sig * ys
            B[t] += 0.25 * dgs * (np.abs(ys) + dys) + sig * dys + 4 * U32 * sig * np.abs(ys)
            mag += sig * np.abs(ys)
        B[t] += gam(k + 1) * mag
    return out, B, w, gap, dl


def check_within(res, Wh, x, k, **kw):
    """``res``'s output within the bound of the float64 twin on ``res``'s own routing; returns (excess [T] = max
    |res - exact| / B per token, the twin's gap and logit bound)."""
    ids = cp.asnumpy(res.topk_ids)
    ex, B, w, gap, dl = exact_and_bound(Wh, cp.asnumpy(x), ids, k, **kw)
    # the routing weights: within their own bound (rel) of the twin's
    E = Wh["router"].shape[0]
    relw = 2 * (2 * dl + (E + 4) * U32) + (k + 1) * U32
    assert (np.abs(cp.asnumpy(res.topk_weights) - w) <= relw[:, None] * w + 1e-300).all()
    return (np.abs(cp.asnumpy(res.out).astype(np.float64) - ex) / B).max(1), gap, dl


@cuda
@pytest.mark.parametrize("shape", ["wide", "narrow"])
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_decode_block_within_float32_bound_of_grouped_chain(rng, monkeypatch, shape, fmt, T):
    W, k = weights(rng, fmt, **SHAPES[shape])
    x = cp.asarray(rng.standard_normal((T, SHAPES[shape]["H"])).astype(np.float32))
    ref, fused, log = both(monkeypatch, W, k, x)
    assert log == [True], log  # the decode block ran
    Wh = host(W)
    ex_f, gap, dl = check_within(fused, Wh, x, k)
    ex_r, _, _ = check_within(ref, Wh, x, k)
    assert (ex_f <= 1).all(), ex_f  # the decode block within B of float64
    assert (ex_r <= 1).all(), ex_r  # and the grouped chain: the bound is not fitted to the new kernels
    tie = gap <= 4 * dl  # a rank-k gap below the logit error: either selection is a correct float32 result
    np.testing.assert_array_equal(cp.asnumpy(fused.topk_ids)[~tie], cp.asnumpy(ref.topk_ids)[~tie])
    # router logits: each within gamma(H) sum |w x| of float64
    xa = cp.asnumpy(x).astype(np.float64)
    lb = gam(xa.shape[1]) * (np.abs(xa) @ np.abs(Wh["router"]).T)
    for r in (fused, ref):
        assert (np.abs(cp.asnumpy(r.router_logits) - xa @ Wh["router"].T) <= lb).all()


@cuda
@pytest.mark.parametrize("shared_fmt", ["fp8", "nvfp4"])
def test_decode_block_stored_format_shared_expert(rng, monkeypatch, shared_fmt):
    """The shared expert in a stored format (the FP8 release stores it in FP8): same bound."""
    W, k = weights(rng, "nvfp4" if shared_fmt == "fp8" else "fp8", **SHAPES["wide"], shared_fmt=shared_fmt)
    x = cp.asarray(rng.standard_normal((3, 256)).astype(np.float32))
    ref, fused, log = both(monkeypatch, W, k, x)
    assert log == [True], log
    ex_f, _, _ = check_within(fused, host(W), x, k)
    assert (ex_f <= 1).all(), ex_f


@cuda
def test_fallbacks_run_the_grouped_chain_bit_for_bit(rng, monkeypatch):
    """float32 experts (no entry in DECODE_BLOCK_MAX_TOKENS) and an unstacked shared expert are not taken by the
    decode block: the grouped chain runs (bit for bit the same as with the flag off)."""
    for fmt, stacked in (("f32", True), ("bf16", False)):
        W, k = weights(rng, fmt, **SHAPES["wide"])
        x = cp.asarray(rng.standard_normal((2, 256)).astype(np.float32))
        ref, fused, log = both(monkeypatch, W, k, x, stacked=stacked)
        assert log == [], (fmt, log)
        same(fused.out, ref.out)
        same(fused.topk_ids, ref.topk_ids)


@cuda
def test_bf16_router_and_no_shared_expert(rng, monkeypatch):
    W, k = weights(rng, "bf16", **SHAPES["wide"], router_bf16=True)
    x = cp.asarray(rng.standard_normal((5, 256)).astype(np.float32))
    ref, fused, log = both(monkeypatch, W, k, x, shared=False)
    assert log == [True], log
    ex_f, _, _ = check_within(fused, host(W), x, k, shared=False)
    assert (ex_f <= 1).all(), ex_f


@cuda
@pytest.mark.parametrize("fmt", ["bf16", "fp8", "nvfp4"])
def test_deterministic_and_batch_invariant(rng, monkeypatch, fmt):
    """Two runs give the same bits; every token of a 16-token step gets the same bits as alone (T = 1) and in a
    4-token step (no float atomics; every sum's order is fixed by the format and K, not by the other tokens)."""
    W, k = weights(rng, fmt, **SHAPES["wide"])
    x = cp.asarray(rng.standard_normal((16, 256)).astype(np.float32))
    a, b = run(W, k, x), run(W, k, x)
    same(a.out, b.out)
    same(a.router_logits, b.router_logits)
    for t in (0, 7, 15):
        one = run(W, k, x[t:t + 1].copy())
        same(one.out[0], a.out[t])
        same(one.topk_weights[0], a.topk_weights[t])
    four = run(W, k, x[4:8].copy())
    same(four.out, a.out[4:8])


@cuda
def test_graph_replay_bit_exact(rng, monkeypatch):
    """Captured as a CUDA graph (no host synchronisation; the tickets reset themselves) and replayed on new
    inputs: every replay equals the eager result bit for bit."""
    W, k = weights(rng, "nvfp4", **SHAPES["wide"])
    T = 4
    xs = [cp.asarray(rng.standard_normal((T, 256)).astype(np.float32)) for _ in range(3)]
    x = xs[0].copy()
    run(W, k, x)
    run(W, k, x)  # warm: compiled modules, the memory pool, the counters
    s = cp.cuda.Stream(non_blocking=True)
    with s:
        s.begin_capture()
        o = run(W, k, x)
        graph = s.end_capture()
    outs = []
    for xi in xs + xs[:1]:
        with s:
            x[...] = xi
        graph.launch(stream=s)
        s.synchronize()
        eager = run(W, k, xi)
        same(eager.out, o.out)
        same(eager.topk_ids, o.topk_ids)
        outs.append(cp.asnumpy(o.out).copy())
    same(outs[0], outs[-1])
    assert not np.array_equal(outs[0], outs[1])


@cuda
def test_negative_controls_exceed_the_bound(rng, monkeypatch):
    """A swapped expert, a dropped shared expert and a wrong top-k selection are caught by the bound check at exactly
    the tokens concerned."""
    W, k = weights(rng, "bf16", **SHAPES["wide"])
    T = 4
    x = cp.asarray(rng.standard_normal((T, 256)).astype(np.float32))
    good = run(W, k, x)
    Wh = host(W)
    ex, _, _ = check_within(good, Wh, x, k)
    assert (ex <= 1).all()
    ids = cp.asnumpy(good.topk_ids)
    # swapped expert weights (a wrong expert id read): caught at the tokens using either expert
    a, b = int(ids[0, 0]), int(ids[0, 1])
    dn = W["down"].copy()
    dn[[a, b]] = dn[[b, a]]
    bad = run(dict(W, down=dn), k, x)
    ex_bad, _, _ = check_within(bad, Wh, x, k)
    users = {t for t in range(T) if a in ids[t] or b in ids[t]}
    assert {int(t) for t in np.nonzero(ex_bad > 1)[0]} == users
    # dropped shared expert: caught at every token
    ns = run(W, k, x, shared=False)
    ex_ns, _, _ = check_within(ns, Wh, x, k, shared=True)
    assert (ex_ns > 1).all()
    # a wrong selection (token 1's last expert replaced by its (k+1)-th): the twin on the true routing flags token 1
    wrong = ids.copy()
    lg = cp.asnumpy(good.router_logits)
    wrong[1, -1] = int(np.argsort(-lg[1], kind="stable")[k])
    exw, Bw, _, _, _ = exact_and_bound(Wh, cp.asnumpy(x), wrong, k)
    flagged = (np.abs(cp.asnumpy(good.out) - exw) / Bw).max(1) > 1
    assert np.nonzero(flagged)[0].tolist() == [1]


@cuda
@pytest.mark.parametrize("name", ["tiny", "tiny-fp8", "tiny-nvfp4"])
def test_engine_decode_block_matches_grouped_chain(monkeypatch, name):
    """(The decode block for every format and token count: the poison fixture.) The whole engine (prefill, then batched decode steps with their CUDA graphs, fixed input tokens) with the
    decode block agrees with the grouped chain within the self-consistency limit (selfcheck.SELF_TOL: paths that
    differ in float32 summation order only), and two engines with the decode block give the same bits."""
    from engine import Engine, selfcheck
    from reference.checkpoint import Checkpoint
    from reference.paths import FIXTURES
    monkeypatch.setattr(dense_common, "POISON", False)
    ck = Checkpoint.open(FIXTURES / name)
    ids = np.load(FIXTURES / name / "golden.npz")["short/ids"]

    def go(fused):
        monkeypatch.setattr(M, "FUSED_DECODE", fused)
        eng = Engine(ck, precision="bf16", device="cuda", kv_tokens=512)
        seqs = [eng.add_sequence() for _ in range(3)]
        for j, s in enumerate(seqs):
            eng.prefill(s, ids[: len(ids) - j])
        rows = []
        for step in range(8):  # eager, capture, replays
            toks = [int(ids[(step + j) % len(ids)]) for j in range(3)]
            lg = eng.decode(seqs[:2] if step % 2 else seqs, toks[:2] if step % 2 else toks)
            rows.append(np.asarray(lg, dtype=np.float32).copy())
        st = dict(eng.graphs.stats) if eng.graphs is not None else {}
        assert st.get("captures", 0) >= 2 and st.get("failed", 1) == 0 and st.get("replays", 0) >= 2, (fused, st)
        return rows
    a, b, c = go(False), go(True), go(True)
    for ra, rb, rc in zip(a, b, c):
        assert selfcheck.rel_err(rb, ra) < selfcheck.SELF_TOL
        np.testing.assert_array_equal(rb.view(np.uint32), rc.view(np.uint32))
