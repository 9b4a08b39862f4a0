"""MoE routing and experts (engine/kernels/moe.py, cuda/dense_moe.cu): router top-k with the canonical tie order,
the route tables, the grouped experts over every tile kind, the whole MoE block (routed + shared expert), and a dense
decode step (hc_pre -> MoE block -> hc_combine) captured as a CUDA graph.

CPU: the NumPy twin against a per-token float64 loop (``moe_ref64``), TOL32 = 1e-5 relative. Negative controls: the
opposite tie-break, swapped experts (caught at exactly the tokens using them).
CUDA: CUDA vs twin (float32) vs float64 with poisoned outputs, TOL 1e-5; ids compared wherever the float64
probabilities are not within float32 noise of a tie; no host synchronisation in the decode ops (graph capture).
The MoE decode block (one launch chain for decode): tests/engine/test_moe_decode_block.py.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import moe as M, norms as N
from engine.kernels.dense_common import KernelInputError, to_bf16_bits
from op_devices import cp, on_cuda
from op_helpers import g, rel, rel_dev, replayed, sig64, three_way, to_f64

# the gpu marker, a skip without cupy / a GPU, and poison (conftest.py) before every CUDA test
cuda = on_cuda("poison")


TOL32 = 1e-5  # see module docstring


# ----------------------------------------------------------------------------------------------- MoE
def canonical_ids_ref(p64_row, k):
    return [e for _, e in sorted(((-p, e) for e, p in enumerate(p64_row)))[:k]]


def test_router_topk_canonical_tie_order(rng):
    T, E, k = 6, 16, 4
    logits = rng.standard_normal((T, E)).astype(np.float32)
    # exact ties: duplicate the largest logits of every row into other (random) slots
    for t in range(T):
        top = int(np.argmax(logits[t]))
        others = rng.choice([e for e in range(E) if e != top], size=2, replace=False)
        logits[t, others] = logits[t, top]
    ids, w = M.router_topk(logits, k, True)
    assert ids.dtype == np.int32 and ids.shape == (T, k)
    for t in range(T):
        ex = np.exp(logits[t].astype(np.float64) - logits[t].max())
        p = ex / ex.sum()
        assert ids[t].tolist() == canonical_ids_ref(p, k)
        ref_w = p[ids[t]] / p[ids[t]].sum()
        assert rel(w[t], ref_w) < TOL32
    # negative control: the opposite tie-break (higher id first) is detected by the same check
    rev_ids = (E - 1) - np.argsort(-logits[:, ::-1], axis=-1, kind="stable")[:, :k]
    assert any(rev_ids[t].tolist() != canonical_ids_ref(np.exp(logits[t] - logits[t].max()), k) for t in range(T))
    # renormalisation off: raw probabilities
    _, w_raw = M.router_topk(logits, k, False)
    assert np.all(w_raw.sum(axis=1) < 1.0 + 1e-6) and not np.allclose(w_raw.sum(axis=1), 1.0)


def test_moe_route_tables_invariants(rng):
    T, k, E = 7, 3, 6
    ids = np.stack([rng.choice(E, size=k, replace=False) for _ in range(T)]).astype(np.int32)
    r = M.moe_route_tables(ids, E)
    S = T * k
    flat = ids.reshape(-1)
    assert sorted(r.slot_pos.tolist()) == list(range(S))
    for s in range(S):
        p = r.slot_pos[s]
        assert r.offsets[flat[s]] <= p < r.offsets[flat[s] + 1]
        assert r.sorted_token[p] == s // k
    with pytest.raises(KernelInputError, match="ids"):
        M.moe_route_tables(np.full((2, 2), E, np.int32), E)


def _moe_weights(rng, E, H, I, Is, wkind="bf16"):
    def mk(*shape):
        a = (rng.standard_normal(shape) * 0.3).astype(np.float32)
        return to_bf16_bits(a) if wkind == "bf16" else a
    return dict(router=mk(E, H), gate_up=mk(E, 2 * I, H), down=mk(E, H, I), sg=mk(Is, H), su=mk(Is, H),
                sd=mk(H, Is), sgate=mk(1, H))


def moe_ref64(x, W, k, E, I):
    """Per-token loop in float64: softmax, canonical top-k, renormalised weights, experts, shared."""
    x64 = x.astype(np.float64)
    out = np.zeros_like(x64)
    gu, dn = to_f64(W["gate_up"]), to_f64(W["down"])
    for t in range(x.shape[0]):
        lg = to_f64(W["router"]) @ x64[t]
        p = np.exp(lg - lg.max())
        p /= p.sum()
        sel = canonical_ids_ref(p, k)
        ws = p[sel] / p[sel].sum()
        for e, wt in zip(sel, ws):
            g = gu[e, :I] @ x64[t]
            u = gu[e, I:] @ x64[t]
            out[t] += wt * (dn[e] @ (g * sig64(g) * u))
        g = to_f64(W["sg"]) @ x64[t]
        u = to_f64(W["su"]) @ x64[t]
        out[t] += sig64(to_f64(W["sgate"]) @ x64[t])[0] * (to_f64(W["sd"]) @ (g * sig64(g) * u))
    return out


@pytest.mark.parametrize("T", [1, 4, 23])
def test_moe_block_twin_matches_float64(rng, T):
    E, H, I, Is, k = 8, 32, 24, 20, 3
    W = _moe_weights(rng, E, H, I, Is)
    x = rng.standard_normal((T, H)).astype(np.float32)
    o = M.moe_block(x, W["router"], W["gate_up"], W["down"], top_k=k, shared_gate_proj=W["sg"],
                    shared_up_proj=W["su"], shared_down_proj=W["sd"], shared_expert_gate=W["sgate"])
    ref = moe_ref64(x, W, k, E, I)
    assert o.out.shape == (T, H)
    assert rel(o.out, ref) < TOL32
    # negative control: swap two experts' down projections -> caught, located at the tokens using them
    a, b = int(o.topk_ids[0, 0]), int((o.topk_ids[0, 0] + 1) % E)
    dn = W["down"].copy()
    dn[[a, b]] = dn[[b, a]]
    bad = M.moe_experts(x, o.topk_ids, o.topk_weights, W["gate_up"], dn)
    good = M.moe_experts(x, o.topk_ids, o.topk_weights, W["gate_up"], W["down"])
    tok_err = np.abs(bad - good).max(axis=1)
    users = {t for t in range(T) if a in o.topk_ids[t] or b in o.topk_ids[t]}
    assert {int(t) for t in np.nonzero(tok_err > 1e-4)[0]} == users
    with pytest.raises(KernelInputError, match="shared expert"):
        M.moe_block(x, W["router"], W["gate_up"], W["down"], top_k=k, shared_gate_proj=W["sg"])


TOL = 1e-5  # see module docstring


@cuda
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
    assert rel_dev(w, tw) < TOL
    # negative control: the opposite tie-break (higher id first) differs from what CUDA produced
    rev = (E - 1) - np.argsort(-logits[:, ::-1], axis=-1, kind="stable")[:, :k]
    assert (rev != cp.asnumpy(ids)).any()


@cuda
@pytest.mark.parametrize("E,k", [(7, 7), (16, 10), (100, 1), (100, 64), (512, 10), (2000, 64)])
def test_router_topk_cuda_every_width(rng, E, k):
    """The ranking selection at widths where warps own no entry (E < 256), fewer than k (E = 16) or many (E = 2000),
    k = E and k = 64, with exact ties at the top and across the k boundary: the twin's ids and weights."""
    T = 4
    logits = rng.standard_normal((T, E)).astype(np.float32)
    for t in range(T):
        order = np.argsort(-logits[t])
        logits[t, order[1:3]] = logits[t, order[0]]
        if k < E - 1:
            logits[t, order[k]] = logits[t, order[k - 1]]
    ids, w = M.router_topk(g(logits), k, True)
    tid, tw = M.router_topk(logits, k, True)
    np.testing.assert_array_equal(cp.asnumpy(ids), tid)
    assert rel_dev(w, tw) < TOL


