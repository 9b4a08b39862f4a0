"""PLE (engine/kernels/ple.py): the host n-gram hash (chunked, EOS resets, batched decode, the reference's
readable form on the tiny fixture's tables, any chunking as a property), the dilated causal conv with carried state,
and the whole PLE layer; on the CPU (twins against Python-int / float64 references) and on CUDA.

CPU tolerance: TOL32 = 1e-5 relative (float32 twin vs float64 truth); hashes are compared bit for bit. Negative
controls: dropped context / state between chunks (caught at the first positions of the next chunk only), an
off-by-one history, a hash ignoring EOS. CUDA: CUDA vs float64 twin with carried state over prefill and decode
steps (poisoned outputs), TOL 1e-5; a dropped conv state is caught in the first L positions only.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from engine.kernels import moe as M, norms as N, ple as P
from ple_helpers import ple_layer
from engine.kernels.dense_common import KernelInputError, to_bf16_bits
from reference.checkpoint import Checkpoint
from reference.paths import FIXTURES
from op_devices import cp, on_cuda
from op_helpers import g, rel, rel_dev, rms_ref64, sig64, to_f64

# the gpu marker, a skip without cupy / a GPU, and poison (conftest.py) before every CUDA test
cuda = on_cuda("poison")


TOL32 = 1e-5  # see module docstring


# ----------------------------------------------------------------------------------------------- norms


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
        for order in range(2, n + 1):
            toks = []
            for s in range(order):
                src = q - s
                ok = src >= 0 and all(hist[p] != eos for p in range(src, q)) if s else True
                toks.append(hist[src] if ok else eos)
            mixed = 0
            for s, tkn in enumerate(toks):
                mixed ^= (tkn * mult[s]) & MASK
            signed = mixed - (1 << 64) if mixed >= (1 << 63) else mixed
            for h in range((order - 2) * hpn, (order - 1) * hpn):
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
        key = rms_ref64(e64 @ to_f64(kp).T, nk, H, eps).reshape(T, hc, H)
        q = rms_ref64(hidden[b], nq, H, eps).reshape(T, hc, H)
        g = (key * q).sum(-1) / np.sqrt(H)
        g = np.sign(g) * np.sqrt(np.maximum(np.abs(g), 1e-6))
        gated = (sig64(g)[:, :, None] * (e64 @ to_f64(vp).T)[:, None, :]).reshape(T, W)
        ref = gated + conv_ref64(rms_ref64(gated, nc, H, eps), cw, dil)
        assert rel(gate[b], g) < TOL32
        assert rel(out[b], ref) < TOL32


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


TOL = 1e-5  # see module docstring


@cuda
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
        assert rel_dev(og, o64) < TOL and rel_dev(gg, g64) < TOL
        assert rel_dev(slab_g, slab_64) < TOL
    # negative control: a dropped conv state is caught in the first L positions of the next chunk only
    x = rng.standard_normal((1, 12, W)).astype(np.float32)
    keep = P.ple_conv(g(x), slab_g.copy(), g(np.array([2])), g(cw), dilation=dil)
    dropped = slab_g.copy()
    dropped[2] = 0
    lost = P.ple_conv(g(x), dropped, g(np.array([2])), g(cw), dilation=dil)
    bad_t = np.nonzero(cp.asnumpy(cp.abs(keep - lost).max(axis=2))[0] > 1e-6)[0]
    assert len(bad_t) and bad_t.max() < Lh
