"""The MTP head: the fixtures that carry one (both layouts read), the reference head against an independent
float64 implementation of its formulas (tests/mtp_f64.py), its named options, its goldens, and speculative
greedy decoding with its drafts equal to plain greedy decoding.

Provenance: no official MTP implementation exists (transformers drops ``mtp.*``); the truth is the
reference's implementation of the vLLM/SGLang dataflow (reference/blocks/mtp.py)."""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from fixture_helpers import FIXTURES, fixture_dir
from mtp_f64 import F64MTP
from reference.checkpoint import Checkpoint, CheckpointError, DictWeights, mtp_expected_shapes
from reference.errors import InputError
from reference.model import ReferenceModel
from reference.session import accept_greedy, speculative_greedy

MTP_FIXTURES = {"tiny-mtp": "tiny", "tiny-hc3-mtp": "tiny-hc3"}
PROMPTS = ("short", "qsa", "eos", "maxid", "chat")


def _golden(name):
    with np.load(fixture_dir(name) / "golden_mtp.npz") as z:
        g = {k: z[k] for k in z.files}
    return g, json.loads((fixture_dir(name) / "golden_mtp.json").read_text())


def _rel(a, b):
    return float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())


# Regression goldens (the float32 reference against its own committed outputs): the same code in another
# evaluation order (BLAS picks its kernels and blocking by CPU, thread count and version) differs by float32
# rounding only, measured 1.3e-7 .. 5.8e-7 relative to the tensor's largest magnitude (a few float32 epsilons,
# 1.19e-7) on both MTP fixtures. 1e-5 relative leaves >= 17x margin; a real change moves the outputs by
# >= 1e-2 (negative control: a perturbed fc_hidden). Relative, not absolute: tiny-hc3-mtp's logits reach 14.
REGRESSION_REL = 1e-5


def _assert_golden(new, old, what):
    """``new`` reproduces the committed golden ``old``: integer arrays (ids, counts) exactly, float arrays
    within REGRESSION_REL of the golden's largest magnitude."""
    new, old = np.asarray(new), np.asarray(old)
    assert new.shape == old.shape, (what, new.shape, old.shape)
    if old.dtype.kind in "fc":
        err = _rel(new, old)
        assert err <= REGRESSION_REL, f"{what}: {err:.3g} relative > {REGRESSION_REL:g}"
    else:
        assert np.array_equal(new, old), what


# ------------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_mtp_fixture_reads_in_its_layout_and_keeps_the_base_trunk(name):
    """Both layouts: tiny-mtp (save_pretrained names, per-expert mtp experts, one file) and tiny-hc3-mtp
    (release: model.language_model. trunk, top-level mtp.*, fused 3-D experts, own shard in the index).
    Every trunk tensor is byte-identical to the base fixture's (so its official goldens still hold)."""
    ck, base = Checkpoint.open(fixture_dir(name)), Checkpoint.open(fixture_dir(MTP_FIXTURES[name]))
    assert ck.has_mtp() and not base.has_mtp()
    assert ck.validate() == []  # nothing unknown, every shape (mtp.* included) as the config says
    mtp = sorted(n for n in ck.names() if n.startswith("mtp."))
    fused = name == "tiny-hc3-mtp"
    assert len(mtp) == (31 if fused else 29 + 3 * ck.config.num_experts)  # the real head's 31 when fused
    assert ("mtp.layers.0.mlp.experts.gate_up_proj" in mtp) == fused
    assert sorted(set(ck.names()) - set(mtp)) == base.names()
    for n in base.names():
        assert np.array_equal(np.asarray(ck.get_raw(n)).view(np.uint8), np.asarray(base.get_raw(n)).view(np.uint8)), n
    shapes = mtp_expected_shapes(ck.config)
    for n in mtp:
        if n in shapes:
            assert ck.shape(n) == shapes[n]
    g, u, d = ck.expert("mtp", 3)
    H, I = ck.config.hidden_size, ck.config.moe_intermediate_size
    assert g.shape == u.shape == (I, H) and d.shape == (H, I)
    if fused:
        gu = ck.get("mtp.layers.0.mlp.experts.gate_up_proj")
        assert np.array_equal(g, gu[3, :I]) and np.array_equal(u, gu[3, I:])
    else:
        assert np.array_equal(u, ck.get("mtp.layers.0.mlp.experts.3.up_proj.weight"))


