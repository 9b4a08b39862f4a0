"""The bundled fixtures: goldens' shapes and prompt coverage, goldens consistent with the stored weights
(logits = lm_head(mixer_out); mixer_out = hyper_connection_mixer(last layer)), incremental decode
consistent with the full forward, no QSA top-k ties, tokenizer + chat template, size budget; with the
oracle installed: the build is deterministic and the committed files are what it writes."""
from __future__ import annotations

import importlib.util
import json

import numpy as np
import pytest

from fixture_helpers import FIXTURE_NAMES, FIXTURES, fixture_dir, load_golden
from reference.checkpoint import Checkpoint
from reference.config import load_config

PROMPTS = ("short", "qsa", "eos", "maxid", "chat")


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_golden_shapes(name):
    cfg = load_config(fixture_dir(name))
    g, meta = load_golden(name)
    assert tuple(meta["prompts"]) == PROMPTS
    for p in PROMPTS:
        ids = g[f"{p}/ids"]
        T = ids.shape[0]
        assert ids.dtype == np.int64 and ids.min() >= 0 and ids.max() < cfg.vocab_size
        assert g[f"{p}/logits"].shape == (T, cfg.vocab_size) and g[f"{p}/logits"].dtype == np.float32
        assert g[f"{p}/hidden"].shape == (cfg.num_hidden_layers, T, cfg.hc_hidden_size)
        assert g[f"{p}/mixer_out"].shape == (T, cfg.hidden_size)
        assert np.isfinite(g[f"{p}/logits"]).all() and np.isfinite(g[f"{p}/hidden"]).all()
    for p in ("qsa", "eos"):
        P = int(g[f"decode/{p}/prefix_len"])
        T = g[f"{p}/ids"].shape[0]
        assert g[f"decode/{p}/prefill_logits"].shape == (P, cfg.vocab_size)
        assert g[f"decode/{p}/logits"].shape == (T - P, cfg.vocab_size)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_prompts_cover_the_required_cases(name):
    cfg = load_config(fixture_dir(name))
    g, meta = load_golden(name)
    bound = cfg.indexer_budget + cfg.indexer_compress_ratio
    assert len(g["qsa/ids"]) > bound  # crosses the QSA bound
    assert int(g["decode/qsa/prefix_len"]) < bound < len(g["qsa/ids"])  # ... during decode too
    eos = g["eos/ids"]
    e0 = cfg.ple_eos_token_id
    assert eos[0] == e0  # EOS at position 0
    assert any(eos[i] == eos[i + 1] == e0 for i in range(len(eos) - 1))  # consecutive EOS
    assert (eos[1:] == e0).sum() >= 3
    if len(cfg.eos_token_ids) > 1:
        assert cfg.eos_token_ids[1] in eos  # the second EOS id (no PLE reset) appears too
    assert cfg.vocab_size - 1 in g["maxid/ids"]
    assert meta["exact_tie_count"] == 0, meta["ties"]
    for rec in meta["ties"].values():
        assert rec["exact_ties"] == []


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_logits_are_lm_head_of_mixer_out(name):
    """Goldens and stored weights agree: logits = mixer_out @ lm_head.T (tied lm_head for tiny-hc3).
    Tolerance: a float32 dot product of H <= 64 terms of O(1) values, computed by torch vs numpy:
    rounding differences ~1e-6; 1e-4 absolute leaves margin while a wrong weight moves logits by O(1)."""
    ck = Checkpoint.open(fixture_dir(name))
    W = ck.get("lm_head.weight", np.float64)
    g, _ = load_golden(name)
    for p in PROMPTS:
        ours = g[f"{p}/mixer_out"].astype(np.float64) @ W.T
        np.testing.assert_allclose(ours, g[f"{p}/logits"], atol=1e-4, rtol=0)
    # negative control: a perturbed lm_head row is caught and located
    bad = ck.with_override("lm_head.weight", ck.get("lm_head.weight") + np.eye(ck.config.vocab_size,
                                                                               ck.config.hidden_size) * 0.5)
    diff = np.abs(g["short/mixer_out"].astype(np.float64) @ bad.get("lm_head.weight", np.float64).T
                  - g["short/logits"]).max(axis=0)
    assert (diff > 1e-3).any() and set(np.nonzero(diff > 1e-3)[0]) <= set(range(ck.config.hidden_size))


