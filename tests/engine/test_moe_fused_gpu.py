"""GPU tests of the MoE decode chain (``moe.FUSED_DECODE``, the default: engine/kernels/cuda/moe_route.cu, the
shared-expert stream) against the grouped chain of ``moe.moe_experts``.

The chain computes every value with the same expression as the unfused chain (the GEMV bodies are shared,
the top-k emulates router_topk's 256-thread reductions, SwiGLU and combine are dense_moe.cu's formulas), so the
checks are bit-for-bit (``view(uint32)`` equality), no tolerance; a sanity check against the float64 twin uses the
dense tests' 1e-5 (float32 summation order only, see test_kernels_dense_gpu.py). Outputs are poisoned (NaN / -7)
before each launch, so a step that did not run is caught. Negative controls: a swapped expert, a wrong top-k
selection and a dropped shared expert are each caught at exactly the tokens concerned. Graph replays: bit-exact.
"""
from __future__ import annotations

import numpy as np
import pytest

cp = pytest.importorskip("cupy", reason="GPU tests need cupy (pip install '.[gpu]')")

from engine.backend import gpu_available  # noqa: E402
from engine.kernels import dense_common  # noqa: E402
from engine.kernels import moe as M  # noqa: E402
from engine.kernels.dense_common import to_bf16_bits  # noqa: E402
from engine.kernels.quant import QuantWeight  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_available(), reason="no CUDA GPU visible to cupy")]
TOL = 1e-5  # twin sanity check only (float32 summation order), see the module docstring

# wide: the column-block (ks1) GEMV variants and the tensor-core _sx kernels; narrow: few blocks -> split-K (ks8)
SHAPES = {"wide": dict(E=64, H=256, I=96, Is=80, k=6), "narrow": dict(E=16, H=128, I=64, Is=64, k=2)}


@pytest.fixture(autouse=True)
def poison(monkeypatch):
    monkeypatch.setattr(dense_common, "POISON", True)


def bits(a):
    a = cp.asnumpy(a) if isinstance(a, cp.ndarray) else np.asarray(a)
    return a.view(np.uint32) if a.dtype == np.float32 else a


def same(a, b):
    np.testing.assert_array_equal(bits(a), bits(b))


