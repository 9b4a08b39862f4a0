"""Bad config.json / index / safetensors-header / generation_config.json values.

Each case is a copy of a bundled fixture with ONE edit, run the way a user runs it: through
``parity.cli.main`` (exit 2, one stderr line naming the key / file, no traceback) or the library call
(one ConfigError / CheckpointError / InputError). Every group has a negative control: the same input made
valid is accepted, so a check that rejected everything would fail here too.
"""
from __future__ import annotations

import json
import shutil
import struct
import time

import pytest

from fixture_helpers import fixture_dir
from parity.cli import main
from reference.checkpoint import Checkpoint, expected_shape, expected_shapes
from reference.config import ConfigError, ModelConfig, find_nth_prime_after, load_config
from reference.errors import CheckpointError, InputError


def _copy(tmp_path, name="tiny"):
    return shutil.copytree(fixture_dir(name), tmp_path / name)


def _edit_json(path, **changes):
    d = json.loads(path.read_text())
    d.update(changes)
    path.write_text(json.dumps(d))


def _one_line(capsys, *needles):
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    assert "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], (n, lines[0])
    return lines[0]


def _base() -> dict:
    return json.loads((fixture_dir("tiny") / "config.json").read_text())


# ------------------------------------------------------------------ 1. eos_token_id in config.json
@pytest.mark.parametrize("value", ["a", [1, "a"], {}, 1.5, True, -1, [440, 2.0]])
@pytest.mark.parametrize("config_only", [True, False])
def test_config_eos_token_id_bad_type_is_exit_2(tmp_path, capsys, value, config_only):
    c = _copy(tmp_path)
    _edit_json(c / "config.json", eos_token_id=value)
    assert main(["info", str(c)] + (["--config-only"] if config_only else [])) == 2
    _one_line(capsys, "config.json", "eos_token_id", "expected an integer id", repr(value))