@cuda
def test_router_topk_cuda_invalid_logits():
    """NaN logits give no probability: a token with fewer than k valid experts gets id 0x7fffffff at the positions
    past them (the decode block's item table skips such slots), never a valid id with a NaN weight."""
    E, k = 64, 4
    logits = np.full((2, E), np.nan, dtype=np.float32)
    logits[1] = np.linspace(-1, 1, E, dtype=np.float32)
    ids = cp.asnumpy(M.router_topk(g(logits), k, True)[0])
    assert (ids[0] == 0x7FFFFFFF).all(), ids[0]
    assert ids[1].tolist() == [E - 1, E - 2, E - 3, E - 4]


@cuda
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
    assert rel_dev(og.router_logits, o64.router_logits) < TOL
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


@cuda
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
    assert rel_dev(out, M.moe_experts(x.astype(np.float64), ids, w, gu, dn)) < TOL
    assert int(route.tiles.n_tiles.get()[0]) <= route.tiles.max_tiles


@cuda
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
    out = replayed(step)
    assert rel_dev(out, eager) == 0.0


def _side_stream_setup(rng, monkeypatch, E: int, H: int, I: int = 96, Is: int = 80):
    """BF16 device weights of one MoE block with a shared expert, and a list that gets one entry per fork onto the
    side stream (``moe._side_branch`` wrapped)."""
    mk = lambda *s: g(to_bf16_bits(rng.standard_normal(s) * 0.1))  # noqa: E731
    W = dict(router=mk(E, H), gate_up=mk(E, 2 * I, H), down=mk(E, H, I), sg=mk(Is, H), su=mk(Is, H), sd=mk(H, Is),
             sgate=mk(1, H))
    forks = []
    branch = M._side_branch

    def counted():
        forks.append(1)
        return branch()
    monkeypatch.setattr(M, "_side_branch", counted)
    return W, forks


