"""``qwen4exp slice`` (reference/slice.py): slices of every bundled fixture are valid qwen4exp checkpoints that
keep the real weights -- a layers-only slice reproduces the source's hidden state after its last kept layer
exactly, kept experts and router rows and vocabulary rows are the source's -- pass a short parity
(reference vs engine-cpu, ci level), and load in the official model (transformers), which agrees with our
reference on them. Bad requests are one clear error; a damaged slice is caught (negative control)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from reference.checkpoint import Checkpoint
from reference.model import ReferenceModel
from reference.paths import bundled_model
from reference.slice import SliceError, slice_checkpoint
from taps.recorder import Recorder

FIXTURES = ("tiny", "tiny-hc2", "tiny-hc3", "tiny-fp8")


def _ids(cfg, n=21):
    from parity.harness.scenarios.common import token_stream
    return token_stream(cfg, n, seed=11, eos_every=8)


def _tap(model, ids, name):
    with Recorder(None, include=[name], meta={"token_ids": ids}) as rec:
        model.forward(ids)
    return np.asarray(rec.archive().get(name))


@pytest.mark.parametrize("fx", FIXTURES)
def test_layers_slice_keeps_the_real_function(fx, tmp_path):
    """The first N layers of the slice compute exactly what the source's first N layers compute: the
    residual after layer N-1 (a tap) is equal, bit for bit (same weights, same float32 code path)."""
    src = bundled_model(fx)
    ck = Checkpoint.open(src)
    n = 3
    plan = slice_checkpoint(src, tmp_path / "s", layers=n)
    sl = Checkpoint.open(tmp_path / "s")
    cfg = sl.config
    assert cfg.num_hidden_layers == n and list(cfg.layer_types) == list(ck.config.layer_types[:n])
    assert list(cfg.ple_layer_ids) == [i for i in ck.config.ple_layer_ids if i <= n]
    assert not any(x.startswith("mtp.") for x in sl.names()) and "golden.json" not in {p.name for p in (tmp_path / "s").iterdir()}
    for name in sl.names():  # every kept tensor is stored as in the source, same dtype and bytes
        assert sl.dtype(name) == ck.dtype(name), name
        assert np.array_equal(np.asarray(sl.get_raw(name)).view(np.uint8), np.asarray(ck.get_raw(name)).view(np.uint8)), name
    ids = _ids(cfg)
    tap = f"layers.{n - 1}.mlp_hyper_connection.combine"
    a, b = _tap(ReferenceModel(ck), ids, tap), _tap(ReferenceModel(sl), ids, tap)
    assert np.array_equal(a, b)
    assert "layers 0..2" in plan.notes[0]


def test_expert_and_vocab_subsets_keep_the_real_rows(tmp_path):
    """Kept experts are the source's (renumbered), the router keeps their rows, num_experts_per_tok is clipped;
    vocabulary rows and the tokenizer are reduced consistently, specials renumbered; FP8 per-expert scales
    follow their experts."""
    for fx in ("tiny", "tiny-fp8", "tiny-hc3"):
        src = bundled_model(fx)
        ck = Checkpoint.open(src)
        ex = [1, 3]
        out = tmp_path / f"{fx}-e"
        slice_checkpoint(src, out, layers=2, experts=ex, vocab=300)
        sl = Checkpoint.open(out)
        c = sl.config
        assert c.num_experts == 2 and c.num_experts_per_tok == min(2, ck.config.num_experts_per_tok)
        vocab = sorted(set(range(300)) | {440, 441, 442, 443, 444})
        assert c.vocab_size == len(vocab) and c.ple_eos_token_id == vocab.index(ck.config.ple_eos_token_id)
        for i in range(2):
            g0 = ck.get(f"layers.{i}.mlp.gate.weight")
            assert np.array_equal(sl.get(f"layers.{i}.mlp.gate.weight"), g0[ex])
            for k, e in enumerate(ex):
                for x, y in zip(sl.expert(i, k), ck.expert(i, e)):
                    assert np.array_equal(x, y)
        assert np.array_equal(sl.get("embed_tokens.weight"), ck.get("embed_tokens.weight")[vocab])
        assert np.array_equal(sl.get("lm_head.weight"), ck.get("lm_head.weight")[vocab])
        # stored PLE multipliers follow the new vocab_size (transformers loads the stored buffer)
        for i in c.ple_layers:
            n = f"layers.{i}.ple.ple_embedding.layer_multipliers"
            if sl.has(n):
                assert list(sl.get(n)) == list(c.ple_layout(i).multipliers)
    import tokenizers
    tok = tokenizers.Tokenizer.from_file(str(tmp_path / "tiny-e" / "tokenizer.json"))
    assert tok.get_vocab_size() == 305 and tok.token_to_id("<|im_end|>") == vocab.index(442)
    assert max(tok.encode("the lighthouse keeper at the workshop").ids) < 305
    gen = json.loads((tmp_path / "tiny-e" / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [vocab.index(442), vocab.index(440)]


def test_bad_requests_are_one_clear_error(tmp_path):
    src = bundled_model("tiny")
    for kw, what in (({"layers": 0}, "layers"), ({"layers": 99}, "layers"), ({"experts": [0, 99]}, "experts"),
                     ({"experts": 0}, "experts"), ({"vocab": 10**6}, "vocab"), ({"experts": []}, "experts")):
        with pytest.raises(SliceError, match=what):
            slice_checkpoint(src, tmp_path / "x", **kw)
        assert not (tmp_path / "x").exists()
    slice_checkpoint(src, tmp_path / "y", layers=2)
    from reference.errors import InputError
    with pytest.raises(InputError, match="overwrite"):
        slice_checkpoint(src, tmp_path / "y", layers=2)
    with pytest.raises(InputError, match="other than the source"):
        slice_checkpoint(tmp_path / "y", tmp_path / "y", layers=1, overwrite=True)


def test_repeated_expert_ids_are_refused_naming_the_repeat(tmp_path, capsys):
    """``--experts 3,0,0,5`` is not silently three experts: exit 2, one line naming the repeated id, nothing
    written; the same ids without the repeat are accepted (control)."""
    from fixture_helpers import one_line_error
    from parity.cli import main
    src = bundled_model("tiny")
    with pytest.raises(SliceError, match=r"expected each id once, found \[0\]"):
        slice_checkpoint(src, tmp_path / "x", experts=[3, 0, 0, 5])
    capsys.readouterr()
    assert main(["slice", "tiny", str(tmp_path / "x"), "--experts", "3,0,0,5"]) == 2
    one_line_error(capsys, "slice experts", "each id once", "[0]", "3,0,0,5")
    assert not (tmp_path / "x").exists()
    assert main(["slice", "tiny", str(tmp_path / "x"), "--experts", "3,0,5"]) == 0
    assert Checkpoint.open(tmp_path / "x").config.num_experts == 3


def test_clipped_top_k_is_said_on_stderr(tmp_path, capsys):
    """Keeping fewer experts than the model's top-k changes num_experts_per_tok: a note on stderr names the old
    and new value; keeping at least top-k experts changes nothing and prints no note (control)."""
    from parity.cli import main
    top_k = Checkpoint.open(bundled_model("tiny")).config.num_experts_per_tok
    assert top_k >= 2
    capsys.readouterr()
    assert main(["slice", "tiny", str(tmp_path / "few"), "--layers", "1", "--experts", "1"]) == 0
    err = capsys.readouterr().err
    assert f"note: num_experts_per_tok {top_k} -> 1" in err, err
    assert Checkpoint.open(tmp_path / "few").config.num_experts_per_tok == 1
    assert main(["slice", "tiny", str(tmp_path / "enough"), "--layers", "1", "--experts", str(top_k)]) == 0
    assert "note:" not in capsys.readouterr().err
    assert Checkpoint.open(tmp_path / "enough").config.num_experts_per_tok == top_k


def test_a_damaged_slice_is_caught(tmp_path):
    """Negative control of the function test: one weight of the slice off by 1% changes the tap."""
    src = bundled_model("tiny")
    slice_checkpoint(src, tmp_path / "s", layers=3)
    sl = Checkpoint.open(tmp_path / "s")
    name = "layers.1.mlp.shared_expert.up_proj.weight"
    bad = sl.with_override(name, sl.get(name) * 1.01)
    ids = _ids(sl.config)
    tap = "layers.2.mlp_hyper_connection.combine"
    assert not np.array_equal(_tap(ReferenceModel(Checkpoint.open(src)), ids, tap), _tap(ReferenceModel(bad), ids, tap))


@pytest.mark.parametrize("fx", FIXTURES)
def test_parity_on_slices_reference_vs_engine_cpu(fx, tmp_path, capsys):
    """A short parity (engine-cpu, ci level) on a slice with an expert and a vocabulary subset passes."""
    pytest.importorskip("engine.engine", reason="the engine package is not importable")
    from parity.cli import main
    out = tmp_path / "s"
    assert main(["slice", fx, str(out), "--layers", "3", "--experts", "0,2,3", "--vocab", "320"]) == 0
    capsys.readouterr()
    rc = main(["parity", str(out), "--backend", "engine-cpu", "--scenario", "budget", "speculative-rollback",
               "--level", "ci", "--json", "--no-progress"])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 0 and doc["verdict"] == "pass", [r["detail"] for r in doc["scenarios"]]


@pytest.mark.oracle
@pytest.mark.parametrize("fx", FIXTURES)
def test_official_model_loads_the_slice_and_agrees(fx, tmp_path):
    """transformers loads each slice (from_pretrained for BF16, the documented exact reader for FP8) and its
    logits equal our reference's on the slice (tiny-hc3 with the reference breaking exact indexer ties as
    torch.topk does: the tie finding of tests/parity/test_backend_transformers.py)."""
    pytest.importorskip("torch", reason="needs the oracle extra")
    pytest.importorskip("transformers.models.qwen4_exp", reason="needs transformers with qwen4_exp")
    from parity.backends import open_backend
    from test_backend_transformers import _torch_tie_order
    out = tmp_path / "s"
    slice_checkpoint(bundled_model(fx), out, layers=3, experts=[0, 2], vocab=320)
    be = open_backend("transformers", out)
    try:
        ref = ReferenceModel(Checkpoint.open(out))
        if fx == "tiny-hc3":
            ref.selection_hook = _torch_tie_order
        ids = _ids(ref.config)
        a, b = be.logits(ids), ref.forward(ids)
        assert float(np.max(np.abs(a - b)) / np.max(np.abs(b))) < 1e-4  # float32 vs float32, as in that file
        if fx != "tiny-fp8":
            assert "from_pretrained" in be.load_note
    finally:
        be.close()


def test_a_slice_into_the_folder_holding_its_source_is_refused(tmp_path, capsys):
    """``slice ./a/m ./a --overwrite``: replacing ./a deleted the source checkpoint; exit 2 before anything is
    written, naming DST and the model; the source is left as it was. A sibling folder is accepted (control)."""
    import shutil

    from fixture_helpers import one_line_error
    from parity.cli import main
    m = tmp_path / "a" / "m"
    shutil.copytree(bundled_model("tiny"), m)
    before = sorted(p.name for p in m.iterdir())
    assert main(["slice", str(m), str(tmp_path / "a"), "--overwrite", "--layers", "2"]) == 2
    one_line_error(capsys, "DST", str(m))
    assert sorted(p.name for p in m.iterdir()) == before
    assert main(["slice", str(m), str(tmp_path / "a" / "s"), "--layers", "2"]) == 0
