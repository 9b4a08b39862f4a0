"""reference/config.py: parsing, validation (each rule names its field), layer_types derivation and the
derived PLE layout checked against the buffers transformers stored in the bundled checkpoints."""
from __future__ import annotations

import copy
import dataclasses
import json

import numpy as np
import pytest

from fixture_helpers import FIXTURE_NAMES, fixture_dir
from reference.config import ConfigError, ModelConfig, _TEXT_DEFAULTS, find_nth_prime_after, load_config


def _base() -> dict:
    """The flat text config of the bundled `tiny` fixture (valid: every feature on)."""
    return json.loads((fixture_dir("tiny") / "config.json").read_text())


def test_base_config_is_valid():
    cfg = ModelConfig.from_dict(_base())
    assert cfg.qsa_enabled and cfg.ple_layer_ids and cfg.hc_count == 4


def _set(**kw):
    def f(d):
        d.update(kw)
    return f


def _pop(k):
    def f(d):
        d.pop(k, None)
    return f


# (mutation, field named in the message, a found value that must appear in the message or None)
RULES = [
    (_set(layer_types=["linear_attention"] * 5), "layer_types", "5"),
    (_set(layer_types=["linear_attention"] * 5 + ["sliding_attention"]), "layer_types", "sliding_attention"),
    (_set(output_gate_type="relu"), "output_gate_type", "relu"),
    (_set(hidden_act="gelu", output_gate_type="sigmoid"), "hidden_act", "gelu"),
    (_set(hc_count=1), "hc_count", "1"),
    (_set(num_experts=0, num_experts_per_tok=0), "num_experts", "0"),
    (_set(num_experts_per_tok=9), "num_experts_per_tok", "9"),
    (_set(moe_intermediate_size=0), "moe_intermediate_size", "0"),
    (_pop("indexer_budget"), "indexer_budget", None),
    (_set(indexer_kv_heads=2), "indexer_kv_heads", "2"),
    (_set(indexer_budget=10), "indexer_budget", "10"),
    (_set(indexer_n_heads=-1), "QSA", "-1"),
    (_set(indexer_head_dim=4), "indexer_head_dim", "4"),
    (_set(ple_layer_ids=[3]), "ple_layer_ids", "3"),
    (_set(ple_layer_ids=[7]), "ple_layer_ids", "7"),
    (_set(ple_layer_ids=[0]), "ple_layer_ids", "0"),
    (_set(eos_token_id=None, pad_token_id=None), "eos_token_id", None),
    (_set(eos_token_id=[], pad_token_id=None), "eos_token_id", None),
    (_set(ple_embed_dim=30), "ple_embed_dim", "30"),
    (_set(linear_conv_kernel_dim=0), "linear_conv_kernel_dim", "0"),
    (_set(ple_conv_kernel_size=-1), "ple_conv_kernel_size", "-1"),
    (_set(ngram_size=1), "ngram_size", "1"),
    (_set(num_attention_heads=5), "num_attention_heads", "5"),
    (_set(linear_num_value_heads=3), "linear_num_value_heads", "3"),
    (_set(eos_token_id=600), "eos_token_id", "600"),
    (_set(eos_token_id=[440, 512]), "eos_token_id", "512"),
    (_set(pad_token_id=-1), "pad_token_id", "-1"),
    (_set(bos_token_id=9999), "bos_token_id", "9999"),
    (_set(vocab_size="512"), "vocab_size", "512"),
    (_set(hidden_size=0), "hidden_size", "0"),
    (_set(model_type="llama"), "model_type", "llama"),
    (_set(rms_norm_eps=0), "rms_norm_eps", "0"),
    (_set(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.0}),
     "partial_rotary_factor", "0.0"),
    (_set(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}), "rope_type", "yarn"),
    (_set(rope_parameters={"rope_type": "default"}), "rope_theta", None),
    (_set(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                           "mrope_section": [2, 1]}), "mrope_section", "[2, 1]"),
    (_set(ple_layer_ids="2"), "ple_layer_ids", "2"),
    (_set(ngram_vocab_size_base=1), "ngram_vocab_size_base", "1"),
    (_set(split_ngram_parts=0), "split_ngram_parts", "0"),
]


@pytest.mark.parametrize("mutate,field,found", RULES, ids=[f"{r[1]}-{i}" for i, r in enumerate(RULES)])
def test_validation_rule_names_field(mutate, field, found):
    d = _base()
    mutate(d)
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d, where="cfg.json")
    msg = str(ei.value)
    assert field in msg, msg
    assert "cfg.json" in msg
    if found is not None:
        assert found in msg, msg


def test_full_attention_interval_rejected_when_not_positive():
    d = _base()
    d.pop("layer_types")
    d["full_attention_interval"] = 0
    with pytest.raises(ConfigError, match="full_attention_interval"):
        ModelConfig.from_dict(d)