def _rms_group(x, w, eps, group):
    """Zero-centred grouped RMSNorm: x / rms(group) * (1 + w).
    Source: modeling_qwen4_exp.py Qwen4ExpTextRMSNorm.forward."""
    shp = x.shape
    xg = x.reshape(*shp[:-1], -1, group)
    y = xg / np.sqrt((xg * xg).mean(-1, keepdims=True) + eps)
    return y.reshape(shp) * (1.0 + w)


def _mixer(ck, h):
    """The final hyper-connection collapse [T, hc*H] -> [T, H].
    Source: modeling_qwen4_exp.py Qwen4ExpTextGatedResidual.forward (use_combine=False)."""
    c = ck.config
    p = "hyper_connection_mixer."
    xn = _rms_group(h, ck.get(p + "hc_norm.weight", np.float64), c.rms_norm_eps, c.hidden_size)
    a = xn @ ck.get(p + "input_mix_weight_down.weight", np.float64).T / c.hc_count
    a = a / (1.0 + np.exp(-a))
    mix = 1.0 / (1.0 + np.exp(-(a @ ck.get(p + "input_mix_weight_up.weight", np.float64).T)))
    T = h.shape[0]
    return (mix.reshape(T, c.hc_count, c.hidden_size) * xn.reshape(T, c.hc_count, c.hidden_size)).mean(1)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_mixer_out_is_mixer_of_last_layer(name):
    """hidden[-1] (the last decoder layer's output) through the stored mixer weights gives mixer_out.
    Tolerance 2e-5 absolute: float32 oracle vs float64 here over a 64..256-wide norm and two small
    matmuls of O(1) values (observed ~1e-6)."""
    ck = Checkpoint.open(fixture_dir(name))
    g, _ = load_golden(name)
    for p in PROMPTS:
        np.testing.assert_allclose(_mixer(ck, g[f"{p}/hidden"][-1].astype(np.float64)), g[f"{p}/mixer_out"],
                                   atol=2e-5, rtol=0)
    # negative control: the second-to-last layer's output does not give mixer_out
    assert not np.allclose(_mixer(ck, g["qsa/hidden"][-2].astype(np.float64)), g["qsa/mixer_out"], atol=1e-3)


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_decode_goldens_agree_with_full_forward(name):
    """Official cache path vs official full forward. Tolerance 1e-4: both are float32 runs of the same
    math in a different order (observed max 1.1e-5, recorded in golden.json)."""
    g, meta = load_golden(name)
    for p in ("qsa", "eos"):
        P = int(g[f"decode/{p}/prefix_len"])
        full = g[f"{p}/logits"]
        np.testing.assert_allclose(g[f"decode/{p}/prefill_logits"], full[:P], atol=1e-4, rtol=0)
        np.testing.assert_allclose(g[f"decode/{p}/logits"], full[P:], atol=1e-4, rtol=0)
        assert meta["decode"][p]["max_abs_diff_vs_full_forward"] < 1e-4
        # negative control: an off-by-one position does not agree
        assert not np.allclose(g[f"decode/{p}/logits"][1:], full[P:-1], atol=1e-2)


