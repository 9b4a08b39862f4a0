"""CPU tests of the dense kernels' NumPy twins (engine/kernels/{linear,moe,norms,ple}.py), including the
engine's host n-gram hash against the reference's readable form on the tiny fixture's tables.

Every check draws random inputs from the test's fixed seed (``rng`` fixture of tests/conftest.py, printed) and
compares with an independent float64 formula written here (loops / Python ints, not the twins'
vectorised code). Negative controls inject a known fault and assert it is caught AND located.

Tolerances: float32 twin vs float64 truth by ||out - ref|| / ||ref||. float32 arithmetic over the
sizes used here (K <= 96 terms) lands near 1e-7..1e-6; 1e-5 leaves a 10x margin while a single
perturbed weight (relative size ~1e-1 of a row) gives errors > 1e-3.
"""
from __future__ import annotations

import numpy as np
import pytest

from engine.kernels import linear as L
from engine.kernels import moe as M
from engine.kernels import norms as N
from engine.kernels import ple as P
from ple_helpers import ple_layer  # noqa: E402
from engine.kernels.dense_common import KernelInputError, to_bf16_bits
from reference.checkpoint import Checkpoint
from reference.paths import FIXTURES

TOL32 = 1e-5  # see module docstring


def rel(a, b) -> float:
    a = np.asarray(a, np.float64)
    b = np.asarray(b, np.float64)
    assert np.all(np.isfinite(a)), "non-finite output"
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def bf16_to_f64(bits):
    # independent decode: bit pattern -> float64 through Python's struct-free integer view
    u32 = bits.astype(np.uint32) << np.uint32(16)
    return u32.view(np.float32).astype(np.float64)


def sig64(x):
    return 1.0 / (1.0 + np.exp(-x))


# ----------------------------------------------------------------------------------------------- linear
@pytest.mark.parametrize("wkind", ["bf16", "f32"])
@pytest.mark.parametrize("M_", [1, 5, 40])
def test_linear_twin_matches_float64(rng, wkind, M_):
    K, Nn = 96, 24
    x = rng.standard_normal((M_, K)).astype(np.float32)
    w32 = rng.standard_normal((Nn, K)).astype(np.float32)
    w = to_bf16_bits(w32) if wkind == "bf16" else w32
    w64 = bf16_to_f64(w) if wkind == "bf16" else w32.astype(np.float64)
    ref = np.array([[sum(float(x[m, k]) * w64[n, k] for k in range(K)) for n in range(Nn)] for m in range(M_)])
    y = L.linear(x, w)
    assert y.dtype == np.float32 and y.shape == (M_, Nn)
    assert rel(y, ref) < TOL32
    # out= is written in full
    out = np.full((M_, Nn), np.nan, np.float32)
    L.linear(x, w, out=out)
    assert rel(out, ref) < TOL32
    # negative control: one perturbed weight is caught and located in its output column
    bad = w.copy()
    # the perturbed input column is the one with the largest |x|: the fault's output error (4 |x[:, c]|)
    # is then always far above the tolerance (a small |x[:, c]| once hid it for M_ = 1)
    r, c = int(rng.integers(Nn)), int(np.argmax(np.abs(x).max(axis=0)))
    bad[r, c] = to_bf16_bits(np.float32(w64[r, c] + 4.0)) if wkind == "bf16" else np.float32(w64[r, c] + 4.0)
    yb = L.linear(x, bad)
    assert rel(yb, ref) > 100 * TOL32
    col_err = np.abs(yb.astype(np.float64) - ref).max(axis=0)
    assert int(np.argmax(col_err)) == r


def test_linear_bad_input_errors():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(KernelInputError, match="w"):
        L.linear(x, np.zeros((3, 9), np.float32))
    with pytest.raises(KernelInputError, match="weight"):
        L.linear(x, np.zeros((3, 8), np.int32))
    with pytest.raises(KernelInputError, match="out"):
        L.linear(x, np.zeros((3, 8), np.float32), out=np.zeros((2, 2), np.float32))