def test_layer_types_derived_from_interval():
    d = _base()
    d.pop("layer_types")
    d.update(num_hidden_layers=8, full_attention_interval=4, ple_layer_ids=[1])
    cfg = ModelConfig.from_dict(d)
    pattern = "".join("Q" if t == "indexed_attention" else "L" for t in cfg.layer_types)
    assert pattern == "LLLQLLLQ"
    d.pop("full_attention_interval")  # default interval is 4 as well
    assert ModelConfig.from_dict(d).layer_types == cfg.layer_types
    d["full_attention_interval"] = 2
    assert "".join("Q" if t == "indexed_attention" else "L"
                   for t in ModelConfig.from_dict(d).layer_types) == "LQLQLQLQ"


def test_full_attention_renamed_to_indexed_attention():
    d = _base()
    d["layer_types"] = ["full_attention" if t == "indexed_attention" else t for t in d["layer_types"]]
    assert "full_attention" in d["layer_types"]
    cfg = ModelConfig.from_dict(d)
    assert cfg.layer_types == ModelConfig.from_dict(_base()).layer_types
    assert "full_attention" not in cfg.layer_types


def test_wrapper_and_flat_forms_agree(tmp_path):
    wrapper = json.loads((fixture_dir("tiny-hc3") / "config.json").read_text())
    assert wrapper["model_type"] == "qwen4_exp" and "text_config" in wrapper
    a = load_config(fixture_dir("tiny-hc3"))
    (tmp_path / "config.json").write_text(json.dumps(wrapper["text_config"]))
    b = load_config(tmp_path)
    assert a == b
    # the wrapper's text_config, not its top level, is what counts
    w2 = copy.deepcopy(wrapper)
    w2["text_config"]["hc_count"] = 2
    w2["text_config"]["hc_lowrank"] = 10
    assert ModelConfig.from_dict(w2).hc_count == 2 != a.hc_count
    with pytest.raises(ConfigError, match="text_config"):
        ModelConfig.from_dict({"model_type": "qwen4_exp"})