def test_mtp_names_with_a_language_model_prefix_read_the_same():
    """``model.language_model.mtp.*`` / ``model.mtp.*`` map to the canonical ``mtp.*`` (the reader's prefix rule)."""
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    arrays = {}
    for n in ck.names():
        pre = "model.language_model." if n.startswith("mtp.layers") else ("model." if n.startswith("mtp.") else "")
        arrays[pre + n] = np.asarray(ck.get(n))
    dw = DictWeights(ck.config, arrays)
    assert dw.has_mtp()
    g = _golden("tiny-mtp")[0]
    lg, _ = ReferenceModel(dw).mtp_forward(g["eos/residual"][:-1], g["eos/ids"][1:])
    np.testing.assert_allclose(lg, g["eos/logits"], atol=1e-5, rtol=0)


def test_partial_mtp_head_is_refused_with_the_missing_name():
    ck = Checkpoint.open(fixture_dir("tiny-hc3-mtp"))
    arrays = {n: np.asarray(ck.get(n)) for n in ck.names() if n != "mtp.fc_hidden.weight"}
    with pytest.raises(CheckpointError, match="mtp.fc_hidden.weight"):
        DictWeights(ck.config, arrays).has_mtp()
    with pytest.raises(CheckpointError, match="mtp"):
        ReferenceModel(Checkpoint.open(fixture_dir("tiny"))).new_mtp_session()
    with pytest.raises(InputError, match="hnorm"):
        ReferenceModel(ck).new_mtp_session(hnorm="per_head")
    with pytest.raises(InputError, match="draft_selection"):
        ReferenceModel(ck).new_mtp_session(draft_selection="stale")
    ms = ReferenceModel(ck).new_mtp_session()
    with pytest.raises(InputError, match="residual"):
        ms.step(np.zeros((2, 5)), [1, 2])


# ------------------------------------------------------------------------------------------- float64 check
# Tolerance: the reference runs float32 (BF16 weights read exactly), the check float64, over one decoder
# layer, the trunk-shaped fusion and the lm_head of O(1)-scaled random weights; the difference is float32
# rounding, measured <= 2e-7 relative to the largest logit on both fixtures. 1e-4 relative leaves a wide
# margin (the float32 error grows with width) while the negative controls move the logits by >= 1e-3 relative.
TOL = 1e-4


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_reference_mtp_matches_independent_float64_formulas(name):
    ck = Checkpoint.open(fixture_dir(name))
    g, meta = _golden(name)
    assert "no official implementation" in meta["truth_provenance"]
    f64 = F64MTP(ck)
    f64_ps = F64MTP(ck, hnorm="per_stream")
    for p in ("eos", "chat"):  # eos: EOS ids inside; chat: crosses the QSA bound (top-k selection binds)
        R, ids = g[f"{p}/residual"].astype(np.float64), g[f"{p}/ids"]
        lg, st = f64.forward(R[:-1], ids[1:])
        assert _rel(g[f"{p}/logits"], lg) < TOL, p
        assert _rel(g[f"{p}/state"], st) < TOL, p
        assert _rel(g[f"{p}/logits_per_stream"], f64_ps.forward(R[:-1], ids[1:])[0]) < TOL, p
        # negative control: the other hnorm grouping is a different function, caught at > 10x the tolerance
        # (the tiny trunks' streams have similar RMS, so the two groupings differ by ~1e-2 here, not more)
        assert _rel(g[f"{p}/logits_per_stream"], lg) > 10 * TOL, p
    for p in ("qsa", "chat"):
        n = int(g[f"draft/{p}/n"])
        R, ids = g[f"{p}/residual"].astype(np.float64), g[f"{p}/ids"]
        for opt in ("fresh", "reuse_step0"):
            d, dl = f64.draft(R[:n], ids[1:n + 1], meta["draft_k"], reuse_step0=(opt == "reuse_step0"))
            assert _rel(g[f"draft/{p}/{opt}/logits"], dl) < TOL, (p, opt)
            assert np.array_equal(g[f"draft/{p}/{opt}/ids"], d), (p, opt)


