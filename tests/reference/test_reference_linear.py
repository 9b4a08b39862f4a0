"""The BF16 stored-bits products of the reference (reference/blocks/linear.py, numba_kernels.bf16_matmul_t)
and their use by ReferenceModel in float32: same numbers as the upcast weights up to float32 summation
order, only routed experts touched, no float32 expert copies kept; with negative controls."""
from __future__ import annotations
from reference import taphook

import ml_dtypes
import numpy as np
import pytest

from reference.blocks import linear as L
from reference.checkpoint import Checkpoint, DictWeights
from reference.model import ReferenceModel
from reference.numba_kernels import bf16_matmul_t
from reference.paths import resolve_model

EPS32 = float(np.finfo(np.float32).eps)


def _bound(x, w32):
    """Worst-case float32 summation error of ``x @ w.T`` (any order, FMA or not): ``K * eps * |x| @ |w|.T``
    (the standard a-priori bound of a length-K float32 dot product; the products themselves are exact)."""
    K = x.shape[1]
    return K * EPS32 * (np.abs(x).astype(np.float64) @ np.abs(w32).astype(np.float64).T)


@pytest.mark.parametrize("N", [1, 3, 4, 5, 9])
def test_bf16_matmul_matches_upcast_product(N):
    """All row counts (the kernel's 4-row blocks and their remainder) agree with the float64 product of the
    exactly upcast weight within the float32 summation bound; a one-weight perturbation is caught and located."""
    rng = np.random.default_rng(N)
    K, O = 77, 45
    w = rng.standard_normal((O, K)).astype(ml_dtypes.bfloat16)
    x = rng.standard_normal((N, K)).astype(np.float32)
    w32 = w.astype(np.float32)
    exact = x.astype(np.float64) @ w32.astype(np.float64).T
    got = bf16_matmul_t(x, w)
    assert got.dtype == np.float32 and got.shape == (N, O)
    assert np.all(np.abs(got - exact) <= _bound(x, w32))
    assert np.array_equal(bf16_matmul_t(x, w.view(np.uint16)), got)  # raw bits accepted alike
    # negative control: one weight changed by one BF16 ulp-scale step -> exactly that output column flagged
    bad = w.copy()
    bad[17, 5] = ml_dtypes.bfloat16(float(bad[17, 5]) + 4.0)
    diff = np.abs(bf16_matmul_t(x, bad) - exact) > _bound(x, w32)
    assert set(np.nonzero(diff.any(axis=0))[0].tolist()) == {17}


def test_bf16_matmul_rejects_bad_input():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="bfloat16"):
        bf16_matmul_t(x, np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match=r"\[N, K\]"):
        bf16_matmul_t(x, np.ones((3, 9), ml_dtypes.bfloat16))
    with pytest.raises(TypeError, match="2-D"):
        L.BF16Matrix(np.ones(8, ml_dtypes.bfloat16))