@cuda
@pytest.mark.parametrize("T", [1, 5, 16, 17])
def test_shared_expert_on_a_side_stream_equals_one_stream(rng, monkeypatch, T):
    """The shared expert forked onto the side stream (1..16 tokens) gives the one-stream results bit for bit, run
    eagerly and replayed from a captured graph (where the fork and the join are graph edges); 17 tokens stay on one
    stream."""
    k, H = 6, 256
    W, forks = _side_stream_setup(rng, monkeypatch, E=64, H=H)
    x = g(rng.standard_normal((T, H)).astype(np.float32))

    def run():
        return M.moe_block(x, W["router"], W["gate_up"], W["down"], top_k=k, shared_gate_proj=W["sg"],
                           shared_up_proj=W["su"], shared_down_proj=W["sd"], shared_expert_gate=W["sgate"]).out
    monkeypatch.setattr(M, "SHARED_SIDE_STREAM", False)
    one = cp.asnumpy(run())
    assert not forks
    monkeypatch.setattr(M, "SHARED_SIDE_STREAM", True)
    side = cp.asnumpy(run())
    assert len(forks) == (1 if T <= M.GEMV_MAX_ROWS else 0)
    np.testing.assert_array_equal(side, one)
    np.testing.assert_array_equal(cp.asnumpy(replayed(run, launches=2)), one)
    # negative control: the comparison sees a change of the shared expert alone
    W["sd"] = W["sd"] * np.uint16(1) + np.uint16(1)  # the last bit of every BF16 down weight
    assert not np.array_equal(cp.asnumpy(run()), one)


def test_the_shared_expert_stays_on_one_stream_where_a_branch_takes_the_tensor_cores(monkeypatch):
    """The side stream only for blocks whose router and shared-expert GEMMs are all off the tensor-core path: that
    path's cuBLAS calls share one workspace per device, so a shared-expert GEMM on the side stream and the router's on
    the current one would write it at once (``gemm_tc.TC_MIN_ROWS`` at 16 or below reaches decode-sized blocks)."""
    from engine.kernels import gemm_tc as TC
    bf16, f32 = np.zeros((8, 32), np.uint16), np.zeros((1, 32), np.float32)
    monkeypatch.setattr(M, "SHARED_SIDE_STREAM", True)
    monkeypatch.setattr(TC, "TC_ENABLED", True)
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 64)
    assert M.shared_on_side_stream(16, (bf16, None, f32))
    assert not M.shared_on_side_stream(17, (bf16, None, f32))
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 8)
    assert M.shared_on_side_stream(7, (bf16, None, f32))
    assert not M.shared_on_side_stream(8, (bf16, None))
    assert not M.shared_on_side_stream(8, (None, f32))  # one weight on the tensor cores is enough
    monkeypatch.setattr(TC, "TC_ENABLED", False)
    assert M.shared_on_side_stream(8, (bf16, None, f32))
    monkeypatch.setattr(M, "SHARED_SIDE_STREAM", False)
    assert not M.shared_on_side_stream(1, (bf16, None, f32))