def test_draft_selection_option_matters_past_the_qsa_bound():
    """reuse_step0 and fresh agree on the first draft (same step) and differ later once a later draft step
    would select other blocks; the float64 check tells them apart (negative control of the option)."""
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    g, _ = _golden("tiny-mtp")
    a, b = g["draft/chat/fresh/logits"], g["draft/chat/reuse_step0/logits"]
    np.testing.assert_array_equal(a[0], b[0])
    assert _rel(b[1:], a[1:].astype(np.float64)) > 1e-3
    f64 = F64MTP(ck)
    n = int(g["draft/chat/n"])
    _, dl = f64.draft(g["chat/residual"][:n].astype(np.float64), g["chat/ids"][1:n + 1], 3, reuse_step0=False)
    assert _rel(b, dl) > 1e-3  # the reuse golden is not the fresh formula


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_mtp_goldens_are_the_current_reference(name):
    """Regression: the reference (float32) reproduces its committed goldens; a perturbed fc_hidden does not
    (caught, negative control). Tolerance: REGRESSION_REL (same code, same dtype; only the evaluation order)."""
    ck = Checkpoint.open(fixture_dir(name))
    g, _ = _golden(name)
    m = ReferenceModel(ck)
    for p in PROMPTS:
        R, ids = g[f"{p}/residual"], g[f"{p}/ids"]
        lg, st = m.mtp_forward(R[:-1], ids[1:])
        _assert_golden(lg, g[f"{p}/logits"], f"{p}/logits")
        _assert_golden(st, g[f"{p}/state"], f"{p}/state")
    sess = m.new_session()
    sess.residual_log = []
    sess.prefill(g["qsa/ids"])
    _assert_golden(np.concatenate(sess.residual_log), g["qsa/residual"], "qsa/residual")
    W = ck.get("mtp.fc_hidden.weight")
    bad = ReferenceModel(ck.with_override("mtp.fc_hidden.weight", W + 0.05 * np.eye(*W.shape, dtype=W.dtype)))
    assert _rel(bad.mtp_forward(g["eos/residual"][:-1], g["eos/ids"][1:])[0], g["eos/logits"]) > 1e-2


def test_mtp_session_step_by_step_equals_one_call_and_truncate_is_exact():
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    g, _ = _golden("tiny-mtp")
    m = ReferenceModel(ck)
    R, ids = g["chat/residual"][:-1], g["chat/ids"][1:]
    ms = m.new_mtp_session()
    a = [ms.step(R[:10], ids[:10])[0]]
    snap = ms.snapshot()
    for t in range(10, len(ids)):
        a.append(ms.step(R[t:t + 1], ids[t:t + 1])[0])
    _assert_golden(np.concatenate(a), g["chat/logits"], "chat/logits")
    ms.truncate(10)
    _assert_golden(ms.step(R[10:], ids[10:])[0], g["chat/logits"][10:], "chat/logits[10:]")
    ms.restore(snap)
    assert ms.position == 10
    d, dl = ms.draft(R[10:20], ids[10:20], 3)
    assert ms.position == 20 and ms.state.qsa.k.n == 20  # speculative draft steps never stay
    _assert_golden(dl[0], g["chat/logits"][19], "chat/logits[19]")


# ------------------------------------------------------------------------------------------- speculative
def _plain_greedy(m, prompt, n):
    s = m.new_session()
    lg = s.prefill(prompt)[-1]
    out = []
    while len(out) < n:
        out.append(int(np.argmax(lg)))
        lg = s.decode(out[-1])
    return out


def test_accept_greedy_counts_the_matching_prefix():
    lg = np.zeros((4, 5))
    lg[0, 2] = lg[1, 4] = lg[2, 1] = lg[3, 0] = 1
    assert accept_greedy([2, 4, 1], lg) == 3
    assert accept_greedy([2, 4, 3], lg) == 2
    assert accept_greedy([0, 4, 1], lg) == 0


@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_speculative_greedy_equals_plain_greedy_short(name):
    """64 tokens, k = 3: same tokens as plain greedy; every acceptance count seen is in 0..k; the trace's
    positions advance by accepted + 1 (rollback of the rejected ones)."""
    m = ReferenceModel(Checkpoint.open(fixture_dir(name)))
    prompt = _golden(name)[0]["chat/ids"]
    trace = []
    spec = speculative_greedy(m, prompt, 64, 3, trace=trace)
    assert spec == _plain_greedy(m, prompt, 64)
    assert all(0 <= t["accepted"] <= 3 for t in trace)
    for a, b in zip(trace, trace[1:]):
        assert b["position"] == a["position"] + a["accepted"] + 1


