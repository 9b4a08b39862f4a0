"""``qwen4exp info``: layer pattern, per-component parameter counts from checkpoint headers and from
config.json alone, the real architecture's numbers, and the error path."""
from __future__ import annotations

import json
import math

import numpy as np
import pytest

from fixture_helpers import FIXTURES, fixture_dir
from parity.cli import main
from reference.checkpoint import write_safetensors
from reference.config import load_config
import shutil
from fixture_helpers import one_line_error

REAL = FIXTURES / "configs" / "qwen3.8-flash-next"


def _info(capsys, *argv) -> dict:
    assert main(["info", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_default_model_is_bundled_tiny(capsys):
    a = _info(capsys)
    b = _info(capsys, str(fixture_dir("tiny")))
    assert a["params"] == b["params"] and a["model"].endswith("tiny")


@pytest.mark.parametrize("name", ["tiny", "tiny-hc2", "tiny-hc3", "tiny-fp8", "tiny-nvfp4"])
def test_counts_match_config_arithmetic(capsys, name):
    cfg = load_config(fixture_dir(name))
    r = _info(capsys, name)
    p = r["params"]
    # routed experts: L x E x (gate + up + down) x I x H
    assert p["routed_experts"] == cfg.num_hidden_layers * cfg.num_experts * 3 * cfg.moe_intermediate_size * cfg.hidden_size
    assert p["ple_table"] == sum(cfg.ple_layout(i).padded_rows * cfg.ple_layout(i).head_dim for i in cfg.ple_layers)
    assert p["mtp"] == 0 and p["vision"] == 0
    # the same numbers from config.json alone (tied lm_head counted once, per-expert == fused)
    c = _info(capsys, name, "--config-only")["params"]
    assert {k: c[k] for k in ("backbone", "routed_experts", "ple_table")} == \
        {k: p[k] for k in ("backbone", "routed_experts", "ple_table")}
    assert c["mtp"] is None and c["vision"] is None
    assert r["bf16_bytes"]["backbone"] == 2 * p["backbone"]
    pat = r["config"]["layer_pattern"].replace(" ", "")
    assert len(pat) == cfg.num_hidden_layers
    for i, t in enumerate(cfg.layer_types):
        assert pat[i] == ("Q" if t == "indexed_attention" else "P" if i in cfg.ple_layers else "L")


def test_layer_pattern_text(capsys):
    assert main(["info", "tiny"]) == 0
    out = capsys.readouterr().out
    assert "LPQ LLQ" in out and "routed experts" in out and "MiB" in out


@pytest.mark.parametrize("argv, columns", [
    (["tiny"], ["component", "parameters", "BF16 MiB/GiB", "disk MiB/GiB"]),
    (["tiny", "--config-only"], ["component", "parameters", "BF16 MiB/GiB"])])
def test_parameter_table_has_a_header_naming_columns_and_units(capsys, argv, columns):
    """The parameter table opens with a header row naming each column with its unit, then a rule; every row's
    cells end where their header's column ends (right-aligned under it). ``--json`` is unchanged: JSON only."""
    import re
    assert main(["info", *argv]) == 0
    lines = capsys.readouterr().out.splitlines()
    h = next(i for i, ln in enumerate(lines) if ln.lstrip().startswith("component"))
    assert re.split(r"\s{2,}", lines[h].strip()) == columns, lines[h]
    assert set(lines[h + 1].replace(" ", "")) == {"-"}, lines[h + 1]
    ends = [m.end() for m in re.finditer(r"\S+(?: \S+)*", lines[h])][1:]
    rows = lines[h + 2:h + 5]  # backbone, routed experts, PLE n-gram tables
    assert rows[0].lstrip().startswith("backbone") and rows[2].lstrip().startswith("PLE n-gram tables"), rows
    for r in rows:
        cells = [m.end() for m in re.finditer(r"\S+(?: \S+)*", r)][1:]
        assert cells == ends, (lines[h], r)
        assert r.rstrip().endswith("MiB"), r
    assert main(["info", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert "component" not in out and json.loads(out)["params"]["backbone"] > 0


def test_mtp_and_vision_counted(tmp_path, capsys):
    """Extra mtp.* / model.visual.* tensors land in their own components (not in the backbone)."""
    from reference.checkpoint import Checkpoint
    src = Checkpoint.open(fixture_dir("tiny-hc2"))
    t = {src.stored_name(n): np.array(src.get_raw(n)) for n in src.names()}
    t["mtp.fc.weight"] = np.zeros((64, 128), np.float32)
    t["model.visual.blocks.0.attn.qkv.weight"] = np.zeros((3, 5), np.float32)
    t["model.layers.0.linear_attn.in_proj_z.weight_scale_inv"] = np.ones((1, 1), np.float32)  # not a parameter
    (tmp_path / "config.json").write_text((fixture_dir("tiny-hc2") / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", t)
    base = _info(capsys, "tiny-hc2")["params"]
    r = _info(capsys, str(tmp_path))["params"]
    assert r["mtp"] == 64 * 128 and r["vision"] == 15
    assert r["backbone"] == base["backbone"]


def test_unused_tensor_is_a_note_not_a_failure(tmp_path, capsys):
    """A tensor the model does not use: ``info`` succeeds (its JSON alone on stdout) and stderr holds one note
    naming the tensor as stored."""
    from reference.checkpoint import Checkpoint
    src = Checkpoint.open(fixture_dir("tiny-hc2"))
    t = {src.stored_name(n): np.array(src.get_raw(n)) for n in src.names()}
    t["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.zeros((4,), np.float32)
    (tmp_path / "config.json").write_text((fixture_dir("tiny-hc2") / "config.json").read_text())
    write_safetensors(tmp_path / "model.safetensors", t)
    assert main(["info", str(tmp_path), "--json"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["storage"]["tensors"] == len(t)
    notes = [ln for ln in cap.err.splitlines() if ln.startswith("note:")]
    assert len(notes) == 1 and "1 stored tensor(s) the model does not use, ignored: " \
        "'model.layers.0.self_attn.rotary_emb.inv_freq'" in notes[0], cap.err


def test_real_architecture_config_only(capsys):
    """Numbers from config.json of the real model agree with the published tensor census
    (model-facts.md: PLE shards [2,500,012, 160] x 128; routed experts 120.80B params)."""
    r = _info(capsys, str(REAL), "--config-only")
    assert r["config"]["layer_pattern"] == "LPLQ" + " LLLQ" * 11
    assert r["params"]["ple_table"] == 128 * 2_500_012 * 160
    assert round(r["params"]["routed_experts"] / 1e9, 2) == 120.80
    assert r["config"]["tie_word_embeddings"] is False
    cfg = load_config(REAL)
    assert cfg.ple_layout(1).padded_rows // cfg.split_ngram_parts == 2_500_012
    assert math.isclose(cfg.rotary_dim, 64)


def test_missing_model_is_exit_2(capsys):
    assert main(["info", "no-such-model"]) == 2
    err = capsys.readouterr().err
    assert "no-such-model" in err and "tiny" in err


def test_stored_bytes_follow_the_dtypes(capsys):
    """F32 fixture: 4 bytes/param; BF16: 2; FP8 experts: 1 byte/param + 4 per float32 block scale."""
    for name, per in (("tiny-hc2", 4), ("tiny", 2)):
        r = _info(capsys, name)
        for k in ("backbone", "routed_experts", "ple_table"):
            assert r["storage"]["stored_bytes"][k] == per * r["params"][k], (name, k)
    r = _info(capsys, "tiny-fp8")
    cfg = load_config(fixture_dir("tiny-fp8"))
    n_scales = cfg.num_hidden_layers * cfg.num_experts * 3  # one 128x128 block per (small) expert matrix
    assert r["storage"]["stored_bytes"]["routed_experts"] == r["params"]["routed_experts"] + 4 * n_scales
    assert r["storage"]["stored_bytes"]["ple_table"] == r["params"]["ple_table"] + 2  # one BF16 scale
    # NVFP4 experts: half a byte per parameter (two E2M1 codes per U8) + one E4M3 byte per 16 + per matrix a float32
    # global scale (weight_scale_2) and a float32 activation scale (input_scale)
    r = _info(capsys, "tiny-nvfp4")
    from reference.checkpoint import Checkpoint
    ck = Checkpoint.open(fixture_dir("tiny-nvfp4"))
    n_global = sum(1 for n in ck.names() if ".mlp.experts." in n and n.endswith("weight_scale_2"))
    p = r["params"]["routed_experts"]
    assert n_global > 0 and r["storage"]["stored_bytes"]["routed_experts"] == p // 2 + p // 16 + 8 * n_global


def test_info_header_shape_mismatch_is_exit_2(tiny, tmp_path, capsys):
    m = tmp_path / "m"
    shutil.copytree(tiny, m)
    cfg = json.loads((m / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] + 1
    (m / "config.json").write_text(json.dumps(cfg))
    assert main(["info", str(m)]) == 2
    one_line_error(capsys, "tensor", "expected", str(cfg["hidden_size"]))
    assert main(["info", str(tiny)]) == 0


def test_keys_left_to_the_official_default_are_listed(tmp_path, capsys):
    """The real config without ``num_experts_per_tok`` and ``layer_types`` is valid with their official defaults
    (top-10 of 512; indexed attention every 4th layer): ``info`` lists them as defaults, in text and JSON; the
    bundled tiny sets every key and lists none."""
    raw = json.loads((REAL / "config.json").read_text())
    text = raw.get("text_config") or raw
    text.pop("num_experts_per_tok")
    text.pop("layer_types")
    d = tmp_path / "real"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(raw))
    defaults = _info(capsys, str(d), "--config-only")["official_defaults"]
    assert defaults["num_experts_per_tok"] == "num_experts_per_tok=10"
    assert defaults["layer_types"].startswith("layer_types=indexed_attention at 0-based layers 3, 7, ...")
    assert main(["info", str(d), "--config-only"]) == 0
    line = [ln for ln in capsys.readouterr().out.splitlines() if "official defaults" in ln]
    assert len(line) == 1 and "num_experts_per_tok=10" in line[0] and "layer_types=" in line[0], line
    assert _info(capsys, "tiny")["official_defaults"] == {}
    assert main(["info", "tiny"]) == 0
    assert "official defaults" not in capsys.readouterr().out
