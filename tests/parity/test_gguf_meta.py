"""``llama.cpp:gguf=PATH`` refuses a GGUF that is not a conversion of MODEL (parity/backends/gguf_meta.py): the
header's architecture, layer count, hidden size and vocabulary size against MODEL's config.json, read with the
``gguf`` package or the dependency-free header reader (the two agree). The GGUFs are small files written by the
``gguf`` package's writer (metadata only); llama.cpp itself is not needed: the check runs before it loads."""
from __future__ import annotations

import pytest

gguf = pytest.importorskip("gguf", reason="needs the gguf package (pip install gguf; the llamacpp extra) to "
                                          "write test GGUFs")

from parity.backends.gguf_meta import GGUF_ARCH, check_gguf_matches, read_header, read_metadata  # noqa: E402
from reference.config import load_config  # noqa: E402
from reference.errors import InputError  # noqa: E402
from reference.paths import bundled_model  # noqa: E402

TINY = bundled_model("tiny")


def _write(path, *, arch=GGUF_ARCH, layers=None, hidden=None, tokens=None, vocab_size=None, nextn=None):
    """A metadata-only GGUF like the converter's for tiny (6 layers, hidden 64, 512 tokens), with edits."""
    cfg = load_config(TINY)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers if layers is None else layers)
    w.add_embedding_length(cfg.hidden_size if hidden is None else hidden)
    w.add_uint32(f"{arch}.expert_count", cfg.num_experts)
    w.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    w.add_array(f"{arch}.attention.compress_ratios", [0, 0, 4, 0, 0, 4])
    w.add_bool("general.test_flag", True)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size if tokens is None else tokens)])
    if vocab_size is not None:
        w.add_vocab_size(vocab_size)
    if nextn is not None:
        w.add_uint32(f"{arch}.nextn_predict_layers", nextn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_header_reader_agrees_with_the_gguf_package(tmp_path):
    f = _write(tmp_path / "m.gguf", vocab_size=512)
    a, b = read_header(f), read_metadata(f)
    assert a == b
    assert a.values["general.architecture"] == GGUF_ARCH and a.values[f"{GGUF_ARCH}.block_count"] == 6
    assert a.values[f"{GGUF_ARCH}.embedding_length"] == 64 and a.values["general.test_flag"] is True
    assert a.array_lengths["tokenizer.ggml.tokens"] == 512
    assert a.array_lengths[f"{GGUF_ARCH}.attention.compress_ratios"] == 6


def test_a_gguf_of_the_checkpoint_is_accepted(tmp_path):
    cfg = load_config(TINY)
    assert check_gguf_matches(_write(tmp_path / "ok.gguf"), cfg, TINY).values["general.architecture"] == GGUF_ARCH
    # MTP layers a converter appends, declared by nextn_predict_layers, are no mismatch
    check_gguf_matches(_write(tmp_path / "mtp.gguf", layers=7, nextn=1), cfg, TINY)


@pytest.mark.parametrize("edit, key, expected, found", [
    (dict(arch="llama"), "general.architecture", "'qwen4exp'", "'llama'"),
    (dict(layers=4), f"{GGUF_ARCH}.block_count", "6 (config.json num_hidden_layers)", "found 4"),
    (dict(hidden=128), f"{GGUF_ARCH}.embedding_length", "64 (config.json hidden_size)", "found 128"),
    (dict(tokens=600), "tokenizer.ggml.tokens", "512 (config.json vocab_size, as the number of tokens)", "found 600"),
    (dict(vocab_size=1000), f"{GGUF_ARCH}.vocab_size", "512 (config.json vocab_size)", "found 1000"),
    (dict(layers=7, nextn=2), f"{GGUF_ARCH}.block_count",
     f"8 (config.json num_hidden_layers + {GGUF_ARCH}.nextn_predict_layers 2)", "found 7"),
])
def test_a_gguf_of_another_model_is_refused_naming_the_key(tmp_path, edit, key, expected, found):
    f = _write(tmp_path / "other.gguf", **edit)
    with pytest.raises(InputError) as e:
        check_gguf_matches(f, load_config(TINY), TINY)
    msg = str(e.value)
    assert e.value.exit_code == 2
    assert f"{key}: expected {expected}" in msg and found in msg, msg
    assert "does not match MODEL" in msg and str(f) in msg, msg


def test_every_mismatch_is_in_the_one_error(tmp_path):
    f = _write(tmp_path / "other.gguf", layers=40, hidden=2048, tokens=1000)
    with pytest.raises(InputError) as e:
        check_gguf_matches(f, load_config(TINY), TINY)
    msg = str(e.value)
    for part in ("block_count: expected 6", "found 40", "embedding_length: expected 64", "found 2048",
                 "tokenizer.ggml.tokens: expected 512", "found 1000"):
        assert part in msg, (part, msg)


def test_a_file_that_is_not_a_gguf_is_refused(tmp_path):
    f = tmp_path / "model.gguf"
    f.write_bytes(b"PK\x03\x04 not a gguf at all")
    for read in (read_header, read_metadata):
        with pytest.raises(InputError, match="expected a GGUF file"):
            read(f)
    f.write_bytes(_write(tmp_path / "whole.gguf").read_bytes()[:40])   # cut inside the header
    with pytest.raises(InputError, match="expected a complete GGUF header"):
        read_header(f)


def test_parity_with_a_mismatching_gguf_is_a_usage_error(tmp_path, capsys):
    """The whole command: exit 2 and one line naming the key, before llama.cpp (not needed here) loads it."""
    from parity.cli import main
    f = _write(tmp_path / "other.gguf", hidden=128)
    assert main(["parity", "tiny", "--backend", f"llama.cpp:gguf={f}", "--scenario", "kl", "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("qwen4exp parity: error: "), err
    assert f"{GGUF_ARCH}.embedding_length: expected 64 (config.json hidden_size), found 128" in err[0], err


def _with_embedding(path, model, qtype=None):
    """A tiny-shaped metadata GGUF holding ``model``'s token embedding as ``token_embd.weight`` (F32, or quantised to
    ``qtype`` by the gguf package)."""
    import numpy as np

    from reference.checkpoint import Checkpoint
    cfg = load_config(TINY)
    emb = np.asarray(Checkpoint.open(str(bundled_model(model))).get("embed_tokens.weight", dtype=np.float32),
                     np.float32)
    w = gguf.GGUFWriter(str(path), GGUF_ARCH)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_embedding_length(cfg.hidden_size)
    w.add_token_list([f"t{i}" for i in range(cfg.vocab_size)])
    if qtype is None:
        w.add_tensor("token_embd.weight", emb)
    else:
        w.add_tensor("token_embd.weight", gguf.quants.quantize(emb, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtype", [None, "F16", "Q8_0", "Q4_0"])
def test_the_checkpoints_own_embedding_is_accepted_in_any_storage_format(tmp_path, qtype):
    from parity.backends.gguf_meta import EMBED_MISMATCH_REL, embedding_distance
    q = None if qtype is None else getattr(gguf.GGMLQuantizationType, qtype)
    f = _with_embedding(tmp_path / "own.gguf", "tiny", q)
    rel = embedding_distance(f, TINY)
    assert rel is not None and rel < EMBED_MISMATCH_REL / 2, rel   # the format's rounding, well inside the bound
    check_gguf_matches(f, load_config(TINY), TINY)


def test_another_fixtures_gguf_of_the_same_shape_is_refused_by_its_weights(tmp_path):
    """tiny-fp8 has tiny's layer count, hidden size and vocabulary: the header check cannot tell them apart; its
    token embedding is another matrix (a wrong GGUF judged against tiny would be a false FAIL of llama.cpp)."""
    assert load_config(bundled_model("tiny-fp8")).hidden_size == load_config(TINY).hidden_size
    f = _with_embedding(tmp_path / "fp8.gguf", "tiny-fp8", gguf.GGMLQuantizationType.Q8_0)
    with pytest.raises(InputError) as e:
        check_gguf_matches(f, load_config(TINY), TINY)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "token_embd.weight: expected MODEL's embed_tokens.weight" in msg, msg


def test_a_truncated_gguf_is_one_error_naming_the_file_and_the_tensor_cut(tmp_path, capsys):
    """A GGUF cut inside its tensor data (an incomplete download or copy): exit 2 and one line naming the file, the
    tensor, the bytes it needs and where the file ends -- not the reader's NumPy reshape message."""
    whole = _with_embedding(tmp_path / "whole.gguf", "tiny").read_bytes()
    f = tmp_path / "cut.gguf"
    f.write_bytes(whole[:-1000])
    with pytest.raises(InputError) as e:
        read_metadata(f)
    msg = str(e.value)
    assert e.value.exit_code == 2 and "reshape" not in msg, msg
    assert str(f) in msg and "tensor 'token_embd.weight' (F32, dims [64, 512])" in msg, msg
    assert f"..{len(whole)}, found the file ending at byte {len(whole) - 1000} (a truncated file" in msg, msg
    from parity.cli import main
    assert main(["parity", "tiny", "--backend", f"llama.cpp:gguf={f}", "--scenario", "kl", "--no-progress"]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("qwen4exp parity: error: ") and "token_embd.weight" in err[0], err


@pytest.mark.parametrize("qtype", [None, "Q8_0"])
def test_a_gguf_not_stored_in_f32_is_a_finding_naming_its_storage_types(tmp_path, qtype):
    """A user's GGUF in F16 / a quantised type is judged against float32 weights: the rounding of its weights
    alone fails at float32 thresholds, so the report must say what the file stores (an all-F32 GGUF: nothing)."""
    from parity.backends.gguf_meta import rounding_finding, storage_types
    q = None if qtype is None else getattr(gguf.GGMLQuantizationType, qtype)
    f = _with_embedding(tmp_path / "own.gguf", "tiny", q)
    types = storage_types(f)
    assert types == {qtype or "F32": 1}, types
    found = rounding_finding(f, types)
    if qtype is None:
        assert found is None
    else:
        assert found["id"] == "gguf:weights-not-f32" and "1 as Q8_0" in found["where"], found
        assert "--outtype f32" in found["message"] and "rounding" in found["message"], found


def test_engine_findings_are_printed_under_the_table():
    from parity.harness.report import ParityReport, ScenarioRow, render_table
    finding = {"id": "gguf:weights-not-f32", "where": "GGUF 'x.gguf': 3 as Q8_0 (of 5 tensors)",
               "message": "the GGUF stores 3 as Q8_0 of its 5 tensors: ..."}
    rep = ParityReport(backend="llama.cpp:gguf=x.gguf", model="tiny", meta={"engine_findings": [finding]},
                       rows=[ScenarioRow("kl", 5, 5, 0.1, 1.0, "prompt 0: first divergence embed_tokens.out at "
                                         "position 0", 1.0, "fail")])
    text = render_table(rep, columns=None)
    assert "engine findings (1):" in text and "gguf:weights-not-f32: the GGUF stores 3 as Q8_0" in text, text
    assert "(GGUF 'x.gguf': 3 as Q8_0 (of 5 tensors))" in text, text