def test_linear_dispatch():
    """Arrays: exactly ``x @ w.T``. BF16Matrix: the fused kernel up to FUSED_MAX_ROWS float32 rows, the
    upcast (through the given callable) for more rows and for float64 -- bit-equal to BLAS on the upcast."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((24, 40)).astype(ml_dtypes.bfloat16)
    calls = []

    def up(dt):
        calls.append(dt)
        return w.astype(dt)

    m = L.BF16Matrix(w, upcast=up)
    few = rng.standard_normal((3, 40)).astype(np.float32)
    many = rng.standard_normal((L.FUSED_MAX_ROWS + 1, 40)).astype(np.float32)
    a = w.astype(np.float32)
    assert np.array_equal(L.linear(few, a), few @ a.T)
    assert np.array_equal(L.linear(few, m), bf16_matmul_t(few, w)) and calls == []
    assert np.array_equal(L.linear(many, m), many @ a.T) and calls == [np.float32]
    f64 = few.astype(np.float64)
    assert np.array_equal(L.linear(f64, m), f64 @ w.astype(np.float64).T)
    assert L.linear(f64, m).dtype == np.float64


@pytest.fixture(scope="module")
def tiny_ck():
    return Checkpoint.open(resolve_model("tiny"))


def _ids(ck, n=24, seed=5):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, ck.config.vocab_size, n)
    for e in ck.config.eos_token_ids:
        ids[ids == e] = (e + 1) % ck.config.vocab_size
    return ids


def test_bits_path_equals_upcast_weights_and_catches_a_perturbed_expert(tiny_ck):
    """The BF16 checkpoint (products from stored bits) and the same weights upcast to float32 in memory
    (plain BLAS products) give the same logits up to float32 summation order, for a whole prompt and for
    one-token decode steps; a perturbed routed expert is caught."""
    ids = _ids(tiny_ck)
    bits = ReferenceModel(tiny_ck)
    assert bits._bf16_raw("lm_head.weight" if tiny_ck.has("lm_head.weight") else "embed_tokens.weight") is not None
    f32 = DictWeights(tiny_ck.config, {n: (np.array(tiny_ck.get_raw(n)).astype(np.float32)
                                          if tiny_ck.dtype(n) == "BF16" else np.array(tiny_ck.get_raw(n)))
                                       for n in tiny_ck.names()})
    plain = ReferenceModel(f32)
    a, b = bits.forward(ids), plain.forward(ids)
    scale = np.abs(b).max()
    # float32 rounding order only: 1e-4 of the logit scale leaves ~100x headroom over the observed ~1e-6
    # while a perturbed expert (below) moves logits by > 1e-2 of the scale.
    assert np.abs(a - b).max() <= 1e-4 * scale
    s1, s2 = bits.new_session(), plain.new_session()
    for t in ids[:6]:
        assert np.abs(s1.decode(int(t)) - s2.decode(int(t))).max() <= 1e-4 * scale
    # negative control: perturb the most used routed expert of layer 0 in the BF16 checkpoint (either layout)
    from reference.model import _Capture
    import taps.recorder as recmod
    cap = _Capture({"layers.0.mlp.gate.topk_ids"})
    tok = taphook.set_current(cap)
    try:
        bits.forward(ids)
    finally:
        taphook.reset_current(tok)
    e = int(np.bincount(cap.result()["layers.0.mlp.gate.topk_ids"].ravel()).argmax())
    fused = "layers.0.mlp.experts.gate_up_proj"
    name = fused if tiny_ck.has(fused) else f"layers.0.mlp.experts.{e}.gate_proj.weight"
    raw = np.array(tiny_ck.get_raw(name))
    sl = raw[e] if name == fused else raw
    sl[...] = (sl.astype(np.float32) * 1.5 + 0.05).astype(ml_dtypes.bfloat16)
    pert = ReferenceModel(tiny_ck.with_override(name, raw)).forward(ids)
    assert np.abs(pert - b).max() > 1e-2 * scale

def test_bits_path_reads_only_routed_experts_and_keeps_no_float32_copies(tiny_ck, monkeypatch):
    """float32 over a BF16 checkpoint: experts are taken from their stored bits, only those some token routes
    to (asked once per call each), never through the upcasting ``expert()`` and never cached."""
    import taps.recorder as recmod
    from reference.model import _Capture
    ids = _ids(tiny_ck, 5, seed=9)
    m = ReferenceModel(tiny_ck)
    asked = []
    orig = ReferenceModel._expert_bits

    def spy(self, layer, e):
        asked.append((layer, e))
        return orig(self, layer, e)

    monkeypatch.setattr(ReferenceModel, "_expert_bits", spy)
    monkeypatch.setattr(type(tiny_ck), "expert", lambda *a, **k: pytest.fail("expert() upcast used"))
    cap = _Capture()
    tok = taphook.set_current(cap)
    try:
        m.forward(ids)
    finally:
        taphook.reset_current(tok)
    r = cap.result()
    L_ = tiny_ck.config.num_hidden_layers
    used = {(i, int(e)) for i in range(L_) for e in np.unique(r[f"layers.{i}.mlp.gate.topk_ids"])}
    assert set(asked) == used and len(asked) == len(used)
    assert len(used) < L_ * tiny_ck.config.num_experts  # some experts unused: the check has teeth
    assert m._expert_cache == {}
    # float64 keeps the upcasting path (exact BF16 -> float64 through expert())
    assert ReferenceModel(tiny_ck, dtype=np.float64)._expert_bits(0, 0) is None