def qmake(rng, fmt, shape):
    """Random stored-format experts (every code but the E4M3 NaN), as test_kernels_quant_gpu.py builds them."""
    *lead, N, K = shape
    lead = tuple(lead)
    if fmt == "fp8":
        q = rng.integers(0, 256, size=lead + (N, K), dtype=np.uint8)
        q[(q & 0x7F) == 0x7F] = 0x3F
        s = rng.uniform(0.001, 0.02, size=lead + (-(-N // 128), -(-K // 128))).astype(np.float32)
        return QuantWeight("fp8", shape, q, s, rb=128, cb=128).to(cp)
    q = rng.integers(0, 256, size=lead + (N, K // 2), dtype=np.uint8)
    sc = rng.integers(0x20, 0x48, size=lead + (N, K // 16), dtype=np.uint8)
    s2 = rng.uniform(0.001, 0.01, size=(lead[0] * 2,)).astype(np.float32)
    return QuantWeight("nvfp4", shape, q, sc, s2, s2_rows=N // 2).to(cp)


def weights(rng, fmt, E, H, I, Is, k, router_bf16=False):
    def dense(*shape):
        a = (rng.standard_normal(shape) * 0.1).astype(np.float32)
        return a if fmt == "f32" else to_bf16_bits(a)
    router = (rng.standard_normal((E, H)) * 0.1).astype(np.float32)  # float32, as the engine loads it
    sg, su = dense(Is, H), dense(Is, H)
    W = dict(router=to_bf16_bits(router) if router_bf16 else router, sg=sg, su=su, sd=dense(H, Is),
             sgate=dense(1, H), sgu=np.concatenate([sg, su]))
    W = {n: cp.asarray(a) for n, a in W.items()}
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
    """(grouped, decode-chain) results, and the decode chain's record of whether its route block ran."""
    monkeypatch.setattr(M, "FUSED_DECODE", False)
    ref = run(W, k, x, **kw)
    monkeypatch.setattr(M, "FUSED_DECODE", True)
    log = []
    route_block = M._route_block

    def route_block_logged(*a, **k_):
        r = route_block(*a, **k_)
        log.append(("route_block", r is not None))
        return r
    monkeypatch.setattr(M, "_route_block", route_block_logged)
    fused = run(W, k, x, **kw)
    monkeypatch.setattr(M, "_route_block", route_block)
    cp.cuda.Device().synchronize()
    return ref, fused, log


def check_same(ref, fused):
    same(fused.router_logits, ref.router_logits)
    same(fused.topk_ids, ref.topk_ids)
    same(fused.topk_weights, ref.topk_weights)
    same(fused.out, ref.out)


MODES = ["chain", "chain-one-stream"]


def set_mode(monkeypatch, mode):
    """chain: the default decode chain (route block, shared-expert stream); chain-one-stream: without the side
    stream."""
    monkeypatch.setattr(M, "SHARED_STREAM", mode != "chain-one-stream")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["wide", "narrow"])
@pytest.mark.parametrize("fmt", ["bf16", "f32", "fp8", "nvfp4"])
@pytest.mark.parametrize("T", [1, 4, 16])
def test_fused_bit_identical_to_unfused(rng, monkeypatch, shape, fmt, T, mode):
    if shape == "narrow" and fmt in ("f32", "fp8"):
        pytest.skip("narrow shape: bf16 and nvfp4 cover the split-K GEMVs (keeps the compile count down)")
    set_mode(monkeypatch, mode)
    W, k = weights(rng, fmt, **SHAPES[shape])
    x = cp.asarray(rng.standard_normal((T, SHAPES[shape]["H"])).astype(np.float32))
    ref, fused, log = both(monkeypatch, W, k, x)
    assert log == [("route_block", True)], log
    check_same(ref, fused)
    # sanity: both equal the float64 twin to float32 summation order where the routing has no near-tie
    Wn = {n: (a if isinstance(a, QuantWeight) else cp.asnumpy(a)) for n, a in W.items()}
    for n in ("gate_up", "down"):
        if isinstance(Wn[n], QuantWeight):
            Wn[n] = Wn[n].to(np)
    o64 = run(Wn, k, cp.asnumpy(x).astype(np.float64))
    lg = o64.router_logits
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ps = np.sort(p, axis=1)[:, ::-1]
    if ((ps[:, k - 1] - ps[:, k]) > 1e-6).all():
        np.testing.assert_array_equal(cp.asnumpy(fused.topk_ids), o64.topk_ids)
        a, b = cp.asnumpy(fused.out).astype(np.float64), o64.out
        assert np.linalg.norm(a - b) / np.linalg.norm(b) < TOL


@pytest.mark.parametrize("T", [1, 5])
def test_fused_fallbacks_stay_bit_identical(rng, monkeypatch, T):
    """A BF16 router at T = 5 takes the tensor-core GEMV and an unstacked shared expert the grouped shared path (no
    side stream): results still bit for bit."""
    set_mode(monkeypatch, "chain")
    W, k = weights(rng, "bf16", **SHAPES["wide"], router_bf16=True)
    x = cp.asarray(rng.standard_normal((T, 256)).astype(np.float32))
    ref, fused, log = both(monkeypatch, W, k, x, stacked=False)
    assert log == [("route_block", True)], log
    check_same(ref, fused)


@pytest.mark.parametrize("mode", MODES)
def test_fused_graph_replay_bit_exact(rng, monkeypatch, mode):
    """Captured as a CUDA graph (no host synchronisation in the chain; the shared-expert stream forked and joined
    inside the capture) and replayed on new inputs: every replay equals the grouped chain's eager result bit for
    bit. (Measured failing before the side stream's arrays were kept alive up
    to the join: the pool handed them to the main stream's next allocations, a race in the replay.)"""
    set_mode(monkeypatch, mode)
    W, k = weights(rng, "bf16", **SHAPES["wide"])
    T = 4
    xs = [cp.asarray(rng.standard_normal((T, 256)).astype(np.float32)) for _ in range(3)]
    x = xs[0].copy()
    monkeypatch.setattr(M, "FUSED_DECODE", True)
    run(W, k, x)
    run(W, k, x)  # warm: compiled modules, the memory pool
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
        monkeypatch.setattr(M, "FUSED_DECODE", False)
        check_same(run(W, k, xi), o)
        monkeypatch.setattr(M, "FUSED_DECODE", True)
        outs.append(cp.asnumpy(o.out).copy())
    same(outs[0], outs[-1])  # the same input replayed again: the same bits
    assert not np.array_equal(outs[0], outs[1])


def test_negative_swapped_expert_caught(rng, monkeypatch):
    W, k = weights(rng, "bf16", **SHAPES["wide"])
    T = 4
    x = cp.asarray(rng.standard_normal((T, 256)).astype(np.float32))
    _, good, _ = both(monkeypatch, W, k, x)
    ids = cp.asnumpy(good.topk_ids)
    a, b = int(ids[0, 0]), int(ids[0, 1])
    dn = W["down"].copy()
    dn[[a, b]] = dn[[b, a]]
    bad = run(dict(W, down=dn), k, x)
    users = {t for t in range(T) if a in ids[t] or b in ids[t]}
    diff = np.abs(cp.asnumpy(bad.out) - cp.asnumpy(good.out)).max(1)
    assert {int(t) for t in np.nonzero(diff > 1e-5)[0]} == users


def test_negative_wrong_topk_and_dropped_shared_caught(rng, monkeypatch):
    W, k = weights(rng, "bf16", **SHAPES["wide"])
    T = 3
    x = cp.asarray(rng.standard_normal((T, 256)).astype(np.float32))
    _, fused, _ = both(monkeypatch, W, k, x)
    # the routed part recomputed unfused from the fused routing reproduces the fused output bit for bit ...
    monkeypatch.setattr(M, "FUSED_DECODE", False)
    shared = M.shared_expert(x, W["sg"], W["su"], W["sd"], gate_up=W["sgu"])
    sg = M.linear(x, W["sgate"])
    redo = M.moe_experts(x, fused.topk_ids, fused.topk_weights, W["gate_up"], W["down"], shared=shared, shared_gate=sg)
    same(redo, fused.out)
    # ... and a wrong selection (token 1's last expert replaced by its (k+1)-th) is caught at token 1 only
    lg = cp.asnumpy(fused.router_logits)
    wrong = cp.asnumpy(fused.topk_ids).copy()
    wrong[1, -1] = int(np.argsort(-lg[1], kind="stable")[k])
    bad = M.moe_experts(x, cp.asarray(wrong), fused.topk_weights, W["gate_up"], W["down"], shared=shared,
                        shared_gate=sg)
    diff = np.abs(cp.asnumpy(bad) - cp.asnumpy(fused.out)).max(1)
    assert np.nonzero(diff > 1e-5)[0].tolist() == [1]
    # a dropped shared expert: fused without it equals unfused without it, and differs at every token from fused
    ref_ns, fused_ns, log = both(monkeypatch, W, k, x, shared=False)
    assert log == [("route_block", True)], log
    check_same(ref_ns, fused_ns)
    diff = np.abs(cp.asnumpy(fused_ns.out) - cp.asnumpy(fused.out)).max(1)
    assert (diff > 1e-5).all()


@pytest.mark.parametrize("name", ["tiny", "tiny-fp8", "tiny-nvfp4"])
def test_engine_decode_fused_bit_identical(monkeypatch, name):
    """The whole engine (prefill, then batched decode steps with their CUDA graphs) gives the same logits bit for
    bit with the fused chain as with the unfused one (a fresh engine per flag: graphs capture the chain in use)."""
    from engine import Engine
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
        toks = [int(ids[-1]), int(ids[0]), int(ids[1])]
        rows = []
        for _ in range(8):  # eager, capture, replays
            lg = eng.decode(seqs[:2] if len(rows) % 2 else seqs, toks[:2] if len(rows) % 2 else toks)
            rows.append(np.asarray(lg, dtype=np.float32).copy())
            toks = [int(t) for t in np.argmax(lg, -1)] + toks[len(lg):]
        st = dict(eng.graphs.stats) if eng.graphs is not None else {}
        # the steps really ran as CUDA graphs: a capture failure (e.g. of the side stream) would fall back to eager
        assert st.get("captures", 0) >= 2 and st.get("failed", 1) == 0 and st.get("replays", 0) >= 2, (fused, st,
                                                                                                       getattr(eng.graphs, "failed", None))
        return rows
    a, b = go(False), go(True)
    for ra, rb in zip(a, b):
        np.testing.assert_array_equal(ra.view(np.uint32), rb.view(np.uint32))