@pytest.mark.parametrize("value", [440, [440], [1, 440]])
def test_config_eos_token_id_negative_control_ints_accepted(tmp_path, capsys, value):
    c = _copy(tmp_path)
    _edit_json(c / "config.json", eos_token_id=value)
    assert main(["info", str(c), "--config-only", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["eos_token_id"] == (value if isinstance(value, list) else [value])


# ------------------------------------------------------------------ 2. rope_parameters
@pytest.mark.parametrize("rp, key", [({"rope_theta": "x"}, "rope_parameters.rope_theta"),
                                     ({"rope_theta": True}, "rope_parameters.rope_theta"),
                                     ({"rope_theta": 0}, "rope_parameters.rope_theta"),
                                     ({"rope_theta": 1e4, "partial_rotary_factor": "half"},
                                      "rope_parameters.partial_rotary_factor"),
                                     ({"rope_theta": 1e4, "rope_type": 3}, "rope_parameters.rope_type")])
def test_rope_parameters_bad_type_is_exit_2(tmp_path, capsys, rp, key):
    c = _copy(tmp_path)
    _edit_json(c / "config.json", rope_parameters=rp)
    assert main(["info", str(c), "--config-only"]) == 2
    _one_line(capsys, "config.json", key)


def test_rope_theta_negative_control_int_theta_accepted(tmp_path, capsys):
    c = _copy(tmp_path)
    _edit_json(c / "config.json", rope_parameters={"rope_theta": 500000, "partial_rotary_factor": 0.5})
    assert main(["info", str(c), "--config-only"]) == 0
    assert "theta 500000" in capsys.readouterr().out


def test_rope_parameters_null_is_one_note_naming_the_default(tmp_path, capsys):
    """``rope_parameters: null`` is valid and stands for the official default (rope_theta 10000, every channel
    rotated): one note on stderr says so, once however often the file is read, and ``info`` lists it among the
    official defaults. With the legacy ``rope_theta`` key beside it the note names that key instead. The control:
    the fixture's own rope_parameters prints no note."""
    c = _copy(tmp_path)
    _edit_json(c / "config.json", rope_parameters=None)
    capsys.readouterr()
    assert main(["info", str(c), "--json"]) == 0
    cap = capsys.readouterr()
    line = _one_line_of(cap.err)
    assert line.startswith(f"note: {c / 'config.json'}: rope_parameters is null"), line
    assert "rope_theta=10000.0 (official default)" in line and \
        "partial_rotary_factor=1.0 (official default: every channel rotated)" in line, line
    assert json.loads(cap.out)["official_defaults"]["rope_parameters"] == \
        "rope_parameters={'rope_type': 'default', 'rope_theta': 10000.0}"
    load_config(c)
    assert main(["info", str(c), "--config-only"]) == 0
    assert "note:" not in capsys.readouterr().err
    legacy = _copy(tmp_path / "legacy")
    _edit_json(legacy / "config.json", rope_parameters=None, rope_theta=500000)
    load_config(legacy)
    line = _one_line_of(capsys.readouterr().err)
    assert "rope_theta=500000.0 (config.json's rope_theta)" in line and "partial_rotary_factor=1.0" in line, line
    assert main(["info", str(_copy(tmp_path / "control")), "--config-only"]) == 0
    assert capsys.readouterr().err == ""


def _one_line_of(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) == 1, err
    return lines[0]


# ------------------------------------------------------------------ 3. the type of every field
BAD_TYPES = [  # (key, bad value, words of the expectation)
    ("norm_topk_prob", "no", "a JSON boolean"), ("tie_word_embeddings", "yes", "a JSON boolean"),
    ("use_cache", 1, "a JSON boolean"), ("attention_bias", "false", "a JSON boolean"),
    ("output_router_logits", None, "a JSON boolean"),
    ("hidden_size", 64.0, "an integer"), ("num_experts", True, "an integer"), ("seed", "1234", "an integer"),
    ("vocab_size", [512], "an integer"),
    ("indexer_budget", "8", "an integer or null"), ("pad_token_id", True, "an integer or null"),
    ("bos_token_id", 1.0, "an integer or null"), ("ple_embed_dim", 32.0, "an integer or null"),
    ("rms_norm_eps", "1e-6", "a finite number"), ("initializer_range", True, "a finite number"),
    ("attention_dropout", None, "a finite number"), ("router_aux_loss_coef", [0.1], "a finite number"),
    ("hidden_act", 5, "a string"), ("output_gate_type", 1, "a string or null"),
    ("layer_types", ["linear_attention", 3, "indexed_attention", "linear_attention", "linear_attention",
                     "indexed_attention"], "a list of strings"),
    ("layer_types", "linear_attention", "a list of strings"),
]


@pytest.mark.parametrize("key, value, expect", BAD_TYPES, ids=[f"{k}={v!r}"[:40] for k, v, _ in BAD_TYPES])
def test_every_field_type_is_checked(key, value, expect):
    d = _base()
    d[key] = value
    with pytest.raises(ConfigError) as ei:
        ModelConfig.from_dict(d, where="c/config.json")
    msg = str(ei.value)
    assert msg.startswith("c/config.json: ") and f"{key}: expected {expect}" in msg and repr(value) in msg, msg


@pytest.mark.parametrize("key, value", [("norm_topk_prob", False), ("tie_word_embeddings", True),
                                        ("rms_norm_eps", 1), ("attention_dropout", 0), ("output_gate_type", None),
                                        ("bos_token_id", 3), ("seed", 2**40)])
def test_every_field_type_negative_control_valid_values_accepted(key, value):
    d = _base()
    d[key] = value
    assert getattr(ModelConfig.from_dict(d), key) == value


def test_bool_field_cli_prints_the_key(tmp_path, capsys):
    c = _copy(tmp_path)
    _edit_json(c / "config.json", norm_topk_prob="no")
    assert main(["info", str(c), "--config-only"]) == 2
    _one_line(capsys, "config.json", "norm_topk_prob", "'no'")


# ------------------------------------------------------------------ 4. huge sizes: no hang, clear bounds
def test_huge_num_experts_config_only_is_fast(tmp_path, capsys):
    """num_experts 10**7 in config.json alone is answered fast: the tensor listing does not enumerate
    per-expert names per layer, so its cost is independent of num_experts; 10 s is a loose ceiling for a ~0.2 s command on a loaded CI core."""
    c = _copy(tmp_path)
    _edit_json(c / "config.json", num_experts=10_000_000)
    t0 = time.perf_counter()
    assert main(["info", str(c), "--config-only", "--json"]) == 0
    assert time.perf_counter() - t0 < 10
    info = json.loads(capsys.readouterr().out)
    assert info["config"]["moe"].startswith("10000000 experts")
    assert len(expected_shapes(load_config(c))) == len(expected_shapes(load_config(fixture_dir("tiny"))))
    # with the weights: the router's shape names the mismatch instead
    assert main(["info", str(c)]) == 2
    _one_line(capsys, "layers.0.mlp.gate.weight", "10000000")


def test_per_expert_shapes_still_known():
    """expected_shape answers per-expert names (not enumerated any more) and refuses out-of-range ones."""
    cfg = load_config(fixture_dir("tiny"))
    H, I = cfg.hidden_size, cfg.moe_intermediate_size
    assert expected_shape(cfg, "layers.5.mlp.experts.7.down_proj.weight") == (H, I)
    assert expected_shape(cfg, "layers.0.mlp.experts.0.gate_proj.weight") == (I, H)
    assert expected_shape(cfg, f"layers.0.mlp.experts.{cfg.num_experts}.gate_proj.weight") is None
    assert expected_shape(cfg, f"layers.{cfg.num_hidden_layers}.mlp.experts.0.gate_proj.weight") is None


def test_per_expert_misshaped_tensor_still_caught(tmp_path):
    """Negative control for the lazy per-expert lookup: a per-expert checkpoint (tiny-fp8 stores that layout)
    with one expert's shape edited in the header is refused by validate()."""
    c = _copy(tmp_path, "tiny-fp8")
    files = sorted(c.glob("*.safetensors"))
    done = False
    for f in files:
        hdr, data = _read_st(f)
        for k, v in hdr.items():
            if k.endswith("mlp.experts.3.down_proj.weight"):
                r, col = v["shape"]
                v["shape"] = [col, r]  # same byte size, transposed: only the shape check can see it
                done = True
        if done:
            _write_st(f, hdr, data)
            break
    assert done
    with pytest.raises(CheckpointError, match=r"experts\.3\.down_proj\.weight'.*unexpected shape"):
        Checkpoint.open(c).validate(require_complete=False)


@pytest.mark.parametrize("key, value, name", [("num_hidden_layers", 10**6, "num_hidden_layers"),
                                              ("hidden_size", 2**31, "hidden_size"),
                                              ("num_experts", 2**40, "num_experts"),
                                              ("indexer_budget", 2**33, "indexer_budget"),
                                              ("heads_per_ngram", 10**5, "heads_per_ngram")])
def test_upper_bounds_are_named(key, value, name):
    d = _base()
    d[key] = value
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=f"{name}.*expected at most.*found"):
        ModelConfig.from_dict(d)
    assert time.perf_counter() - t0 < 10  # fails fast (loose ceiling for a loaded CI core)


def test_large_ngram_base_is_cheap_and_exact():
    """ngram_vocab_size_base near the int32 bound: the prime walk (Miller-Rabin) stays fast and gives primes
    > base, identical to the reference walk find_nth_prime_after."""
    d = _base()
    d["ngram_vocab_size_base"] = 2**31 - 1000
    cfg = ModelConfig.from_dict(d)
    lay = cfg.ple_layout(cfg.ple_layers[0])
    assert lay.head_vocab_sizes[0] == find_nth_prime_after(2**31 - 1001, 1)
    assert all(p > 2**31 - 1001 for p in lay.head_vocab_sizes)
    assert list(lay.head_vocab_sizes) == sorted(set(lay.head_vocab_sizes))


# ------------------------------------------------------------------ 5. index weight_map values
@pytest.mark.parametrize("value", [5, None, ["model-00001-of-00003.safetensors"], "", "../x.safetensors"])
def test_index_weight_map_non_string_is_exit_2(tmp_path, capsys, value):
    h = _copy(tmp_path, "tiny-hc3")
    idx = h / "model.safetensors.index.json"
    d = json.loads(idx.read_text())
    key = next(iter(d["weight_map"]))
    d["weight_map"][key] = value
    idx.write_text(json.dumps(d))
    assert main(["info", str(h)]) == 2
    _one_line(capsys, "model.safetensors.index.json", key, "expected a shard file name")


@pytest.mark.parametrize("doc, found", [({"metadata": {}}, "no 'weight_map' key"),
                                        ({"weight_map": [["a", "b"]]}, "'weight_map' as list"),
                                        ({"weight_map": "x"}, "'weight_map' as str"),
                                        ([1, 2], "list")])
def test_index_without_a_weight_map_object_names_what_it_found(tmp_path, capsys, doc, found):
    """An index that is valid JSON but holds no 'weight_map' object: the error says what is there (not a
    Python exception name, nor 'unreadable content' for a readable file); a list of pairs is not taken as a map."""
    h = _copy(tmp_path, "tiny-hc3")
    (h / "model.safetensors.index.json").write_text(json.dumps(doc))
    assert main(["info", str(h)]) == 2
    line = _one_line(capsys, "model.safetensors.index.json", "expected JSON with a 'weight_map' object", found)
    assert "Error" not in line and "unreadable" not in line, line


def test_index_negative_control_unchanged_copy_opens(tmp_path, capsys):
    h = _copy(tmp_path, "tiny-hc3")
    assert main(["info", str(h)]) == 0
    assert "3 file(s)" in capsys.readouterr().out


# ------------------------------------------------------------------ 6. safetensors header values
def _read_st(f):
    b = f.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return json.loads(b[8:8 + n]), b[8 + n:]


def _write_st(f, hdr, data):
    blob = json.dumps(hdr).encode()
    blob += b" " * (-len(blob) % 8)
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


@pytest.mark.parametrize("field, value, needle", [("shape", [512, 64.5], "shape: expected a list of integers"),
                                                  ("shape", [-512, -64], "shape: expected a list of integers"),
                                                  ("shape", [512, True], "shape: expected a list of integers"),
                                                  ("shape", "512x64", "shape: expected a list of integers"),
                                                  ("dtype", "ZZ99", "unknown dtype"),
                                                  ("dtype", 16, "unknown dtype"),
                                                  ("data_offsets", [88.0, 65624], "data_offsets: expected two"),
                                                  ("data_offsets", [65624, 88], "expected start <= end, found")])
@pytest.mark.parametrize("command", ["info", "logits"])
def test_safetensors_header_bad_values_rejected_at_open(tmp_path, capsys, field, value, needle, command):
    c = _copy(tmp_path)
    f = c / "model.safetensors"
    hdr, data = _read_st(f)
    hdr["lm_head.weight"][field] = value
    _write_st(f, hdr, data)
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        Checkpoint.open(c)
    ids = tmp_path / "ids.txt"
    ids.write_text("1,2")
    argv = (["info", str(c)] if command == "info" else
            ["logits", str(c), "--ids", str(ids), "--out", str(tmp_path / "o.npy")])
    assert main(argv) == 2
    _one_line(capsys, "model.safetensors", "'lm_head.weight'", needle)


def test_safetensors_header_negative_control_rewritten_header_opens(tmp_path):
    """The same rewrite with valid values (header re-serialised, so offsets into the data are unchanged)."""
    c = _copy(tmp_path)
    f = c / "model.safetensors"
    hdr, data = _read_st(f)
    _write_st(f, hdr, data)
    ck = Checkpoint.open(c)
    ck.validate()
    assert ck.shape("lm_head.weight") == (512, 64) and ck.dtype("lm_head.weight") == "BF16"


# ------------------------------------------------------------------ 7. generation_config.json eos_token_id
@pytest.mark.parametrize("value", [[1, "x"], "x", 99999, 512, [440, 512], True, -3])
def test_generation_config_eos_is_exit_2(tmp_path, capsys, value):
    c = _copy(tmp_path)
    _edit_json(c / "generation_config.json", eos_token_id=value)
    assert main(["generate", str(c), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    _one_line(capsys, "generation_config.json", "eos_token_id", repr(value))


def test_generation_config_do_sample_must_be_bool(tmp_path, capsys):
    c = _copy(tmp_path)
    _edit_json(c / "generation_config.json", do_sample="no")
    assert main(["generate", str(c), "--prompt", "hi", "--max-new-tokens", "1"]) == 2
    _one_line(capsys, "generation_config.json", "do_sample", "'no'")


def test_generation_config_eos_library_calls():
    from parity import generate as G
    # negative control: valid ids (int or list) merge with the model's, in order, de-duplicated
    assert G.eos_ids_from({"eos_token_id": [442, 440]}, (440,), vocab_size=512) == (440, 442)
    assert G.eos_ids_from({"eos_token_id": 7}, ()) == (7,)
    assert G.load_generation_config(fixture_dir("tiny"))["eos_token_id"] == [442, 440]
    with pytest.raises(InputError, match=r"generation_config.json: eos_token_id: .*\[0, vocab_size=512\).*99999"):
        G.eos_ids_from({"eos_token_id": 99999}, (), vocab_size=512)
    with pytest.raises(InputError, match="generation_config.json: eos_token_id"):
        G.eos_ids_from({"eos_token_id": [1, "x"]})
    with pytest.raises(InputError, match="generation_config.json: do_sample"):
        G.sampling_defaults({"do_sample": "yes"})


# ------------------------------------------------------------------ a key left to the official default
def test_missing_num_hidden_layers_names_the_official_default(tmp_path, capsys):
    """config.json without ``num_hidden_layers`` takes the official default (40): the layer_types mismatch that
    follows names the default and that config.json does not set it; the control: set, the message says so."""
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    n = len(cfg["layer_types"])
    (cfg.get("text_config") or cfg).pop("num_hidden_layers")
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    _one_line(capsys, "layer_types", "official default, not in config.json: num_hidden_layers=40", f"found {n}")
    (cfg.get("text_config") or cfg)["num_hidden_layers"] = n + 1
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    _one_line(capsys, f"num_hidden_layers = {n + 1} entries (from config.json)", f"found {n}")


def test_missing_num_experts_per_tok_names_the_official_default(tmp_path, capsys):
    """config.json without ``num_experts_per_tok`` takes the official default (10), more than tiny's 8 experts:
    the range error names the default and that config.json does not set it; the control: set, it says so."""
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (cfg.get("text_config") or cfg).pop("num_experts_per_tok")
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    _one_line(capsys, "num_experts_per_tok: expected in [1, num_experts=8], found 10",
              "official default, not in config.json: num_experts_per_tok=10")
    (cfg.get("text_config") or cfg)["num_experts_per_tok"] = 9
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    _one_line(capsys, "num_experts_per_tok: expected in [1, num_experts=8], found 9 (from config.json)")


def test_missing_layer_types_names_the_official_default(tmp_path, capsys):
    """config.json without ``layer_types`` takes the official pattern (indexed attention every 4th layer): tiny's
    tensors (indexed attention at layers 2 and 5) then miss layer 2's GatedDeltaNet weights, and the error says
    which mixer layer_types gives layer 2 and that it is the official default; the control: a layer_types in
    config.json with the same mistake says it comes from config.json."""
    d = _copy(tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    text = cfg.get("text_config") or cfg
    lt = text.pop("layer_types")
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    _one_line(capsys, "missing tensor 'model.layers.2.linear_attn.", "layer 2 is 'linear_attention' by layer_types",
              "official default, not in config.json: layer_types=indexed_attention at 0-based layers 3, 7, ...",
              "full_attention_interval=4 (also the official default)")
    text["layer_types"] = ["linear_attention"] * 3 + lt[3:]
    (d / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(d)]) == 2
    line = _one_line(capsys, "missing tensor 'model.layers.2.linear_attn.",
                     "layer 2 is 'linear_attention' by layer_types (from config.json)")
    assert "official default" not in line
