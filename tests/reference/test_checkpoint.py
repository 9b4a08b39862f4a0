"""reference/checkpoint.py: every dtype (BF16 exact upcast and FP8 block dequant checked against hand
decoding of the raw bits), sharded index, prefixes, both expert layouts, the n-gram gather across shards,
overrides, fingerprint, atomic writes, and every error case (each a CheckpointError naming the thing)."""
from __future__ import annotations

import ast
import json
import re
import os
import shutil
import struct

import ml_dtypes
import numpy as np
import pytest

from fixture_helpers import FIXTURE_NAMES, fixture_dir
from reference.bench_ngram import bench_ngram_gather
from reference.checkpoint import (Checkpoint, CheckpointError, DictWeights, canonical_name,
                                  write_safetensors)
from reference.errors import InputError


# ------------------------------------------------------------------------------------------ helpers
def _tensors(name: str) -> dict[str, np.ndarray]:
    """Stored name -> raw array (stored dtype) of a bundled fixture."""
    with Checkpoint.open(fixture_dir(name)) as ck:
        return {ck.stored_name(n): np.array(ck.get_raw(n)) for n in ck.names()}


def _write_ck(dst, config: dict, tensors: dict[str, np.ndarray], n_files: int = 1):
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config))
    if n_files == 1:
        write_safetensors(dst / "model.safetensors", tensors)
        return dst
    names = sorted(tensors)
    wmap = {}
    for j in range(n_files):
        fn = f"model-{j:05d}.safetensors"
        chunk = names[j::n_files]
        write_safetensors(dst / fn, {n: tensors[n] for n in chunk})
        wmap.update({n: fn for n in chunk})
    (dst / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wmap}))
    return dst


def _config(name: str) -> dict:
    return json.loads((fixture_dir(name) / "config.json").read_text())


def _bf16_by_hand(raw_bytes: bytes) -> np.ndarray:
    """BF16 -> float32 without ml_dtypes: the 16 stored bits are the top half of a float32."""
    u16 = np.frombuffer(raw_bytes, dtype="<u2").astype(np.uint32)
    return (u16 << 16).view(np.float32)


def _e4m3_by_hand(code: int) -> float:
    """FP8 E4M3 (fn: no inf, NaN = S.1111.111) decoded from its bits: bias 7, 3 mantissa bits."""
    code = int(code)
    s = -1.0 if code & 0x80 else 1.0
    e = (code >> 3) & 0xF
    m = code & 0x7
    if e == 0xF and m == 0x7:
        return float("nan")
    if e == 0:
        return s * (m / 8.0) * 2.0 ** -6
    return s * (1.0 + m / 8.0) * 2.0 ** (e - 7)


# ------------------------------------------------------------------------------------------ opening
@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_bundled_fixtures_open_and_validate(name):
    with Checkpoint.open(fixture_dir(name)) as ck:
        assert ck.validate() == []
        assert ck.has("embed_tokens.weight") and ck.has("lm_head.weight")
        assert not any(n.startswith("model.") for n in ck.names())
        assert ck.shape("embed_tokens.weight") == (ck.config.vocab_size, ck.config.hidden_size)


def test_prefixes_are_normalised():
    assert canonical_name("model.language_model.layers.0.mlp.gate.weight") == "layers.0.mlp.gate.weight"
    assert canonical_name("model.layers.0.mlp.gate.weight") == "layers.0.mlp.gate.weight"
    assert canonical_name("model.visual.blocks.0.attn.qkv.weight") == "visual.blocks.0.attn.qkv.weight"
    assert canonical_name("lm_head.weight") == "lm_head.weight"
    assert canonical_name("mtp.layers.0.eh_proj.weight") == "mtp.layers.0.eh_proj.weight"


def test_prefix_forms_read_identically(tmp_path):
    t = _tensors("tiny-hc2")
    cfg = _config("tiny-hc2")
    bare = {canonical_name(k): v for k, v in t.items()}
    mm = {("model.language_model." + k if not k.startswith("lm_head") else k): v for k, v in bare.items()}
    extra = {"mtp.fc.weight": np.ones((4, 4), np.float32), "model.visual.patch.weight": np.ones((2,), np.float32)}
    a = Checkpoint.open(fixture_dir("tiny-hc2"))
    b = Checkpoint.open(_write_ck(tmp_path / "bare", cfg, bare))
    c = Checkpoint.open(_write_ck(tmp_path / "mm", cfg, {**mm, **extra}))
    assert a.names() == b.names() == sorted(set(c.names()) - {"mtp.fc.weight", "visual.patch.weight"})
    assert c.validate() == []  # mtp / visual listed but not required nor flagged
    for n in a.names():
        assert np.array_equal(a.get_raw(n), b.get_raw(n)) and np.array_equal(a.get_raw(n), c.get_raw(n)), n
    # the same tensor under two prefixes is ambiguous
    dup = {**t, "model.language_model.embed_tokens.weight": t["model.embed_tokens.weight"]}
    with pytest.raises(CheckpointError, match="stored twice"):
        Checkpoint.open(_write_ck(tmp_path / "dup", cfg, dup))