@pytest.mark.slow
@pytest.mark.parametrize("name", MTP_FIXTURES)
def test_speculative_greedy_equals_plain_greedy_512(name):
    m = ReferenceModel(Checkpoint.open(fixture_dir(name)))
    prompt = _golden(name)[0]["qsa/ids"]
    for k in (1, 4):
        assert speculative_greedy(m, prompt, 512, k) == _plain_greedy(m, prompt, 512), k


def test_mtp_build_is_deterministic(tmp_path):
    """Rebuilding an MTP fixture from its committed base gives the committed weights, index, config and meta
    byte for byte and its goldens within REGRESSION_REL (float32 outputs of BLAS; no torch needed)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location("fixtures_build", FIXTURES / "build.py")
    b = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(b)
    shutil.copytree(fixture_dir("tiny-hc3"), tmp_path / "tiny-hc3")
    b.build_mtp_fixture("tiny-hc3-mtp", out=tmp_path)
    for f in ("model-mtp.safetensors", "model.safetensors.index.json", "config.json", "golden_mtp.json"):
        assert (tmp_path / "tiny-hc3-mtp" / f).read_bytes() == (fixture_dir("tiny-hc3-mtp") / f).read_bytes(), f
    new = dict(np.load(tmp_path / "tiny-hc3-mtp" / "golden_mtp.npz"))
    old, _ = _golden("tiny-hc3-mtp")
    assert new.keys() == old.keys()
    for k in old:
        _assert_golden(new[k], old[k], k)
    # negative control: a golden off by 1e-4 of its scale, or one id off, is caught
    lg = old["chat/logits"].copy()
    lg.flat[0] += np.float32(1e-4 * np.abs(lg).max())
    with pytest.raises(AssertionError, match="chat/logits"):
        _assert_golden(lg, old["chat/logits"], "chat/logits")
    ids = old["chat/ids"].copy()
    ids[0] += 1
    with pytest.raises(AssertionError, match="chat/ids"):
        _assert_golden(ids, old["chat/ids"], "chat/ids")


def test_mtp_taps_are_registered_and_emitted_in_order():
    """Every mtp.* tap the reference head emits is in the registry (mtp_tap_names, forward order) and only those."""
    from reference import taphook
    from reference.model import _Capture
    from taps import registry

    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    g, _ = _golden("tiny-mtp")
    cap = _Capture()
    tok = taphook.set_current(cap)
    try:
        lg, st = ReferenceModel(ck).mtp_forward(g["qsa/residual"][:-1], g["qsa/ids"][1:])
    finally:
        taphook.reset_current(tok)
    assert list(cap.values) == registry.mtp_tap_names()
    assert all(registry.spec_for(n) is not None for n in cap.values)
    assert sorted(cap.values, key=registry.order_key) == list(cap.values)
    r = cap.result()
    np.testing.assert_array_equal(r["mtp.logits"], lg)
    np.testing.assert_array_equal(r["mtp.layers.0.mlp_hyper_connection.combine"], st)


def test_session_drafts_keep_residuals_through_verify_rollback_and_restore():
    """Session.mtp_draft_next keeps the trunk residuals after its first draft; after verify + rollback and
    after a restore its drafts still equal the from-scratch truth (mtp_draft_from_history), exactly."""
    from reference.session import mtp_draft_from_history
    ck = Checkpoint.open(fixture_dir("tiny-mtp"))
    m = ReferenceModel(ck)
    ids = _golden("tiny-mtp")[0]["chat/ids"]
    s = m.new_session()
    s.prefill(ids[:15])
    snap = s.snapshot()
    s.mtp_draft_next(int(ids[15]), 3)
    s.forward_tokens(ids[15:20])
    s.rollback(3)
    for _ in range(2):
        d, lg = s.mtp_draft_next(7, 3)
        td, tl = mtp_draft_from_history(m, s.tokens, 7, 3)
        np.testing.assert_array_equal(d, td)
        np.testing.assert_allclose(lg, tl, atol=1e-5, rtol=0)
        s.restore(snap)
    assert s.tokens == list(ids[:15])
