"""Dense kernels' NumPy twins against the official transformers modules (the specification).

Each test builds the official module (``transformers.models.qwen4_exp.modeling_qwen4_exp``) in
float64 with random weights (the test's fixed seed), runs it, and runs the engine op on the same weights in float64
(the twins compute in float64 for float64 inputs, the same code path as float32). Tolerance: the
official RMSNorms compute in float32 even inside a float64 module (``self._norm(x.float())``), so
agreement is at float32 level (~1e-7 relative seen); 1e-5 leaves a wide margin while any formula
error (a missing ``1 +``, a swapped activation, a perturbed weight) gives > 1e-3.
Negative controls: a perturbed weight, a wrong tie-break, a dropped state are each caught.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="oracle tests need torch (pip install '.[oracle]')")
mq = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp",
                         reason="oracle tests need transformers >= 5.23 with qwen4_exp")
cq = pytest.importorskip("transformers.models.qwen4_exp.configuration_qwen4_exp")

from engine.kernels import moe as M  # noqa: E402
from fixture_helpers import seed_for_test  # noqa: E402
from engine.kernels import norms as N  # noqa: E402
from engine.kernels import ple as P  # noqa: E402
from ple_helpers import ple_layer  # noqa: E402
from reference.config import ModelConfig  # noqa: E402

pytestmark = pytest.mark.oracle
TOL = 1e-5  # see module docstring
FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "tiny" / "config.json"


@pytest.fixture
def seed(request):
    s = seed_for_test(request.node.nodeid) % (2 ** 31)
    print(f"seed={s}")
    torch.manual_seed(s)
    return s


def official_config():
    raw = json.loads(FIXTURE.read_text())
    return cq.Qwen4ExpTextConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "transformers_version",
                                                                                "model_type", "dtype")})


def randomise(module, scale=0.3):
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn_like(p) * scale)
    return module.double().eval()


def npy(t):
    return t.detach().cpu().numpy()


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.all(np.isfinite(a))
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-300))


def test_norms_vs_official(seed):
    cfg = official_config()
    H, hc = cfg.hidden_size, cfg.hc_count
    norm = randomise(mq.Qwen4ExpTextRMSNorm(hc * H, group_size=H, eps=cfg.rms_norm_eps))
    x = torch.randn(7, hc * H, dtype=torch.float64)
    ref = npy(norm(x))
    w = npy(norm.weight)
    assert rel(N.rms_norm(npy(x), w, eps=cfg.rms_norm_eps, group_size=H), ref) < TOL
    # negative control: the non-centred weight (w instead of 1 + w) is caught
    assert rel(N.rms_norm(npy(x), w - 1.0 + 0.0, eps=cfg.rms_norm_eps, group_size=H), ref) > 1e-3
    gated = randomise(mq.Qwen4ExpTextRMSNormGated(H, eps=cfg.rms_norm_eps, activation="sigmoid"))
    g = torch.randn(7, H, dtype=torch.float64)
    xh = torch.randn(7, H, dtype=torch.float64)
    assert rel(N.gated_rms_norm(npy(xh), npy(g), npy(gated.weight), eps=cfg.rms_norm_eps, activation="sigmoid"),
               npy(gated(xh, g))) < TOL


@pytest.mark.parametrize("use_combine", [True, False])
def test_hyper_connection_vs_official(seed, use_combine):
    cfg = official_config()
    H, hc = cfg.hidden_size, cfg.hc_count
    mod = randomise(mq.Qwen4ExpTextGatedResidual(cfg, use_combine=use_combine))
    x = torch.randn(5, hc * H, dtype=torch.float64)
    res = mod(x)
    inj_w = npy(mod.block_inject_weight.weight) if use_combine else None
    o = N.hc_pre(npy(x), npy(mod.hc_norm.weight), npy(mod.input_mix_weight_down.weight),
                 npy(mod.input_mix_weight_up.weight), inj_w, hc_count=hc, eps=cfg.rms_norm_eps)
    if not use_combine:
        assert rel(o.mixed, npy(res)) < TOL and o.injection_weights is None
        return
    mixed, hyper_in, inj = res
    assert rel(o.mixed, npy(mixed)) < TOL
    assert rel(o.injection_weights, npy(inj)) < TOL
    y = torch.randn(5, H, dtype=torch.float64)
    ref = hyper_in + (y.unsqueeze(-2) * inj.unsqueeze(-1)).flatten(-2)  # the decoder layer's combine
    assert rel(N.hc_combine(npy(x), npy(y), o.injection_weights), npy(ref)) < TOL


def test_moe_block_vs_official(seed):
    cfg = official_config()
    mod = randomise(mq.Qwen4ExpTextSparseMoeBlock(cfg))
    T, H = 9, cfg.hidden_size
    x = torch.randn(1, T, H, dtype=torch.float64)
    ref = npy(mod(x))[0]
    ex = mod.experts
    args = dict(top_k=cfg.num_experts_per_tok, norm_topk_prob=cfg.norm_topk_prob,
                shared_gate_proj=npy(mod.shared_expert.gate_proj.weight),
                shared_up_proj=npy(mod.shared_expert.up_proj.weight),
                shared_down_proj=npy(mod.shared_expert.down_proj.weight),
                shared_expert_gate=npy(mod.shared_expert_gate.weight))
    out = M.moe_block(npy(x)[0], npy(mod.gate.weight), npy(ex.gate_up_proj), npy(ex.down_proj), **args)
    assert rel(out.out, ref) < TOL
    logits, scores, idx = mod.gate(x.reshape(T, H))
    assert rel(out.router_logits, npy(logits)) < TOL
    np.testing.assert_array_equal(out.topk_ids, npy(idx))  # random logits: no ties, torch order is canonical
    assert rel(out.topk_weights, npy(scores)) < TOL
    # negative control: one perturbed expert weight is caught
    gu = npy(ex.gate_up_proj).copy()
    e = int(out.topk_ids[0, 0])
    gu[e, 0, :] += 1.0
    bad = M.moe_block(npy(x)[0], npy(mod.gate.weight), gu, npy(ex.down_proj), **args)
    assert rel(bad.out, ref) > 1e-4


def test_ple_layer_vs_official(seed):
    cfg = official_config()
    mc = ModelConfig.from_dict(json.loads(FIXTURE.read_text()))
    layer_idx = mc.ple_layers[0]
    pli = mc.ple_layer_index(layer_idx)
    mod = randomise(mq.Qwen4ExpTextPLELayer(cfg, layer_idx, pli))
    H, hc, T = cfg.hidden_size, cfg.hc_count, 11
    eos = mc.ple_eos_token_id
    ids = torch.randint(0, cfg.vocab_size, (1, T))
    ids[0, 4] = eos
    hidden = torch.randn(1, T, hc * H, dtype=torch.float64)
    ref = npy(mod(hidden, ids, None))[0]
    lay = mc.ple_layout(layer_idx)
    tabs = P.PLEHashTables.from_layout(lay, mc)
    ne = mod.ple_embedding
    assert tabs.multipliers.tolist() == ne.layer_multipliers.tolist()
    assert tabs.vocab_sizes.tolist() == ne.ngram_heads_vocab_sizes.tolist()
    ctx = np.full((1, mc.ngram_size - 1), eos, np.int64)
    slab = np.zeros((1, mc.ple_conv_state_len, hc * H), np.float64)
    table = npy(ne.ngram_embedding.weight)

    def run(split):
        c, s, outs = ctx.copy(), slab.copy(), []
        for a, b in ((0, split), (split, T)):
            rows = P.ngram_hash(npy(ids)[:, a:b], c, [0], tabs)
            emb = table[rows].reshape(1, b - a, -1)
            o, _ = ple_layer(npy(hidden)[:, a:b], emb, npy(mod.key_proj.weight), npy(mod.value_proj.weight),
                             npy(mod.norm_key.weight), npy(mod.norm_query.weight), npy(mod.norm_conv.weight),
                             npy(mod.conv1d.weight)[:, 0, :], s, [0], hc_count=hc, eps=cfg.rms_norm_eps,
                             dilation=mc.ngram_size)
            outs.append(o[0])
        return np.concatenate(outs), c, s

    got, _, _ = run(6)  # two chunks with carried n-gram context and conv state
    assert rel(got, ref) < TOL
    # negative control: a dropped conv state between the chunks is caught at the second chunk
    c, s = ctx.copy(), slab.copy()
    rows = P.ngram_hash(npy(ids)[:, :6], c, [0], tabs)
    s[:] = 0.0
    c[:] = eos
    rows2 = P.ngram_hash(npy(ids)[:, 6:], c, [0], tabs)
    direct = mod.ple_embedding(ids, None)
    np.testing.assert_array_equal(table[rows[0]].reshape(6, -1), npy(direct)[0, :6])
    assert not np.array_equal(table[rows2[0]].reshape(T - 6, -1), npy(direct)[0, 6:])