@cuda
def test_a_block_on_the_tensor_cores_keeps_the_shared_expert_on_one_stream(rng, monkeypatch):
    """With the tensor-core path from 4 rows, a 12-token block does not fork (its GEMMs share cuBLAS's workspace)
    and a 3-token one does."""
    from engine.kernels import gemm_tc as TC
    k, H = 4, 256
    W, forks = _side_stream_setup(rng, monkeypatch, E=16, H=H)
    monkeypatch.setattr(M, "SHARED_SIDE_STREAM", True)
    monkeypatch.setattr(TC, "TC_MIN_ROWS", 4)
    for T, n in ((3, 1), (12, 1)):  # the 12-token block adds no fork
        x = g(rng.standard_normal((T, H)).astype(np.float32))
        M.moe_block(x, W["router"], W["gate_up"], W["down"], top_k=k, shared_gate_proj=W["sg"], shared_up_proj=W["su"],
                    shared_down_proj=W["sd"], shared_expert_gate=W["sgate"])
        assert len(forks) == n, (T, forks)


def _fake_cupy_streams(log):
    """A stand-in for the part of cupy that :class:`engine.kernels.moe._side_branch` uses; ``log`` gets each call
    as ``(stream, what[, the stream an awaited event was recorded on])``."""
    import types

    class Stream:
        def __init__(self, name="side", non_blocking=False):
            self.name = name

        def wait_event(self, e):
            log.append((self.name, "wait", e.where))

        def __enter__(self):
            log.append((self.name, "enter"))
            return self

        def __exit__(self, *exc):
            log.append((self.name, "exit"))
            return False

    class Event:
        def __init__(self, disable_timing=False):
            self.where = None

        def record(self, s):
            self.where = s.name
            log.append((s.name, "record"))

    main = Stream("main")
    return types.SimpleNamespace(cuda=types.SimpleNamespace(
        get_current_stream=lambda: main, Device=lambda: types.SimpleNamespace(id=0),
        Stream=lambda non_blocking=False: Stream("side", non_blocking), Event=Event))


def test_a_side_branch_is_joined_on_leaving_its_region_on_an_error_too(monkeypatch):
    """The fork is joined when its region is left: normally, on an error of the side work, and on one raised
    between the fork and the join on the current stream (an interrupt, say). An unjoined fork would end a capture
    with cudaErrorStreamCaptureUnjoined instead of the error (the graphs' fallback takes that for a capture failure
    and carries on, so an interrupt would be lost), and leave an eager step's current stream not waiting for side
    kernels that still read its memory."""
    import sys
    log = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_streams(log))
    monkeypatch.setattr(M, "_SIDE_STREAMS", {})
    with M._side_branch() as b:
        with b.side:
            pass
    assert log == [("main", "record"), ("side", "wait", "main"), ("side", "enter"), ("side", "exit"),
                   ("side", "record"), ("main", "wait", "side")]
    joined = [("side", "record"), ("main", "wait", "side")]
    log.clear()
    with pytest.raises(RuntimeError, match="side work failed"):
        with M._side_branch() as b:
            with b.side:
                raise RuntimeError("side work failed")
    assert log[-3:] == [("side", "exit")] + joined
    log.clear()
    with pytest.raises(KeyboardInterrupt):
        with M._side_branch():
            raise KeyboardInterrupt
    assert log[-2:] == joined


def test_a_side_branch_whose_join_fails_after_an_error_reports_the_error(monkeypatch):
    """A capture that the error invalidated refuses the join's event calls too: the first error is the one that
    propagates."""
    import sys
    log = []
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy_streams(log))
    monkeypatch.setattr(M, "_SIDE_STREAMS", {})
    b = M._side_branch()

    def refused(e):
        raise RuntimeError("cudaErrorStreamCaptureInvalidated")
    b.main.wait_event = refused
    with pytest.raises(RuntimeError, match="side work failed"):
        with b:
            with b.side:
                raise RuntimeError("side work failed")