def test_grouped_linear_twin(rng):
    E, Nn, K, R = 5, 12, 40, 9
    w = to_bf16_bits(rng.standard_normal((E, Nn, K)))
    counts = rng.integers(0, 5, size=E)
    S = int(counts.sum())
    offsets = np.concatenate([[0], np.cumsum(counts)])
    x = rng.standard_normal((R, K)).astype(np.float32)
    row_index = rng.integers(0, R, size=S).astype(np.int32)
    y = L.grouped_linear(x, w, offsets, row_index=row_index)
    w64 = bf16_to_f64(w)
    ref = np.zeros((S, Nn))
    for s in range(S):
        e = int(np.searchsorted(offsets, s, side="right") - 1)
        ref[s] = w64[e] @ x[row_index[s]].astype(np.float64)
    assert rel(y, ref) < TOL32
    # negative control: two experts' weights swapped -> exactly their rows are wrong
    used = [e for e in range(E) if counts[e] > 0]
    if len(used) >= 2:
        a, b = used[0], used[1]
        ws = w.copy()
        ws[[a, b]] = ws[[b, a]]
        ys = L.grouped_linear(x, ws, offsets, row_index=row_index)
        bad_rows = np.nonzero(np.abs(ys - ref).max(axis=1) > 1e-3)[0]
        expect = np.r_[offsets[a]:offsets[a + 1], offsets[b]:offsets[b + 1]]
        assert set(bad_rows.tolist()) == set(expect.tolist())
    with pytest.raises(KernelInputError, match="offsets"):
        L.grouped_linear(x, w, offsets[::-1], row_index=row_index)


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


def _f64(w):
    return bf16_to_f64(w) if w.dtype == np.uint16 else w.astype(np.float64)


def moe_ref64(x, W, k, E, I):
    """Per-token loop in float64: softmax, canonical top-k, renormalised weights, experts, shared."""
    x64 = x.astype(np.float64)
    out = np.zeros_like(x64)
    gu, dn = _f64(W["gate_up"]), _f64(W["down"])
    for t in range(x.shape[0]):
        lg = _f64(W["router"]) @ x64[t]
        p = np.exp(lg - lg.max())
        p /= p.sum()
        sel = canonical_ids_ref(p, k)
        ws = p[sel] / p[sel].sum()
        for e, wt in zip(sel, ws):
            g = gu[e, :I] @ x64[t]
            u = gu[e, I:] @ x64[t]
            out[t] += wt * (dn[e] @ (g * sig64(g) * u))
        g = _f64(W["sg"]) @ x64[t]
        u = _f64(W["su"]) @ x64[t]
        out[t] += sig64(_f64(W["sgate"]) @ x64[t])[0] * (_f64(W["sd"]) @ (g * sig64(g) * u))
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