def test_sharded_index_equals_single_file(tmp_path):
    t = _tensors("tiny")
    one = Checkpoint.open(fixture_dir("tiny"))
    many = Checkpoint.open(_write_ck(tmp_path / "sh", _config("tiny"), t, n_files=3))
    assert len(list((tmp_path / "sh").glob("*.safetensors"))) == 3
    assert one.names() == many.names()
    for n in one.names():
        assert np.array_equal(one.get(n), many.get(n)), n
    assert one.fingerprint() == many.fingerprint()  # identity does not depend on the file split


# ------------------------------------------------------------------------------------------ dtypes
def test_bf16_upcast_is_exact():
    """fixtures/tiny stores BF16: get() equals hand-decoded bits read straight from the file."""
    ck = Checkpoint.open(fixture_dir("tiny"))
    en = ck._entries["layers.0.linear_attn.in_proj_qkv.weight"]
    assert en.dtype == "BF16"
    with open(en.file, "rb") as f:
        f.seek(en.start)
        hand = _bf16_by_hand(f.read(en.nbytes)).reshape(en.shape)
    got32 = ck.get("layers.0.linear_attn.in_proj_qkv.weight")
    got64 = ck.get("layers.0.linear_attn.in_proj_qkv.weight", np.float64)
    assert got32.dtype == np.float32 and got64.dtype == np.float64
    assert np.array_equal(got32, hand) and np.array_equal(got64, hand.astype(np.float64))
    raw = ck.get_raw("layers.0.linear_attn.in_proj_qkv.weight")
    assert raw.dtype == ml_dtypes.bfloat16 and not raw.flags.writeable


def test_f16_i64_f32_dtypes(tmp_path):
    cfg = _config("tiny-hc2")
    t = _tensors("tiny-hc2")
    rng = np.random.default_rng(0)
    k = "model.layers.0.linear_attn.out_proj.weight"
    t[k] = rng.standard_normal(t[k].shape).astype(np.float16)
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, t))
    assert ck.dtype("layers.0.linear_attn.out_proj.weight") == "F16"
    assert np.array_equal(ck.get("layers.0.linear_attn.out_proj.weight"), t[k].astype(np.float32))
    m = ck.get("layers.2.ple.ple_embedding.layer_multipliers", np.float32)  # ints stay int64
    assert m.dtype == np.int64 and m.tolist() == list(ck.config.ple_layout(2).multipliers)