def test_tokenizer_and_chat_template():
    from tokenizers import Tokenizer
    import jinja2

    tdir = FIXTURES / "tokenizer"
    tok = Tokenizer.from_file(str(tdir / "tokenizer.json"))
    sp = {s: tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")}
    assert all(v is not None for v in sp.values()) and len(set(sp.values())) == 5
    for name in FIXTURE_NAMES:
        cfg = load_config(fixture_dir(name))
        assert tok.get_vocab_size() <= cfg.vocab_size
        assert cfg.ple_eos_token_id == sp["<|endoftext|>"]
        assert json.loads((fixture_dir(name) / "tokenizer.json").read_text()) == json.loads(
            (tdir / "tokenizer.json").read_text())
    text = (FIXTURES / "text" / "workshop.txt").read_text()
    enc = tok.encode(text)
    assert tok.decode(enc.ids, skip_special_tokens=False) == text
    assert len(enc.ids) < len(text.encode()) / 1.5  # BPE merges actually compress real text
    gen = json.loads((tdir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [sp["<|im_end|>"], sp["<|endoftext|>"]]
    assert (gen["temperature"], gen["top_k"], gen["top_p"]) == (1.0, 20, 0.95)
    tcfg = json.loads((tdir / "tokenizer_config.json").read_text())
    tpl = jinja2.Environment().from_string(tcfg["chat_template"])
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    out = tpl.render(messages=msgs, add_generation_prompt=True)
    assert out == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    off = tpl.render(messages=msgs, add_generation_prompt=True, enable_thinking=False)
    assert off.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids = tok.encode(out).ids
    assert ids.count(sp["<|im_start|>"]) == 3 and ids.count(sp["<|im_end|>"]) == 2 and ids[-2] == sp["<think>"]


def test_fixture_size_budget():
    total = sum(p.stat().st_size for p in FIXTURES.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
    assert total < 20 * 2**20


def _load_build():
    spec = importlib.util.spec_from_file_location("fixtures_build", FIXTURES / "build.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# sha256 of the per-expert tensors (names, dtypes, shapes, bytes, in the order written) and the dequantised
# experts that fixtures/build_quant.py wrote for the seeded experts below before its per-expert loop was factored
# into quantise_experts: the FP8 and NVFP4 stored bytes of tiny-fp8 / tiny-nvfp4 depend on nothing else of it
_EXPERT_QUANT_SHA256 = {"fp8": "00b510a458eebfe98e11e09418c6e345d4d9a0d04683a27ecfc509ff1b795773",
                        "nvfp4": "0207e22ef7929cb319860f958b1bc3453ce84e2aa9826a2f1db285154b29edb2"}


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4"])
def test_expert_quantisation_bytes_are_pinned(fmt):
    """quantise_experts (FP8 128x128 blocks with a partial column block; NVFP4 with gate and up sharing one
    global scale) writes the same bytes, names and order as the fixtures were built with; the control: one
    weight changed changes the digest."""
    import hashlib
    import ml_dtypes
    _load_build()
    import build_quant as bq

    def experts(bump=False):
        r = np.random.default_rng(20260)
        bf = lambda *s: (r.standard_normal(s) * 0.05).astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
        w = {"layers.0.mlp.experts.gate_up_proj": bf(4, 64, 160), "layers.0.mlp.experts.down_proj": bf(4, 160, 32)}
        if bump:   # one weight becomes its block's largest: its codes and scales change
            w["layers.0.mlp.experts.gate_up_proj"][1, 40, 7] = 0.5
        return w

    def digest(w):
        part = bq._fp8_part((128, 128)) if fmt == "fp8" else bq._nvfp4_part
        out, deqs = {}, []
        for key, x in w.items():
            deqs.append(bq.quantise_experts(out, key, x, 32, part))
        assert len(out) == 4 * 3 * (2 if fmt == "fp8" else 4)   # every expert's gate, up, down and their scales
        h = hashlib.sha256()
        for k, v in out.items():
            h.update(k.encode() + str(v.dtype).encode() + str(v.shape).encode() + np.ascontiguousarray(v).tobytes())
        for d in deqs:
            h.update(np.ascontiguousarray(d).tobytes())
        return h.hexdigest()
    assert digest(experts()) == _EXPERT_QUANT_SHA256[fmt]
    assert digest(experts(bump=True)) != _EXPERT_QUANT_SHA256[fmt]


def test_build_atomic_helpers(tmp_path):
    b = _load_build()
    f = tmp_path / "x.json"
    b.atomic_write_json(f, {"a": 1})
    assert json.loads(f.read_text()) == {"a": 1}
    final = tmp_path / "fx"
    with b.atomic_dir(final) as d:
        (d / "w").write_text("v1")
    assert (final / "w").read_text() == "v1"
    with pytest.raises(RuntimeError):
        with b.atomic_dir(final) as d:
            (d / "w").write_text("half")
            raise RuntimeError("interrupted")
    assert (final / "w").read_text() == "v1"  # the old fixture survives an interrupted build
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fx", "x.json"]  # no temp dirs left


# Regenerated goldens against the committed ones. The weights, config and tokenizer come from seeded
# generators and BF16 rounding: byte-identical on any machine. The goldens are float32 forwards of the
# official torch code, whose summation order follows the CPU's SIMD width: another processor rounds
# differently, ~1e-6 of an array's scale observed (float32 eps 1.2e-7, accumulated over the K <= 512
# terms of a matmul and the model's layers). GOLDEN_RTOL = 1e-5 keeps a 10x margin; a real change (a
# weight, a formula, a prompt) moves logits and hidden states by >= 1e-3 of their scale (control below).
# golden.json's numbers are statistics of those float32 outputs (probability gaps in [0, 1], logit
# differences ~1e-6): compared to GOLDEN_RTOL * max(1, |value|); ids, counts and strings exactly.
GOLDEN_RTOL = 1e-5


def golden_mismatches(new: dict, old: dict, new_meta, old_meta) -> list[str]:
    """Keys where regenerated goldens (``new`` arrays, ``new_meta`` golden.json) differ from the committed
    ones beyond float32 rounding (see GOLDEN_RTOL); integer arrays, strings and counts must be equal."""
    bad = [f"key set: {sorted(set(new) ^ set(old))}"] if new.keys() != old.keys() else []
    for k in sorted(set(new) & set(old)):
        a, b = new[k], old[k]
        if a.shape != b.shape or a.dtype != b.dtype:
            bad.append(f"{k}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}")
        elif np.issubdtype(b.dtype, np.floating):
            scale = float(np.abs(b).max()) if b.size else 0.0
            if not np.all(np.isfinite(a)) or float(np.abs(a.astype(np.float64) - b).max(initial=0.0)) > GOLDEN_RTOL * scale:
                bad.append(k)
        elif not np.array_equal(a, b):
            bad.append(k)

    def walk(x, y, path):
        if isinstance(y, dict) and isinstance(x, dict):
            if x.keys() != y.keys():
                bad.append(f"golden.json{path}: keys {sorted(set(x) ^ set(y))}")
            for key in set(x) & set(y):
                walk(x[key], y[key], f"{path}/{key}")
        elif isinstance(y, list) and isinstance(x, list) and len(x) == len(y):
            for i, (u, v) in enumerate(zip(x, y)):
                walk(u, v, f"{path}[{i}]")
        elif isinstance(y, float) and isinstance(x, (int, float)) and not isinstance(x, bool):
            if abs(x - y) > GOLDEN_RTOL * max(1.0, abs(y)):
                bad.append(f"golden.json{path}: {x!r} vs {y!r}")
        elif x != y or type(x) is not type(y):
            bad.append(f"golden.json{path}: {x!r} vs {y!r}")
    # the writer's versions (transformers, torch) are provenance: a newer oracle regenerating equal goldens is current
    strip = lambda m: {k: v for k, v in m.items() if k not in WRITER_VERSIONS} if isinstance(m, dict) else m
    walk(strip(new_meta), strip(old_meta), "")
    return bad


#: golden.json fields naming the versions that wrote the goldens, not what they hold
WRITER_VERSIONS = ("transformers", "torch")


@pytest.mark.oracle
def test_build_is_deterministic_and_committed_files_are_current(tmp_path):
    pytest.importorskip("torch", reason="needs torch (oracle extra)")
    pytest.importorskip("transformers", reason="needs transformers (oracle extra)")
    b = _load_build()
    assert b.main(["tiny-hc2", "--out", str(tmp_path)]) == 0
    for f in ("model.safetensors", "tokenizer.json"):
        assert (tmp_path / "tiny-hc2" / f).read_bytes() == (fixture_dir("tiny-hc2") / f).read_bytes(), f
    # config.json: every field equal except the writer's own version stamp (transformers records the version
    # that saved the file; it is provenance, not part of the model's function)
    def _config(d):
        c = json.loads((d / "config.json").read_text())
        c.pop("transformers_version", None)
        return c
    assert _config(tmp_path / "tiny-hc2") == _config(fixture_dir("tiny-hc2"))
    new = dict(np.load(tmp_path / "tiny-hc2" / "golden.npz"))
    new_meta = json.loads((tmp_path / "tiny-hc2" / "golden.json").read_text())
    old, old_meta = load_golden("tiny-hc2")
    assert golden_mismatches(new, old, new_meta, old_meta) == []
    # negative controls: a real change of one logit (1e-3 of the scale), one hidden value, a different id,
    # one golden.json statistic -- each caught and named
    k = next(k for k in old if k.endswith("/logits"))
    moved = dict(new)
    moved[k] = new[k].copy()
    moved[k][0, 0] += np.float32(1e-3 * np.abs(old[k]).max())
    h = next(k for k in old if k.endswith("/hidden"))
    moved[h] = new[h].copy()
    moved[h].flat[7] += np.float32(1e-3 * np.abs(old[h]).max())
    i = next(k for k in old if k.endswith("/ids"))
    moved[i] = new[i].copy()
    moved[i][-1] += 1
    meta2 = json.loads(json.dumps(new_meta))
    meta2["prompts"]["short"]["router_min_relative_gap"] += 1e-3
    got = golden_mismatches(moved, old, meta2, old_meta)
    assert set(got) == {k, h, i, "golden.json/prompts/short/router_min_relative_gap: "
                        f"{meta2['prompts']['short']['router_min_relative_gap']!r} vs "
                        f"{old_meta['prompts']['short']['router_min_relative_gap']!r}"}, got
    # ... while float32-rounding-sized differences (1e-6 of the scale) pass
    jitter = {key: (v + np.float32(1e-6 * np.abs(v).max()) if np.issubdtype(v.dtype, np.floating) else v)
              for key, v in new.items()}
    assert golden_mismatches(jitter, old, new_meta, old_meta) == []


@pytest.mark.oracle
def test_official_from_pretrained_reproduces_goldens():
    """Stored (BF16) weights are the weights the goldens were computed with."""
    torch = pytest.importorskip("torch", reason="needs torch (oracle extra)")
    transformers = pytest.importorskip("transformers", reason="needs transformers (oracle extra)")
    m = transformers.Qwen4ExpForCausalLM.from_pretrained(str(fixture_dir("tiny")), dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    g, _ = load_golden("tiny")
    with torch.no_grad():
        out = m(input_ids=torch.tensor([g["eos/ids"].tolist()]), use_cache=False).logits[0].numpy()
    np.testing.assert_allclose(out, g["eos/logits"], atol=1e-5, rtol=0)  # same weights, same code


def test_fp8_fixture_layout():
    """tiny-fp8 is stored like the official FP8 release: per-expert F8_E4M3 + float32 128x128 block
    `weight_scale_inv`, an F8_E4M3 n-gram table with one BF16 `weight_scale`, embeddings/norms in BF16."""
    ck = Checkpoint.open(fixture_dir("tiny-fp8"))
    cfg = ck.config
    assert cfg.extra["quantization_config"]["weight_block_size"] == [128, 128]
    assert ck.dtype("layers.0.mlp.experts.3.gate_proj.weight") == "F8_E4M3"
    assert ck.dtype("layers.0.mlp.experts.3.gate_proj.weight_scale_inv") == "F32"
    assert ck.shape("layers.0.mlp.experts.3.gate_proj.weight_scale_inv") == (1, 1)
    assert ck.dtype("layers.2.self_attn.q_proj.weight") == "F8_E4M3"
    assert ck.dtype("embed_tokens.weight") == "BF16" and ck.dtype("layers.0.attn_hyper_connection.hc_norm.weight") == "BF16"
    i = cfg.ple_layers[0]
    base = f"layers.{i}.ple.ple_embedding.ngram_embedding"
    assert ck.dtype(base + ".shard_0.weight") == "F8_E4M3"
    assert ck.dtype(base + ".weight_scale") == "BF16" and ck.shape(base + ".weight_scale") == (1,)
    assert not any(n.startswith(base + ".shard_") and n.endswith("_scale") for n in ck.names())


def test_fp8_fixture_reference_matches_goldens():
    """End to end: the reference reading FP8 storage (dequantised by the checkpoint reader) reproduces the
    official model run on the dequantised weights. Relative tolerance 1e-4 on the logits: both are
    float32 computations of the same weights in different orders (observed ~4e-6); a wrong block scale or
    a table scale not applied changes logits at the 1e-1 level (negative control below)."""
    from reference.model import ReferenceModel

    ck = Checkpoint.open(fixture_dir("tiny-fp8"))
    g, _ = load_golden("tiny-fp8")
    m = ReferenceModel(ck)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())  # noqa: E731
    for p in ("qsa", "eos"):
        assert rel(m.forward(g[f"{p}/ids"]), g[f"{p}/logits"]) < 1e-4, p
    # negative control: the n-gram table read without its BF16 scale
    i = ck.config.ple_layers[0]
    name = f"layers.{i}.ple.ple_embedding.ngram_embedding.weight"
    raw = np.asarray(ck.get_raw(name)).astype(np.float32)
    bad = ReferenceModel(ck.with_override(name, raw))
    assert rel(bad.forward(g["eos/ids"]), g["eos/logits"]) > 1e-2