# ----------------------------------------------------------------------------------------------- norms
def rms_ref64(x, w, gs, eps):
    x = x.astype(np.float64)
    y = np.empty_like(x)
    D = x.shape[-1]
    for g in range(D // gs):
        sl = slice(g * gs, (g + 1) * gs)
        ms = (x[:, sl] ** 2).sum(axis=1, keepdims=True) / gs
        y[:, sl] = x[:, sl] / np.sqrt(ms + eps) * (1.0 + w[sl].astype(np.float64))
    return y


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


def hc_ref64(x, nw, down, up, inj_w, hc, eps):
    T, W = x.shape
    H = W // hc
    n = rms_ref64(x, nw, H, eps)
    a = n @ _f64(down).T / hc
    a = a * sig64(a)
    m = sig64(a @ _f64(up).T)
    mixed = sum((m * n)[:, s * H:(s + 1) * H] for s in range(hc)) / hc
    inj = 2.0 * sig64(n @ _f64(inj_w).T / hc)
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


# ----------------------------------------------------------------------------------------------- PLE
class _Cfg:
    """Just the fields the PLE hash tables read (sizes like the tiny fixture, odd ones on purpose)."""

    def __init__(self, n=3, hpn=2, eos=5):
        self.ngram_size, self.heads_per_ngram, self.ple_eos_token_id = n, hpn, eos


class _Layout:
    def __init__(self, rng, n, hpn):
        heads = (n - 1) * hpn
        self.multipliers = tuple(int(2 * rng.integers(1, 2**61) + 1) for _ in range(n))  # odd, < 2**63
        self.head_vocab_sizes = tuple(int(v) for v in rng.choice([1009, 1013, 1019, 1021, 1031, 1033], heads))
        offs, tot = [], 0
        for v in self.head_vocab_sizes:
            offs.append(tot)
            tot += v
        self.head_offsets = tuple(offs)


MASK = (1 << 64) - 1


def ngram_ref_python(seq, n, hpn, eos, mult, vocab, offs):
    """Python-int reference over a whole sequence (no carry): EOS-filled start, explicit wrap-around."""
    hist = [eos] * (n - 1) + list(seq)
    rows = []
    for q in range(n - 1, len(hist)):
        row = []
        for g in range(2, n + 1):
            toks = []
            for s in range(g):
                src = q - s
                ok = src >= 0 and all(hist[p] != eos for p in range(src, q)) if s else True
                toks.append(hist[src] if ok else eos)
            mixed = 0
            for s, tkn in enumerate(toks):
                mixed ^= (tkn * mult[s]) & MASK
            signed = mixed - (1 << 64) if mixed >= (1 << 63) else mixed
            for h in range((g - 2) * hpn, (g - 1) * hpn):
                row.append(signed % vocab[h] + offs[h])  # Python % is the floor modulo
        rows.append(row)
    return np.array(rows, dtype=np.int64)


def _chunks(rng, T):
    cuts = sorted(set(rng.integers(1, T, size=3).tolist()))
    return [0] + cuts + [T]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ngram_hash_chunked_matches_python_ints(rng, n):
    hpn, eos, V = 2, 5, 40
    cfg = _Cfg(n, hpn, eos)
    lay = _Layout(rng, n, hpn)
    tabs = P.PLEHashTables.from_layout(lay, cfg)
    T = 30
    seq = rng.integers(0, V, size=T)
    seq[rng.choice(T, size=3, replace=False)] = eos  # document boundaries
    seq[:2] = rng.integers(6, V, size=2)
    ref = ngram_ref_python(seq.tolist(), n, hpn, eos, lay.multipliers, lay.head_vocab_sizes, lay.head_offsets)
    ctx = np.full((4, n - 1), eos, np.int64)
    slot = 2
    cuts = _chunks(rng, T)
    got = np.concatenate([P.ngram_hash(seq[None, a:b], ctx, [slot], tabs)[0] for a, b in zip(cuts, cuts[1:])])
    np.testing.assert_array_equal(got, ref)
    assert ctx[slot].tolist() == seq[T - (n - 1):].tolist()
    assert (ctx[[0, 1, 3]] == eos).all()  # other slots untouched
    # negative control 1: dropped context between chunks -> caught at the first positions of chunk 2. The
    # n-1 tokens before the cut are made non-EOS (an EOS there would make the dropped context an EOS-filled
    # one that the official hash also uses, hiding the fault), so the control is active on every input.
    b = cuts[1]
    seq_c = seq.copy()
    seq_c[max(0, b - (n - 1)):b] = rng.integers(eos + 1, V, size=b - max(0, b - (n - 1)))
    ref_c = ngram_ref_python(seq_c.tolist(), n, hpn, eos, lay.multipliers, lay.head_vocab_sizes, lay.head_offsets)
    ctx2 = np.full((1, n - 1), eos, np.int64)
    first = P.ngram_hash(seq_c[None, :b], ctx2, [0], tabs)[0]
    ctx2[:] = eos  # fault: state dropped
    second = P.ngram_hash(seq_c[None, b:], ctx2, [0], tabs)[0]
    bad = np.nonzero((np.concatenate([first, second]) != ref_c).any(axis=1))[0]
    assert len(bad) and bad[0] == b and bad.max() < b + n - 1
    # negative control 2: off-by-one position (the history shifted by one token) is caught
    shifted = np.concatenate([[eos], seq[:-1]])
    ctx3 = np.full((1, n - 1), eos, np.int64)
    assert (P.ngram_hash(shifted[None], ctx3, [0], tabs)[0] != ref).any()


def test_ngram_hash_eos_reset_is_located(rng):
    n, hpn, eos = 3, 2, 5
    lay = _Layout(rng, n, hpn)
    tabs = P.PLEHashTables.from_layout(lay, _Cfg(n, hpn, eos))
    seq = rng.integers(6, 50, size=12)
    seq[6] = eos
    ref = ngram_ref_python(seq.tolist(), n, hpn, eos, lay.multipliers, lay.head_vocab_sizes, lay.head_offsets)
    ctx = np.full((1, n - 1), eos, np.int64)
    np.testing.assert_array_equal(P.ngram_hash(seq[None], ctx, [0], tabs)[0], ref)
    # negative control: a hash that ignores EOS (a different document boundary) differs exactly at the
    # two positions after the EOS, where the official hash resets the history
    other = seq.copy()
    other[6] = 7  # not EOS -> no reset
    ref_no_reset = ngram_ref_python(other.tolist(), n, hpn, eos, lay.multipliers, lay.head_vocab_sizes,
                                    lay.head_offsets)
    diff = np.nonzero((ref_no_reset != ref).any(axis=1))[0]
    assert diff.tolist() == [6, 7, 8]


def test_ngram_hash_batched_decode_equals_per_sequence(rng):
    n, hpn, eos = 3, 2, 5
    lay = _Layout(rng, n, hpn)
    tabs = P.PLEHashTables.from_layout(lay, _Cfg(n, hpn, eos))
    B, T = 3, 9
    seqs = rng.integers(0, 40, size=(B, T))
    ctx = np.full((5, n - 1), eos, np.int64)
    slots = np.array([4, 0, 2])
    steps = np.stack([P.ngram_hash(seqs[:, t:t + 1], ctx, slots, tabs)[:, 0] for t in range(T)], axis=1)
    for b in range(B):
        ref = ngram_ref_python(seqs[b].tolist(), n, hpn, eos, lay.multipliers, lay.head_vocab_sizes, lay.head_offsets)
        np.testing.assert_array_equal(steps[b], ref)


@pytest.mark.parametrize("T", [1, 4])
def test_ngram_hash_equals_reference_readable_form(T):
    """The engine's batched host hash (the reference's Numba twin over the engine's context slab) equals the
    reference's readable form sequence by sequence, and advances each carried context to its last tokens."""
    from reference.blocks.ple import ngram_rows_numpy
    ck = Checkpoint.open(FIXTURES / "tiny")
    c = ck.config
    layer = c.ple_layers[0]
    tab = P.PLEHashTables.from_layout(c.ple_layout(layer), c, np)
    rng = np.random.default_rng(3 + T)
    ids = rng.integers(0, c.vocab_size, (4, T))
    ids[1, 0] = tab.eos
    ids[3, T - 1] = tab.eos
    ctx = rng.integers(0, c.vocab_size, (6, c.ngram_size - 1))
    ctx[2, -1] = tab.eos
    slots = np.array([0, 2, 5, 3])
    got_ctx = ctx.copy()
    got = P.ngram_hash(ids, got_ctx, slots, tab)
    for b, s in enumerate(slots):
        want = ngram_rows_numpy(ctx[s], ids[b], tab.eos, tab.multipliers, tab.vocab_sizes, tab.offsets,
                                tab.heads_per_ngram)
        np.testing.assert_array_equal(got[b], want)
        hist = np.concatenate([ctx[s], ids[b]])
        np.testing.assert_array_equal(got_ctx[s], hist[len(hist) - (c.ngram_size - 1):])
    untouched = [r for r in range(6) if r not in slots]
    np.testing.assert_array_equal(got_ctx[untouched], ctx[untouched])
    # negative control: one multiplier off by one changes rows of every head of that order and above
    bad = P.PLEHashTables(tab.multipliers.copy(), tab.vocab_sizes, tab.offsets, tab.ngram_size,
                              tab.heads_per_ngram, tab.eos)
    bad.multipliers[1] += 1
    wrong = P.ngram_hash(ids, ctx.copy(), slots, bad)
    assert (wrong != got).any()


def test_ngram_hash_bad_input():
    ck = Checkpoint.open(FIXTURES / "tiny")
    c = ck.config
    tab = P.PLEHashTables.from_layout(c.ple_layout(c.ple_layers[0]), c, np)
    ctx = np.zeros((2, c.ngram_size - 1), np.int64)
    with pytest.raises(KernelInputError, match="slots"):
        P.ngram_hash(np.zeros((1, 1), np.int64), ctx, [5], tab)
    with pytest.raises(KernelInputError, match="ctx_slab"):
        P.ngram_hash(np.zeros((1, 1), np.int64), ctx.astype(np.int32), [0], tab)


def conv_ref64(x, w, dil):
    """Full-sequence dilated causal depthwise conv (zero history) + silu, in float64 loops."""
    T, C = x.shape
    K = w.shape[1]
    y = np.zeros((T, C))
    for t in range(T):
        for j in range(K):
            tau = t - (K - 1 - j) * dil
            if tau >= 0:
                y[t] += w[:, j].astype(np.float64) * x[tau]
    return y * sig64(y)


def test_ple_conv_chunked_with_state(rng):
    T, C, K, dil = 19, 6, 4, 3
    Lh = (K - 1) * dil
    x = rng.standard_normal((T, C)).astype(np.float32)
    w = rng.standard_normal((C, K)).astype(np.float32)
    ref = conv_ref64(x.astype(np.float64), w, dil)
    slab = np.zeros((3, Lh, C), np.float32)
    cuts = _chunks(rng, T)
    got = np.concatenate([P.ple_conv(x[None, a:b], slab, [1], w, dilation=dil)[0] for a, b in zip(cuts, cuts[1:])])
    assert rel(got, ref) < TOL32
    np.testing.assert_array_equal(slab[1], x[T - Lh:])
    assert not slab[[0, 2]].any()
    # negative control: dropped state at the second chunk -> caught in its first L positions only
    slab2 = np.zeros((1, Lh, C), np.float32)
    b = cuts[1]
    y1 = P.ple_conv(x[None, :b], slab2, [0], w, dilation=dil)[0]
    slab2[:] = 0
    y2 = P.ple_conv(x[None, b:], slab2, [0], w, dilation=dil)[0]
    bad = np.nonzero(np.abs(np.concatenate([y1, y2]) - ref).max(axis=1) > 1e-4)[0]
    assert len(bad) and bad.min() >= b and bad.max() < b + Lh


def test_ple_layer_matches_float64(rng):
    B, T, hc, H, D, K, dil, eps = 2, 5, 4, 8, 12, 4, 3, 1e-6
    W = hc * H
    hidden = rng.standard_normal((B, T, W)).astype(np.float32)
    emb = rng.standard_normal((B, T, D)).astype(np.float32)
    kp = to_bf16_bits(rng.standard_normal((W, D)) * 0.3)
    vp = to_bf16_bits(rng.standard_normal((H, D)) * 0.3)
    nk, nq, nc = ((rng.standard_normal(W) * 0.1).astype(np.float32) for _ in range(3))
    cw = rng.standard_normal((W, K)).astype(np.float32)
    slab = np.zeros((B, (K - 1) * dil, W), np.float32)
    out, gate = ple_layer(hidden, emb, kp, vp, nk, nq, nc, cw, slab, [0, 1], hc_count=hc, eps=eps, dilation=dil)
    for b in range(B):
        e64 = emb[b].astype(np.float64)
        key = rms_ref64(e64 @ _f64(kp).T, nk, H, eps).reshape(T, hc, H)
        q = rms_ref64(hidden[b], nq, H, eps).reshape(T, hc, H)
        g = (key * q).sum(-1) / np.sqrt(H)
        g = np.sign(g) * np.sqrt(np.maximum(np.abs(g), 1e-6))
        gated = (sig64(g)[:, :, None] * (e64 @ _f64(vp).T)[:, None, :]).reshape(T, W)
        ref = gated + conv_ref64(rms_ref64(gated, nc, H, eps), cw, dil)
        assert rel(gate[b], g) < TOL32
        assert rel(out[b], ref) < TOL32


# ----------------------------------------------------------------------------------------------- properties
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=25, deadline=None)
@given(seq=st.lists(st.integers(0, 12), min_size=1, max_size=24), n=st.integers(2, 4),
       cuts=st.lists(st.integers(1, 23), max_size=4), seed=st.integers(0, 2**32 - 1))