def _fp8_fixture(tmp_path, rows=200, cols=300, per_tensor=False):
    """tiny-hc2 with one matrix replaced by FP8 E4M3 + scale (block 128x128, partial edge blocks)."""
    cfg = _config("tiny-hc2")
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    cfg.update(vocab_size=rows, hidden_size=64)
    rng = np.random.default_rng(1)
    codes = rng.integers(0, 256, size=(rows, 64), dtype=np.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3A  # no NaN codes
    w8 = codes.view(ml_dtypes.float8_e4m3fn)
    scale = (rng.random((1,) if per_tensor else (-(-rows // 128), 1)) + 0.5).astype(np.float32)
    return cfg, codes, w8, scale


def test_fp8_block_dequant_matches_hand_computation(tmp_path):
    # embed_tokens [V=200, H=64]: blocks of 128 rows -> scale [2, 1], second block partial
    cfg, codes, w8, scale = _fp8_fixture(tmp_path)
    t = {k: v for k, v in _tensors("tiny-hc2").items() if "embed_tokens" not in k and "lm_head" not in k}
    t["model.embed_tokens.weight"] = w8
    t["model.embed_tokens.weight_scale_inv"] = scale
    t["lm_head.weight"] = np.zeros((200, 64), np.float32)
    cfg["eos_token_id"] = [1, 2]
    cfg["pad_token_id"] = 1
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, t))
    hand = np.empty(codes.shape, np.float32)
    for i in range(codes.shape[0]):
        for j in range(codes.shape[1]):
            hand[i, j] = np.float32(_e4m3_by_hand(int(codes[i, j]))) * scale[i // 128, j // 128]
    got = ck.get("embed_tokens.weight")
    assert np.array_equal(got, hand)
    assert ck.get_raw("embed_tokens.weight").dtype == ml_dtypes.float8_e4m3fn
    # negative control: applying the scale of the wrong block is detected
    wrong = hand.copy()
    wrong[128:] = wrong[128:] / scale[1, 0] * scale[0, 0]
    assert not np.array_equal(got, wrong)
    # a mis-shaped scale is an error naming both tensors
    t["model.embed_tokens.weight_scale_inv"] = np.ones((3, 1), np.float32)
    ck2 = Checkpoint.open(_write_ck(tmp_path / "bad", cfg, t))
    with pytest.raises(CheckpointError, match=r"weight_scale_inv.*expected \[2, 1\].*found \[3, 1\]"):
        ck2.get("embed_tokens.weight")
    # FP8 without any scale
    del t["model.embed_tokens.weight_scale_inv"]
    ck3 = Checkpoint.open(_write_ck(tmp_path / "noscale", cfg, t))
    with pytest.raises(CheckpointError, match="expected a scale"):
        ck3.get("embed_tokens.weight")


def test_fp8_fused_and_per_expert_block_scales(tmp_path):
    cfg = _config("tiny-hc2")
    t = _tensors("tiny-hc2")
    E, I, H = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["hidden_size"]
    rng = np.random.default_rng(2)
    codes = rng.integers(0, 0x7E, size=(E, 2 * I, H), dtype=np.uint8)
    scale = (rng.random((E, 1, 1)) + 0.5).astype(np.float32)
    fused = {k: v for k, v in t.items() if ".mlp.experts." not in k or not k.startswith("model.layers.1.")}
    fused["model.layers.1.mlp.experts.gate_up_proj"] = codes.view(ml_dtypes.float8_e4m3fn)
    fused["model.layers.1.mlp.experts.gate_up_proj_scale_inv"] = scale
    fused["model.layers.1.mlp.experts.down_proj"] = np.stack(
        [t[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(E)])
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, fused))
    for e in range(E):
        g, u, d = ck.expert(1, e)
        hand = np.vectorize(_e4m3_by_hand)(codes[e]).astype(np.float32) * scale[e, 0, 0]
        assert np.array_equal(g, hand[:I]) and np.array_equal(u, hand[I:])
        assert np.array_equal(d, t[f"model.layers.1.mlp.experts.{e}.down_proj.weight"])


def test_fp8_ngram_table_with_one_table_scale(tmp_path):
    cfg = _config("tiny-hc2")
    t = _tensors("tiny-hc2")
    i = 2
    base = f"model.layers.{i}.ple.ple_embedding.ngram_embedding"
    shard_names = sorted((k for k in t if k.startswith(base + ".shard_")), key=lambda k: int(k.split("shard_")[1].split(".")[0]))
    rng = np.random.default_rng(3)
    codes = {}
    for k in shard_names:
        c = rng.integers(0, 0x7E, size=t[k].shape, dtype=np.uint8)
        codes[k] = c
        t[k] = c.view(ml_dtypes.float8_e4m3fn)
    t[base + ".weight_scale"] = np.array([0.000199], dtype=ml_dtypes.bfloat16)  # one BF16 scale, as released
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, t))
    s = np.float32(np.array([0.000199], dtype=ml_dtypes.bfloat16).astype(np.float32)[0])
    table = np.concatenate([np.vectorize(_e4m3_by_hand)(codes[k]).astype(np.float32) * s for k in shard_names])
    rows = np.array([[0, 1, table.shape[0] - 1], [5, table.shape[0] // 3, table.shape[0] // 3 + 1]])
    assert np.array_equal(ck.ngram_rows(i, rows), table[rows])
    assert np.array_equal(ck.get(f"layers.{i}.ple.ple_embedding.ngram_embedding.weight"), table)


# ------------------------------------------------------------------------------------------ experts
def _fuse(t: dict, cfg: dict, prefix="model.") -> dict:
    E = cfg["num_experts"]
    out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
    for i in range(cfg["num_hidden_layers"]):
        p = f"{prefix}layers.{i}.mlp.experts."
        out[p + "gate_up_proj"] = np.stack([np.concatenate([t[f"{p}{e}.gate_proj.weight"], t[f"{p}{e}.up_proj.weight"]])
                                            for e in range(E)])
        out[p + "down_proj"] = np.stack([t[f"{p}{e}.down_proj.weight"] for e in range(E)])
    return out


def test_both_expert_layouts_give_identical_experts(tmp_path):
    cfg, t = _config("tiny"), _tensors("tiny")
    per = Checkpoint.open(fixture_dir("tiny"))
    fused = Checkpoint.open(_write_ck(tmp_path / "f", cfg, _fuse(t, cfg)))
    assert fused.validate() == [] and fused.has("layers.0.mlp.experts.gate_up_proj")
    for i in range(cfg["num_hidden_layers"]):
        for e in range(cfg["num_experts"]):
            for a, b in zip(per.expert(i, e), fused.expert(i, e)):
                assert a.shape == b.shape and np.array_equal(a, b)
    # negative control: up rows first instead of gate rows first is told apart
    bad = _fuse(t, cfg)
    I = cfg["moe_intermediate_size"]
    gu = bad["model.layers.0.mlp.experts.gate_up_proj"]
    bad["model.layers.0.mlp.experts.gate_up_proj"] = np.concatenate([gu[:, I:], gu[:, :I]], axis=1)
    swapped = Checkpoint.open(_write_ck(tmp_path / "s", cfg, bad))
    assert not np.array_equal(swapped.expert(0, 0)[0], per.expert(0, 0)[0])
    with pytest.raises(InputError, match="expert"):
        per.expert(0, cfg["num_experts"])


def test_release_layout_fixture_matches_save_pretrained_values():
    """tiny-hc3 is stored fused under model.language_model. in 3 shards; its values are consistent
    with its goldens' lm_head (tied) check in test_fixtures; here: layout facts."""
    ck = Checkpoint.open(fixture_dir("tiny-hc3"))
    assert (fixture_dir("tiny-hc3") / "model.safetensors.index.json").exists()
    assert ck.stored_name("embed_tokens.weight") == "model.language_model.embed_tokens.weight"
    assert ck.has("layers.0.mlp.experts.gate_up_proj") and not ck.has("layers.0.mlp.experts.0.gate_proj.weight")
    assert "lm_head.weight" not in ck.names() and ck.has("lm_head.weight")  # tied
    assert np.array_equal(ck.get("lm_head.weight"), ck.get("embed_tokens.weight"))


def test_untied_missing_lm_head_is_an_error(tmp_path):
    t = {k: v for k, v in _tensors("tiny-hc2").items() if k != "lm_head.weight"}
    ck = Checkpoint.open(_write_ck(tmp_path, _config("tiny-hc2"), t))
    assert not ck.has("lm_head.weight")
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        ck.get("lm_head.weight")
    with pytest.raises(CheckpointError, match="lm_head.weight"):
        ck.validate()


# ------------------------------------------------------------------------------------------ n-gram table
def test_ngram_rows_across_shard_boundaries():
    """tiny-hc2 stores F32 shards: compare with safetensors' own numpy reader, shard by shard."""
    from safetensors import safe_open

    ck = Checkpoint.open(fixture_dir("tiny-hc2"))
    i = ck.config.ple_layers[0]
    base = f"model.layers.{i}.ple.ple_embedding.ngram_embedding.shard_"
    with safe_open(str(fixture_dir("tiny-hc2") / "model.safetensors"), "np") as f:
        shards = [f.get_tensor(f"{base}{k}.weight") for k in range(ck.config.split_ngram_parts)]
    table = np.concatenate(shards)
    assert table.shape == (ck.config.ple_layout(i).padded_rows, ck.config.ple_layout(i).head_dim)
    edges = np.cumsum([s.shape[0] for s in shards])[:-1]
    rows = np.concatenate([edges - 1, edges, [0, table.shape[0] - 1], edges[::-1]]).reshape(2, -1)
    got = ck.ngram_rows(i, rows)
    assert got.shape == rows.shape + (table.shape[1],) and got.dtype == np.float32
    assert np.array_equal(got, table[rows])
    # negative control: an off-by-one row is a different embedding
    assert not np.array_equal(ck.ngram_rows(i, rows[:1, :1] + 1)[0, 0], table[rows][0, 0])
    with pytest.raises(InputError, match=r"expected ids in \[0, "):
        ck.ngram_rows(i, np.array([table.shape[0]]))
    with pytest.raises(InputError, match="PLE layer"):
        ck.ngram_rows(0, np.array([0]))


def test_unsharded_ngram_table_accepted(tmp_path):
    cfg, t = _config("tiny-hc2"), _tensors("tiny-hc2")
    ck0 = Checkpoint.open(fixture_dir("tiny-hc2"))
    i = ck0.config.ple_layers[0]
    base = f"model.layers.{i}.ple.ple_embedding.ngram_embedding"
    shards = [t.pop(f"{base}.shard_{k}.weight") for k in range(cfg["split_ngram_parts"])]
    t[base + ".weight"] = np.concatenate(shards)
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, t))
    rows = np.arange(0, t[base + ".weight"].shape[0], 7)
    assert np.array_equal(ck.ngram_rows(i, rows), ck0.ngram_rows(i, rows))
    assert ck.validate() == []


def test_ngram_shard_gap_and_row_total_errors(tmp_path):
    cfg, t = _config("tiny-hc2"), _tensors("tiny-hc2")
    base = "model.layers.2.ple.ple_embedding.ngram_embedding"
    gap = dict(t)
    del gap[base + ".shard_1.weight"]
    with pytest.raises(CheckpointError, match=r"missing shard\(s\) \[1\]"):
        Checkpoint.open(_write_ck(tmp_path / "gap", cfg, gap)).ngram_rows(2, np.array([0]))
    short = dict(t)
    short[base + ".shard_2.weight"] = short[base + ".shard_2.weight"][:-1]
    with pytest.raises(CheckpointError, match="rows in total"):
        Checkpoint.open(_write_ck(tmp_path / "short", cfg, short)).ngram_rows(2, np.array([0]))


def test_bench_ngram_gather_flat_memory_on_table_larger_than_ram(tmp_path):
    """A sparse table 1.25x physical RAM: gathering random rows keeps resident memory flat."""
    with open("/proc/meminfo") as f:
        mem = int(next(line for line in f if line.startswith("MemTotal")).split()[1]) * 1024
    r = bench_ngram_gather(int(mem * 1.25), n_gathers=20, rows_per_gather=2048, directory=tmp_path)
    assert r["table_bytes"] > mem
    assert r["rows"] == 20 * 2048 and r["rows_per_s"] > 1000
    # 40960 gathered rows x 320 B = 13 MB would be read; resident growth must stay far below the
    # table (and below 64 MiB: output buffers are freed per batch, nothing is mapped)
    assert r["rss_growth_bytes"] < 64 * 2**20, r
    assert r["anon_growth_bytes"] < 64 * 2**20, r


# ------------------------------------------------------------------------------------------ errors
def test_truncated_file(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(fixture_dir("tiny-hc2"), d)
    f = d / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt file: tensor .* data_offsets"):
        Checkpoint.open(d)
    f.write_bytes(data[:5])
    with pytest.raises(CheckpointError, match="truncated safetensors file"):
        Checkpoint.open(d)


def test_corrupt_header(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(fixture_dir("tiny-hc2"), d)
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    (n,) = struct.unpack("<Q", data[:8])
    bad = bytes(data)
    bad = bad[:8] + b"#" + bad[9:]
    f.write_bytes(bad)
    with pytest.raises(CheckpointError, match="corrupt safetensors header: expected JSON"):
        Checkpoint.open(d)
    f.write_bytes(struct.pack("<Q", len(data) * 2) + bytes(data[8:]))
    with pytest.raises(CheckpointError, match="header length .* runs beyond the file"):
        Checkpoint.open(d)
    # offsets that disagree with dtype x shape
    hdr = json.loads(bytes(data[8:8 + n]))
    k = next(k for k in hdr if k != "__metadata__")
    hdr[k]["shape"] = [hdr[k]["shape"][0] + 1] + hdr[k]["shape"][1:]
    blob = json.dumps(hdr).encode()
    f.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(data[8 + n:]))
    with pytest.raises(CheckpointError, match=f"{k}.* needs .* bytes, data_offsets give"):
        Checkpoint.open(d)


def test_index_naming_missing_shard(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(fixture_dir("tiny-hc3"), d)
    (d / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"names shard file\(s\) that do not exist: \['model-00002-of-00003"):
        Checkpoint.open(d)


def test_index_pointing_to_wrong_file(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(fixture_dir("tiny-hc3"), d)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    k = "model.language_model.embed_tokens.weight"
    idx["weight_map"][k] = next(v for v in idx["weight_map"].values() if v != idx["weight_map"][k])
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="embed_tokens.weight"):
        Checkpoint.open(d)


def test_missing_tensor_lists_near_names(tmp_path):
    t = _tensors("tiny-hc2")
    del t["model.layers.0.linear_attn.in_proj_z.weight"]
    ck = Checkpoint.open(_write_ck(tmp_path, _config("tiny-hc2"), t))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model.layers.0.linear_attn.in_proj_z.weight'.*near names"):
        ck.get("layers.0.linear_attn.in_proj_z.weight")
    with pytest.raises(CheckpointError, match="in_proj_z"):
        ck.validate()


@pytest.mark.parametrize("name, key, n_files", [
    ("tiny-hc2", "model.layers.0.linear_attn.in_proj_z.weight", 1),
    ("tiny-hc3", "model.language_model.layers.0.linear_attn.in_proj_z.weight", 3),
    # no other embed_tokens key to copy the prefix from: the trunk's prefix
    ("tiny-hc3", "model.language_model.embed_tokens.weight", 1),
    ("tiny-hc2", "lm_head.weight", 1)])
def test_missing_tensor_named_as_the_files_spell_it(tmp_path, name, key, n_files):
    """A missing tensor is named by the key the checkpoint's files would hold (their ``model.`` /
    ``model.language_model.`` prefix kept; ``lm_head`` stays bare as stored), with the shape config.json
    expects and that no such key was found; the near names are file keys too."""
    t = _tensors(name)
    del t[key]
    ck = Checkpoint.open(_write_ck(tmp_path, _config(name), t, n_files=n_files))
    c = canonical_name(key)
    shape = list(ck._expected[c])
    for read in (lambda: ck.get(c), ck.validate):
        with pytest.raises(CheckpointError) as e:
            read()
        msg = str(e.value)
        assert f"missing tensor {key!r}: expected a float tensor of shape {shape} (shape from config.json), " \
               f"found no such key" in msg, msg
        near = re.search(r"near names present: (\[.*\])", msg)
        assert near and all(n in t for n in ast.literal_eval(near.group(1))), msg


def test_unused_tensors_are_reported_once_and_ignored(tmp_path, capsys):
    """Stored tensors the model does not use load (they are ignored) with one note on stderr: their count and
    the first 5 stored names (prefix kept); the MTP head, the vision tower and quantisation scales are known and
    not listed; opening the same checkpoint again prints nothing more. The control: a bundled fixture opens
    without a note."""
    t = _tensors("tiny-hc2")
    extra = {f"model.layers.0.rotary_emb.extra_{k}": np.zeros((2,), np.float32) for k in range(7)}
    known = {"mtp.fc.weight": np.ones((4, 4), np.float32), "model.visual.patch.weight": np.ones((2,), np.float32),
             "model.layers.0.linear_attn.in_proj_z.weight_scale_inv": np.ones((1, 1), np.float32)}
    d = _write_ck(tmp_path / "ck", _config("tiny-hc2"), {**t, **extra, **known})
    capsys.readouterr()
    ck = Checkpoint.open(d)
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("note:")]
    assert len(lines) == 1, err
    assert "7 stored tensor(s) the model does not use, ignored" in lines[0] and "and 2 more" in lines[0], lines
    assert lines[0].count("'model.layers.0.rotary_emb.extra_") == 5, lines
    assert not any(k in lines[0] for k in ("mtp.", "visual", "_scale_inv")), lines
    assert ck.unused_names() == sorted(canonical_name(k) for k in extra)
    assert np.array_equal(ck.get("embed_tokens.weight"), t["model.embed_tokens.weight"])
    assert ck.validate() == ck.unused_names()
    Checkpoint.open(d)
    assert "note:" not in capsys.readouterr().err
    Checkpoint.open(fixture_dir("tiny-hc2"))
    Checkpoint.open(fixture_dir("tiny-mtp"))
    assert capsys.readouterr().err == ""


def test_unused_tensors_of_an_incomplete_checkpoint_leave_the_missing_tensor_error_alone(tmp_path, capsys):
    """A tensor stored under a name the model does not use, in place of one it needs: no note at open (the
    missing tensor's error names it among the near names); once complete, the note comes."""
    t = _tensors("tiny-hc2")
    key = "model.layers.0.linear_attn.in_proj_z.weight"
    t["model.layers.0.linear_attn.in_proj_zz.weight"] = t.pop(key)
    capsys.readouterr()
    ck = Checkpoint.open(_write_ck(tmp_path / "a", _config("tiny-hc2"), t))
    assert capsys.readouterr().err == ""
    with pytest.raises(CheckpointError, match=r"in_proj_z.weight'.*near names.*in_proj_zz"):
        ck.validate()
    assert ck.unused_names() == ["layers.0.linear_attn.in_proj_zz.weight"]
    t[key] = t["model.layers.0.linear_attn.in_proj_zz.weight"]
    Checkpoint.open(_write_ck(tmp_path / "b", _config("tiny-hc2"), t))
    assert "1 stored tensor(s) the model does not use" in capsys.readouterr().err


def test_wrong_shape_reported_on_access(tmp_path):
    t = _tensors("tiny-hc2")
    t["model.layers.0.linear_attn.in_proj_b.weight"] = np.zeros((5, 64), np.float32)
    ck = Checkpoint.open(_write_ck(tmp_path, _config("tiny-hc2"), t))  # lazy: opening succeeds
    # named by the key as the file stores it (its 'model.' prefix), so it can be found there
    with pytest.raises(CheckpointError, match=r"'model\.layers\.0\.linear_attn\.in_proj_b.weight'.*expected \[4, 64\].*found \[5, 64\]"):
        ck.get("layers.0.linear_attn.in_proj_b.weight")
    with pytest.raises(CheckpointError, match="unexpected shape"):
        ck.validate()
    assert ck.get("layers.0.linear_attn.in_proj_a.weight").shape == (4, 64)


@pytest.mark.parametrize("key", ["model.layers.0.attn_hyper_connection.hc_norm.weight", "model.layers.0.linear_attn.A_log",
                                 "model.layers.0.mlp.experts.3.up_proj.weight"])
def test_parameter_stored_as_integers_is_an_error(tmp_path, key):
    """A float parameter stored with an integer dtype would be read as integers: an error naming the tensor and the
    dtypes, on access and in validate(); the integer buffers stay readable (the control)."""
    t = _tensors("tiny-hc2")
    t[key] = np.round(t[key].astype(np.float32) * 100).astype(np.int32)
    ck = Checkpoint.open(_write_ck(tmp_path, _config("tiny-hc2"), t))
    name = key[len("model."):]
    with pytest.raises(CheckpointError, match=rf"'{re.escape(key)}'.*expected a float dtype.*found I32"):
        ck.get(name)
    with pytest.raises(CheckpointError, match="expected a float dtype"):
        ck.validate()
    assert ck.get("layers.2.ple.ple_embedding.layer_multipliers").dtype == np.int64


def _ck_with_a_log_dtype(tmp_path, dtype: bytes):
    """A tiny-hc2 checkpoint whose header gives ``layers.0.linear_attn.A_log`` (F32) another dtype name."""
    d = _write_ck(tmp_path, _config("tiny-hc2"), _tensors("tiny-hc2"))
    f = d / "model.safetensors"
    data = f.read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    hdr = data[8:8 + n].replace(b'"model.layers.0.linear_attn.A_log":{"dtype":"F32"',
                                b'"model.layers.0.linear_attn.A_log":{"dtype":"' + dtype + b'"')
    assert hdr != data[8:8 + n]
    f.write_bytes(data[:8] + hdr + data[8 + n:])
    return d


def test_unknown_dtype(tmp_path):
    d = _ck_with_a_log_dtype(tmp_path, b"Q4X")
    # rejected when the header is read (not only when the tensor is), naming the tensor and the file
    with pytest.raises(CheckpointError, match=r"model.safetensors: tensor '.*A_log'.*unknown dtype.*found 'Q4X'"):
        Checkpoint.open(d)


def test_no_weights_and_missing_config(tmp_path):
    (tmp_path / "config.json").write_text((fixture_dir("tiny") / "config.json").read_text())
    with pytest.raises(CheckpointError, match="found none"):
        Checkpoint.open(tmp_path)
    from reference.config import ConfigError
    (tmp_path / "noconf").mkdir()
    with pytest.raises(ConfigError, match="config.json not found"):
        Checkpoint.open(tmp_path / "noconf")
    with pytest.raises(CheckpointError, match="expected a checkpoint directory"):
        Checkpoint.open(tmp_path / "does-not-exist")


# ------------------------------------------------------------------------------------------ laziness, identity
def test_get_raw_is_memory_mapped_and_lazy():
    ck = Checkpoint.open(fixture_dir("tiny"))
    assert ck._maps == {}  # nothing mapped or read at open
    raw = ck.get_raw("embed_tokens.weight")
    b = raw
    while getattr(b, "base", None) is not None and not isinstance(b, np.memmap):
        b = b.base
    assert isinstance(b, np.memmap)


def test_fingerprint_stable_and_sensitive(tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(fixture_dir("tiny-hc2"), d)
    fp = Checkpoint.open(d).fingerprint()
    assert fp == Checkpoint.open(fixture_dir("tiny-hc2")).fingerprint()
    ck = Checkpoint.open(d)
    en = ck._entries["layers.0.linear_attn.A_log"]
    ck.close()
    with open(en.file, "r+b") as f:  # flip one byte of a sampled region
        f.seek(en.start)
        b = f.read(1)
        f.seek(en.start)
        f.write(bytes([b[0] ^ 0x01]))
    assert Checkpoint.open(d).fingerprint() != fp


def test_with_override_and_dictweights():
    ck = Checkpoint.open(fixture_dir("tiny"))
    name = "layers.1.linear_attn.dt_bias"
    orig = ck.get(name)
    pert = ck.with_override(name, orig + 1.0)
    assert np.array_equal(pert.get(name), orig + 1.0) and np.array_equal(ck.get(name), orig)
    assert pert.fingerprint() != ck.fingerprint()
    with pytest.raises(CheckpointError, match=r"expected shape \[2\], found \[3\]"):
        ck.with_override(name, np.zeros(3, np.float32))
    dw = DictWeights.from_checkpoint(ck)
    for n in ("embed_tokens.weight", "layers.2.self_attn.q_proj.weight"):
        assert np.array_equal(dw.get(n), ck.get(n))
    assert all(np.array_equal(a, b) for a, b in zip(dw.expert(3, 5), ck.expert(3, 5)))
    rows = np.array([3, 1024, 4095])
    assert np.array_equal(dw.ngram_rows(1, rows), ck.ngram_rows(1, rows))
    # overriding the whole n-gram table (a perturbation control for PLE)
    tbl = ck.get("layers.1.ple.ple_embedding.ngram_embedding.weight")
    tbl2 = tbl.copy()
    tbl2[1024] += 1
    p2 = ck.with_override("layers.1.ple.ple_embedding.ngram_embedding.weight", tbl2)
    assert np.array_equal(p2.ngram_rows(1, rows)[1], tbl[1024] + 1)
    assert np.array_equal(p2.ngram_rows(1, rows)[0], tbl[3])
    dw2 = dw.with_override(name, orig * 2)
    assert dw2.fingerprint() != dw.fingerprint() and dw.fingerprint() == DictWeights.from_checkpoint(ck).fingerprint()


def test_write_safetensors_is_atomic(tmp_path, monkeypatch):
    p = tmp_path / "w.safetensors"
    write_safetensors(p, {"a": np.arange(4, dtype=np.float32)})
    before = p.read_bytes()

    def boom(*a, **k):
        raise OSError("disk full")
    monkeypatch.setattr(os, "replace", boom)
    from reference.atomic import OutputWriteError  # reference.atomic wraps write failures in this (one-line CLI error)
    with pytest.raises((OSError, OutputWriteError), match="disk full"):
        write_safetensors(p, {"a": np.zeros(4, np.float32), "b": np.ones(2, ml_dtypes.bfloat16)})
    assert p.read_bytes() == before
    assert sorted(x.name for x in tmp_path.iterdir()) == ["w.safetensors"]  # no temp file left behind


def test_peak_memory_near_the_tensor_being_read(tmp_path):
    """get() allocates about its float32 output, not the file, not several temporaries (tracemalloc
    sees numpy's allocations). Bound 1.3x the output: the output plus small per-block scale rows."""
    import tracemalloc

    cfg = _config("tiny-hc2")
    cfg.update(vocab_size=4096, hidden_size=64, eos_token_id=[1, 2], pad_token_id=1)
    cfg["quantization_config"] = {"weight_block_size": [128, 128]}
    t = {k: v for k, v in _tensors("tiny-hc2").items() if "embed_tokens" not in k and "lm_head" not in k}
    rng = np.random.default_rng(5)
    t["model.embed_tokens.weight"] = rng.integers(0, 0x7E, (4096, 64), dtype=np.uint8).view(ml_dtypes.float8_e4m3fn)
    t["model.embed_tokens.weight_scale_inv"] = (rng.random((32, 1)) + 0.5).astype(np.float32)
    t["lm_head.weight"] = rng.standard_normal((4096, 64)).astype(ml_dtypes.bfloat16)
    ck = Checkpoint.open(_write_ck(tmp_path, cfg, t))
    out_bytes = 4096 * 64 * 4
    for name in ("embed_tokens.weight", "lm_head.weight"):
        tracemalloc.start()
        a = ck.get(name)
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert a.nbytes == out_bytes
        assert peak < 1.3 * out_bytes, (name, peak, out_bytes)
    # negative control: the naive dequant (full-size repeated scale matrix + product) exceeds the bound,
    # so the measurement can tell
    raw = ck.get_raw("embed_tokens.weight")
    s = np.asarray(ck.get_raw("embed_tokens.weight_scale_inv"))
    tracemalloc.start()
    naive = raw.astype(np.float32) * np.repeat(np.repeat(s, 128, 0), 128, 1)[:4096, :64]
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert np.array_equal(naive, ck.get("embed_tokens.weight")) and peak > 1.3 * out_bytes


def test_block_size_from_wrapper_root_quantization_config(tmp_path):
    """The FP8 release puts quantization_config at the root of the wrapper config: its block size is used."""
    cfg, codes, w8, _ = _fp8_fixture(tmp_path, rows=200)
    cfg.pop("quantization_config")
    cfg.update(eos_token_id=[1, 2], pad_token_id=1)
    wrapper = {"model_type": "qwen4_exp", "text_config": cfg,
               "quantization_config": {"quant_method": "fp8", "weight_block_size": [64, 64]}}
    t = {k: v for k, v in _tensors("tiny-hc2").items() if "embed_tokens" not in k and "lm_head" not in k}
    scale = np.array([[1.0], [2.0], [4.0], [8.0]], np.float32)  # [ceil(200/64), ceil(64/64)]
    t["model.embed_tokens.weight"] = w8
    t["model.embed_tokens.weight_scale_inv"] = scale
    t["lm_head.weight"] = np.zeros((200, 64), np.float32)
    ck = Checkpoint.open(_write_ck(tmp_path, wrapper, t))
    got = ck.get("embed_tokens.weight")
    plain = w8.astype(np.float32)
    assert np.array_equal(got, plain * np.repeat(scale, 64, 0)[:200])


def test_ngram_rows_any_shard_split_property(tmp_path):
    """Any split of the table into contiguous shards (even or not) gathers the same rows, through files
    (preadv path) and through memory (DictWeights)."""
    from hypothesis import given, settings, strategies as st, HealthCheck

    cfg_d = _config("tiny-hc2")
    from reference.config import ModelConfig
    cfg = ModelConfig.from_dict(cfg_d)
    i = cfg.ple_layers[0]
    lay = cfg.ple_layout(i)
    rng = np.random.default_rng(7)
    table = rng.standard_normal((lay.padded_rows, lay.head_dim)).astype(np.float32)
    base = f"layers.{i}.ple.ple_embedding.ngram_embedding"
    others = {canonical_name(k): v for k, v in _tensors("tiny-hc2").items() if "ngram_embedding" not in k}
    counter = iter(range(10**6))

    @settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(cuts=st.lists(st.integers(1, lay.padded_rows - 1), max_size=5, unique=True),
           rows=st.lists(st.integers(0, lay.padded_rows - 1), min_size=1, max_size=40))
    def check(cuts, rows):
        edges = [0] + sorted(cuts) + [lay.padded_rows]
        shards = {f"{base}.shard_{k}.weight": table[a:b] for k, (a, b) in enumerate(zip(edges, edges[1:]))}
        r = np.asarray(rows, dtype=np.int64)
        dw = DictWeights(cfg, {**others, **shards})
        assert np.array_equal(dw.ngram_rows(i, r), table[r])
        d = _write_ck(tmp_path / f"c{next(counter)}", cfg_d, {**others, **shards})
        with Checkpoint.open(d) as ck:
            assert np.array_equal(ck.ngram_rows(i, r), table[r])
    check()


def test_valid_but_undecoded_dtype_opens_and_fails_only_when_read(tmp_path):
    """A safetensors dtype this reader does not decode (U32 here; same byte size as the F32 it replaces) must
    not stop the checkpoint from opening (real checkpoints may carry such tensors we never read); reading that
    tensor is one clear error naming it."""
    ck = Checkpoint.open(_ck_with_a_log_dtype(tmp_path, b"U32"))
    with pytest.raises(CheckpointError, match=r"A_log.*unknown dtype.*found 'U32'"):
        ck.get("layers.0.linear_attn.A_log")