def test_load_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="config.json not found"):
        load_config(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(tmp_path)


def _stored_int(name, tensor):
    from reference.checkpoint import Checkpoint
    with Checkpoint.open(fixture_dir(name)) as ck:
        return ck.get_raw(tensor).tolist()


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_ple_layout_equals_transformers_buffers(name):
    """layer_multipliers / ngram_heads_vocab_sizes / ngram_heads_offsets as transformers stored them."""
    cfg = load_config(fixture_dir(name))
    assert cfg.ple_layers
    for i in cfg.ple_layers:
        lay = cfg.ple_layout(i)
        p = f"layers.{i}.ple.ple_embedding."
        assert list(lay.multipliers) == _stored_int(name, p + "layer_multipliers")
        assert list(lay.head_vocab_sizes) == _stored_int(name, p + "ngram_heads_vocab_sizes")
        assert list(lay.head_offsets) == _stored_int(name, p + "ngram_heads_offsets")
        assert lay.padded_rows % cfg.make_ngram_vocab_size_divisible_by == 0
        assert lay.total_rows == sum(lay.head_vocab_sizes) <= lay.padded_rows


def test_ple_layout_negative_controls():
    """A wrong seed or a wrong PLE-layer position gives different buffers (the test above can fail)."""
    cfg = load_config(fixture_dir("tiny-hc3"))
    i0, i1 = cfg.ple_layers
    stored = _stored_int("tiny-hc3", f"layers.{i1}.ple.ple_embedding.ngram_heads_vocab_sizes")
    assert list(cfg.ple_layout(i0).head_vocab_sizes) != stored  # the second PLE layer continues the primes
    d = json.loads((fixture_dir("tiny-hc3") / "config.json").read_text())
    d["text_config"]["seed"] += 1
    other = ModelConfig.from_dict(d)
    assert list(other.ple_layout(i1).multipliers) != _stored_int(
        "tiny-hc3", f"layers.{i1}.ple.ple_embedding.layer_multipliers")


def test_nth_prime_matches_incremental_walk():
    # the cached layout walks primes incrementally; the official restarts per head: same numbers
    base = 1000
    inc, p = [], base - 1
    for _ in range(12):
        p = find_nth_prime_after(p, 1)
        inc.append(p)
    assert inc == [find_nth_prime_after(base - 1, n + 1) for n in range(12)]
    assert all(all(x % d for d in range(2, int(x ** 0.5) + 1)) for x in inc)


def test_multipliers_are_odd_and_below_bound():
    cfg = load_config(fixture_dir("tiny-hc2"))
    for i in cfg.ple_layers:
        m = cfg.ple_layout(i).multipliers
        assert len(m) == cfg.ngram_size
        assert all(x % 2 == 1 and 0 < x < (1 << 63) // cfg.vocab_size for x in m)
        # int64-representable (they are stored as I64)
        np.asarray(m, dtype=np.int64)


# ---------------------------------------------------------------------------------- oracle
_QSA = dict(indexer_n_heads=4, indexer_kv_heads=1, indexer_head_dim=256, indexer_budget=2048, indexer_compress_ratio=4)


@pytest.mark.oracle
def test_defaults_equal_official():
    transformers = pytest.importorskip("transformers", reason="needs transformers (oracle extra)")
    official = transformers.Qwen4ExpTextConfig(**_QSA)
    ours = ModelConfig.from_dict(dict(_QSA))
    for f in dataclasses.fields(ours):
        if f.name in ("extra", "source"):
            continue
        a = getattr(ours, f.name)
        a = list(a) if isinstance(a, tuple) else a
        assert a == getattr(official, f.name), f.name
    # every declared field of the official class has the same default here
    for f in dataclasses.fields(transformers.Qwen4ExpTextConfig):
        if f.name in _TEXT_DEFAULTS and f.default is not dataclasses.MISSING:
            assert _TEXT_DEFAULTS[f.name] == f.default, f.name


@pytest.mark.oracle
@pytest.mark.parametrize("mutate,field,found", RULES[:18], ids=[r[1] for r in RULES[:18]])
def test_official_rules_are_enforced_here_too(mutate, field, found):
    """Whatever the official config rejects, ModelConfig rejects (and the base is valid for both)."""
    transformers = pytest.importorskip("transformers", reason="needs transformers (oracle extra)")
    d = _base()
    transformers.Qwen4ExpTextConfig(**{k: v for k, v in d.items() if k not in ("architectures", "model_type",
                                                                               "transformers_version")})
    mutate(d)
    kw = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version")}
    try:
        transformers.Qwen4ExpTextConfig(**kw)
    except Exception:
        with pytest.raises(ConfigError):
            ModelConfig.from_dict(d)
    else:
        pytest.skip(f"the official config accepts this ({field}); ModelConfig's extra rule is tested above")


@pytest.mark.oracle
def test_ple_layout_equals_official_for_later_layers():
    torch = pytest.importorskip("torch", reason="needs torch (oracle extra)")
    mod = pytest.importorskip("transformers.models.qwen4_exp.modeling_qwen4_exp")
    d = _base()
    d.update(num_hidden_layers=9, layer_types=None, full_attention_interval=3, ple_layer_ids=[1, 4, 7])
    d.pop("layer_types")
    cfg = ModelConfig.from_dict(d)
    tcfg = __import__("transformers").Qwen4ExpTextConfig(**{k: v for k, v in d.items() if k not in (
        "architectures", "model_type", "transformers_version")})
    for pli, i in enumerate(cfg.ple_layers):
        emb = mod.Qwen4ExpTextNGramEmbedding(tcfg, tcfg.ple_embed_dim, i, pli)
        lay = cfg.ple_layout(i)
        assert list(lay.head_vocab_sizes) == emb.head_vocab_sizes
        assert list(lay.head_offsets) == emb.head_offsets
        assert list(lay.multipliers) == emb.layer_multipliers.tolist()
        assert lay.padded_rows == emb.ngram_embedding.weight.shape[0]
        assert lay.head_dim == emb.ngram_embedding.weight.shape[1]
    del torch


def test_real_architecture_config_parses():
    """The real release's root config (wrapper form, `full_attention`, extra keys) is accepted."""
    from fixture_helpers import FIXTURES
    cfg = load_config(FIXTURES / "configs" / "qwen3.8-flash-next")
    assert cfg.layer_types.count("indexed_attention") == 12 and cfg.ple_layers == (1,)
    assert cfg.rotary_dim == 64 and cfg.qsa_bound == 2051 and cfg.split_ngram_parts == 128
    assert "mtp_num_hidden_layers" in cfg.extra


@pytest.mark.oracle
def test_real_architecture_config_matches_official():
    transformers = pytest.importorskip("transformers", reason="needs transformers (oracle extra)")
    from fixture_helpers import FIXTURES
    raw = json.loads((FIXTURES / "configs" / "qwen3.8-flash-next" / "config.json").read_text())
    official = transformers.Qwen4ExpConfig(**raw).text_config
    ours = load_config(FIXTURES / "configs" / "qwen3.8-flash-next")
    for f in dataclasses.fields(ours):
        if f.name in ("extra", "source"):
            continue
        a = getattr(ours, f.name)
        assert (list(a) if isinstance(a, tuple) else a) == getattr(official, f.name), f.name