def test_ngram_hash_property_any_chunking(seq, n, cuts, seed):
    """Any token sequence (EOS = 5 appears often: ids 0..12), any chunking: the carried-context hash
    equals the whole-sequence Python-int reference bit for bit."""
    rng = np.random.default_rng(seed)
    hpn, eos = 2, 5
    lay = _Layout(rng, n, hpn)
    tabs = P.PLEHashTables.from_layout(lay, _Cfg(n, hpn, eos))
    arr = np.array(seq, dtype=np.int64)
    T = len(seq)
    bounds = [0] + sorted({c for c in cuts if c < T}) + [T]
    ctx = np.full((1, n - 1), eos, np.int64)
    got = np.concatenate([P.ngram_hash(arr[None, a:b], ctx, [0], tabs)[0] for a, b in zip(bounds, bounds[1:])])
    ref = ngram_ref_python(seq, n, hpn, eos, lay.multipliers, lay.head_vocab_sizes, lay.head_offsets)
    np.testing.assert_array_equal(got, ref)


def test_bad_inputs_name_the_argument():
    x = np.zeros((2, 8), np.float32)
    with pytest.raises(KernelInputError, match="top_k"):
        M.router_topk(x, 9)
    with pytest.raises(KernelInputError, match="gate_up/down"):
        M.moe_experts(x, np.zeros((2, 1), np.int32), np.ones((2, 1), np.float32), np.zeros((3, 6, 8), np.float32),
                      np.zeros((3, 8, 4), np.float32))
    with pytest.raises(KernelInputError, match="ids/weights"):
        M.moe_experts(x, np.zeros((2, 1), np.int32), np.ones((2, 2), np.float32), np.zeros((3, 6, 8), np.float32),
                      np.zeros((3, 8, 3), np.float32))
    with pytest.raises(KernelInputError, match="x"):
        N.hc_pre(np.zeros((2, 10), np.float32), np.zeros(10, np.float32), np.zeros((2, 10), np.float32),
                 np.zeros((10, 2), np.float32), hc_count=4, eps=1e-6)
    lay = _Layout(np.random.default_rng(0), 3, 2)
    tabs = P.PLEHashTables.from_layout(lay, _Cfg(3, 2, 5))
    with pytest.raises(KernelInputError, match="ctx_slab"):
        P.ngram_hash(np.zeros((1, 3), np.int64), np.zeros((2, 3), np.int64), [0], tabs)
    with pytest.raises(KernelInputError, match="slots"):
        P.ngram_hash(np.zeros((2, 3), np.int64), np.zeros((2, 2), np.int64), [0], tabs)
    with pytest.raises(KernelInputError, match="weight/conv_slab"):
        P.ple_conv(np.zeros((1, 2, 4), np.float32), np.zeros((1, 5, 4), np.float32), [0], np.zeros((4, 4)),
                   dilation=3)
    with pytest.raises(KernelInputError, match="key/value/hidden"):
        P.ple_gate(np.zeros((2, 8)), np.zeros((2, 3)), np.zeros((2, 8)), *(np.zeros(8),) * 3, hc_count=4, eps=1e-6)
